"""Re-simulating a recorded run (its twin), and simulating a what-if, into the store.

Rules kept here:
- A twin replays the recorded *arrivals*, not the recorded decisions: every `RequestArrived`
  (time, prompt and output tokens, conversation, tenant, turn) becomes a simulated request
  with the same id, so a live run and its twin can be compared request by request.
- First turns and single requests arrive open loop, at their recorded times (shifted so the
  first arrival is at 0). A later turn of a conversation is closed loop, as in the runner: it
  is released its recorded think time (its arrival minus the previous turn's recorded finish)
  after the previous turn finishes *in the simulation*. A turn whose previous turn is not in
  the recording arrives open loop.
- Prompt content is described as the workload generators do: a conversation is one
  append-only token stream, so turn k's prompt extends turn k-1's; a shared prefix comes from
  the scenario's workload (`shared_prefix_fraction` or `shared_prefix_tokens`).
- The scenario gives cluster, profiles, engine and connector. It is the one given, else the
  one recorded with the run (`meta.scenario`), else the bundled scenario the run's name points
  at (`<scenario>:<point label>`). Mode and bidirectional reuse follow the recording's
  `RequestRouted` events unless the caller fixes them. `profiles` overrides model or hardware
  profiles (each file says its `kind`).
- The twin is stored as one run of kind `replay` whose parent is the original, with the
  scenario it ran under (`meta.scenario`, self-contained) and its summary in `meta`.
- A what-if is a scenario (usually a baseline's, with a few fields changed) run like the
  runner runs it, one child run per sweep point and seed under a sweep run of kind `sim` whose
  parent is the baseline run, reporting progress as requests finish. Given the scenario
  before the change (the control), it runs too, with the same seeds: two arms that differ in
  the changed fields only, and the sweep lists those fields.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import update

from kvplane.store import BatchingRecorder, EventStore, RunInfo, open_store, runs_table

from .config import (
    MultiTurnWorkload,
    Point,
    PoissonWorkload,
    Scenario,
    ScenarioError,
    load_scenario,
    scenario_from_data,
)
from .costs import SimCosts
from .engine import Simulation
from .host_state import HostTimeline
from .metrics import summarize
from .profiles import load_profile
from .runner import engine_config, feed, serve_history
from .workloads import FIRST_PRIVATE, SHARED_STREAM, Request

__all__ = [
    "LABEL_RE",
    "Progress",
    "RecordedRequest",
    "differences",
    "parse_label",
    "recorded_requests",
    "replay_into_sim",
    "run_whatif",
    "scenario_for_run",
    "with_profiles",
]

#: `<mode>[_bidi][_qps<q>][_in<in>][_out<out>]_iter<i>`, the runner's point labels and the
#: file names of `vllm bench serve` results.
LABEL_RE = re.compile(
    r"^(?P<mode>push|pull)(?P<bidi>_bidi)?(?:_qps(?P<qps>[0-9.eE+-]+|inf))?"
    r"(?:_in(?P<input_len>\d+))?(?:_out(?P<output_len>\d+))?_iter(?P<iteration>\d+)$"
)

#: progress(done, total, what) while a simulation runs.
Progress = Callable[[int, int, str], None]


def parse_label(label: str) -> dict[str, Any] | None:
    """The axes of a point label, or None when it is not one."""
    m = LABEL_RE.match(label)
    if m is None:
        return None
    return {
        "mode": m["mode"],
        "bidirectional": m["bidi"] is not None,
        "qps": float(m["qps"]) if m["qps"] is not None else None,
        "input_len": int(m["input_len"]) if m["input_len"] is not None else None,
        "output_len": int(m["output_len"]) if m["output_len"] is not None else None,
        "iteration": int(m["iteration"]),
    }


# --- the recording ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """One `RequestArrived`, with the recorded finish time when there is one."""

    id: str
    arrival: float
    prompt_tokens: int
    output_tokens: int
    conversation: str | None
    tenant: str
    turn: int
    finished: float | None


def recorded_requests(store: EventStore, run_id: str) -> list[RecordedRequest]:
    """Every request the run saw arrive, in arrival order (reads two event types only)."""
    finished: dict[str, float] = {}
    arrivals = []
    for e in store.events(run_id, ["RequestArrived", "RequestFinished"]):
        name = type(e).__name__
        if name == "RequestFinished" and e.request is not None:
            finished.setdefault(e.request, e.at)
        elif name == "RequestArrived" and e.request is not None:
            arrivals.append(e)
    # a live run records each request's arrival at every hop (router, prefill leg, decode
    # leg): the client's request is the earliest one
    first: dict[str, Any] = {}
    for e in sorted(arrivals, key=lambda e: e.at):
        first.setdefault(e.request, e)
    out = [
        RecordedRequest(
            id=e.request, arrival=e.at, prompt_tokens=e.prompt_tokens,  # type: ignore[attr-defined]
            output_tokens=e.output_tokens, conversation=e.conversation,  # type: ignore[attr-defined]
            tenant=e.tenant, turn=e.turn, finished=finished.get(e.request),  # type: ignore[attr-defined]
        )
        for e in first.values()
    ]
    out.sort(key=lambda r: (r.arrival, r.id))
    return out


def _recorded_routing(store: EventStore, run_id: str) -> tuple[str | None, bool | None]:
    """The mode and reuse setting most requests of the run were routed with."""
    modes: Counter[str] = Counter()
    bidi: Counter[bool] = Counter()
    for e in store.events(run_id, "RequestRouted"):
        modes[e.mode] += 1  # type: ignore[attr-defined]
        bidi[e.bidirectional] += 1  # type: ignore[attr-defined]
    return (modes.most_common(1)[0][0] if modes else None,
            bidi.most_common(1)[0][0] if bidi else None)


# --- the scenario -----------------------------------------------------------------------------


def with_profiles(scenario: Scenario, profiles: Iterable[str | Path]) -> Scenario:
    """The scenario with model and/or hardware profiles replaced (each file names its kind)."""
    data = scenario.model_dump(mode="json")
    changed = False
    for ref in profiles:
        prof = load_profile(ref)
        kind = "model" if type(prof).__name__ == "ModelProfile" else "hardware"
        data["profiles"][kind] = prof.model_dump(mode="json")
        changed = True
    return scenario_from_data(data, file=f"{scenario.name} + profiles") if changed else scenario


def _pick(sc: Scenario, label: str | None) -> Point:
    points = sc.points()
    if label is not None:
        for p in points:
            if p.label == label:
                return p
    return points[0]


def scenario_for_run(store: EventStore, run: RunInfo) -> Scenario:
    """The scenario a run was made under: recorded in `meta`, else named by the run.

    Raises ScenarioError when neither says, naming the run and what to pass instead.
    """
    return _scenario_and_seed(store, run)[0]


def _scenario_and_seed(store: EventStore, run: RunInfo
                       ) -> tuple[Scenario, int, tuple[Point, ...]]:
    """The run's scenario, the seed its point ran with (`meta.seed`, else the point's) and the
    sweep points its servers ran before it (`engine.pool_history: sweep`; else none)."""
    sc, seed, history = _find_scenario(store, run)
    recorded = run.meta.get("seed") if isinstance(run.meta, dict) else None
    if isinstance(recorded, int) and not isinstance(recorded, bool):
        seed = recorded
    return sc, seed, history


def _find_scenario(store: EventStore, run: RunInfo) -> tuple[Scenario, int, tuple[Point, ...]]:
    meta = run.meta if isinstance(run.meta, dict) else {}
    if isinstance(meta.get("scenario"), dict):
        sc = scenario_from_data(meta["scenario"], file=f"run {run.id} meta.scenario")
        return sc, sc.seed, ()
    label = meta.get("point") or (run.scenario.rpartition(":")[2] if ":" in run.scenario
                                  else None)
    candidates = [meta.get("compare_with"), run.scenario.partition(":")[0]]
    if run.parent is not None:
        try:
            parent = store.run(run.parent)
        except Exception:  # noqa: BLE001 - a parent deleted meanwhile: use the run's own name
            parent = None
        if parent is not None and isinstance(parent.meta.get("scenario"), dict):
            sc = scenario_from_data(parent.meta["scenario"], file=f"run {parent.id} meta.scenario")
            p = _pick(sc, label)
            # a simulated point ran after its sweep history; what served a measured run
            # before it is not recorded, so its twin starts on fresh servers
            return p.scenario, p.seed, (p.history if run.kind == "sim" else ())
        if parent is not None:
            candidates = [parent.meta.get("compare_with"), *candidates,
                          parent.scenario.partition(":")[0]]
    for cand in candidates:
        if not isinstance(cand, str) or not cand:
            continue
        try:
            sc = load_scenario(cand)
        except ScenarioError:
            continue
        p = _pick(sc, label)
        return p.scenario, p.seed, ()
    raise ScenarioError(f"run {run.id}", [(
        "scenario",
        ("a run recorded with its scenario, or one named after a bundled scenario or a "
         "scenario file; pass one explicitly (--scenario NAME_OR_FILE)"),
        repr(run.scenario), None,
    )])


# --- feeding recorded requests ------------------------------------------------------------------


def _requests(recorded: Sequence[RecordedRequest], sc: Scenario
              ) -> tuple[list[Request], list[str]]:
    """Workload records (rid = position) for the recorded requests, and their original ids."""
    t0 = recorded[0].arrival if recorded else 0.0
    wl = sc.workload
    conv_index: dict[tuple[str, str], int] = {}
    last_turn: dict[tuple[str, str], tuple[int, float | None]] = {}
    out: list[Request] = []
    for rid, r in enumerate(recorded):
        conversation = None
        previous = None
        think = 0.0
        stream = FIRST_PRIVATE + rid
        shared_stream, shared = 0, 0
        if r.conversation is not None:
            key = (r.tenant, r.conversation)
            conversation = conv_index.setdefault(key, len(conv_index))
            stream = FIRST_PRIVATE + len(recorded) + conversation
            prev = last_turn.get(key)
            if prev is not None and prev[1] is not None:
                previous, think = prev[0], max(r.arrival - prev[1], 0.0)
            last_turn[key] = (rid, r.finished)
            if isinstance(wl, MultiTurnWorkload) and wl.shared_prefix_tokens:
                shared_stream = SHARED_STREAM
                shared = min(wl.shared_prefix_tokens, r.prompt_tokens)
        elif isinstance(wl, PoissonWorkload) and wl.shared_prefix_fraction:
            shared_stream = SHARED_STREAM
            shared = int(r.prompt_tokens * wl.shared_prefix_fraction)
        out.append(Request(
            rid=rid, arrival=r.arrival - t0, prompt_tokens=r.prompt_tokens,
            output_tokens=r.output_tokens, conversation=conversation, turn=r.turn,
            think_time=think, previous=previous, shared_stream=shared_stream,
            shared_tokens=shared, stream=stream,
        ))
    return out, [r.id for r in recorded]


def _run_until(sim: Simulation, done_event: Any, total: int, progress: Progress | None,
               what: str) -> None:
    """`env.run(until=done_event)`, reporting progress as requests finish (requests finished
    before it, a sweep history's, are not counted)."""
    env = sim.env
    base = sim.finished_count
    if progress is None:
        env.run(until=done_event)
        return
    last = -1
    steps = 0
    while not done_event.triggered:
        if env.peek() == float("inf"):
            break  # nothing left to happen: a stuck workload; summarize() says what finished
        env.step()
        steps += 1
        if steps % 2000 == 0 and sim.finished_count - base != last:
            last = sim.finished_count - base  # not len(sim.done): a long run streams (runner.py)
            progress(last, total, what)
    progress(sim.finished_count - base, total, what)


def _summary(sim: Simulation, warmup: float, wall: float, simulated: float) -> dict[str, Any]:
    stats = summarize(sim.done, warmup=warmup)
    return {**_finite(stats), "finished": len(sim.done), "simulated_s": simulated,
            "wall_s": wall}


def _finite(value: Any) -> Any:
    """JSON for run meta: NaN (no samples) becomes None."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value


# --- the twin -------------------------------------------------------------------------------------


def replay_into_sim(
    db: str | EventStore | None,
    run_id: str,
    scenario: str | Path | Scenario | None = None,
    *,
    profiles: Sequence[str | Path] = (),
    mode: str | None = None,
    bidirectional: bool | None = None,
    progress: Progress | None = None,
    host_samples: Sequence[Sequence[float]] | None = None,
) -> str:
    """Re-simulate a recorded run's arrivals; store the twin (kind `replay`, parent = the run).

    `host_samples` (`[time, run queue, ...]`, the events' clock; default: the run's own
    `meta.host_samples`, where a live run on a shared host kept them) is the host's state
    during the recorded run: with a calibration conditioned on it (`host_state`), each hop's
    slowdown is drawn given the run queue at the hop's simulated time (sim/host_state.py).
    Returns the new run's id. Raises `RunNotFound` for an unknown run, ScenarioError when no
    scenario can be found or the run holds no `RequestArrived` event.
    """
    if isinstance(db, EventStore):
        return _replay(db, run_id, scenario, profiles, mode, bidirectional, progress,
                       host_samples)
    with open_store(db) as store:
        return _replay(store, run_id, scenario, profiles, mode, bidirectional, progress,
                       host_samples)


def _replay(store: EventStore, run_id: str, scenario: str | Path | Scenario | None,
            profiles: Sequence[str | Path], mode: str | None, bidirectional: bool | None,
            progress: Progress | None, host_samples: Sequence[Sequence[float]] | None) -> str:
    run = store.run(run_id)
    if host_samples is None:
        host_samples = run.meta.get("host_samples") or None
    history: tuple[Point, ...] = ()
    if scenario is None:
        sc, seed, history = _scenario_and_seed(store, run)
    elif isinstance(scenario, Scenario):
        sc, seed = scenario, scenario.seed
    else:
        first = _pick(load_scenario(scenario), None)
        sc, seed = first.scenario, first.seed
    sc = with_profiles(sc, profiles)
    recorded = recorded_requests(store, run_id)
    if not recorded:
        raise ScenarioError(f"run {run_id}", [(
            "events", "a run with RequestArrived events to replay", "none", None)])
    rec_mode, rec_bidi = _recorded_routing(store, run_id)
    mode = mode or rec_mode or sc.connector.mode
    bidi = bidirectional if bidirectional is not None else (
        rec_bidi if rec_bidi is not None else sc.connector.bidirectional)
    connector = sc.connector.model_copy(update={"mode": mode, "bidirectional": bidi})
    sc = sc.model_copy(update={"connector": connector})
    point = Point(index=0, mode=connector.mode, bidirectional=bidi, qps=None, input_len=None,
                  output_len=None, iteration=0, seed=seed, scenario=sc, history=history)
    reqs, ids = _requests(recorded, sc)
    try:
        costs = SimCosts.from_scenario(sc)
    except ValueError as exc:  # the profiles do not fit together (a model too big, say)
        raise ScenarioError(sc.name, [("profiles", "a model that fits the hardware", str(exc),
                                       None)]) from None
    cfg = engine_config(point, costs)
    dump = sc.model_dump(mode="json")
    twin = store.create_run("replay", f"twin of {run.scenario}", parent=run_id, meta={
        "scenario": dump, "replay_of": run_id, "point": point.label, "seed": seed,
        "requests": len(reqs), "profiles": [str(p) for p in profiles],
    })
    rec = BatchingRecorder(store, twin, trusted=True)  # the core's events
    try:
        sim = Simulation(cfg, costs, rec.record)
        # a simulated sweep point whose servers served the sweep before it: the same history
        serve_history(sim, point, cfg.decode_layout.block_size)
        begin = sim.env.now
        bins = costs.host_state_bins()
        followed = 0
        if host_samples and bins is not None:  # the host's state as the recorded run met it
            sim.follow_host(HostTimeline.from_samples(host_samples, bins[0],
                                                      shift=begin - recorded[0].arrival))
            followed = len(host_samples)
        done = feed(sim, reqs, cfg.decode_layout.block_size, ids=ids,
                    tenants=[r.tenant for r in recorded],
                    conversations=[r.conversation for r in recorded], start=begin)
        wall = time.perf_counter()
        _run_until(sim, done, len(reqs), progress, f"replaying {run_id[:8]}")
        simulated = sim.env.now - begin
        sim.drain()
        wall = time.perf_counter() - wall
    finally:
        rec.close()
    _set_meta(store, twin, {"summary": _summary(sim, 0.0, wall, simulated),
                            "host_samples_followed": followed})
    return twin


def _set_meta(store: EventStore, run_id: str, extra: dict[str, Any]) -> None:
    """Add keys to a run's meta after it ran (the store has no call for it: a plain UPDATE of
    the run we created ourselves)."""
    info = store.run(run_id)
    meta = {**info.meta, **_finite(extra)}
    with store.engine.begin() as conn:
        conn.execute(update(runs_table).where(runs_table.c.id == run_id).values(meta=meta))


# --- what-if --------------------------------------------------------------------------------------


def run_whatif(
    db: str | EventStore | None,
    scenario: Scenario,
    *,
    baseline: str | None = None,
    changes: dict[str, Any] | None = None,
    progress: Progress | None = None,
    seeds: int = 1,
    control: Scenario | None = None,
) -> dict[str, Any]:
    """Simulate every point of `scenario` into the store under a sweep run whose parent is
    `baseline` (a run id, or None), `seeds` times each (iterations with their own seeds).

    With `control` (the scenario before the change), the control runs too, with the same
    seeds and so the same arrivals wherever the change leaves the workload alone: the two arms
    differ in the changed fields only, listed in the sweep's `meta.differences`.
    Returns {"run_id", "points": [summary with run_id and arm], "differences"}."""
    if isinstance(db, EventStore):
        return _whatif(db, scenario, baseline, changes or {}, progress, seeds, control)
    with open_store(db) as store:
        return _whatif(store, scenario, baseline, changes or {}, progress, seeds, control)


def differences(a: Scenario, b: Scenario) -> list[str]:
    """Every field where two scenarios differ, as `dotted.path: a -> b` (sweep, name,
    description and published figures left out)."""
    def flat(d: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(d, dict):
            out: dict[str, Any] = {}
            for k, v in d.items():
                out.update(flat(v, f"{prefix}{k}."))
            return out
        return {prefix[:-1]: d}

    skip = ("sweep", "name", "description", "published", "assumptions")
    da = flat({k: v for k, v in a.model_dump(mode="json").items() if k not in skip})
    db_ = flat({k: v for k, v in b.model_dump(mode="json").items() if k not in skip})
    out = []
    for key in sorted(set(da) | set(db_)):
        if key.endswith((".source", ".description")):
            continue
        if da.get(key) != db_.get(key):
            out.append(f"{key}: {da.get(key)!r} -> {db_.get(key)!r}")
    return out


def _with_seeds(sc: Scenario, seeds: int) -> Scenario:
    from .config import Sweep

    return sc.model_copy(update={"sweep": Sweep(iterations=max(seeds, 1))})


def _whatif(store: EventStore, sc: Scenario, baseline: str | None, changes: dict[str, Any],
            progress: Progress | None, seeds: int, control: Scenario | None) -> dict[str, Any]:
    arms = [("what-if", _with_seeds(sc, seeds).points())]
    diff = differences(control, sc) if control is not None else []
    if control is not None:
        arms.insert(0, ("control", _with_seeds(control, seeds).points()))
    total = sum(len(p) for _, p in arms)
    parent = store.create_run("sim", sc.name, parent=baseline, meta={
        "points": total, "seed": sc.seed, "seeds": seeds, "whatif": _finite(changes),
        "differences": diff, "scenario": sc.model_dump(mode="json"),
        **({"control": control.model_dump(mode="json")} if control is not None else {}),
    })
    results = []
    i = 0
    for arm, points in arms:
        for point in points:
            i += 1
            run_id = store.create_run("sim", f"{point.scenario.name}:{point.label}",
                                      parent=parent, meta={"point": point.label,
                                                           "seed": point.seed, "arm": arm})
            rec = BatchingRecorder(store, run_id, trusted=True)  # the core's events
            try:
                summary = _simulate_point(point, rec.record, progress,
                                          f"{arm} {i}/{total} seed {point.iteration + 1}")
            finally:
                rec.close()
            summary["run_id"] = run_id
            summary["arm"] = arm
            _set_meta(store, run_id, {"summary": summary})
            results.append(summary)
    return {"run_id": parent, "scenario": sc.name, "points": results, "differences": diff}


def _simulate_point(point: Point, record: Callable[[Any], None], progress: Progress | None,
                    what: str) -> dict[str, Any]:
    """runner.simulate with progress reported while it runs; NaN made JSON-safe for meta."""
    from .runner import simulate

    _, summary = simulate(point, record,
                          run=lambda sim, done, total: _run_until(sim, done, total, progress,
                                                                  what))
    return _finite(summary)  # type: ignore[no-any-return]
