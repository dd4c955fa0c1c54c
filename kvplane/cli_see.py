"""The "see" commands: `kvplane dashboard`, `kvplane twin`, `kvplane import vllm-bench|trace`.

`register(app)` adds them to the main `kvplane` app (kvplane/cli.py). Like every command, each
imports its room lazily, so `kvplane --help` stays fast; the store is `--db URL`, else
`$KVPLANE_DB`, else ./kvplane.db.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

DbOpt = Annotated[
    Optional[str],  # noqa: UP045 (typer needs Optional on 3.11)
    typer.Option("--db", help="Event store URL (sqlite:///file.db or postgresql+psycopg://...)."),
]

import_app = typer.Typer(
    help="Bring outside measurements into the store: vllm bench serve results, request traces.",
    no_args_is_help=True,
)


def _fail(msg: str, code: int = 2) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def dashboard(
    db: DbOpt = None,
    port: Annotated[int, typer.Option(help="Port to serve on.")] = 8501,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    open_browser: Annotated[bool, typer.Option("--open/--no-open",
                                               help="Open a browser tab.")] = False,
) -> None:
    """Serve the dashboard (Streamlit + Plotly) on the event store.

    Pages: runs, request timeline, push vs pull, reuse, leases, sim vs live, what-if.
    """
    from kvplane.store import resolve_url

    try:
        import streamlit  # noqa: F401
    except ImportError:
        _fail("the dashboard needs the 'dashboard' extra: pip install -e '.[dashboard]'")
    url = resolve_url(db).render_as_string(hide_password=False)
    app_file = Path(__file__).resolve().parent.parent / "dashboard" / "app.py"
    if not app_file.is_file():  # installed (non-editable): the package's own copy
        import kvplane.dashboard

        app_file = Path(kvplane.dashboard.__file__).resolve().parent / "app.py"
    cmd = [sys.executable, "-m", "streamlit", "run", str(app_file),
           "--server.port", str(port), "--server.address", host,
           "--server.headless", "false" if open_browser else "true",
           "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
           "--global.developmentMode", "false", "--client.toolbarMode", "viewer"]
    typer.echo(f"kvplane dashboard on http://{host}:{port}  (store: "
               f"{resolve_url(db).render_as_string(hide_password=True)})")
    env = {**os.environ, "KVPLANE_DB": url}  # not on the command line: ps would show a password
    sys.stdout.flush()
    # Become the server (no child left behind when this process is stopped or killed).
    os.execve(sys.executable, cmd, env)


def twin(
    run: Annotated[str, typer.Argument(help="Run id or unique prefix to re-simulate "
                                       "(`latest`, the default: the newest run with "
                                       "requests that is not itself a twin).")] = "latest",
    db: DbOpt = None,
    scenario: Annotated[Optional[str], typer.Option(  # noqa: UP045
        help="Scenario (bundled name or YAML) giving cluster, profiles, engine and connector; "
        "default: the run's own.")] = None,
    profile: Annotated[Optional[list[str]], typer.Option(  # noqa: UP045
        "--profile", help="Model or hardware profile (name or YAML) replacing the scenario's; "
        "repeatable.")] = None,
    mode: Annotated[Optional[str], typer.Option(  # noqa: UP045
        help="push or pull (default: as the run was routed).")] = None,
) -> None:
    """Re-simulate a recorded run's arrivals and conversations as a new run (its twin).

    The twin is stored with kind replay and the run as its parent; the dashboard's Sim vs live
    page lays the two side by side.
    """
    from kvplane.sim.config import ScenarioError
    from kvplane.sim.replay_sim import replay_into_sim
    from kvplane.store import RunNotFound, open_store

    if mode not in (None, "push", "pull"):
        _fail(f"--mode must be push or pull, not {mode!r}")
    with open_store(db) as store:
        if run == "latest":
            from sqlalchemy import select

            from kvplane.store import events_table, run_ref, runs_table

            stmt = (select(runs_table.c.id).join(events_table, events_table.c.run ==
                                                  run_ref(store.engine))
                    .where(events_table.c.type == "RequestArrived",
                           runs_table.c.kind != "replay")  # not a twin of a twin
                    .group_by(runs_table.c.id, runs_table.c.started)
                    .order_by(runs_table.c.started.desc()).limit(1))
            with store.engine.connect() as conn:
                found = conn.execute(stmt).scalar()
            if found is None:
                _fail(f"no run with requests in {store.url}")
            run = str(found)
        else:
            from kvplane.results import RunRefError, resolve_id

            try:
                run = resolve_id(store, run)
            except RunRefError as exc:
                _fail(str(exc))
        try:
            new = replay_into_sim(store, run, scenario, profiles=profile or [], mode=mode)
        except RunNotFound as exc:
            _fail(str(exc))
            return
        except (ScenarioError, ValueError) as exc:
            _fail(str(exc))
            return
        info = store.run(new)
        summary = info.meta.get("summary", {})
    ttft = (summary.get("ttft_ms") or {}).get("mean")
    tpot = (summary.get("tpot_ms") or {}).get("mean")
    typer.echo(f"twin {new} of {run}: {summary.get('finished')} requests, mean TTFT "
               f"{ttft:.1f} ms, mean TPOT {tpot:.2f} ms" if ttft is not None and tpot is not None
               else f"twin {new} of {run}")
    typer.echo(f"compare them: kvplane dashboard (Sim vs live), or kvplane replay {new}")


@import_app.command("vllm-bench")
def import_vllm_bench(
    directory: Annotated[Path, typer.Argument(help="Folder of `vllm bench serve` result JSON "
                                              "files named <mode>_qps<q>_in<in>_out<out>_"
                                              "iter<i>.json.")],
    db: DbOpt = None,
    scenario: Annotated[Optional[str], typer.Option(  # noqa: UP045
        help="The scenario these measurements reproduce (e.g. seed_push_vs_pull): the "
        "dashboard overlays its published figures.")] = None,
) -> None:
    """Import vllm bench serve results as one sweep of runs (kind import).

    One transaction: every file or none; bad files are listed with what is wrong.
    """
    from kvplane.sim.imports import ImportProblem
    from kvplane.sim.imports import import_vllm_bench as do_import

    try:
        result = do_import(db, directory, scenario=scenario)
    except ImportProblem as exc:
        _fail(str(exc))
        return
    typer.echo(f"imported {len(result['points'])} points as run {result['run_id']}:")
    for p in result["points"]:
        typer.echo(f"  {p['label']:<36} {p['requests']:>6} requests  {p['run_id']}")


@import_app.command("trace")
def import_trace(
    file: Annotated[Path, typer.Argument(help="Trace file (JSONL).")],
    fmt: Annotated[str, typer.Option("--format", help="Trace format: mooncake.")] = "mooncake",
    base: Annotated[str, typer.Option(help="Scenario giving cluster, profiles, engine and "
                                      "connector.")] = "seed_push_vs_pull",
    out: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        help="Scenario YAML to write (default: <trace>.scenario.yaml next to the trace).")] = None,
    record: Annotated[bool, typer.Option("--record/--no-record",
                                         help="Also store the arrivals as a run (kind import), "
                                         "for `kvplane twin`.")] = False,
    db: DbOpt = None,
    time_scale: Annotated[float, typer.Option(help="Multiply every timestamp.")] = 1.0,
) -> None:
    """Load a request trace as a workload scenario (YAML next to the trace).

    Run it with `kvplane sim run`; --record also stores its arrivals as a run.
    """
    from kvplane.sim.config import ScenarioError
    from kvplane.sim.imports import import_trace as do_import

    try:
        result = do_import(file, fmt=fmt, base=base, out=out, db=db, record=record,
                           time_scale=time_scale)
    except ScenarioError as exc:
        _fail(str(exc))
        return
    typer.echo(f"{result['requests']} requests; scenario written to {result['scenario']}")
    typer.echo(f"run it: kvplane sim run {result['scenario']}")
    if result["run_id"]:
        typer.echo(f"arrivals stored as run {result['run_id']}")


def register(app: typer.Typer) -> None:
    """Add the see-room commands to the main `kvplane` app."""
    app.command("dashboard")(dashboard)
    app.command("twin")(twin)
    app.add_typer(import_app, name="import")


def _main() -> None:
    """`python -m kvplane.cli_see ...`: these commands alone, before they are wired into
    `kvplane` (the dashboard's browser test uses it when `kvplane dashboard` is missing)."""
    app = typer.Typer(no_args_is_help=True, add_completion=False,
                      pretty_exceptions_enable=False)
    register(app)
    app()


if __name__ == "__main__":
    _main()
