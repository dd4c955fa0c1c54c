"""Running a scenario: every sweep point through the engine, recorded, summarised.

Rules kept here:
- A point is a pure function of (scenario, point seed): same seed, same numbers.
- Each point is its own run in the store, a child of the sweep's run (kind `sim`), so points
  simulated in parallel processes never share a sequence of events.
- Multi-turn conversations are closed loops: turn k is released `think_time` after turn k-1
  finished, never before.
- Recording goes through the store's batching recorder, which never blocks the simulation on
  I/O; `record=False` uses no store at all.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from itertools import count
from typing import Any

import numpy as np

from kvplane.core.routing import Policy

from .config import Point, Scenario, load_scenario
from .costs import SimCosts
from .engine import EngineConfig, SimRequest, Simulation, ignore
from .metrics import StreamingSummary, summarize
from .workloads import Request, RequestBatch, requests_for_point


def engine_config(point: Point, costs: SimCosts) -> EngineConfig:
    sc: Scenario = point.scenario
    con, eng, cl = sc.connector, sc.engine, sc.cluster
    lease = con.lease
    renewable = lease.kind == "renewable"
    routing = Policy(cl.routing)
    return EngineConfig(
        mode=point.mode,
        bidirectional=point.bidirectional,
        num_prefill=cl.prefill_instances,
        num_decode=cl.decode_instances,
        prefill_layout=costs.layout("prefill"),
        decode_layout=costs.layout("decode"),
        prefill_blocks=costs.pool_blocks["prefill"],
        decode_blocks=costs.pool_blocks["decode"],
        pool_run_blocks=eng.pool_run_blocks,
        block_reuse=eng.block_reuse,
        max_num_seqs=eng.max_num_seqs,
        max_num_batched_tokens=eng.max_num_batched_tokens if eng.chunked_prefill else 1 << 30,
        decode_policy=Policy("kv_affinity") if point.bidirectional else routing,
        prefill_policy=routing,
        prefill_prefix_caching=con.prefix_caching.prefill,
        decode_prefix_caching=con.prefix_caching.decode,
        ttl=con.decoder_kv_blocks_ttl,
        renewable=renewable,
        heartbeat_interval=getattr(lease, "heartbeat_interval_s", 5.0),
        heartbeat_extension=getattr(lease, "extension_s", 20.0),
        idle_after=getattr(lease, "idle_after_s", 60.0),
        recompute_threshold=con.kv_recompute_threshold,
        hold_ttl=con.pull_hold_lease_s,
        hold_heartbeat=con.pull_hold_heartbeat_s,
        hold_extension=con.pull_hold_extension_s,
        handshake_at_start=con.handshake_at_start,
        pull_reader_thread=con.pull_reader_thread,
        reuse_read_run_blocks=con.reuse_read_run_blocks,
        seed=point.seed,
    )


def feed(sim: Simulation, batch: RequestBatch | Sequence[Request], block_size: int, *,
         ids: Sequence[str] | None = None, tenants: Sequence[str] | None = None,
         conversations: Sequence[str | None] | None = None, start: float = 0.0) -> Any:
    """Release the workload into the simulation: open-loop arrivals for first turns, closed
    loop (previous turn's finish + think time) for later turns. `ids`, `tenants` and
    `conversations` (indexed by rid) keep a recorded run's names; else they are generated.
    `start` shifts every arrival (a batch fed after earlier ones have run).
    Returns an event that fires when every request has finished."""
    env = sim.env
    all_done = env.event()
    total = sim.finished_count + len(batch)
    followers: dict[int, list[Request]] = {}
    firsts: list[Request] = []
    ranks = count()  # requests are made as they arrive: in arrival order
    for q in batch:  # a RequestBatch iterates its columns once, not a numpy scalar per field
        if q.previous is None:
            firsts.append(q)
        else:
            followers.setdefault(q.previous, []).append(q)

    # a prompt's block hashes are read by a prefix cache and by a reuse decision only
    cfg = sim.cfg
    hashed = cfg.prefill_prefix_caching or cfg.decode_prefix_caching or cfg.bidirectional

    def make(q: Request) -> SimRequest:
        retained = None
        if q.conversation is not None:  # the prompt's hashes lead those of prompt + output
            retained = q.block_hashes(block_size, q.prompt_tokens + q.output_tokens)
            hashes = retained[: q.prompt_tokens // block_size]
        else:
            hashes = q.block_hashes(block_size) if hashed else None
        r = SimRequest(ids[q.rid] if ids else q.request_id, env.now, q.prompt_tokens,
                       q.output_tokens,
                       conversation=(conversations[q.rid] if conversations
                                     else q.conversation_id),
                       tenant=tenants[q.rid] if tenants else "default", turn=q.turn,
                       hashes=hashes, retained_hashes=retained, rank=next(ranks))
        nxt = followers.pop(q.rid, [])
        r.on_done = lambda _r: finished(nxt)
        return r

    def finished(nxt: Any) -> None:
        for n in nxt:
            release_later(n)
        if sim.finished_count >= total and not all_done.triggered:
            all_done.succeed()

    def release_later(q: Request) -> None:
        env.timeout(q.think_time).callbacks.append(lambda _: sim.submit(make(q)))

    def arrivals() -> Any:
        for q in firsts:
            if start + q.arrival > env.now:
                yield env.timeout(start + q.arrival - env.now)
            sim.submit(make(q))

    env.process(arrivals())
    return all_done


STREAM_ABOVE = 100_000  # requests; a longer run streams its finished requests by default


def simulate(point: Point, record: Callable[[Any], None] | None = None,
             drain: bool = True,
             run: Callable[[Simulation, Any, int], None] | None = None,
             stream: bool | None = None,
             ) -> tuple[Simulation, dict[str, Any]]:
    """Run one point; return the simulation and its summary (the JSON shape of a point).
    `run(sim, all_done, total)` replaces `env.run(until=all_done)` (to report progress).
    `stream`: keep aggregates of finished requests, not the requests (`sim.done` stays
    empty), so memory stays flat over a long run (`metrics.StreamingSummary`); by default
    only for runs of more than `STREAM_ABOVE` requests."""
    costs = SimCosts.from_scenario(point.scenario)
    cfg = engine_config(point, costs)
    sim = Simulation(cfg, costs, record)
    wall = time.perf_counter()
    history = serve_history(sim, point, cfg.decode_layout.block_size)
    preempted = _preemptions(sim)
    begin = sim.env.now
    batch = requests_for_point(point)
    if stream is None:
        stream = len(batch) > STREAM_ABOVE
    streamed = None
    sc = point.scenario
    warm = sc.warmup_requests / max(len(batch), 1)
    if stream:
        # the warm-up as `summarize` counts it: the first int(n x warm) arrivals
        streamed = StreamingSummary(cfg.decode_layout.block_size,
                                    warmup=int(len(batch) * warm))
        sim.sink = streamed.add
    all_done = feed(sim, batch, cfg.decode_layout.block_size, start=begin)
    # What exists now (modules, the simulation, the workload) lives as long as the run: the
    # cyclic garbage collector need not walk it again at every full collection. The run makes
    # and drops many small objects (events, commands) that reference counting frees: the
    # young generation is collected less often. Each young collection costs more as a long
    # run's state grows (35 ms each at `cluster_32p32d`'s fifth simulated minute, 30 a
    # minute at 20,000): every 100,000 allocations, a fifth as many (measured at 12,000
    # requests: the collector's time 1.06 -> 0.63 s); only cyclic garbage waits longer.
    frozen = gc.get_freeze_count() == 0
    if frozen:
        gc.freeze()
    threshold = gc.get_threshold()
    gc.set_threshold(max(threshold[0], 100_000), *threshold[1:])
    try:
        if run is None:
            sim.env.run(until=all_done)
        else:
            run(sim, all_done, len(batch))
    finally:
        gc.set_threshold(*threshold)
        if frozen:
            gc.unfreeze()
    simulated = sim.env.now - begin
    if drain:
        sim.drain()
    wall = time.perf_counter() - wall
    if streamed is not None:
        stats = streamed.result()
        mean_run_blocks = stats.pop("mean_run_blocks")
    else:
        stats = summarize(sim.done, warmup=warm)
        runs = [r.runs for r in sim.done if r.runs]
        blocks = [-(-r.prompt // cfg.decode_layout.block_size) for r in sim.done if r.runs]
        mean_run_blocks = float(np.sum(blocks) / np.sum(runs)) if runs else None
    summary: dict[str, Any] = {
        "label": point.label,
        "mode": point.mode,
        "bidirectional": point.bidirectional,
        "qps": point.qps,
        "input_len": point.input_len,
        "output_len": point.output_len,
        "iteration": point.iteration,
        "seed": point.seed,
        "rate_unit": ("conversations/s" if sc.workload.kind == "multi_turn" else
                      "requests/s"),
        **stats,
        "mean_run_blocks": mean_run_blocks,
        # vllm:num_preemptions_total, summed over all instances (the point's requests, its
        # warm-up too, not the history)
        "preemptions": _preemptions(sim) - preempted,
        "simulated_s": simulated,
        "wall_s": wall,
        "finished": sim.finished_count - history,
        "submitted": len(batch),
        "history_requests": history,
    }
    return sim, summary


def _preemptions(sim: Simulation) -> int:
    return sum(i.preemptions for i in (*sim.prefills.values(), *sim.decodes.values()))


def serve_history(sim: Simulation, point: Point, block_size: int) -> int:
    """`engine.pool_history: sweep`: the same servers first run the sweep's earlier points
    (`point.history`), one after the other, each to its last request, as `vllm bench serve`
    runs a sweep, with a quiescent pause (`Simulation.drain`) after each. Their requests are
    warm-up: named `h<k>-...`, not recorded (the point's run in the store holds the point's
    requests; each earlier point is a run of its own) and dropped from `sim.done`, so no
    statistic of the point counts them. Returns how many."""
    served = 0
    rec, sim.rec = sim.rec, ignore
    try:
        for k, earlier in enumerate(point.history):
            batch = requests_for_point(earlier)
            ids = [f"h{k}-{q.request_id}" for q in batch]
            sim.env.run(until=feed(sim, batch, block_size, ids=ids, start=sim.env.now))
            sim.drain()  # the pause between two benchmark runs: every lease and hold ends
            served += len(batch)
    finally:
        sim.rec = rec
    del sim.done[:]
    return served


def _run_point(args: tuple[Point, str | None, str | None]) -> dict[str, Any]:
    """A local worker's point: it records straight into the store by URL."""
    point, db, parent = args
    if db is None or parent is None:
        return simulate(point)[1]
    from kvplane.store import BatchingRecorder, open_store

    with open_store(db) as store:
        run_id = store.create_run("sim", f"{point.scenario.name}:{point.label}", parent=parent,
                                  meta={"point": point.label, "seed": point.seed})
        rec = BatchingRecorder(store, run_id, trusted=True)  # the core's events
        try:
            _, summary = simulate(point, rec.record)
        finally:
            rec.close()
        summary["run_id"] = run_id
    return summary


def _run_point_collecting(args: tuple[Point, bool]) -> tuple[dict[str, Any], list[Any]]:
    """A Ray task's point: a cluster node may not reach the driver's store (a SQLite file on
    the driver's disk, say), so the events come back with the summary, already checked and
    encoded where they were made, and the driver writes them."""
    point, record = args
    if not record:
        return simulate(point)[1], []
    from kvplane.store.encoding import encode_trusted_one  # the core's events

    rows: list[Any] = []
    add, enc = rows.append, encode_trusted_one
    _, summary = simulate(point, lambda e: add(enc(e)))
    return summary, rows


def _gather_ray(points: list[Point], db: str | None, record: bool, parent: str | None,
                address: str | None, bar: Any) -> list[dict[str, Any]]:
    from .engines import map_ordered

    results: list[dict[str, Any]] = []
    work = [(p, record) for p in points]
    store = None
    if record:
        from kvplane.store import open_store

        store = open_store(db)  # the URL as given: `store.url` hides a password
    try:
        for point, (summary, rows) in zip(
                points, map_ordered(_run_point_collecting, work, engine="ray",
                                    address=address), strict=True):
            if store is not None:
                run_id = store.create_run(
                    "sim", f"{point.scenario.name}:{point.label}", parent=parent,
                    meta={"point": point.label, "seed": point.seed})
                for i in range(0, len(rows), _GATHER_BATCH):
                    store.append_encoded(run_id, rows[i:i + _GATHER_BATCH])
                summary["run_id"] = run_id
            results.append(summary)
            bar.update(1)
    finally:
        if store is not None:
            store.close()
    return results


_GATHER_BATCH = 5000


def run_scenario(scenario: str | Scenario, *, db: str | None = None, seed: int | None = None,
                 jobs: int = 0, record: bool = True, progress: bool = True,
                 requests: int | None = None, engine: str = "local",
                 address: str | None = None) -> dict[str, Any]:
    """Run every point of a scenario; record each under a child of one sweep run.

    `seed` and `requests` (per point) override the scenario's. `engine` is where points run
    (`local` processes or `ray` tasks, see `engines.py`); the numbers and the recorded events
    are the same either way."""
    from .engines import check_engine, map_ordered

    check_engine(engine, address)
    sc = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    if seed is not None:
        sc = sc.model_copy(update={"seed": seed})
    if requests is not None:
        sc = sc.model_copy(update={"requests": requests,
                                   "warmup_requests": min(sc.warmup_requests, requests // 5)})
    points = sc.points()
    parent = None
    url = None
    if record:
        from kvplane.store import open_store

        with open_store(db) as store:
            url = store.url
            parent = store.create_run("sim", sc.name, meta={
                "points": len(points), "seed": sc.seed,
                "scenario": sc.model_dump(mode="json")})
    bar = _progress(len(points), f"simulating {sc.name}", progress)
    if engine == "ray":
        results = _gather_ray(points, db, record, parent, address, bar)
    else:
        results = []
        work = [(p, url if record else None, parent) for p in points]
        for res in map_ordered(_run_point, work, jobs=jobs):
            results.append(res)
            bar.update(1)
    bar.close()
    return {"run_id": parent, "db": url, "scenario": sc.name, "seed": sc.seed,
            "points": results}


def _progress(total: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="point", disable=not enabled, leave=False)
