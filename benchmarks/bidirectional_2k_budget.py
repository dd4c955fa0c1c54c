"""Where the bidirectional seed's 2k prefill duration goes, and what load would add to it.

Prints, within one run (docs/validation.md, "The 2k figures: no mechanism found"):

1. the seed's per-turn budget for the turns under 3k tokens, mean over seeds: queue on
   prefill, D->P read, compute, prefill duration (the harness's window, as validate reads it),
   P->D transfer (from prefill's last step), first decode step, TTFT;
2. the same 2k and 24k-region turns with the seed loaded (more conversations, no think time),
   per seed: how queueing on prefill grows with reuse off and with reuse on;
3. the closed-form wait behind one other closed-loop client (vLLM PR #32553's harness runs two),
   for conversations shaped as that PR's benchmark prints them, priced with the seed's own
   prefill durations: P(other client in prefill) x its mean residual prefill;
4. the bundled calibration's price of PR #32553's own shortest prompt on Llama-3.3-70B (its
   baseline's minimum TTFT is 383.7 ms) and of a decode step at two requests (its TPOT 21.9 ms).

    python benchmarks/bidirectional_2k_budget.py [--seeds 10]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np

from kvplane.sim.config import Scenario, load_scenario
from kvplane.sim.engine import SimRequest
from kvplane.sim.runner import simulate
from kvplane.sim.validate import prefill_window


def _runs(sc: Scenario) -> dict[bool, list[SimRequest]]:
    return {p.bidirectional: list(simulate(p, drain=False)[0].done) for p in sc.points()}


def _row(rs: Sequence[SimRequest]) -> list[float]:
    cols = [(r.prefill_start - r.prefill_received, r.reuse_read_s, r.compute_s,
             prefill_window(r), r.kv_ready - r.prefill_end,
             r.first_token - r.kv_ready, r.first_token - r.arrival) for r in rs]
    return list(np.mean(np.array(cols), axis=0) * 1e3)


def budget(base: Scenario, seeds: int) -> dict[bool, dict[int, float]]:
    """Part 1; returns reuse -> prompt length -> mean prefill duration (ms), all turns."""
    by: dict[tuple[bool, int], list[SimRequest]] = {}
    for k in range(seeds):
        for bidi, done in _runs(base.model_copy(update={"seed": base.seed + k})).items():
            for r in done:
                by.setdefault((bidi, r.prompt), []).append(r)
    print(f"1. the seed, {seeds} seeds (ms)")
    print(f"{'reuse':>5} {'prompt':>6} {'n':>4} {'queue':>6} {'read':>6} {'compute':>7} "
          f"{'prefill':>7} {'P->D':>6} {'first':>6} {'TTFT':>6}")
    curve: dict[bool, dict[int, float]] = {False: {}, True: {}}
    for (bidi, n), rs in sorted(by.items()):
        row = _row(rs)
        curve[bidi][n] = row[3]
        if n < 3000:
            print(f"{'on' if bidi else 'off':>5} {n:>6} {len(rs):>4} "
                  + " ".join(f"{v:{w}.1f}" for v, w in zip(row, (6, 6, 7, 7, 6, 6, 6),
                                                          strict=True)))
    return curve


def loaded(base: Scenario, rates: Sequence[float], seeds: int) -> None:
    print("\n2. the seed loaded: a new conversation every 1/rate s, no think time (ms)")
    print(f"{'rate':>5} {'seed':>4} | {'2k off: queue':>13} {'prefill':>7} | "
          f"{'2k on: queue':>12} {'prefill':>7} | 24k region off: prefill by turn")
    for rate in rates:
        wl = base.workload.model_copy(update={"conversation_rate": rate, "think_time_s": 0.0})
        for k in range(seeds):
            runs = _runs(base.model_copy(update={"workload": wl, "seed": base.seed + k}))
            lengths = sorted({r.prompt for r in runs[False]})
            short = min(lengths, key=lambda n: abs(n - 2048))
            long_ = [n for n in lengths if abs(n - 24576) <= 0.25 * 24576 or n > 24576]
            off = _row([r for r in runs[False] if r.prompt == short])
            on = _row([r for r in runs[True] if r.prompt == short])
            far = " / ".join(f"{_row([r for r in runs[False] if r.prompt == n])[3]:.0f}"
                             for n in long_)
            print(f"{rate:>5g} {k:>4} | {off[0]:>13.1f} {off[3]:>7.1f} | {on[0]:>12.1f} "
                  f"{on[3]:>7.1f} | {far}")


def pr_conversations(out_lo: int, out_hi: int, rng: np.random.Generator,
                     conversations: int = 24) -> np.ndarray:
    """(prompt, output) per turn, shaped as PR #32553's benchmark prints its parameters:
    6-9 user turns, a 500-token common prefix, a lognormal first-message prefix (mean 4,000,
    median ratio 0.85, at most 10,000), user messages of 120-160 tokens."""
    mu, sigma = np.log(4000 * 0.85), np.sqrt(2 * np.log(1 / 0.85))
    rows: list[tuple[float, float]] = []
    for _ in range(conversations):
        prompt = 500 + min(rng.lognormal(mu, sigma), 10000) + rng.integers(120, 161)
        for _ in range(int(rng.integers(12, 19)) // 2):
            out = float(rng.integers(out_lo, out_hi + 1))
            rows.append((prompt, out))
            prompt += out + rng.integers(120, 161)
    return np.array(rows)


def closed_loop(curve: dict[bool, dict[int, float]], tpot_s: float) -> None:
    print("\n3. wait behind one other closed-loop client, PR #32553's conversation shape")
    rng = np.random.default_rng(0)
    for lo, hi in ((800, 1200), (240, 270), (80, 120)):
        conv = pr_conversations(lo, hi, rng)
        for bidi in (False, True):
            xs = sorted(curve[bidi])
            s = np.interp(conv[:, 0], xs, [curve[bidi][x] for x in xs]) / 1e3
            cycle = s + conv[:, 1] * tpot_s  # a client's request: prefill, then its answer
            wait = float((s ** 2).mean() / (2 * cycle.mean()))
            print(f"answers {lo}-{hi} tokens, reuse {'on ' if bidi else 'off'}: "
                  f"P(other in prefill) {s.mean() / cycle.mean():.3f}, "
                  f"mean wait {wait * 1e3:.1f} ms")


def pr_model() -> None:
    from kvplane.sim.costs import ComputeCost
    from kvplane.sim.profiles import (
        CalibrationProfile,
        HardwareProfile,
        ModelProfile,
        load_profile,
    )

    hw = load_profile("p5en-h200-tp8", "hardware")
    cal = load_profile("calib-dense-p5en-h200-tp8", "calibration")
    model = load_profile("llama-3.3-70b", "model")
    assert isinstance(hw, HardwareProfile) and isinstance(cal, CalibrationProfile)
    assert isinstance(model, ModelProfile)
    c = ComputeCost(model, hw, None, 16, cal)
    print("\n4. Llama-3.3-70B, TP8 on p5en, the bundled calibration")
    for n in (1750, 2048):
        print(f"prefill of {n} tokens: {c.chunked_prefill_time(n, 0, 8192) * 1e3:.1f} ms")
    print(f"decode step, two requests of 8k context: {c.decode_step_time(2, 16384) * 1e3:.1f} ms")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--load-seeds", type=int, default=3)
    args = ap.parse_args(argv)
    base = load_scenario("seed_bidirectional")
    curve = budget(base, args.seeds)
    loaded(base, (0.05, 0.08, 0.12), args.load_seeds)
    from kvplane.sim.costs import SimCosts

    closed_loop(curve, SimCosts.from_scenario(base).decode_step_time(2, 2 * 8192))
    pr_model()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
