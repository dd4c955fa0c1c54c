"""The one `kvplane` command. Each sub-command imports its room lazily, so `--help` is fast.

Where things go: the store is `--db URL` or `$KVPLANE_DB`, else `./kvplane.db` (SQLite).
Commands that only read open it read-only (they never create one). What is wrong with a store
is one line on stderr and exit code 2; `kvplane --debug` (or KVPLANE_DEBUG=1) adds the traceback.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(
    help=(
        "kvplane: plan, run and see KV-cache movement in vLLM prefill/decode disaggregation.\n\n"
        "plan: `kvplane sim run`, `kvplane plan`, `kvplane validate` (SimPy simulator).\n"
        "see: `kvplane runs`, `kvplane replay` (event store: SQLite by default, PostgreSQL by "
        "URL).\n\nThe store is --db URL, else $KVPLANE_DB, else ./kvplane.db."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
sim_app = typer.Typer(help="The simulator: run scenarios (YAML) and sweeps.", no_args_is_help=True)
app.add_typer(sim_app, name="sim")

DbOpt = Annotated[
    Optional[str],  # noqa: UP045 (typer needs Optional on 3.11)
    typer.Option("--db", help="Event store URL (sqlite:///file.db or postgresql+psycopg://...)."),
]


EngineOpt = Annotated[str, typer.Option(
    help="Where points run: `local` processes, or `ray` tasks (pip install 'kvplane[ray]').")]
AddressOpt = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option(help="With --engine ray: the Ray cluster to join (host:port, or `auto`); "
                 "default: the one this shell joined, else a private local one."),
]


_debug = False


@app.callback()
def _global_options(
    debug: Annotated[bool, typer.Option(
        "--debug", envvar="KVPLANE_DEBUG",
        help="Show the traceback of an error (a damaged store, say) as well as its message.")
    ] = False,
) -> None:
    global _debug
    _debug = debug


def _fail(msg: str, code: int = 2) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


@sim_app.command("run")
def sim_run(
    scenario: Annotated[str, typer.Argument(help="Scenario YAML file, or a bundled name "
                                            "(seed_push_vs_pull, seed_bidirectional).")],
    db: DbOpt = None,
    out: Annotated[Optional[Path], typer.Option(help="Write the summary JSON here.")] = None,  # noqa: UP045
    seed: Annotated[Optional[int], typer.Option(help="Override the scenario's seed.")] = None,  # noqa: UP045
    jobs: Annotated[int, typer.Option(help="Sweep points run in parallel processes.")] = 0,
    no_record: Annotated[bool, typer.Option("--no-record",
                                            help="Do not write events to the store.")] = False,
    engine: EngineOpt = "local",
    address: AddressOpt = None,
) -> None:
    """Run every point of a scenario's sweep, record every core event, print a summary."""
    from kvplane.sim.config import ScenarioError
    from kvplane.sim.engines import EngineError
    from kvplane.sim.runner import run_scenario

    try:
        summary = run_scenario(scenario, db=db, seed=seed, jobs=jobs, record=not no_record,
                               engine=engine, address=address)
    except (ScenarioError, EngineError) as exc:
        _fail(str(exc))
        return
    from kvplane.sim.report import points_table

    typer.echo(points_table(summary["points"]))
    if summary.get("run_id"):
        typer.echo(f"\nrun {summary['run_id']} recorded in {summary['db']}")
    if out is not None:
        out.write_text(json.dumps(summary, indent=2))
        typer.echo(f"summary written to {out}")


@app.command()
def validate(
    out: Annotated[Optional[Path], typer.Option(help="Also write the table as Markdown here "  # noqa: UP045
                                                "(e.g. docs/validation.md).")] = None,
    jobs: Annotated[int, typer.Option(help="Parallel processes.")] = 0,
) -> None:
    """Simulate the published experiments and print published vs simulated, with the error."""
    from kvplane.sim.validate import run_validation

    ok, text = run_validation(jobs=jobs)
    typer.echo(text)
    if out is not None:
        out.write_text(text + "\n")
    if not ok:
        raise typer.Exit(1)


@app.command()
def plan(
    scenario: Annotated[str, typer.Argument(help="Scenario YAML giving model, hardware and "
                                            "workload (its sweep is ignored).")],
    ttft_p90_ms: Annotated[float, typer.Option(help="SLO: p90 TTFT in ms.")] = 1000.0,
    tpot_p90_ms: Annotated[float, typer.Option(help="SLO: p90 TPOT in ms.")] = 50.0,
    qps: Annotated[Optional[float], typer.Option(help="Load to plan for (default: the "  # noqa: UP045
                                                 "scenario's highest).")] = None,
    max_instances: Annotated[int, typer.Option(help="Largest xPyD total to try.")] = 8,
    jobs: Annotated[int, typer.Option(help="Parallel processes.")] = 0,
    engine: EngineOpt = "local",
    address: AddressOpt = None,
) -> None:
    """Search xPyD and connector settings for the cheapest configuration meeting an SLO."""
    from kvplane.sim.config import ScenarioError
    from kvplane.sim.engines import EngineError
    from kvplane.sim.planner import search

    try:
        text, found = search(scenario, ttft_p90_ms=ttft_p90_ms, tpot_p90_ms=tpot_p90_ms,
                             qps=qps, max_instances=max_instances, jobs=jobs, engine=engine,
                             address=address)
    except (ScenarioError, EngineError) as exc:
        _fail(str(exc))
        return
    typer.echo(text)
    if not found:
        raise typer.Exit(1)


@app.command()
def runs(db: DbOpt = None) -> None:
    """List the runs in the event store."""
    from kvplane.store import open_store

    with open_store(db, read_only=True) as store:
        rows = store.runs()
        if not rows:
            typer.echo(f"no runs in {store.url}")
            return
        for r in rows:
            typer.echo(f"{r.id}  {r.kind:<6} {str(r.started)[:19]}  events={store.count(r.id):<8}"
                       f" {r.scenario}" + (f"  parent={r.parent}" if r.parent else ""))


@app.command()
def replay(
    run: Annotated[str, typer.Argument(help="Run id (see `kvplane runs`); `latest` for the "
                                       "newest.")],
    db: DbOpt = None,
    final: Annotated[bool, typer.Option(help="Also require the run to be quiescent: no "
                                        "leaked blocks, no transfer left in flight.")] = True,
    into: Annotated[Optional[str], typer.Option(  # noqa: UP045
        "--into", help="`sim`: re-simulate the run's arrivals and conversations instead, as a "
        "new run linked to it (the twin the dashboard compares).")] = None,
    scenario: Annotated[Optional[str], typer.Option(  # noqa: UP045
        help="With --into sim: the scenario (cluster, profiles, connector) to simulate under.")
    ] = None,
    profile: Annotated[Optional[list[str]], typer.Option(  # noqa: UP045
        help="With --into sim: a model or hardware profile to use instead.")] = None,
) -> None:
    """Rebuild a run's state through the core and check every invariant.

    Exits non-zero when an invariant is violated, printing each violation with its event.
    """
    from kvplane.core.replay import replay as do_replay
    from kvplane.store import RunNotFound, SequenceGap, open_store

    if into is not None:
        if into != "sim":
            _fail(f"--into takes `sim`, not {into!r}")
        from kvplane.sim.config import ScenarioError
        from kvplane.sim.replay_sim import replay_into_sim

        try:
            new = replay_into_sim(db, run, scenario, profiles=tuple(profile or ()))
        except (RunNotFound, ScenarioError) as exc:
            _fail(str(exc))
            return
        typer.echo(f"twin of {run} recorded as run {new}")
        return

    with open_store(db, read_only=True) as store:
        all_runs = store.runs()
        if run == "latest":
            if not all_runs:
                _fail(f"no runs in {store.url}")
            top = [r for r in all_runs if r.parent is None] or all_runs
            run = max(top, key=lambda r: r.started).id
        try:
            info = store.run(run)
        except RunNotFound as exc:
            _fail(str(exc))
            return
        # a sweep run holds no events itself: its points are its child runs
        targets = [info] + sorted((r for r in all_runs if r.parent == run),
                                  key=lambda r: r.scenario)
        bad = 0
        for target in targets:
            if target.id == run and len(targets) > 1 and store.count(run) == 0:
                typer.echo(f"run {run} ({info.kind}, {info.scenario}): "
                           f"{len(targets) - 1} point runs")
                continue
            gaps: list[SequenceGap] = []  # seqs missing from the store: a violation too
            events = store.events(target.id, on_gap=gaps.append)
            if target.kind == "live":
                # instances record concurrently: their events interleave arbitrarily in the
                # store, so merge them by the time they happened (a stable sort)
                events = iter(sorted(events, key=lambda e: e.at))
            report = do_replay(events, final=final)
            st = report.state
            problems = [f"{g.rule}: {g.missing}" for g in gaps] + [str(v) for v in
                                                                   report.violations]
            verdict = f"{len(problems)} violation(s)" if problems else "ok"
            typer.echo(f"  {target.id} {target.scenario}: {st.events} events, "
                       f"{len(st.planned)} transfers, {len(st.leases)} live leases: {verdict}")
            for p in problems[:20]:
                typer.echo(f"    {p}")
            bad += bool(problems)
    if bad:
        typer.secho(f"{bad} run(s) violate an invariant", fg=typer.colors.RED)
        raise typer.Exit(1)
    typer.secho("no invariant violated", fg=typer.colors.GREEN)


calibrate_app = typer.Typer(help="Measure this machine's costs for the simulator's profiles.",
                            no_args_is_help=True)
app.add_typer(calibrate_app, name="calibrate")


@calibrate_app.command("nixl")
def calibrate_nixl(
    device: Annotated[str, typer.Option(help="cpu (host memory) or cuda (GPU memory; two "
                                        "GPUs when present: one per process).")] = "cpu",
    mib: Annotated[int, typer.Option(help="Buffer size per side, MiB.")] = 256,
    repeats: Annotated[int, typer.Option(help="Repeats per figure (the median is kept).")] = 5,
    out: Annotated[Optional[Path], typer.Option(help="Also write the YAML block here.")] = None,  # noqa: UP045
) -> None:
    """Time NIXL WRITE/READ bandwidth, per-descriptor cost, latency and set-up costs between
    two processes, moving real bytes, and print them as a sourced hardware-profile block."""
    if device not in ("cpu", "cuda"):
        _fail("--device must be cpu or cuda")
    from kvplane.live.calibrate import as_profile_yaml, measure

    text = as_profile_yaml(measure(device, mib << 20, repeats), device)
    typer.echo(text)
    if out is not None:
        out.write_text(text + "\n")


@app.command()
def demo(db: DbOpt = None) -> None:
    """Reproduce push vs pull on the embedded defaults and leave the run in the store.

    Runs the bundled seed_push_vs_pull scenario on SQLite (./kvplane.db) and prints the
    comparison with the published figures.
    """
    from kvplane.sim.report import comparison_table
    from kvplane.sim.runner import run_scenario

    summary = run_scenario("seed_push_vs_pull", db=db, record=True)
    typer.echo(comparison_table(summary))
    typer.echo(f"\nrun {summary['run_id']} recorded in {summary['db']}")
    typer.echo(f"check it:  kvplane replay {summary['run_id']}")
    typer.echo("look at it: kvplane dashboard    (then open http://127.0.0.1:8501)")


def _register_rooms() -> None:
    """Commands whose rooms keep their own CLI modules (imports inside stay lazy)."""
    from kvplane import cli_live, cli_see

    cli_live.register(app)
    cli_see.register(app)


_register_rooms()


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
        # What is wrong with a store is the user's to fix: one line, unless asked for more.
        # (kvplane.store is looked up, not imported: if no command loaded it, it raised nothing.)
        errors = sys.modules.get("kvplane.store.errors")
        if errors is None or not isinstance(exc, errors.StoreError):
            raise
        if _debug or os.environ.get("KVPLANE_DEBUG", "") not in ("", "0"):
            traceback.print_exc()
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        sys.exit(2)
