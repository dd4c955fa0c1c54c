"""Decode preempts as vLLM V1 does: a running request whose next token finds no free block
(after evicting retained KV) preempts the last running request, whose blocks are freed (kept
in the prefix cache when decode caches prefixes); the victim goes back to the front of the
waiting queue and later recomputes its prompt and output so far, locally: KV it once received
from prefill is never loaded again (the live connector's rule)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kvplane.core import decode as D
from kvplane.core.events import (
    EngineStalled,
    Event,
    RegistrationSent,
    RequestPreempted,
    TransferPlanned,
)
from kvplane.core.replay import replay
from kvplane.sim.config import load_scenario, scenario_from_data
from kvplane.sim.costs import KVGeometry, SimCosts
from kvplane.sim.engine import EngineConfig, SimRequest, Simulation
from kvplane.sim.report import points_table
from kvplane.sim.runner import simulate


def _sim(**over: Any) -> tuple[Simulation, SimCosts, list[Event]]:
    costs = SimCosts.from_scenario(load_scenario("seed_push_vs_pull"))
    cfg = EngineConfig(mode="push", prefill_layout=costs.layout("prefill"),
                       decode_layout=costs.layout("decode"),
                       prefill_blocks=costs.pool_blocks["prefill"],
                       decode_blocks=costs.pool_blocks["decode"])
    log: list[Event] = []
    return Simulation(replace(cfg, **over), costs, log.append), costs, log


def _running_pair(sim: Simulation, prompt: int, output: int) -> list[SimRequest]:
    """Two requests whose prompt KV is already in decode's blocks, joining in one step."""
    d = sim.decodes["decode-0"]
    bs = d.layout.block_size
    reqs = [SimRequest(name, 0.0, prompt, output, decode=d.name) for name in ("a", "b")]
    for r in reqs:
        sim.requests[r.id] = r
        blocks = d.pool.take(-(-prompt // bs))
        assert blocks is not None
        d.held[r.id] = len(blocks)
        d.do(D.Allocate(r.id, 0, blocks))
        d.joining.append(r)
    d.poke()
    return reqs


def _hand_case(decode_prefix_caching: bool) -> tuple[Simulation, SimCosts, list[Event]]:
    """Pool of 8 blocks; a and b: 2 prompt blocks each, 5 at the end (prompt 2 blocks,
    output 2.5). Step 1: a and b take a block each (2 left); step 17: again (0 left); step
    33: a needs one, none is free, so b (last in the running list) is preempted at 32 tokens
    generated, freeing its 4 blocks; a takes one. b needs 4 blocks for its 64 tokens and 3
    are free, so it waits until a finishes; then it recomputes and finishes. One
    preemption."""
    sim, costs, log = _sim(decode_blocks=8, decode_prefix_caching=decode_prefix_caching)
    bs = sim.cfg.decode_layout.block_size
    a, b = _running_pair(sim, 2 * bs, 5 * bs // 2)
    sim.env.run(until=60)
    assert a.finish > 0 and b.finish > 0
    return sim, costs, log


@pytest.mark.parametrize("caching", [False, True])
def test_a_hand_computed_case_preempts_once_and_every_token_is_generated(caching: bool) -> None:
    sim, costs, log = _hand_case(caching)
    d = sim.decodes["decode-0"]
    bs = d.layout.block_size
    pre = [e for e in log if isinstance(e, RequestPreempted)]
    assert [(e.request, e.attempt) for e in pre] == [("b", 0)]
    assert d.preemptions == 1
    a, b = sorted(sim.done, key=lambda r: r.id)
    assert (a.preemptions, b.preemptions) == (0, 1)
    assert a.done_tokens == a.output and b.done_tokens == b.output
    # every generated token is in the step log exactly once
    assert sum(w for _, w in a.itl) == a.output - 1
    assert sum(w for _, w in b.itl) == b.output - 1
    assert b.attempt == 1 and a.attempt == 0
    assert b.first_token < pre[0].at < a.finish < b.finish
    # b recomputes its prompt and its 32 generated tokens; with decode prefix caching, 3 of
    # its 4 freed blocks survive (a took the tail block: vLLM frees tail first, evicts it
    # first), so only the last block's 16 tokens are computed again
    stalls = [e for e in log if isinstance(e, EngineStalled) and e.request == "b"]
    assert len(stalls) == 1 and stalls[0].cause == "preempted: recompute"
    tokens = 2 * bs + 2 * bs
    expect = costs.prefill_time(bs, 3 * bs) if caching else costs.prefill_time(tokens, 0)
    assert stalls[0].seconds == pytest.approx(expect)
    # b is admitted again only after a finished (3 free blocks < 4, or < 1 past its hits)
    assert stalls[0].at >= a.finish - costs.response_leg()
    assert d.pool.free == d.pool.capacity and not d.held and d.pool.reserved == 0


def test_without_pressure_nothing_is_preempted() -> None:
    sim, _, log = _sim(decode_blocks=10)  # 2 x 5 blocks: both fit to the end
    bs = sim.cfg.decode_layout.block_size
    _running_pair(sim, 2 * bs, 5 * bs // 2)
    sim.env.run(until=60)
    assert len(sim.done) == 2
    assert not any(isinstance(e, RequestPreempted) for e in log)
    assert sim.decodes["decode-0"].preemptions == 0


def test_a_request_whose_kv_came_from_prefill_recomputes_locally_when_preempted() -> None:
    """Through the whole P/D path (prefill, push transfer, decode) with a decode pool too
    small for every request's output: requests are preempted, none loads its KV twice, every
    one finishes with all its tokens, and the log replays clean."""
    sim, _, log = _sim(decode_blocks=24, decode_prefix_caching=True)
    reqs = [SimRequest(f"r{i}", 0.01 * i, 100, 120) for i in range(6)]  # 7 -> 14 blocks
    for r in reqs:
        sim.env.timeout(r.arrival).callbacks.append(lambda _, r=r: sim.submit(r))
    sim.env.run(until=120)
    assert len(sim.done) == len(reqs)
    assert all(r.done_tokens == r.output and sum(w for _, w in r.itl) == r.output - 1
               for r in reqs)
    pre = [e for e in log if isinstance(e, RequestPreempted)]
    d = sim.decodes["decode-0"]
    assert pre and d.preemptions == len(pre) == sum(r.preemptions for r in reqs)
    for r in {e.request for e in pre}:
        # one KV exchange with prefill (attempt 0), never a second one
        assert [e.attempt for e in log if isinstance(e, RegistrationSent)
                and e.request == r] == [0]
        assert [e.direction for e in log if isinstance(e, TransferPlanned)
                and e.request == r] == ["P->D"]
        assert any(isinstance(e, EngineStalled) and e.request == r
                   and e.cause == "preempted: recompute" for e in log)
    report = replay(log, final=True)
    assert report.ok, "\n".join(map(str, report.violations[:10]))
    assert d.pool.free == d.pool.capacity and d.pool.reserved == 0


def test_a_request_larger_than_the_decode_pool_is_refused_with_a_reason() -> None:
    sim, _, _ = _sim(decode_blocks=4)
    with pytest.raises(ValueError, match="decode-0.*4 blocks"):
        sim.submit(SimRequest("big", 0.0, 100, 100))
        sim.env.run(until=10)


@pytest.mark.parametrize("run_blocks", [None, 4.0])
def test_the_run_summary_counts_preemptions_as_vllm_does(run_blocks: float | None) -> None:
    """`preemptions` of a point is vllm:num_preemptions_total summed over decode instances;
    the points table shows it. The scenario's activation reserve leaves decode a pool of
    two and a half requests' full length, with up to eight running."""
    base = load_scenario("seed_push_vs_pull")
    data: dict[str, Any] = {
        "name": "tight", "seed": 3, "requests": 24, "warmup_requests": 0,
        "profiles": base.model_dump(mode="json")["profiles"],
        # 4.0: decode's pool starts with a synthetic history (free runs of ~4 blocks)
        "engine": {"activation_reserve_bytes": 0.0, "pool_run_blocks": run_blocks},
        "connector": {"mode": "push", "prefix_caching": {"prefill": True, "decode": True}},
        "workload": {"kind": "poisson", "qps": 8, "input_len": {"mean": 2048},
                     "output_len": {"mean": 512}},
    }
    roomy = SimCosts.from_scenario(scenario_from_data(data, file="<test>"))
    lay = roomy.layout("decode")
    per_request = -(-(2048 + 512) // lay.block_size)
    block_bytes = KVGeometry.of(base.model, roomy.decode.tp, lay.block_size) \
        .bytes_per_block_per_rank
    reserve = (roomy.pool_blocks["decode"] - 5 * per_request // 2) * block_bytes
    data["engine"]["activation_reserve_bytes"] = reserve
    sc = scenario_from_data(data, file="<test>")
    assert SimCosts.from_scenario(sc).pool_blocks["decode"] == pytest.approx(5 * per_request // 2,
                                                                             abs=1)
    log: list[Event] = []
    sim, summary = simulate(sc.points()[0], log.append)
    assert summary["finished"] == summary["submitted"] == 24
    pre = [e for e in log if isinstance(e, RequestPreempted)]
    assert summary["preemptions"] == len(pre) == sum(d.preemptions for d in sim.decodes.values())
    assert summary["preemptions"] > 0
    assert replay(log, final=True).ok
    table = points_table([summary])
    assert "preempt" in table.splitlines()[0]
    assert table.splitlines()[2].split()[-1] == str(summary["preemptions"])


def test_a_local_prefill_is_chunked_into_the_decode_steps_under_the_token_budget() -> None:
    """vLLM schedules the running decodes first (one token each), then prefill chunks in the
    rest of `max_num_batched_tokens`; each step is priced as one mixed step, and the step
    that completes the prefill samples the request's first token."""
    sim, costs, log = _sim(max_num_batched_tokens=42, decode_blocks=100)
    d = sim.decodes["decode-0"]
    bs = d.layout.block_size
    a, b = _running_pair(sim, 2 * bs, 50)
    c = SimRequest("c", 0.0, 100, 5, decode=d.name)
    sim.requests[c.id] = c
    blocks = d.pool.take(-(-100 // bs))
    assert blocks is not None
    d.held[c.id] = len(blocks)
    d.do(D.Allocate(c.id, 0, blocks))
    d.loading.add(c.id)
    d.recomputes.append((c, 100, 0, "KV load failed: local prefill"))
    sim.env.run(until=60)
    assert all(r.done_tokens == r.output for r in (a, b, c))
    # 42 - 2 decodes = 40 tokens per step: chunks of 40, 40 and 20
    steps, t = [], 0.0
    for i, (n, done) in enumerate([(40, 0), (40, 40), (20, 80)]):
        ctxs = [2 * bs + i, 2 * bs + i]
        mixed = costs.mixed_step_time([(n, done)], ctxs)
        steps.append(mixed - costs.decode_step_time(2, sum(ctxs)))
        t += mixed
    stalls = [e for e in log if isinstance(e, EngineStalled) and e.request == "c"]
    assert [e.seconds for e in stalls] == pytest.approx(steps)
    assert c.first_token == pytest.approx(t + costs.response_leg())
    assert a.first_token < c.first_token  # the decodes went on meanwhile
    assert d.pool.free == d.pool.capacity


def test_a_prompt_larger_than_the_prefill_pool_is_refused_not_left_waiting() -> None:
    """Prefill takes a prompt's blocks at admission: one its whole pool cannot hold would wait
    forever (decode then computes it after its KV wait), so it is refused with a reason."""
    from kvplane.sim.engine import PoolTooSmall

    sim, _, _ = _sim(decode_blocks=10_000)
    cap = sim.prefills["prefill-0"].pool.capacity
    bs = sim.cfg.prefill_layout.block_size
    with pytest.raises(PoolTooSmall, match=f"prefill-0.*{cap} blocks"):
        sim.submit(SimRequest("long", 0.0, (cap + 1) * bs, 4))
        sim.env.run(until=10)
