"""Calibration checks: the cost models, with the bundled profiles, against published figures.

These are the numeric checks of docs/calibration.md. They price the *light-load* critical path
by hand (one request alone, an idle engine, no queueing) with the real cost objects, and the
high-load mechanism with the closed-form estimates of the doc's section 6. The simulator must
reproduce the same numbers when it runs the seed scenarios at light load.

Run `python tests/sim/test_sim_calibration.py` to print the tables quoted in the doc.
"""

from __future__ import annotations

import itertools
import math

import pytest

from kvplane.sim.config import load_scenario
from kvplane.sim.costs import ComputeCost, KVGeometry, TransferCost
from kvplane.sim.profiles import load_profile

CHUNK = 8192           # engine.max_num_batched_tokens of both seed scenarios
RUN_BLOCKS = 6.2       # mean contiguous run (blocks) of decode's retained KV, section 4
NEW_SHARE = 0.28       # share of a 24k reuse-on prompt computed fresh, section 5
OUTPUT = 128           # seed_push_vs_pull output length
SEQS = 8               # max_num_seqs


def _models() -> tuple[ComputeCost, TransferCost, KVGeometry]:
    model = load_profile("qwen3-32b", "model")
    hw = load_profile("p5en-h200-tp8", "hardware")
    compute = ComputeCost(model, hw)  # type: ignore[arg-type]
    return compute, TransferCost(hw, "network", compute.calibration), compute.geometry  # type: ignore[arg-type]


C, T, G = _models()


# --- light-load critical path (seconds) ---------------------------------------------------------


def tpot(context: int, batch: int = 1) -> float:
    """Decode step with `batch` sequences of `context` tokens each."""
    return C.decode_step_time(batch, batch * context)


def prefill_off(tokens: int) -> float:
    """Reuse off, prefix caching off: request overhead + chunked recompute of the whole prompt."""
    return C.prefill_request_overhead + C.chunked_prefill_time(tokens, 0, CHUNK)


def pull_p_to_d(tokens: int, runs: int = 1) -> float:
    """Pull P->D on an idle decode: inline prepare + post, wire. Fresh prefill blocks: 1 run."""
    blocks = G.blocks_for(tokens)
    return T.kv_timing(G, blocks, runs, placement="engine_loop", notify=False).total_s


def d_to_p_read(reused: int, run_blocks: float = RUN_BLOCKS) -> float:
    """Reuse read D->P of `reused` tokens' full blocks, in runs of `run_blocks` blocks."""
    blocks = G.full_blocks(reused)
    if blocks == 0:
        return 0.0
    runs = max(1, math.ceil(blocks / run_blocks))
    return T.kv_timing(G, blocks, runs, placement="thread", notify=False,
                       setup_s=T.reuse_read_setup).total_s


def ttft_off(tokens: int) -> float:
    return prefill_off(tokens) + pull_p_to_d(tokens) + tpot(tokens)


def prefill_on(tokens: int, new: int, run_blocks: float = RUN_BLOCKS) -> float:
    """Reuse on: request overhead + D->P read of the history + compute of the `new` suffix."""
    reused = tokens - new
    return (C.prefill_request_overhead + d_to_p_read(reused, run_blocks)
            + C.chunked_prefill_time(new, reused, CHUNK))


def ttft_on(tokens: int, new: int, run_blocks: float = RUN_BLOCKS) -> float:
    return prefill_on(tokens, new, run_blocks) + pull_p_to_d(tokens) + tpot(tokens)


# --- high-load mechanism (section 6) ------------------------------------------------------------


def pull_stall(tokens: int, run_blocks: float) -> float:
    """Decode-loop stall of one pull request: prepare + post of all its descriptors, inline."""
    blocks = G.blocks_for(tokens)
    runs = max(1, math.ceil(blocks / run_blocks))
    return T.kv_timing(G, blocks, runs, placement="engine_loop", notify=False).engine_stall_s


def pull_saturated(tokens: int, run_blocks: float) -> tuple[float, float]:
    """(admission rate [1/s], TPOT [s]) of a saturated pull decode.

    Each of SEQS slots holds a request for OUTPUT x TPOT, and every admission stalls the loop:
    TPOT = step / (1 - mu x stall), mu = SEQS / (OUTPUT x TPOT)  =>  mu = SEQS / (OUTPUT x step +
    SEQS x stall).
    """
    step = tpot(tokens, SEQS)
    stall = pull_stall(tokens, run_blocks)
    mu = SEQS / (OUTPUT * step + SEQS * stall)
    return mu, step / (1.0 - mu * stall)


def pull_tpot_at(qps: float, tokens: int, run_blocks: float) -> float:
    """Pull TPOT when decode keeps up with `qps` (else the saturated value)."""
    mu, saturated = pull_saturated(tokens, run_blocks)
    if qps >= mu:
        return saturated
    stall = pull_stall(tokens, run_blocks)
    # running sequences ~ qps x OUTPUT x TPOT (Little), capped at SEQS; iterate to a fixed point
    value = tpot(tokens)
    for _ in range(50):
        batch = max(1, min(SEQS, round(qps * OUTPUT * value)))
        value = tpot(tokens, batch) / (1.0 - qps * stall)
    return value


def push_capacity(tokens: int) -> float:
    """Requests per second a push decode can admit: SEQS / (OUTPUT x step)."""
    return SEQS / (OUTPUT * tpot(tokens, SEQS))


UNCACHED = 0.1   # seed_push_vs_pull: the last 10 % of every prompt misses prefill's cache
REQUESTS = 100   # seed_push_vs_pull: measured requests per point


def _erlang_c(servers: int, load: float) -> float:
    """Probability of waiting in an M/M/c queue with offered load `load` (Erlang C)."""
    head = sum(load**k / math.factorial(k) for k in range(servers))
    tail = load**servers / math.factorial(servers) * servers / (servers - load)
    return tail / (head + tail)


def _base_ttft(tokens: int, placement: str, step: float) -> float:
    new = round(tokens * UNCACHED)
    blocks = G.blocks_for(tokens)
    runs = math.ceil(blocks / RUN_BLOCKS)
    xfer = T.kv_timing(G, blocks, runs, placement=placement,  # type: ignore[arg-type]
                       notify=placement == "thread")
    return (C.prefill_request_overhead + C.chunked_prefill_time(new, tokens - new, CHUNK)
            + xfer.total_s + step)


def push_ttft_estimate(qps: float, tokens: int) -> tuple[float, float]:
    """(M/D/c-ish, M/M/c) TTFT of push: base path + waiting for one of SEQS decode slots."""
    step = tpot(tokens, SEQS)
    service = OUTPUT * step
    load = qps * service
    wait = _erlang_c(SEQS, load) * service / (SEQS - load)
    base = _base_ttft(tokens, "thread", step)
    return base + wait / 2.0, base + wait


def pull_ttft_estimate(qps: float, tokens: int, requests: int = REQUESTS) -> float:
    """TTFT of a saturated pull decode: base path + the mean backlog wait over the run."""
    mu, saturated = pull_saturated(tokens, RUN_BLOCKS)
    assert qps > mu, "pull decode is not saturated at this rate"
    backlog = sum(i * (1.0 / mu - 1.0 / qps) for i in range(requests)) / requests
    return _base_ttft(tokens, "engine_loop", saturated) + backlog


# --- checks -------------------------------------------------------------------------------------


def _close(sim: float, published: float, rel: float) -> bool:
    return abs(sim - published) <= rel * published


def test_kv_geometry_matches_spec_section_5() -> None:
    assert G.region_bytes == 4096  # 4 KiB per (layer, K/V, block) on one TP rank
    assert G.bytes_per_token_per_rank * 16384 == 512 * 2**20  # 512 MiB per rank at 16k
    assert G.descriptors(G.blocks_for(16384)) == 131072  # SPEC: scattered 16k = 131,072 descs


@pytest.mark.parametrize("context", [1024, 2048, 4096, 8192, 16384])
def test_light_load_tpot(context: int) -> None:
    assert 5.55e-3 <= tpot(context) <= 5.85e-3


def test_tpot_with_eight_running_16k_requests_is_near_7ms() -> None:
    assert _close(tpot(16384, 8), 7.0e-3, 0.05)


def test_the_bundled_calibration_reproduces_what_it_was_fitted_to() -> None:
    """Each figure a constant was fitted to, priced on its light-load critical path with the
    bundled constants and the block runs the pools produce, within the fit's residual (8 %,
    docs/calibration.md section B). The figures it was not fitted to are validate's business."""
    from kvplane.sim import calibration as cal_mod

    cal = C.calibration
    pricers = cal_mod._pricers(cal_mod._default_setting())
    used = {fid for c in cal.constants().values() for fid in c.fitted_to}
    assert used
    for fid in sorted(used):
        for observed, price in pricers[fid]:
            assert _close(price(cal), observed, 0.09), fid


def test_reuse_on_at_2k_is_the_known_outlier() -> None:
    # Any shared per-request overhead that makes TTFT off (2k) the published 158 ms puts TTFT
    # on (2k) above 144 ms: 158 minus all of the 2k compute plus the published 30 ms read.
    # Published: 122 ms. Without such an overhead (the bundled calibration has none) both
    # 2k TTFTs fall far below the published ones: no constant meets the three figures.
    compute_2k = C.chunked_prefill_time(2048, 0, CHUNK)
    floor = 0.158 - compute_2k + 0.030
    assert floor > 0.122
    new = round(2048 * NEW_SHARE)
    assert C.prefill_request_overhead == 0.0
    assert ttft_on(2048, new) < 0.122 and ttft_off(2048) < 0.158 * 0.85


def test_pull_tpot_gap_from_fragmentation_measured_elsewhere() -> None:
    # run length inferred from the bidirectional transfer times, not from the push/pull figures
    _, saturated = pull_saturated(16384, RUN_BLOCKS)
    assert _close(saturated, 10.4e-3, 0.10)
    assert pull_tpot_at(4.0, 16384, RUN_BLOCKS) < saturated


def test_pull_decode_saturates_at_8qps_and_push_does_not() -> None:
    mu, _ = pull_saturated(16384, RUN_BLOCKS)
    assert mu < 8.0 < push_capacity(16384)


def test_high_load_ttft_gap() -> None:
    # closed-form queueing, no simulation: pull's backlog against push's slot wait
    low, high = push_ttft_estimate(8.0, 16384)
    pull = pull_ttft_estimate(8.0, 16384)
    assert 2.0 < pull / high and pull / low < 5.0


def test_decode_side_post_matches_pr_35264() -> None:
    # the line through the PR's two points, read back
    assert _close(T.post_time(118), 460e-6, 0.01)
    assert _close(T.post_time(18880), 46e-3, 0.01)


def test_seed_scenarios_state_their_assumptions_and_published_figures() -> None:
    for name in ("seed_push_vs_pull", "seed_bidirectional"):
        scenario = load_scenario(name)
        assert len(scenario.assumptions) >= 4
        assert scenario.published is not None and scenario.published.figures


def _seed_turns() -> list[tuple[int, int]]:
    """(prompt, reusable tokens) of the first conversation of seed_bidirectional.

    Decode retains the previous prompt and output; the last sampled token has no KV yet, and
    only full blocks are read, so reusable = full blocks of (previous prompt + output - 1).
    """
    from kvplane.sim.workloads import requests_for_point

    point = load_scenario("seed_bidirectional").points()[1]
    batch = requests_for_point(point)
    turns = [r for r in batch if r.conversation == 0]
    out = []
    for before, turn in itertools.pairwise(turns):
        held = before.prompt_tokens + before.output_tokens - 1
        out.append((turn.prompt_tokens, G.full_blocks(held) * G.block_size))
    return out


def test_seed_bidirectional_24k_bucket() -> None:
    from kvplane.sim.calibration import _default_setting

    bucket = [(p, r) for p, r in _seed_turns() if abs(p - 24576) <= 0.25 * 24576]
    assert bucket
    # the reads' runs are those the seed's pools produce (as `kvplane calibrate fit` prices them)
    run = _default_setting().read_run_blocks[24576]
    off = sum(ttft_off(p) for p, _ in bucket) / len(bucket)
    on = sum(ttft_on(p, p - r, run) for p, r in bucket) / len(bucket)
    assert _close(off, 0.778, 0.05)
    assert _close(on, 0.460, 0.10)


# --- the tables of docs/calibration.md ------------------------------------------------------------


def _table() -> None:  # pragma: no cover - a report, not a test
    ms = 1e3
    print("light-load TPOT [ms] by context (batch 1 | batch 8):")
    for ctx in (1024, 2048, 4096, 8192, 16384, 24576):
        print(f"  {ctx:6d}  {tpot(ctx) * ms:6.2f} | {tpot(ctx, 8) * ms:6.2f}")
    print("reuse off [ms]:        prefill (pub)     TTFT (pub)")
    for tokens, pp, pt in ((2048, 153, 158), (24576, 744, 778)):
        print(f"  {tokens:6d}  {prefill_off(tokens) * ms:7.1f} ({pp})   {ttft_off(tokens) * ms:7.1f} ({pt})"
              f"   [P->D {pull_p_to_d(tokens) * ms:.1f}]")
    print("D->P read [ms] (pub):")
    for tokens, pub in ((2048, 30), (24576, 130)):
        print(f"  {tokens:6d}  {d_to_p_read(tokens) * ms:6.1f} ({pub})")
    print(f"reuse on, new share {NEW_SHARE} [ms]: prefill (pub)   TTFT (pub)   speedup")
    for tokens, pp, pt in ((2048, 128, 122), (24576, 414, 460)):
        new = round(tokens * NEW_SHARE)
        print(f"  {tokens:6d}  {prefill_on(tokens, new) * ms:7.1f} ({pp})   "
              f"{ttft_on(tokens, new) * ms:7.1f} ({pt})   {ttft_off(tokens) / ttft_on(tokens, new):.2f}")
    print("seed_bidirectional turns [ms] (prompt, reused, new): off TTFT | on TTFT")
    for prompt, reused in _seed_turns():
        new = prompt - reused
        print(f"  {prompt:6d} {reused:6d} {new:6d}   {ttft_off(prompt) * ms:7.1f} | "
              f"{ttft_on(prompt, new) * ms:7.1f}")
    print("pull at 16k: run length -> descriptors, stall [ms], mu_sat [1/s], TPOT_sat, TPOT@4qps [ms]")
    for run in (1.0, RUN_BLOCKS, 8.0, 32.0, 1024.0):
        blocks = G.blocks_for(16384)
        desc = G.descriptors(max(1, math.ceil(blocks / run)))
        mu, sat = pull_saturated(16384, run)
        print(f"  {run:7.1f} {desc:7d} {pull_stall(16384, run) * ms:7.1f} {mu:6.2f} "
              f"{sat * ms:7.2f} {pull_tpot_at(4.0, 16384, run) * ms:7.2f}")
    print(f"push decode capacity at 16k: {push_capacity(16384):.2f} req/s")
    low, high = push_ttft_estimate(8.0, 16384)
    print(f"TTFT at 8 QPS, 16k: push {low * ms:.0f}-{high * ms:.0f} ms (540), "
          f"pull {pull_ttft_estimate(8.0, 16384) * ms:.0f} ms (1744)")


if __name__ == "__main__":  # pragma: no cover
    _table()


def test_unfitted_priors_equal_the_calibration_they_say_they_copy() -> None:
    """A prior whose constants say `derived: the value of calib-X` holds X's current values
    (a refit of X once left them at X's first fit while claiming otherwise)."""
    from kvplane.sim.profiles import CalibrationProfile, bundled_profile_names

    copies = 0
    for name in bundled_profile_names("calibration"):
        prior = load_profile(name, "calibration")
        assert isinstance(prior, CalibrationProfile)
        for field, c in prior.constants().items():
            said = c.source.removeprefix("derived: the value of ")
            if said == c.source:
                continue
            source = load_profile(said.split(",")[0].split()[0], "calibration")
            assert isinstance(source, CalibrationProfile)
            assert c.value == source.constants()[field].value, (name, field)
            assert not c.fitted_to, (name, field)
            copies += 1
    assert copies >= 3 * 6  # the MoE H200, dense H100 and MoE H100 priors
