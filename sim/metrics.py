"""Per-point figures from finished simulated requests, in the shape `vllm bench serve` reports.

Rules kept here:
- Times are reported in milliseconds: mean, p50, p90, p99 of TTFT, TPOT, ITL, end-to-end
  latency, prefill duration, P->D transfer, D->P reuse read and recompute time.
- TPOT of a request is (finish - first token) / (output tokens - 1); requests of one output
  token have no TPOT. ITL samples are weighted (a macro-step of k equal steps is one value with
  weight k), so percentiles stay exact without storing every token.
- Warm-up: the first `warmup` fraction of requests (by arrival) is left out, as benchmark
  tools exclude the ramp.
- A long run streams instead (`StreamingSummary`): each finished request is folded in and
  dropped, keeping eight numbers of it (about 80 bytes, not the request with its hashes and
  step log) and its ITL in a fixed histogram, so memory stays flat in simulated time. Its
  figures equal `summarize`'s, except ITL percentiles, which are the bin's (0.1 % wide) and
  include warm-up requests.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import chain
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
        "prefill_ms": _stats([r.prefill_end - r.prefill_received for r in reqs
                              if r.prefill_end >= 0]),
        "transfer_ms": _stats(transfer),
        "reuse_read_ms": _stats([r.reuse_read_s for r in reqs if r.reuse_read_s > 0]),
        "recompute_ms": _stats([r.compute_s for r in reqs]),
        "decode_stall_ms": _stats([r.stall_s for r in reqs]),
        "throughput_tok_s": float(sum(r.output for r in reqs) / span) if span > 0 else 0.0,
        "reuse": outcomes,
    }


_FIELDS = ("arrival", "ttft", "tpot", "e2e", "prefill", "transfer", "read", "compute", "stall",
           "finish", "output")
_ITL_BINS = np.geomspace(1e-5, 100.0, 16_000)  # seconds; neighbours 0.1 % apart


class StreamingSummary:
    """`summarize` for a run whose finished requests are not kept: `add` each one as it
    finishes (it is then free to go), `result` at the end."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.cols = {name: array("d") for name in _FIELDS}
        self.itl = np.zeros(_ITL_BINS.size + 1)
        self.itl_sum = 0.0
        self.outcomes: dict[str, int] = {}
        self.runs = 0
        self.run_blocks = 0
        self.n = 0

    def add(self, r: SimRequest) -> None:
        c = self.cols
        c["arrival"].append(r.arrival)
        c["ttft"].append(r.first_token - r.arrival)
        c["tpot"].append((r.finish - r.first_token) / (r.output - 1) if r.output > 1
                         else float("nan"))
        c["e2e"].append(r.finish - r.arrival)
        # a request whose prefill never ran (decode computed it after a failed load) has no
        # prefill duration
        c["prefill"].append(r.prefill_end - r.prefill_received if r.prefill_end >= 0
                            else float("nan"))
        c["transfer"].append(r.transfer_end - r.transfer_start if r.transfer_end >= 0
                             else float("nan"))
        c["read"].append(r.reuse_read_s)
        c["compute"].append(r.compute_s)
        c["stall"].append(r.stall_s)
        c["finish"].append(r.finish)
        c["output"].append(r.output)
        if r.itl:
            # (gap, tokens) pairs as two contiguous float rows, read in C (`np.array` of a
            # list of tuples inspects each tuple: slower than two generator passes)
            n = len(r.itl)
            values, weights = np.fromiter(chain.from_iterable(r.itl), float, 2 * n
                                          ).reshape(n, 2).T.copy()
            np.add.at(self.itl, np.searchsorted(_ITL_BINS, values), weights)
            self.itl_sum += float(values @ weights)
        if r.reuse_outcome:
            self.outcomes[r.reuse_outcome] = self.outcomes.get(r.reuse_outcome, 0) + 1
        if r.runs:
            self.runs += r.runs
            self.run_blocks += -(-r.prompt // self.block_size)
        self.n += 1

    def result(self, warmup: float = 0.0) -> dict[str, Any]:
        if not self.n:
            raise ValueError("no finished requests to summarise")
        col = {k: np.frombuffer(v, dtype=float) for k, v in self.cols.items()}
        order = np.argsort(col["arrival"], kind="stable")[int(self.n * warmup):]
        col = {k: v[order] for k, v in col.items()}
        tpot = col["tpot"][~np.isnan(col["tpot"])]
        transfer = col["transfer"][~np.isnan(col["transfer"])]
        prefill = col["prefill"][~np.isnan(col["prefill"])]
        read = col["read"][col["read"] > 0]
        span = float(col["finish"].max() - col["arrival"].min())
        total = self.itl.sum()
        itl: dict[str, float]
        if total:
            cum = np.cumsum(self.itl) / total
            edges = np.append(_ITL_BINS, _ITL_BINS[-1])
            pick = [float(edges[min(int(np.searchsorted(cum, q)), edges.size - 1)]) * 1e3
                    for q in (0.5, 0.9, 0.99)]
            itl = {"mean": float(self.itl_sum / total * 1e3), "p50": pick[0], "p90": pick[1],
                   "p99": pick[2]}
        else:
            itl = _stats([])
        return {
            "n": int(order.size),
            "ttft_ms": _stats(col["ttft"]),
            "tpot_ms": _stats(tpot),
            "itl_ms": itl,
            "e2e_ms": _stats(col["e2e"]),
            "prefill_ms": _stats(prefill),
            "transfer_ms": _stats(transfer),
            "reuse_read_ms": _stats(read),
            "recompute_ms": _stats(col["compute"]),
            "decode_stall_ms": _stats(col["stall"]),
            "throughput_tok_s": float(col["output"].sum() / span) if span > 0 else 0.0,
            "reuse": dict(self.outcomes),
            "mean_run_blocks": self.run_blocks / self.runs if self.runs else None,
        }
