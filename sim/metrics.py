"""Per-point figures from finished simulated requests, in the shape `vllm bench serve` reports.

Rules kept here:
- Times are reported in milliseconds: mean, p50, p90, p99 of TTFT, TPOT, ITL, end-to-end
  latency, prefill duration, P->D transfer, D->P reuse read and recompute time.
- TPOT of a request is (finish - first token) / (output tokens - 1); requests of one output
  token have no TPOT. ITL samples are weighted (a macro-step of k equal steps is one value with
  weight k), so percentiles stay exact without storing every token.
- Warm-up: the first `warmup` fraction of requests (by arrival) is left out, as benchmark
  tools exclude the ramp.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .engine import SimRequest


def _stats(values: Sequence[float] | np.ndarray, weights: np.ndarray | None = None) -> dict[str, float]:
    v = np.asarray(values, dtype=float) * 1e3
    if v.size == 0:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"),
                "p99": float("nan")}
    if weights is None:
        p50, p90, p99 = np.percentile(v, [50, 90, 99])
        return {"mean": float(v.mean()), "p50": float(p50), "p90": float(p90),
                "p99": float(p99)}
    order = np.argsort(v)
    v, w = v[order], weights[order]
    cum = np.cumsum(w) / w.sum()
    pick = [float(v[min(np.searchsorted(cum, q), v.size - 1)]) for q in (0.5, 0.9, 0.99)]
    return {"mean": float(np.average(v, weights=w)), "p50": pick[0], "p90": pick[1],
            "p99": pick[2]}


def summarize(done: Sequence[SimRequest], warmup: float = 0.0) -> dict[str, Any]:
    reqs = sorted(done, key=lambda r: r.arrival)
    reqs = reqs[int(len(reqs) * warmup):]
    if not reqs:
        raise ValueError("no finished requests to summarise")
    ttft = [r.first_token - r.arrival for r in reqs]
    multi = [r for r in reqs if r.output > 1]
    tpot = [(r.finish - r.first_token) / (r.output - 1) for r in multi]
    itl_v = np.array([v for r in reqs for v, _ in r.itl], dtype=float)
    itl_w = np.array([w for r in reqs for _, w in r.itl], dtype=float)
    span = max(r.finish for r in reqs) - min(r.arrival for r in reqs)
    outcomes: dict[str, int] = {}
    for r in reqs:
        if r.reuse_outcome:
            outcomes[r.reuse_outcome] = outcomes.get(r.reuse_outcome, 0) + 1
    transfer = [r.transfer_end - r.transfer_start for r in reqs if r.transfer_end >= 0]
    return {
        "n": len(reqs),
        "ttft_ms": _stats(ttft),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats(itl_v, itl_w if itl_w.size else None),
        "e2e_ms": _stats([r.finish - r.arrival for r in reqs]),
        "prefill_ms": _stats([r.prefill_end - r.prefill_received for r in reqs]),
        "transfer_ms": _stats(transfer),
        "reuse_read_ms": _stats([r.reuse_read_s for r in reqs if r.reuse_read_s > 0]),
        "recompute_ms": _stats([r.compute_s for r in reqs]),
        "decode_stall_ms": _stats([r.stall_s for r in reqs]),
        "throughput_tok_s": float(sum(r.output for r in reqs) / span) if span > 0 else 0.0,
        "reuse": outcomes,
    }
