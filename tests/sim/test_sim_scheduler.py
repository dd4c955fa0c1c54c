"""Prefill is scheduled as vLLM schedules it: one step packs chunks of several requests under
the token budget and the sequence limit; decode takes output blocks as tokens need them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvplane.sim.config import load_scenario
from kvplane.sim.costs import SimCosts
from kvplane.sim.engine import EngineConfig, SimRequest, Simulation


def _sim(**over: object) -> tuple[Simulation, SimCosts]:
    costs = SimCosts.from_scenario(load_scenario("seed_push_vs_pull"))
    cfg = EngineConfig(mode="push", prefill_layout=costs.layout("prefill"),
                       decode_layout=costs.layout("decode"),
                       prefill_blocks=costs.pool_blocks["prefill"],
                       decode_blocks=costs.pool_blocks["decode"])
    return Simulation(replace(cfg, **over), costs), costs  # type: ignore[arg-type]


def _three(sim: Simulation, prompt: int = 3000) -> list[SimRequest]:
    reqs = [SimRequest(f"r{i}", 0.0, prompt, 4) for i in range(3)]
    for r in reqs:
        sim.submit(r)
    sim.env.run(until=60)
    assert all(r.finish > 0 for r in reqs)
    return reqs


def test_one_step_packs_several_requests_chunks_under_the_budget() -> None:
    sim, costs = _sim(max_num_batched_tokens=8192)
    a, b, c = _three(sim)
    first = costs.prefill_batch_time([(3000, 0), (3000, 0), (2192, 0)])
    second = costs.prefill_batch_time([(808, 2192)])
    start = a.prefill_received + costs.request_overhead()
    assert a.prefill_end == pytest.approx(start + first)
    assert b.prefill_end == a.prefill_end  # same step
    assert c.prefill_end == pytest.approx(start + first + second)
    # packing beats one request after another, each in its own steps
    alone = sum(costs.prefill_time(3000, 0) for _ in range(3))
    assert c.prefill_end - start < alone


def test_the_sequence_limit_holds_a_request_back() -> None:
    sim, _ = _sim(max_num_seqs=2)
    a, _, c = _three(sim)
    assert c.prefill_start >= a.prefill_end > a.prefill_start
    assert c.prefill_end > a.prefill_end


def test_decode_takes_output_blocks_as_tokens_cross_block_boundaries() -> None:
    sim, _ = _sim()
    events: list[object] = []
    sim.rec = events.append
    r = SimRequest("r", 0.0, 40, 30)  # 3 blocks for the prompt, 70 tokens need 5
    sim.submit(r)
    sim.env.run(until=10)
    d = sim.decodes["decode-0"]
    assert r.finish > 0 and not d.held and d.pool.reserved == 0
    from kvplane.core.events import BlocksReserved

    grown = [e for e in events if isinstance(e, BlocksReserved) and e.instance == "decode-0"
             and e.purpose == "decode"]
    assert sum(len(e.blocks) for e in grown) == 5 - 3
    assert d.pool.free == d.pool.capacity  # all of them came back
