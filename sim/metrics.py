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
  dropped. Up to `quantiles.EXACT_UP_TO` requests it keeps eleven numbers of each (not the
  request with its hashes and step log) and its figures are `summarize`'s; past that only
  aggregates (`quantiles.Quantiles`: counts, sums, a log-bucket histogram per figure), whose
  percentiles are within 0.1 % of the exact ones, so memory stays flat in simulated time.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from math import isnan
from typing import Any

import numpy as np

from .engine import SimRequest
from .quantiles import EXACT_UP_TO, Quantiles


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
           "finish", "output", "rank")
# the streams whose percentiles are reported, by summary key; NaN (not applicable) and, for
# `read`, zero (no read) are left out, as `summarize` leaves those requests out
_STREAMS = {"ttft_ms": "ttft", "tpot_ms": "tpot", "e2e_ms": "e2e", "prefill_ms": "prefill",
            "transfer_ms": "transfer", "reuse_read_ms": "read", "recompute_ms": "compute",
            "decode_stall_ms": "stall"}


class StreamingSummary:
    """`summarize` for a run whose finished requests are not kept: `add` each one as it
    finishes (it is then free to go), `result` at the end.

    Up to `exact_up_to` requests it keeps eleven numbers of each (88 bytes) and its figures
    are `summarize`'s (ITL's mean aside, summed in another order); past that it folds them
    into `Quantiles` streams (percentiles within 0.1 %, see `quantiles.py`) and keeps no
    per-request state. Warm-up: the first `warmup` requests by arrival (`SimRequest.rank`)
    count in no figure except the block-run mean, as `summarize` leaves them out."""

    def __init__(self, block_size: int, warmup: int = 0,
                 exact_up_to: int = EXACT_UP_TO) -> None:
        self.block_size = block_size
        self.warmup = warmup
        self.exact_up_to = exact_up_to
        self.cols: dict[str, array[float]] | None = {name: array("d") for name in _FIELDS}
        self.streams: dict[str, Quantiles] = {}
        self.itl = Quantiles(weighted=True)
        self.outcomes: dict[str, int] = {}
        self.runs = 0
        self.run_blocks = 0
        self.n = 0  # requests added
        self.counted = 0  # of them past warm-up (spilled)
        self.first_arrival = float("inf")
        self.last_finish = float("-inf")
        self.output = 0.0

    def add(self, r: SimRequest) -> None:
        warm = r.rank < self.warmup
        if r.itl and not warm:
            self.itl.extend_pairs(r.itl)  # (gap, tokens) pairs
        if r.runs:
            self.runs += r.runs
            self.run_blocks += -(-r.prompt // self.block_size)
        self.n += 1
        ttft = r.first_token - r.arrival
        tpot = ((r.finish - r.first_token) / (r.output - 1) if r.output > 1
                else float("nan"))
        # a request whose prefill never ran (decode computed it after a failed load) has no
        # prefill duration
        prefill = (r.prefill_end - r.prefill_received if r.prefill_end >= 0
                   else float("nan"))
        transfer = (r.transfer_end - r.transfer_start if r.transfer_end >= 0
                    else float("nan"))
        c = self.cols
        if c is not None:
            c["arrival"].append(r.arrival)
            c["ttft"].append(ttft)
            c["tpot"].append(tpot)
            c["e2e"].append(r.finish - r.arrival)
            c["prefill"].append(prefill)
            c["transfer"].append(transfer)
            c["read"].append(r.reuse_read_s)
            c["compute"].append(r.compute_s)
            c["stall"].append(r.stall_s)
            c["finish"].append(r.finish)
            c["output"].append(r.output)
            c["rank"].append(r.rank)
            if r.reuse_outcome and not warm:
                self.outcomes[r.reuse_outcome] = self.outcomes.get(r.reuse_outcome, 0) + 1
            if self.n > self.exact_up_to:
                self._spill()
            return
        if warm:
            return
        if r.reuse_outcome:
            self.outcomes[r.reuse_outcome] = self.outcomes.get(r.reuse_outcome, 0) + 1
        s = self.streams
        s["ttft"].add(ttft)
        if not isnan(tpot):
            s["tpot"].add(tpot)
        s["e2e"].add(r.finish - r.arrival)
        if not isnan(prefill):
            s["prefill"].add(prefill)
        if not isnan(transfer):
            s["transfer"].add(transfer)
        if r.reuse_read_s > 0:
            s["read"].add(r.reuse_read_s)
        s["compute"].add(r.compute_s)
        s["stall"].add(r.stall_s)
        self.counted += 1
        self.first_arrival = min(self.first_arrival, r.arrival)
        self.last_finish = max(self.last_finish, r.finish)
        self.output += r.output

    def _spill(self) -> None:
        """From exact columns to streams: the requests so far, less warm-up, folded in."""
        assert self.cols is not None
        col = {k: np.frombuffer(v, dtype=float) for k, v in self.cols.items()}
        keep = col["rank"] >= self.warmup
        col = {k: v[keep] for k, v in col.items()}
        for name in _STREAMS.values():
            v = col[name]
            v = v[v > 0] if name == "read" else v[~np.isnan(v)]
            self.streams[name] = q = Quantiles(exact_up_to=0)
            q.extend(v)
        self.counted = int(keep.sum())
        if self.counted:
            self.first_arrival = float(col["arrival"].min())
            self.last_finish = float(col["finish"].max())
            self.output = float(col["output"].sum())
        del col, keep
        self.cols = None

    def result(self) -> dict[str, Any]:
        if not self.n:
            raise ValueError("no finished requests to summarise")
        figures: dict[str, Any]
        if self.cols is not None:
            col = {k: np.frombuffer(v, dtype=float) for k, v in self.cols.items()}
            order = np.argsort(col["arrival"], kind="stable")[self.warmup:]
            col = {k: v[order] for k, v in col.items()}
            figures = {key: _stats(col[name][col[name] > 0] if name == "read"
                                   else col[name][~np.isnan(col[name])])
                       for key, name in _STREAMS.items()}
            span = float(col["finish"].max() - col["arrival"].min()) if order.size else 0.0
            n, output = int(order.size), float(col["output"].sum())
        else:
            figures = {key: self.streams[name].stats() for key, name in _STREAMS.items()}
            span = self.last_finish - self.first_arrival if self.counted else 0.0
            n, output = self.counted, self.output
        if not n:
            raise ValueError("no finished requests past the warm-up to summarise")
        return {
            "n": n,
            "ttft_ms": figures["ttft_ms"],
            "tpot_ms": figures["tpot_ms"],
            "itl_ms": self.itl.stats(),
            "e2e_ms": figures["e2e_ms"],
            "prefill_ms": figures["prefill_ms"],
            "transfer_ms": figures["transfer_ms"],
            "reuse_read_ms": figures["reuse_read_ms"],
            "recompute_ms": figures["recompute_ms"],
            "decode_stall_ms": figures["decode_stall_ms"],
            "throughput_tok_s": float(output / span) if span > 0 else 0.0,
            "reuse": dict(self.outcomes),
            "mean_run_blocks": self.run_blocks / self.runs if self.runs else None,
        }
