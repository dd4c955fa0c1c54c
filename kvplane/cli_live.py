"""`kvplane router` and `kvplane deploy`: the live room's commands, added by `register(app)`.

Both import the live room lazily (inside the command), so `kvplane --help` stays fast and works
where aiohttp is not installed.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

HANDLE_KEY_ENV = "KVPLANE_HANDLE_KEY"


def _fail(msg: str, code: int = 2) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _handle_key(path: Path | None) -> tuple[bytes, str]:
    """The HMAC key for retained-KV handles: file, else $KVPLANE_HANDLE_KEY, else a random one."""
    if path is not None:
        raw = path.read_bytes().strip()
        return raw, f"file {path}"
    env = os.environ.get(HANDLE_KEY_ENV, "")
    if env:
        return env.encode(), f"${HANDLE_KEY_ENV}"
    return secrets.token_hex(32).encode(), "random (connectors cannot verify handles)"


def _api_keys(path: Path | None) -> dict[str, str]:
    """`KEY: TENANT` pairs from a YAML/JSON mapping file (kept off the command line)."""
    if path is None:
        return {}
    import yaml  # type: ignore[import-untyped]

    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in data.items()
    ):
        raise ValueError(f"{path}: expected a mapping of API key -> tenant name")
    return data


def register(app: typer.Typer) -> None:
    """Add the `router` and `deploy` commands to the kvplane CLI."""

    @app.command("router")
    def router(
        prefill: Annotated[list[str], typer.Option(
            "--prefill", help="A prefill instance: URL[,id=NAME][,side=URL]. Repeat for more.")],
        decode: Annotated[list[str], typer.Option(
            "--decode", help="A decode instance: URL[,id=NAME][,side=URL]. Repeat for more.")],
        mode: Annotated[str, typer.Option(help="pull, push or bidirectional.")] = "pull",
        policy: Annotated[str, typer.Option(
            help="Decode choice: round_robin, least_loaded or kv_affinity.")] = "round_robin",
        affinity_slack: Annotated[int, typer.Option(
            help="kv_affinity: how many more in-flight requests the retaining decode may have "
                 "than the least loaded one and still be chosen.")] = 4,
        host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
        model: Annotated[Optional[list[str]], typer.Option(  # noqa: UP045
            "--model", help="Served model name(s); default: learned from the instances.")] = None,
        db: Annotated[Optional[str], typer.Option(  # noqa: UP045
            "--db", help="Event store URL (default $KVPLANE_DB, else ./kvplane.db).")] = None,
        run_id: Annotated[Optional[str], typer.Option(  # noqa: UP045
            "--run-id", envvar="KVPLANE_RUN",
            help="Record into this run (created if new); default: this router's last run.")] = None,
        fresh_run: Annotated[bool, typer.Option(
            "--fresh-run", help="Start a new run with an empty conversation table.")] = False,
        no_record: Annotated[bool, typer.Option(
            "--no-record", help="Record nothing and rebuild nothing (no store).")] = False,
        name: Annotated[str, typer.Option(
            help="This router's name in events and runs.")] = "router",
        handle_key_file: Annotated[Optional[Path], typer.Option(  # noqa: UP045
            help=f"HMAC key for retained-KV handles (default ${HANDLE_KEY_ENV}); the "
                 "connectors must hold the same key.")] = None,
        api_keys_file: Annotated[Optional[Path], typer.Option(  # noqa: UP045
            help="YAML/JSON mapping API key -> tenant.")] = None,
        require_api_key: Annotated[bool, typer.Option(
            help="Refuse requests without a key from --api-keys-file.")] = False,
        max_body_bytes: Annotated[int, typer.Option(help="Largest request body.")] = 4 << 20,
        connect_timeout: Annotated[float, typer.Option(help="Seconds to connect.")] = 5.0,
        prefill_timeout: Annotated[float, typer.Option(help="Seconds for prefill's leg.")] = 300.0,
        decode_timeout: Annotated[float, typer.Option(
            help="Seconds to decode's response headers (stream) or whole answer.")] = 300.0,
        stream_gap_timeout: Annotated[float, typer.Option(
            help="Longest silence in decode's stream.")] = 120.0,
        lease_ttl: Annotated[float, typer.Option(help="Retention asked of decode (s).")] = 480.0,
        heartbeat_every: Annotated[float, typer.Option(help="Lease heartbeat period (s).")] = 5.0,
        idle_after: Annotated[float, typer.Option(
            help="A conversation with no turn for this long gets no more heartbeats (s).")] = 120.0,
        no_check_settings: Annotated[bool, typer.Option(
            "--no-check-settings",
            help="Do not read instances' kvplane identity at first contact.")] = False,
        log_level: Annotated[str, typer.Option(help="Python log level.")] = "INFO",
    ) -> None:
        """The KV-cache-aware router: OpenAI API in front of prefill and decode instances."""
        import logging

        try:
            from aiohttp import web

            from kvplane.core.routing import Policy
            from kvplane.live.router import Router, resume_run
            from kvplane.live.router_config import (
                ConfigError,
                Leases,
                RouterConfig,
                Timeouts,
                parse_upstream,
            )
        except ImportError as exc:
            _fail(f"{exc}: install the live extra (pip install 'kvplane[live]')")
            return
        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: "
                            "%(message)s")
        try:
            key, key_source = _handle_key(handle_key_file)
            config = RouterConfig(
                prefill=tuple(parse_upstream(s, "prefill", i) for i, s in enumerate(prefill)),
                decode=tuple(parse_upstream(s, "decode", i) for i, s in enumerate(decode)),
                mode=mode,  # type: ignore[arg-type]
                policy=Policy(policy, affinity_slack),  # type: ignore[arg-type]
                models=tuple(model or ()),
                max_body_bytes=max_body_bytes,
                timeouts=Timeouts(connect_timeout, prefill_timeout, decode_timeout,
                                  stream_gap_timeout),
                leases=Leases(ttl=lease_ttl, heartbeat_every=heartbeat_every,
                              idle_after=idle_after),
                hmac_key=key,
                api_keys=_api_keys(api_keys_file),
                require_api_key=require_api_key,
                upstream_api_key=os.environ.get("KVPLANE_UPSTREAM_API_KEY") or None,
                check_settings=not no_check_settings,
                instance=name,
            ).checked()
        except (ConfigError, OSError, ValueError) as exc:
            _fail(str(exc))
            return
        log = logging.getLogger("kvplane.router")
        log.info("handle key: %s", key_source)
        recorder = None
        history: list[Any] = []
        closer = None
        if not no_record:
            from kvplane.store import BatchingRecorder, StoreError, open_store

            try:
                store = open_store(db)
                run, history = resume_run(store, name=name, run_id=run_id, fresh=fresh_run)
            except (StoreError, OSError, ValueError) as exc:
                _fail(f"event store: {exc}")
                return
            rec = recorder = BatchingRecorder(store, run, flush_interval=0.5)

            def closer() -> None:
                rec.close()
                store.close()

            log.info("recording into run %s of %s; rebuilding %d session events",
                     run, store.url, len(history))
        r = Router(config, recorder=recorder, history=history, on_close=closer)
        log.info("router %s: %s mode, %s policy, %d conversation(s) rebuilt; listening on %s:%d",
                 name, config.mode, config.policy.kind, len(r.table.handles), host, port)
        web.run_app(r.app(), host=host, port=port, access_log=None, print=None)

    @app.command("deploy")
    def deploy(
        topology: Annotated[Path, typer.Argument(help="Topology YAML (see docs/deploy.md).")],
        fmt: Annotated[str, typer.Option(
            "--format", help="commands (per node), script (bash with health checks) or json.")
        ] = "commands",
        out: Annotated[Optional[Path], typer.Option(  # noqa: UP045
            help="Write here instead of standard output (a script is made executable).")] = None,
    ) -> None:
        """Turn a topology into the exact vLLM and router command lines, or a bash script."""
        from kvplane.live.deploy import (
            TopologyError,
            load_topology,
            render_commands,
            render_json,
            render_script,
        )

        renderers = {"commands": render_commands, "script": render_script, "json": render_json}
        if fmt not in renderers:
            _fail(f"--format must be one of {sorted(renderers)}, not {fmt!r}")
            return
        try:
            topo = load_topology(topology)
        except TopologyError as exc:
            _fail(str(exc))
            return
        text = renderers[fmt](topo)
        if out is None:
            sys.stdout.write(text)
            return
        out.write_text(text)
        if fmt == "script":
            out.chmod(0o755)
        typer.echo(f"wrote {out}")
