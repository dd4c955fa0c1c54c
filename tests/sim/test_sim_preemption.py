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
from kvplane.core import prefill as P
from kvplane.core.events import (
    BlocksFreed,
    EngineStalled,
    Event,
    PrefillStarted,
    RegistrationSent,
    RequestPreempted,
    TransferCompleted,
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


def _tight(run_blocks: float | None) -> dict[str, Any]:
    """A scenario whose activation reserve leaves decode a pool of two and a half requests'
    full length, with up to eight running."""
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
    return data


@pytest.mark.parametrize("run_blocks", [None, 4.0])
def test_the_run_summary_counts_preemptions_as_vllm_does(run_blocks: float | None) -> None:
    """`preemptions` of a point is vllm:num_preemptions_total summed over instances; the
    points table shows it."""
    data = _tight(run_blocks)
    roomy = SimCosts.from_scenario(scenario_from_data(data, file="<test>"))
    per_request = -(-(2048 + 512) // roomy.layout("decode").block_size)
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


def _over_admitted(sim: Simulation, *specs: tuple[str, int, int]) -> list[SimRequest]:
    """Requests running on prefill, each holding the blocks of its first `done` tokens and
    having computed them (as when an earlier admission could not see what a later chunk of
    another would need); decode has been asked for each (push)."""
    pf = sim.prefills["prefill-0"]
    bs = pf.layout.block_size
    out = []
    for name, prompt, done in specs:
        r = SimRequest(name, 0.0, prompt, 4, prefill=pf.name, decode="decode-0")
        r.prefill_received = r.prefill_start = 0.0
        sim.requests[r.id] = r
        blocks = pf.pool.take(-(-done // bs))
        assert blocks is not None
        pf.blocks[r.id] = blocks
        pf.do(P.Allocate(r.id, 0, blocks))
        pf._run(r, 0)
        pf.progress[r.id] = done
        sim.decodes["decode-0"].submit(r)
        out.append(r)
    pf.poke()
    return out


def test_prefill_preempts_the_newest_running_request_when_a_chunk_finds_no_block() -> None:
    """Hand-computed: prefill pool of 10 blocks of 16 tokens, a step budget of 64 tokens.
    a (128 tokens) and b (96) hold 4 blocks each, 64 tokens computed; 2 blocks are free.
    Step 1: a's next chunk (64 tokens) needs 4 blocks; b, the last running request, is
    preempted (its 4 blocks freed: 6 free), a takes 4 and completes; nothing is admitted in
    a step that preempted. b needs 6 blocks for its whole prompt and 2 are free until a's KV
    has gone to decode; then it is admitted again and recomputes from token 0: 64 tokens,
    then 32. One preemption, on prefill-0; a's KV is sent once, b's once."""
    sim, costs, log = _sim(prefill_blocks=10, decode_blocks=10_000, max_num_batched_tokens=64)
    pf = sim.prefills["prefill-0"]
    a, b = _over_admitted(sim, ("a", 128, 64), ("b", 96, 64))
    sim.env.run(until=60)
    assert a.finish > 0 and b.finish > 0
    pre = [e for e in log if isinstance(e, RequestPreempted)]
    assert [(e.request, e.instance, e.attempt, e.at) for e in pre] == [("b", "prefill-0", 0, 0.0)]
    assert (pf.preemptions, a.preemptions, b.preemptions) == (1, 0, 1)
    freed = [e for e in log if isinstance(e, BlocksFreed) and e.request == "b"
             and e.reason == "preempted"]
    assert len(freed) == 1 and len(freed[0].blocks) == 4
    step1 = costs.prefill_batch_time([(64, 64)])
    assert a.prefill_end == pytest.approx(step1)
    sent = next(e for e in log if isinstance(e, TransferCompleted) and e.request == "a")
    # b waited for a's 8 blocks (2 free < 6), then computed 64 + 32 tokens from scratch
    starts = [e for e in log if isinstance(e, PrefillStarted) and e.request == "b"]
    assert [(e.at, e.computed_tokens) for e in starts] == [(0.0, 96),
                                                           (pytest.approx(sent.at), 96)]
    redo = costs.prefill_batch_time([(64, 0)]) + costs.prefill_batch_time([(32, 64)])
    assert b.prefill_end == pytest.approx(sent.at + redo)
    assert b.compute_s == pytest.approx(redo)  # its first 64 tokens' step was before the test
    assert [e.request for e in log if isinstance(e, TransferPlanned)] == ["a", "b"]
    assert replay(log, final=True).ok
    assert pf.pool.free == pf.pool.capacity and not pf.blocks


def test_prefill_with_room_for_every_chunk_preempts_nothing() -> None:
    sim, _, log = _sim(prefill_blocks=14, decode_blocks=10_000, max_num_batched_tokens=64)
    _over_admitted(sim, ("a", 128, 64), ("b", 96, 64))  # 8 + 6 blocks: both fit
    sim.env.run(until=60)
    assert len(sim.done) == 2 and sim.prefills["prefill-0"].preemptions == 0
    assert not any(isinstance(e, RequestPreempted) for e in log)


def test_kvplane_show_prints_a_runs_preemptions_from_its_events(tmp_path) -> None:
    """Recorded through the real CLI: `kvplane show` counts the run's RequestPreempted
    events (a sweep: its points' too), in its text and its JSON."""
    import json

    import yaml
    from sqlalchemy import func, select
    from typer.testing import CliRunner

    from kvplane.cli import app
    from kvplane.store import events_table as E
    from kvplane.store import open_store, run_id_of

    data = _tight(None)
    data["sweep"] = {"modes": ["push"], "qps": [4, 8]}
    path = tmp_path / "tight.yaml"
    path.write_text(yaml.safe_dump(data))
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    cli = CliRunner()
    res = cli.invoke(app, ["sim", "run", str(path), "--db", db, "--out",
                           str(tmp_path / "s.json"), "--jobs", "1"])
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "s.json").read_text())
    with open_store(db, read_only=True) as store, store.engine.connect() as conn:
        counted = {run: n for run, n in conn.execute(
            select(run_id_of(store.engine), func.count()).where(E.c.type == "RequestPreempted")
            .group_by(E.c.run))}
    points = summary["points"]
    assert [p["preemptions"] for p in points] == [counted.get(p["run_id"], 0) for p in points]
    busiest = max(points, key=lambda p: p["preemptions"])
    assert busiest["preemptions"] > 0
    res = cli.invoke(app, ["show", busiest["run_id"], "--db", db, "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["preemptions"] == busiest["preemptions"]
    res = cli.invoke(app, ["show", busiest["run_id"], "--db", db])
    assert f"  {busiest['preemptions']} preemptions\n" in res.output
    res = cli.invoke(app, ["show", summary["run_id"], "--db", db, "--json"])
    assert json.loads(res.output)["preemptions"] == sum(p["preemptions"] for p in points)


def _conversations(bidirectional: bool) -> tuple[Simulation, list[Event]]:
    """Three-turn conversations (2k first prompt, 1k more per turn) at 20 new ones per second
    onto a prefill pool of 400 blocks (6,400 tokens), pull mode, prefix caching off."""
    from kvplane.sim.runner import engine_config, feed
    from kvplane.sim.workloads import requests_for_point

    data = load_scenario("seed_bidirectional").model_dump(mode="json")
    for key in ("sweep", "published", "assumptions"):
        data.pop(key, None)
    data["requests"] = 40
    data["connector"]["bidirectional"] = bidirectional
    data["workload"].update({"turns": {"mean": 3}, "first_prompt": {"mean": 2048},
                             "user_tokens": {"mean": 1024}, "output_len": {"mean": 64},
                             "think_time_s": 0.05, "conversation_rate": 20.0})
    sc = scenario_from_data(data, file="<test>")
    point = sc.points()[0]
    assert point.bidirectional == bidirectional
    costs = SimCosts.from_scenario(sc)
    cfg = replace(engine_config(point, costs), prefill_blocks=400)
    log: list[Event] = []
    sim = Simulation(cfg, costs, log.append)
    sim.env.run(until=feed(sim, requests_for_point(point), cfg.decode_layout.block_size))
    sim.drain()
    return sim, log


def test_prefill_preempts_when_a_request_admitted_during_a_reuse_read_takes_its_suffix() -> None:
    """vLLM's defaults check a new prompt against the free blocks, not against what a request
    loading decode's KV will still need for its suffix: with reuse on, a request admitted
    during a D->P read can leave the reader's suffix without blocks, and the newest running
    request is preempted. The same conversations without reuse never preempt on prefill. The
    preempted request recomputes (it never reads decode's KV afterwards), every request ends,
    the log replays clean and prefill's pool is whole again."""
    plain, _ = _conversations(False)
    assert len(plain.done) == 40 and plain.prefills["prefill-0"].preemptions == 0
    sim, log = _conversations(True)
    pf = sim.prefills["prefill-0"]
    pre = [e for e in log if isinstance(e, RequestPreempted) and e.instance == "prefill-0"]
    assert len(sim.done) == 40 and pre and pf.preemptions == len(pre)
    for e in pre:
        reads = [x for x in log if isinstance(x, TransferPlanned) and x.direction == "D->P"]
        assert any(x.at <= e.at for x in reads)  # a read was under way or done before
        assert not any(x.request == e.request and x.at > e.at for x in reads)
        again = [x for x in log if isinstance(x, PrefillStarted) and x.request == e.request]
        assert again[-1].at >= e.at and again[-1].cached_tokens == 0  # recomputed
    assert replay(log, final=True).ok
    assert pf.pool.free == pf.pool.capacity
