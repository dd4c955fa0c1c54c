"""`engine.pool_history: sweep`: a sweep point runs on servers that first served the sweep's
earlier points (one deployment per mode, as a `vllm bench serve` sweep is run), and only the
point's own requests are counted."""

from __future__ import annotations

from typing import Any

from kvplane.core.events import Event, RequestArrived, TransferPlanned
from kvplane.core.replay import replay
from kvplane.sim.config import Point, Scenario, scenario_from_data
from kvplane.sim.runner import simulate

# ~3,600 blocks per pool: more than the point's own requests take (12 x 260), fewer than the
# earlier points' and its own together (another 24 x 68 + 12 x 260): the history wraps the pool
DATA: dict[str, Any] = {
    "name": "history",
    "seed": 7,
    "requests": 10,
    "warmup_requests": 2,
    "profiles": {"model": "qwen3-32b", "hardware": "p5en-h200-tp8"},
    "engine": {"block_reuse": "fifo", "gpu_memory_utilization": 0.1},
    "connector": {"mode": "push"},
    "workload": {"kind": "poisson", "qps": 4, "input_len": {"mean": 1024, "dist": "fixed"},
                 "output_len": {"mean": 64, "dist": "fixed"}},
    "sweep": {"modes": ["push", "pull"], "qps": [2, 4], "input_lens": [1024, 4096]},
}


def _scenario(history: str) -> Scenario:
    data = {**DATA, "engine": {**DATA["engine"], "pool_history": history}}
    return scenario_from_data(data, file="<test>")


def _last(sc: Scenario, mode: str = "push") -> Point:
    return next(p for p in sc.points() if (p.mode, p.qps, p.input_len) == (mode, 4, 4096))


def test_history_is_the_earlier_points_of_the_same_deployment_in_sweep_order() -> None:
    last = _last(_scenario("sweep"))
    # ascending input length, then ascending rate; the point itself and pull's points not in it
    assert [h.label for h in last.history] == [
        "push_qps2_in1024_iter0", "push_qps4_in1024_iter0", "push_qps2_in4096_iter0"]
    first = next(p for p in _scenario("sweep").points() if p.mode == "pull")
    assert first.history == ()  # pull is its own deployment: its first point starts fresh
    assert all(p.history == () for p in _scenario("none").points())


def test_the_point_runs_on_the_pool_the_history_left_and_counts_only_its_own() -> None:
    fresh_sim, fresh = simulate(_last(_scenario("none")), drain=False)
    log: list[Event] = []
    sim, warm = simulate(_last(_scenario("sweep")), log.append)
    # the three earlier points' requests (10 + 2 warm-up each) ran first, on the same servers,
    # and the point's own arrivals came after them (shifted by the history's duration)
    assert warm["history_requests"] == 3 * 12 == fresh["history_requests"] + 36
    assert sim.finished_count == 48 and fresh_sim.finished_count == 12
    arrived = [e for e in log if isinstance(e, RequestArrived)]
    assert len(arrived) == 12  # the history is not recorded: the log is the point's own
    first = {"fresh": min(r.arrival for r in fresh_sim.done), "warm": min(e.at for e in arrived)}
    assert first["fresh"] == 0.0 and first["warm"] > 10.0  # 24 + 12 arrivals at 2-4 QPS
    # ... and are not counted: the point's summary has its own 10 measured requests
    assert warm["n"] == fresh["n"] == 10
    assert warm["finished"] == warm["submitted"] == 12
    assert not [r for r in sim.done if r.id.startswith("h")]
    # the history wrapped decode's pool: freed tail first to the back of the queue (fifo), the
    # point's 4k prompts get blocks in descending order, where a fresh pool hands out one run
    assert fresh["mean_run_blocks"] > 100
    assert warm["mean_run_blocks"] < fresh["mean_run_blocks"] / 10
    pool, fresh_pool = (next(iter(s.decodes.values())).pool for s in (sim, fresh_sim))
    assert pool.queue.runs[0] != fresh_pool.queue.runs[0]
    # history and point together still satisfy every protocol invariant
    report = replay(log, final=True)
    assert report.ok, "\n".join(map(str, report.violations[:10]))


def test_pools_wrapped_in_lockstep_hand_out_descending_ranges_that_move_as_one_run() -> None:
    """Prefix caching off on both sides: both pools wrap under the history, and vLLM frees a
    request's blocks tail first to the back of the queue, so the point's requests get
    descending ids on prefill and on decode. A range descending by one on both sides is one
    run (kvplane.core.plan), so the transfers stay a few runs long."""
    data = {**DATA, "engine": {**DATA["engine"], "pool_history": "sweep"},
            "connector": {"mode": "push", "prefix_caching": {"prefill": False, "decode": False}}}
    log: list[Event] = []
    _, warm = simulate(_last(scenario_from_data(data, file="<test>")), log.append)
    steps: dict[tuple[int, int], int] = {}
    planned = [e for e in log if isinstance(e, TransferPlanned)]
    for e in planned:
        nb = -(-e.num_tokens // 16)
        for i in range(1, nb):
            k = (e.src_blocks[i] - e.src_blocks[i - 1], e.dst_blocks[i] - e.dst_blocks[i - 1])
            steps[k] = steps.get(k, 0) + 1
    pairs = sum(steps.values())
    assert len(planned) == 12 and steps[(-1, -1)] > pairs / 2  # mostly descending together
    # each transfer's runs: one per break (neither both +1 nor both -1; the 4k prompts fill
    # their last block), so a 256-block transfer is a handful of runs, not ~200
    joined = steps[(-1, -1)] + steps.get((1, 1), 0)
    assert sum(e.runs for e in planned) == len(planned) + pairs - joined
    assert warm["mean_run_blocks"] > 4
