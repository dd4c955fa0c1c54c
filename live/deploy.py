"""From a topology (YAML) to the exact command lines of a P/D deployment, or a bash script.

A topology names the model, the mode (pull, push, bidirectional), the NIXL backend (`UCX`, or
`LIBFABRIC` for EFA), the router, and each instance: role, host, port, side-channel port,
tensor-parallel size, GPUs. Every instance loads `KvplaneConnector` (the router speaks its
contract, docs/notes/live-protocol.md). `plan(topology)` returns one `Process` per
vLLM instance plus the router, each with its host, environment and argv; `render_commands`,
`render_script` and `render_json` print them.

Rules kept here:
- Building a plan does no I/O; the topology is checked as a whole and every problem is listed
  at once (`TopologyError`): two instances on one host sharing a port or a side-channel port
  (each instance has its own, vLLM's `VLLM_NIXL_SIDE_CHANNEL_PORT`), a TP size that does not
  match the GPUs listed, GPUs used twice on one host.
- Every vLLM instance is `kv_both` (a request's `kv_transfer_params` say which side it is on),
  named in its connector's events by the same id the router uses; the side channel binds and
  advertises the instance's own host (`VLLM_NIXL_SIDE_CHANNEL_HOST`), so peers on other nodes
  and the router can reach it, and the router is told where it is (`side=HOST:PORT`).
- EFA (`nixl_backend: LIBFABRIC`): `FI_PROVIDER=efa` and `FI_EFA_USE_DEVICE_RDMA=1` are set
  and the connector is asked for NIXL's LIBFABRIC backend (`backends` in
  `kv_connector_extra_config`); UCX settings (`ucx_tls`, `ucx_net_devices`) are passed only when
  given. A topology's own `env` wins over these defaults.
- The connector contract's instance settings (docs/notes/live-protocol.md, section 0) are set:
  `kv_role` `kv_both`, `kv_load_failure_policy` `recompute`, `instance` = the router's id for
  it; prefix caching is left at vLLM's default (on).
- The trust boundary (docs/deploy.md): instances and their side channels listen on the
  instance's own (private) address, never on every interface (`0.0.0.0` is refused); every
  instance requires an API key (`VLLM_API_KEY`), which the router sends
  (`KVPLANE_UPSTREAM_API_KEY`), so only the router can post `kv_transfer_params` to them.
- Secrets stay out of command lines: the store URL, the handle key and the API key reach
  processes through environment variables the operator exports (`KVPLANE_DB`,
  `KVPLANE_HANDLE_KEY`, `KVPLANE_UPSTREAM_API_KEY`), named in the output, never expanded into
  it.
- The script starts the processes of one node (or of every node with `all`, for a single
  machine), waits for each instance's `/health` with a curl loop and a time-out, then starts the
  router and waits for its `/health`; Ctrl-C stops what it started.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml  # type: ignore[import-untyped]
from pydantic import BaseModel, ConfigDict, Field, ValidationError

Mode = Literal["pull", "push", "bidirectional"]
Backend = Literal["UCX", "LIBFABRIC"]

EFA_ENV: dict[str, str] = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"}
CONNECTOR_MODULE = "kvplane.live.connector"


class TopologyError(ValueError):
    """A topology that cannot be deployed; the message lists every problem."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InstanceSpec(_Model):
    role: Literal["prefill", "decode"] = Field(description="What the router uses it for.")
    host: str = Field(description="Address the instance listens on and peers reach it at.")
    port: int = Field(ge=1, le=65535, description="Its OpenAI HTTP port.")
    side_channel_port: int = Field(
        ge=1, le=65535,
        description="NIXL side-channel port (VLLM_NIXL_SIDE_CHANNEL_PORT); one per instance.",
    )
    tp: int = Field(default=1, ge=1, description="--tensor-parallel-size")
    gpus: str | None = Field(
        default=None, description="CUDA_VISIBLE_DEVICES, e.g. '0,1,2,3' (must list tp GPUs)."
    )
    id: str | None = Field(default=None, description="Name in the router and events.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment.")
    args: list[str] = Field(default_factory=list, description="Extra vllm arguments.")


class RouterSpec(_Model):
    host: str = Field(description="Node the router runs on.")
    port: int = Field(default=8000, ge=1, le=65535)
    bind: str = Field(default="0.0.0.0", description="Address the router listens on.")
    policy: Literal["round_robin", "least_loaded", "kv_affinity"] = "kv_affinity"
    env: dict[str, str] = Field(default_factory=dict)
    args: list[str] = Field(default_factory=list, description="Extra `kvplane router` arguments.")


class Topology(_Model):
    name: str = Field(default="kvplane", description="Deployment name (script, run, logs).")
    model: str = Field(description="Model path or hub id given to vLLM.")
    served_model_name: str | None = Field(default=None, description="--served-model-name")
    mode: Mode = "pull"
    nixl_backend: Backend = "UCX"
    kv_buffer_device: Literal["cuda", "cpu"] = "cuda"
    launcher: Literal["serve", "module"] = Field(
        default="serve",
        description="`vllm serve` or `python -m vllm.entrypoints.openai.api_server`.",
    )
    python: str = Field(default="python3", description="Interpreter for `module` and the router.")
    kvplane: str = Field(default="kvplane", description="The kvplane command on the router node.")
    ucx_tls: str | None = Field(default=None, description="UCX_TLS for every instance.")
    ucx_net_devices: str | None = Field(default=None, description="UCX_NET_DEVICES.")
    connector_extra: dict[str, Any] = Field(
        default_factory=dict, description="More kv_connector_extra_config keys."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Environment of every process.")
    vllm_args: list[str] = Field(default_factory=list, description="Arguments of every instance.")
    health_timeout: int = Field(default=1200, ge=1, description="Seconds to wait per /health.")
    router: RouterSpec
    instances: list[InstanceSpec] = Field(min_length=2)


@dataclass(frozen=True, slots=True)
class Process:
    """One process of the deployment: where it runs and exactly how it starts."""

    name: str
    kind: Literal["prefill", "decode", "router"]
    host: str
    port: int
    env: tuple[tuple[str, str], ...]
    argv: tuple[str, ...]

    @property
    def health_url(self) -> str:
        return f"http://{self.host}:{self.port}/health"

    def command(self) -> str:
        env = " ".join(f"{k}={_quote_env(v)}" for k, v in self.env)
        argv = " ".join(shlex.quote(a) for a in self.argv)
        return f"{env} {argv}" if env else argv


def _quote_env(v: str) -> str:
    # keep `$VAR` references live (secrets come from the operator's environment)
    if v.startswith("$") and v[1:].replace("_", "").isalnum():
        return f'"{v}"'
    return shlex.quote(v)


def load_topology(source: str | Path | Mapping[str, Any]) -> Topology:
    """Read a topology from a YAML file (or a dict) and check it."""
    if isinstance(source, Mapping):
        raw: Any = dict(source)
    else:
        try:
            raw = yaml.safe_load(Path(source).read_text())
        except OSError as exc:
            raise TopologyError(f"cannot read topology {source}: {exc}") from None
        except yaml.YAMLError as exc:
            raise TopologyError(f"topology {source} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise TopologyError("a topology must be a YAML mapping")
    try:
        topo = Topology.model_validate(raw)
    except ValidationError as exc:
        lines = [
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        ]
        raise TopologyError("topology:\n  - " + "\n  - ".join(lines)) from None
    problems = check(topo)
    if problems:
        raise TopologyError("topology:\n  - " + "\n  - ".join(problems))
    return topo


def instance_ids(topo: Topology) -> list[str]:
    counts = {"prefill": 0, "decode": 0}
    out = []
    for inst in topo.instances:
        out.append(inst.id or f"{inst.role}-{counts[inst.role]}")
        counts[inst.role] += 1
    return out


def check(topo: Topology) -> list[str]:
    """Every problem with the topology (empty: deployable)."""
    problems: list[str] = []
    roles = [i.role for i in topo.instances]
    for role in ("prefill", "decode"):
        if role not in roles:
            problems.append(f"at least one {role} instance is needed")
    ids = instance_ids(topo)
    if len(set(ids)) != len(ids):
        problems.append(f"instance ids must be unique, got {ids}")
    ports: dict[tuple[str, int], str] = {}
    gpus: dict[tuple[str, str], str] = {}

    def claim(host: str, port: int, what: str) -> None:
        other = ports.get((host, port))
        if other is not None:
            problems.append(f"{what} uses port {port} on {host}, already taken by {other}")
        ports[(host, port)] = what

    claim(topo.router.host, topo.router.port, "the router")
    for name, inst in zip(ids, topo.instances):
        if inst.host in ("0.0.0.0", "::", ""):
            problems.append(f"{name}: host {inst.host!r} listens on every interface; give the "
                            "private address peers and the router reach it at")
        claim(inst.host, inst.port, f"{name} (HTTP)")
        claim(inst.host, inst.side_channel_port, f"{name} (side channel)")
        if inst.gpus is not None:
            listed = [g.strip() for g in inst.gpus.split(",") if g.strip()]
            if len(listed) != inst.tp:
                problems.append(
                    f"{name}: tp {inst.tp} needs {inst.tp} GPUs, gpus lists {len(listed)}"
                )
            for g in listed:
                other = gpus.get((inst.host, g))
                if other is not None:
                    problems.append(f"{name}: GPU {g} on {inst.host} is already {other}'s")
                gpus[(inst.host, g)] = name
    return problems


def advisories(topo: Topology) -> list[str]:
    """Deployable, but worth a line in the output."""
    notes = []
    if topo.nixl_backend == "LIBFABRIC":
        notes.append(
            "LIBFABRIC: the connector is asked for it in kv_connector_extra_config `backends`; "
            "check that this kvplane's transport creates that backend (it made UCX only when "
            "this generator was written)."
        )
    if any(i.tp > 1 for i in topo.instances):
        notes.append("tp > 1: check that this kvplane's connector supports it (it required "
                     "TP 1 when this generator was written).")
    return notes


def _kv_transfer_config(topo: Topology, inst_id: str, inst: InstanceSpec) -> dict[str, Any]:
    extra: dict[str, Any] = {
        "instance": inst_id,
        "side_channel_host": inst.host,
        "side_channel_port": inst.side_channel_port,
        "bidirectional_kv_xfer": topo.mode == "bidirectional",
        "backends": [topo.nixl_backend],
    }
    extra.update(topo.connector_extra)
    return {
        "kv_connector": "KvplaneConnector",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_buffer_device": topo.kv_buffer_device,
        # a failed or timed-out transfer falls back to computing the prompt (not an error)
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def _instance_env(topo: Topology, inst: InstanceSpec) -> dict[str, str]:
    env: dict[str, str] = {}
    if inst.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(g.strip() for g in inst.gpus.split(","))
    env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = inst.host
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(inst.side_channel_port)
    if topo.nixl_backend == "LIBFABRIC":
        env.update(EFA_ENV)
    if topo.ucx_tls:
        env["UCX_TLS"] = topo.ucx_tls
    if topo.ucx_net_devices:
        env["UCX_NET_DEVICES"] = topo.ucx_net_devices
    env["KVPLANE_DB"] = "$KVPLANE_DB"
    env["KVPLANE_RUN"] = "$KVPLANE_RUN"
    env["KVPLANE_HANDLE_KEY"] = "$KVPLANE_HANDLE_KEY"
    env["VLLM_API_KEY"] = "$KVPLANE_UPSTREAM_API_KEY"
    env.update(topo.env)
    env.update(inst.env)
    return env


def plan(topo: Topology) -> list[Process]:
    """Every process of the deployment: instances in topology order, then the router."""
    out: list[Process] = []
    ids = instance_ids(topo)
    for inst_id, inst in zip(ids, topo.instances):
        if topo.launcher == "serve":
            head = ["vllm", "serve", topo.model]
        else:
            head = [topo.python, "-m", "vllm.entrypoints.openai.api_server", "--model", topo.model]
        argv = head + [
            "--host", inst.host,
            "--port", str(inst.port),
            "--tensor-parallel-size", str(inst.tp),
        ]
        if topo.served_model_name:
            argv += ["--served-model-name", topo.served_model_name]
        kv = json.dumps(_kv_transfer_config(topo, inst_id, inst), separators=(",", ":"))
        argv += ["--kv-transfer-config", kv]
        argv += topo.vllm_args + inst.args
        env = _instance_env(topo, inst)
        out.append(Process(inst_id, inst.role, inst.host, inst.port, tuple(env.items()),
                           tuple(argv)))
    r = topo.router
    argv = [
        topo.kvplane, "router",
        "--host", r.bind,
        "--port", str(r.port),
        "--mode", topo.mode,
        "--policy", r.policy,
    ]
    for inst_id, inst in zip(ids, topo.instances):
        flag = "--prefill" if inst.role == "prefill" else "--decode"
        spec = f"http://{inst.host}:{inst.port},id={inst_id},side={inst.host}:"
        argv += [flag, spec + str(inst.side_channel_port)]
    argv += ["--model", topo.served_model_name or topo.model]
    argv += r.args
    env = {"KVPLANE_DB": "$KVPLANE_DB", "KVPLANE_RUN": "$KVPLANE_RUN",
           "KVPLANE_HANDLE_KEY": "$KVPLANE_HANDLE_KEY",
           "KVPLANE_UPSTREAM_API_KEY": "$KVPLANE_UPSTREAM_API_KEY", **topo.env, **r.env}
    out.append(Process("router", "router", r.host, r.port, tuple(env.items()), tuple(argv)))
    return out


def render_commands(topo: Topology, procs: Sequence[Process] | None = None) -> str:
    """The command lines, grouped by node, in start order."""
    procs = list(procs if procs is not None else plan(topo))
    lines = [
        f"# {topo.name}: {topo.mode} mode, KvplaneConnector, NIXL {topo.nixl_backend}",
        ("# export KVPLANE_DB (event store URL), KVPLANE_RUN (one run id for the whole "
        "deployment), KVPLANE_HANDLE_KEY (shared HMAC key) and KVPLANE_UPSTREAM_API_KEY (the "
        "instances' API key) on every node first."),
    ]
    lines += [f"# note: {n}" for n in advisories(topo)]
    for host in _hosts(procs):
        lines.append("")
        lines.append(f"# --- node {host}")
        for p in procs:
            if p.host == host:
                lines.append(f"# {p.name}: health {p.health_url}")
                lines.append(p.command())
    return "\n".join(lines) + "\n"


def render_json(topo: Topology, procs: Sequence[Process] | None = None) -> str:
    procs = list(procs if procs is not None else plan(topo))
    return json.dumps(
        {
            "name": topo.name,
            "mode": topo.mode,
            "notes": advisories(topo),
            "processes": [
                {"name": p.name, "kind": p.kind, "host": p.host, "port": p.port,
                 "health": p.health_url, "env": dict(p.env), "argv": list(p.argv),
                 "command": p.command()}
                for p in procs
            ],
        },
        indent=2,
    ) + "\n"


def _hosts(procs: Sequence[Process]) -> list[str]:
    seen: dict[str, None] = {}
    for p in procs:
        seen.setdefault(p.host, None)
    return list(seen)


def render_script(topo: Topology, procs: Sequence[Process] | None = None) -> str:
    """A bash script: `script.sh NODE|all`; starts that node's processes, waits for health."""
    procs = list(procs if procs is not None else plan(topo))
    instances = [p for p in procs if p.kind != "router"]
    router = next(p for p in procs if p.kind == "router")
    q = shlex.quote
    out = [
        "#!/usr/bin/env bash",
        (f"# {topo.name}: {topo.mode} P/D with KvplaneConnector over NIXL "
        f"{topo.nixl_backend}."),
        "# Generated by `kvplane deploy`. Usage: bash THIS_SCRIPT NODE   (or `all` on one machine)",
        ("# Needs KVPLANE_DB, KVPLANE_RUN, KVPLANE_HANDLE_KEY and KVPLANE_UPSTREAM_API_KEY "
         "exported (the same on every node)."),
        *[f"# note: {n}" for n in advisories(topo)],
        "set -euo pipefail",
        "",
        'NODE="${1:-all}"',
        f'LOG_DIR="${{LOG_DIR:-./logs-{topo.name}}}"',
        f"HEALTH_TIMEOUT={topo.health_timeout}",
        'mkdir -p "$LOG_DIR"',
        ': "${KVPLANE_DB:?export KVPLANE_DB (event store URL) first}"',
        ': "${KVPLANE_RUN:?export KVPLANE_RUN (one run id for the deployment) first}"',
        ': "${KVPLANE_HANDLE_KEY:?export KVPLANE_HANDLE_KEY (shared HMAC key) first}"',
        (': "${KVPLANE_UPSTREAM_API_KEY:?export KVPLANE_UPSTREAM_API_KEY (API key of the '
         'instances) first}"'),
        "PIDS=()",
        "",
        "cleanup() {",
        "  trap - INT TERM EXIT",
        '  if [[ ${#PIDS[@]} -gt 0 ]]; then',
        '    echo "stopping ${PIDS[*]}"',
        '    kill "${PIDS[@]}" 2>/dev/null || true',
        '    wait "${PIDS[@]}" 2>/dev/null || true',
        "  fi",
        "}",
        "trap cleanup INT TERM EXIT",
        "",
        "wait_for_health() {  # URL NAME",
        '  local url=$1 name=$2 waited=0',
        '  until curl -sf -o /dev/null "$url"; do',
        '    if (( waited >= HEALTH_TIMEOUT )); then',
        '      echo "$name: no answer from $url after ${HEALTH_TIMEOUT}s" >&2; return 1',
        "    fi",
        "    sleep 1; waited=$((waited + 1))",
        "  done",
        '  echo "$name is healthy ($url)"',
        "}",
        "",
        "on_node() {  # HOST: true when this invocation starts that node's processes",
        '  [[ "$NODE" == all || "$NODE" == "$1" ]]',
        "}",
        "",
    ]
    for p in instances:
        out += [
            f"if on_node {q(p.host)}; then",
            f'  echo "starting {p.name} ({p.kind}) on {p.host}:{p.port}"',
            f'  {p.command()} \\\n    > "$LOG_DIR/{p.name}.log" 2>&1 &',
            "  PIDS+=($!)",
            "fi",
            "",
        ]
    out += ["# this node's instances first"]
    out += [f"if on_node {q(p.host)}; then wait_for_health {q(p.health_url)} {q(p.name)}; fi"
            for p in instances]
    out += [
        "",
        f"if on_node {q(router.host)}; then",
        "  # every instance, on every node, must be healthy before the router starts",
        *[f"  wait_for_health {q(p.health_url)} {q(p.name)}" for p in instances],
        f'  echo "starting the router on {router.host}:{router.port}"',
        f'  {router.command()} \\\n    > "$LOG_DIR/router.log" 2>&1 &',
        "  PIDS+=($!)",
        f"  wait_for_health {q(f'http://127.0.0.1:{router.port}/health')} router",
        "fi",
        "",
        'echo "all up; Ctrl-C stops the processes this script started"',
        'if [[ ${#PIDS[@]} -gt 0 ]]; then wait "${PIDS[@]}"; fi',
        "",
    ]
    return "\n".join(out)
