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
from typing import Annotated, Any, Optional

import typer

from kvplane.cli_paths import writable_file

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


def _version(value: bool) -> None:
    if value:
        from kvplane import __version__

        typer.echo(f"kvplane {__version__}")
        raise typer.Exit()


sim_app = typer.Typer(help="The simulator: run scenarios (YAML) and sweeps.", no_args_is_help=True)
app.add_typer(sim_app, name="sim")

DbOpt = Annotated[
    Optional[str],  # noqa: UP045 (typer needs Optional on 3.11)
    typer.Option("--db", help="Event store URL (sqlite:///file.db or postgresql+psycopg://...)."),
]


EngineOpt = Annotated[str, typer.Option(
    help="Where points run: `local` processes, or `ray` tasks (pip install 'kvplane\\[ray]').")]
AddressOpt = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option(help="With --engine ray: the Ray cluster to join (host:port, or `auto`); "
                 "default: the one this shell joined, else a private local one."),
]


_debug = False


@app.callback()
def _global_options(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
    debug: Annotated[bool, typer.Option(
        "--debug", envvar="KVPLANE_DEBUG",
        help="Show the traceback of an error (a damaged store, say) as well as its message.")
    ] = False,
) -> None:
    """kvplane: plan, run and see KV-cache movement in vLLM prefill/decode disaggregation."""
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
    out: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        callback=writable_file, help="Write the summary JSON here.")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Override the scenario's seed.")] = None,  # noqa: UP045
    requests: Annotated[Optional[int], typer.Option(  # noqa: UP045
        min=1, help="Override the requests per point (a quick look).")] = None,
    jobs: Annotated[int, typer.Option(min=0, help="Sweep points run in parallel processes.")] = 0,
    no_record: Annotated[bool, typer.Option("--no-record",
                                            help="Do not write events to the store.")] = False,
    engine: EngineOpt = "local",
    address: AddressOpt = None,
) -> None:
    """Run every point of a scenario's sweep, record every core event, print a summary."""
    from kvplane.sim.config import ScenarioError
    from kvplane.sim.engine import PoolTooSmall
    from kvplane.sim.engines import EngineError
    from kvplane.sim.runner import run_scenario

    try:
        summary = run_scenario(scenario, db=db, seed=seed, jobs=jobs, record=not no_record,
                               requests=requests, engine=engine, address=address)
    except (ScenarioError, EngineError) as exc:
        _fail(str(exc))
        return
    except PoolTooSmall as exc:
        _fail(f"{scenario}: {exc}")
        return
    from kvplane.sim.report import points_table

    if not no_record:
        _roll_up(summary, db)
    typer.echo(points_table(summary["points"]))
    if summary.get("run_id"):
        typer.echo(f"\nrun {summary['run_id']} recorded in {summary['db']}")
    if out is not None:
        from kvplane.results import json_safe

        out.write_text(json.dumps(json_safe(summary), indent=2, allow_nan=False) + "\n")
        typer.echo(f"summary written to {out}")


def _roll_up(summary: dict[str, Any], db: str | None) -> None:
    """The dashboard's rollup of each point run just recorded (`kvplane.dashboard.rollup`):
    its pages then open on them without reading their events again. Without the dashboard
    extra (pandas) there is no dashboard to serve: nothing to do."""
    try:
        from kvplane.dashboard import rollup
    except ImportError:
        return
    from kvplane.store import open_store

    ids = [p["run_id"] for p in summary.get("points", []) if p.get("run_id")]
    if not ids:
        return
    with open_store(db) as store:  # as given: the summary's URL hides a password
        for run_id in ids:
            try:
                rollup.write(store, run_id)
            except Exception as exc:  # noqa: BLE001 - the run is recorded; say so, go on
                typer.secho(f"warning: no rollup for run {run_id} ({type(exc).__name__}: "
                            f"{exc}); the dashboard reads its events, `kvplane rollup "
                            f"{run_id[:8]}` tries again", fg=typer.colors.YELLOW, err=True)


@app.command()
def validate(
    out: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        callback=writable_file, help="Also write the table as Markdown here "
        "(e.g. docs/validation.md).")] = None,
    jobs: Annotated[int, typer.Option(min=0, help="Parallel processes.")] = 0,
    seeds: Annotated[int, typer.Option(
        min=1, help="Seeds per figure (mean and 95 % interval).")] = 10,
    calibration: Annotated[Optional[str], typer.Option(  # noqa: UP045
        help="Calibration profile (name or YAML from `kvplane calibrate fit`); default: the "
        "bundled one of each scenario's (model kind, hardware).")] = None,
) -> None:
    """Simulate the published experiments and print published vs simulated over seeds; only
    figures no constant was fitted to count."""
    from kvplane.sim.config import ScenarioError
    from kvplane.sim.profiles import load_profile
    from kvplane.sim.validate import run_validation

    cal = None
    if calibration is not None:
        try:
            cal = load_profile(calibration, "calibration")
        except ScenarioError as exc:
            _fail(str(exc))
    ok, text = run_validation(jobs=jobs, seeds=seeds, calibration=cal)  # type: ignore[arg-type]
    typer.echo(text)
    if out is not None:
        out.write_text(text + "\n")
    if not ok:
        raise typer.Exit(1)


def _positive(value: float | None) -> float | None:
    """A rate or an SLO: None (the default) or more than zero."""
    if value is not None and not value > 0:
        raise typer.BadParameter(f"must be more than 0, not {value:g}")
    return value


@app.command()
def plan(
    scenario: Annotated[str, typer.Argument(help="Scenario YAML or bundled name giving model, "
                                            "hardware, engine and workload shape.")],
    ttft_p90_ms: Annotated[float, typer.Option(callback=_positive,
                                               help="SLO: p90 TTFT in ms.")] = 1000.0,
    tpot_p90_ms: Annotated[float, typer.Option(callback=_positive,
                                               help="SLO: p90 TPOT in ms.")] = 50.0,
    qps: Annotated[Optional[float], typer.Option(  # noqa: UP045
        "--qps", "--rate", callback=_positive, help="Rate to plan for: requests/s "
        "(multi-turn: new conversations/s). Default: the scenario's highest swept rate.")
    ] = None,
    input_len: Annotated[Optional[int], typer.Option(  # noqa: UP045
        min=1, help="Input tokens (multi-turn: first prompt). Default: the longest swept.")
    ] = None,
    output_len: Annotated[Optional[int], typer.Option(  # noqa: UP045
        min=1, help="Output tokens. Default: the longest swept.")] = None,
    requests: Annotated[Optional[int], typer.Option(  # noqa: UP045
        min=1, help="Requests per simulated run. Default: the scenario's.")] = None,
    seeds: Annotated[int, typer.Option(min=1, help="Seeds per candidate; a candidate must "
                                       "meet the SLO at every seed.")] = 3,
    gpu_hour_price: Annotated[Optional[float], typer.Option(  # noqa: UP045
        min=0.0, help="Price of one GPU-hour: rank and print cost in $/h.")] = None,
    max_instances: Annotated[int, typer.Option(min=2, help="Largest xPyD total to try.")] = 8,
    jobs: Annotated[int, typer.Option(min=0, help="Parallel processes (0: one per core).")] = 0,
    engine: EngineOpt = "local",
    address: AddressOpt = None,
    topology_out: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        "--topology-out", callback=writable_file, help="Write the chosen configuration as a "
        "`kvplane deploy` topology YAML here.")] = None,
    model: Annotated[Optional[str], typer.Option(  # noqa: UP045
        help="With --topology-out: the model path or hub id for vLLM (default: the "
        "profile's name).")] = None,
    curve: Annotated[bool, typer.Option("--curve/--no-curve", help="Also run the chosen "
                                        "setting at 0.25x-2x the rate on every shape tried "
                                        "(the dashboard's Plan page).")] = True,
    db: DbOpt = None,
    record: Annotated[bool, typer.Option("--record/--no-record", help="Keep the search in "
                                         "the store (the dashboard's Plan page).")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Search xPyD and connector settings for the cheapest configuration meeting an SLO.

    States the workload it plans for; every candidate runs at several seeds (intervals shown);
    the chosen one can be written as a `kvplane deploy` topology.
    """
    from kvplane.sim.config import ScenarioError, load_scenario
    from kvplane.sim.planner import plan as do_plan

    try:
        sc = load_scenario(scenario)
    except ScenarioError as exc:
        _fail(str(exc))
        return
    from tqdm import tqdm

    bar = tqdm(total=1, desc=f"planning {sc.name}", unit="sim", leave=False,
               disable=as_json)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    try:
        result = do_plan(sc, ttft_p90_ms=ttft_p90_ms, tpot_p90_ms=tpot_p90_ms, rate=qps,
                         input_len=input_len, output_len=output_len, requests=requests,
                         seeds=seeds, max_instances=max_instances,
                         gpu_hour_price=gpu_hour_price, jobs=jobs, curve=curve,
                         progress=progress, engine=engine, address=address)
    except (ScenarioError, ValueError) as exc:
        bar.close()
        _fail(str(exc))
        return
    bar.close()
    data = result.as_dict()
    if as_json:
        typer.echo(json.dumps(data, indent=2, allow_nan=False))
    else:
        typer.echo(result.text())
    if record:
        from kvplane.store import open_store

        with open_store(db) as store:
            run_id = store.create_run("sim", f"plan:{sc.name}", meta={
                "plan": data, "scenario": sc.model_dump(mode="json")})
        if not as_json:
            typer.echo(f"search recorded as run {run_id[:8]} (dashboard: Plan page)")
    if topology_out is not None and result.chosen is not None:
        from kvplane.plan_deploy import render, topology

        topo = topology(data, sc, model=model)
        from kvplane.live.deploy import TopologyError, load_topology

        try:
            load_topology(topo)
        except TopologyError as exc:  # a bug here, not the user's: say so plainly
            _fail(f"the topology written for the plan does not check: {exc}")
        topology_out.write_text(render(data, topo))
        if not as_json:
            typer.echo(f"topology written to {topology_out}: kvplane deploy {topology_out}")
    if not result.found:
        raise typer.Exit(1)


@app.command()
def replay(
    run: Annotated[str, typer.Argument(help="Run id or a unique prefix (see `kvplane runs`); "
                                       "`latest` for the newest.")],
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
    from kvplane.results import RunRefError, resolve_id
    from kvplane.store import RunNotFound, SequenceGap, open_store

    if run != "latest":
        with open_store(db, read_only=True) as store:
            try:
                run = resolve_id(store, run)
            except RunRefError as exc:
                _fail(str(exc))
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
    out: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        callback=writable_file, help="Also write the YAML block here.")] = None,
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


@calibrate_app.command("fit")
def calibrate_fit(
    use: Annotated[str, typer.Option(help="Comma-separated ids of the figures to fit to "
                                     "(scenarios/published.yaml; see docs/published.md).")],
    prior: Annotated[Optional[str], typer.Option(  # noqa: UP045
        help="Calibration to start from (its unfitted constants are kept); default: the "
        "bundled one for the seed scenarios.")] = None,
    name: Annotated[Optional[str], typer.Option(help="Name of the new profile.")] = None,  # noqa: UP045
    out: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        callback=writable_file, help="Write the calibration YAML here.")] = None,
    hold: Annotated[Optional[list[str]], typer.Option(  # noqa: UP045
        help="NAME=VALUE: keep a constant at a value instead of fitting it (e.g. "
        "prefill_request_overhead=0 to remove that delay); repeatable.")] = None,
) -> None:
    """Fit the free constants of a (model kind, hardware) pair to named figures and record
    which figures each constant used; `kvplane validate --calibration FILE` then counts every
    other figure as a prediction."""
    import yaml

    from kvplane.sim.calibration import fit, fittable_figures
    from kvplane.sim.config import ScenarioError
    from kvplane.sim.profiles import load_profile

    ids = [u.strip() for u in use.split(",") if u.strip()]
    unknown = [u for u in ids if u not in fittable_figures()]
    if not ids or unknown:
        _fail(f"--use: unknown or unpriceable figure ids {unknown}; choose from "
              f"{', '.join(fittable_figures())}")
    base = None
    if prior is not None:
        try:
            base = load_profile(prior, "calibration")
        except ScenarioError as exc:
            _fail(str(exc))
    held: dict[str, float] = {}
    for h in hold or []:
        key, _, val = h.partition("=")
        try:
            held[key.strip()] = float(val)
        except ValueError:
            _fail(f"--hold {h!r}: expected NAME=VALUE with a number")
    try:
        result = fit(ids, base, name, hold=held)  # type: ignore[arg-type]
    except ValueError as exc:
        _fail(str(exc))
    for n, figs in result.fitted.items():
        typer.echo(f"{n} = {getattr(result.calibration, n).value:.6g}  (from {', '.join(figs)})")
    for n in result.kept:
        why = "held" if n in held else "not determined: kept"
        typer.echo(f"{n} = {getattr(result.calibration, n).value:.6g}  ({why})")
    for fid, r in result.residuals.items():
        typer.echo(f"  residual {fid}: {r * 100:+.2f} %")
    text = yaml.safe_dump(result.calibration.model_dump(mode="json", exclude_none=True),
                          sort_keys=False, width=100)
    if out is not None:
        out.write_text(text)
        typer.echo(f"written to {out}")
    else:
        typer.echo(text)


@calibrate_app.command("live")
def calibrate_live(
    run: Annotated[str, typer.Argument(help="Recorded live run to fit to (pull-mode requests "
                                       "through kvplane router).")],
    db: DbOpt = None,
    scenario: Annotated[Optional[str], typer.Option(  # noqa: UP045
        help="Scenario the run ran under (model, hardware, engine); default: the run's own "
        "(meta.scenario).")] = None,
    name: Annotated[Optional[str], typer.Option(help="Name of the new profile.")] = None,  # noqa: UP045
    out: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        callback=writable_file, help="Write the calibration YAML here.")] = None,
    predict: Annotated[Optional[str], typer.Option(  # noqa: UP045
        help="Another recorded run to predict with the fit: its twins' TTFT percentiles "
        "against its recorded ones.")] = None,
    seeds: Annotated[int, typer.Option(min=1, help="Twins (seeds) pooled for --predict.")] = 20,
    requests_of: Annotated[Optional[list[str]], typer.Option(  # noqa: UP045
        "--requests-of", help="With --predict of a run that recorded several workloads "
        "together: compare only the requests of this recorded run (repeat for each workload; "
        "the twins simulate them all, as they shared the engines).")] = None,
    host_samples: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        help="JSON file of the host's run-queue samples per run ({run: \\[\\[time, run queue, "
        "...], ...]}, or a live test's prediction.json with them under host_samples); "
        "default: the runs' own meta.host_samples.")] = None,
) -> None:
    """Fit a (model kind, hardware) calibration from a recorded live run: the router's request
    and response legs, the connector's per-transfer set-up, the engine's step overhead and
    compute efficiency, and the host's per-hop delay, each measured from the run's events, and
    record which run and intervals each value came from. With the host's run queue sampled
    during the runs, the delay is split by it and the twin of --predict follows its own run's
    samples."""
    import json

    import yaml

    from kvplane.sim.calibration import apply_calibration, calibration_for
    from kvplane.sim.config import ScenarioError, load_scenario
    from kvplane.sim.live_calibration import (
        describe,
        fit_live,
        interference_note,
        predict_groups,
    )
    from kvplane.sim.live_calibration import requests_of as requests_in
    from kvplane.sim.replay_sim import scenario_for_run
    from kvplane.store import RunNotFound, open_store

    if requests_of and predict is None:
        _fail("--requests-of compares requests of a run given to --predict: give --predict")
    samples: dict[str, list[list[float]]] = {}
    if host_samples is not None:
        try:
            loaded = json.loads(host_samples.read_text())
            samples = loaded.get("host_samples", loaded)
        except (OSError, ValueError, AttributeError) as exc:
            _fail(f"--host-samples {host_samples}: {exc}")
        if not isinstance(samples, dict):
            _fail(f"--host-samples {host_samples}: not an object of run -> samples")
        for want in (run, predict):
            if want is not None and want not in samples:
                _fail(f"--host-samples {host_samples}: no samples for run {want!r} (it has "
                      f"{', '.join(sorted(samples)) or 'none'})")
    with open_store(db) as store:
        try:
            info = store.run(run)
            sc = load_scenario(scenario) if scenario else scenario_for_run(store, info)
            if scenario:
                sc = sc.points()[0].scenario
            result = fit_live(store, info.id, sc.model, sc.hardware, calibration_for(sc), name,
                              sc.engine.block_size, sc.link, host_samples=samples.get(run),
                              graph_batch=sc.engine.cuda_graph_max_batch or 0)
        except (RunNotFound, ScenarioError, ValueError) as exc:
            _fail(str(exc))
        for line in describe(result):
            typer.echo(line)
        if predict is not None:
            try:
                target = store.run(predict).id
                groups = None if not requests_of else {
                    name: requests_in(store, store.run(name).id) for name in requests_of}
                preds = predict_groups(store, target, apply_calibration(sc, result.calibration),
                                       seeds, host_samples=samples.get(predict), groups=groups)
            except (RunNotFound, ScenarioError, ValueError) as exc:
                _fail(str(exc))
            for pred in preds.values():
                for line in pred.lines():
                    typer.echo(line)
            note = interference_note(store, target)
            if note is not None:
                typer.echo(note)
    text = yaml.safe_dump(result.calibration.model_dump(mode="json", exclude_none=True),
                          sort_keys=False, width=100)
    if out is not None:
        out.write_text(text)
        typer.echo(f"written to {out}")


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
    from kvplane import cli_live, cli_results, cli_see

    cli_live.register(app)
    cli_see.register(app)
    cli_results.register(app)


_register_rooms()


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
        # What is wrong with a store is the user's to fix: one line, unless asked for more.
        # (kvplane.store is looked up, not imported: if no command loaded it, it raised nothing.)
        # So is a file it names that cannot be read or written (a missing folder, no rights).
        errors = sys.modules.get("kvplane.store.errors")
        store_error = errors is not None and isinstance(exc, errors.StoreError)
        if not store_error and not isinstance(exc, OSError):
            raise
        if _debug or os.environ.get("KVPLANE_DEBUG", "") not in ("", "0"):
            traceback.print_exc()
        what = str(exc)
        if isinstance(exc, OSError) and exc.strerror and exc.filename:
            what = f"{exc.filename}: {exc.strerror}"
        typer.secho(f"error: {what}", fg=typer.colors.RED, err=True)
        sys.exit(2)
