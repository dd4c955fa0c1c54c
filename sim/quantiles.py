"""Mean and percentiles of a long stream of values, in bounded memory.

Rules kept here:
- Exact while small: the values are kept (8 bytes each, 16 with a weight) until more than
  `exact_up_to` have come; the figures are then `np.percentile`'s (linear between order
  statistics) or, weighted, the first value whose cumulative weight reaches the quantile.
- Beyond that, a log-bucket histogram (the DDSketch mapping): bucket i >= 1 holds the values
  in [LOW * g^(i-1), LOW * g^i) with g = (1 + ALPHA) / (1 - ALPHA), and reads as
  LOW * g^(i-1) * 2g / (1 + g), which is within ALPHA (0.1 %) of every value in it. A
  percentile is the same rule applied to those readings, so it is within ALPHA of the exact
  one, relative, for values from LOW (1 us) up; values below LOW (zeros included) read as the
  smallest such value seen (an absolute error below 1 us). Readings never go outside the
  exact minimum and maximum, which are kept, as are the count and the sum (the mean is exact
  up to floating-point rounding).
- Memory: 13,818 buckets of 8 bytes (about 108 KiB) per stream once it spills, nothing per
  value; values are folded into the buckets 4,096 at a time, in numpy.

A library was considered: `ddsketch` (DataDog's, the same mapping) adds one value per Python
call: at a microsecond or two a call (estimated, not measured here), some 10 CPU seconds for
the nine streams of a 720,000-request run, where a batched
numpy fold costs a fraction of a second.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from operator import itemgetter

import numpy as np

__all__ = ["ALPHA", "EXACT_UP_TO", "Quantiles"]

ALPHA = 1e-3  # the relative error of a spilled stream's percentiles
LOW, HIGH = 1e-6, 1e6  # seconds: buckets cover [LOW, HIGH); above HIGH, the last bucket
_G = (1 + ALPHA) / (1 - ALPHA)
_LN_G = math.log(_G)
_BUCKETS = math.ceil(math.log(HIGH / LOW) / _LN_G) + 2
_READ = np.empty(_BUCKETS)
_READ[1:] = LOW * _G ** np.arange(_BUCKETS - 1) * (2 * _G / (1 + _G))
EXACT_UP_TO = 1 << 17  # values kept exactly (about 1 MiB a stream)
_FOLD = 4096
_first, _second = itemgetter(0), itemgetter(1)


class Quantiles:
    """A stream of values (`weighted`: of (value, weight) pairs, a weight being how many
    samples the value stands for); `stats` gives mean, p50, p90 and p99 in milliseconds."""

    __slots__ = (
        "count",
        "counts",
        "exact_up_to",
        "high",
        "low",
        "total",
        "under",
        "values",
        "weights",
    )

    def __init__(self, weighted: bool = False, exact_up_to: int = EXACT_UP_TO) -> None:
        self.values = array("d")
        self.weights: array[float] | None = array("d") if weighted else None
        self.exact_up_to = exact_up_to
        self.counts: np.ndarray | None = None  # the buckets, once spilled
        self.count = 0.0  # total weight folded into the buckets
        self.total = 0.0  # sum of value x weight folded
        self.low, self.high, self.under = math.inf, -math.inf, math.inf

    @property
    def exact(self) -> bool:
        return self.counts is None

    def add(self, value: float) -> None:
        self.values.append(value)
        if len(self.values) > (self.exact_up_to if self.counts is None else _FOLD):
            self._fold()

    def extend(self, values: np.ndarray, weights: np.ndarray | None = None) -> None:
        self.values.frombytes(np.ascontiguousarray(values, dtype=float).tobytes())
        if self.weights is not None:
            w = np.ones(len(values)) if weights is None else weights
            self.weights.frombytes(np.ascontiguousarray(w, dtype=float).tobytes())
        if len(self.values) > (self.exact_up_to if self.counts is None else _FOLD):
            self._fold()

    def extend_pairs(self, pairs: Sequence[tuple[float, float]]) -> None:
        """(value, weight) pairs of a weighted stream, read in C."""
        assert self.weights is not None
        self.values.extend(map(_first, pairs))
        self.weights.extend(map(_second, pairs))
        if len(self.values) > (self.exact_up_to if self.counts is None else _FOLD):
            self._fold()

    def _fold(self) -> None:
        v = np.frombuffer(self.values, dtype=float)
        w = None if self.weights is None else np.frombuffer(self.weights, dtype=float)
        if self.counts is None:
            self.counts = np.zeros(_BUCKETS)
        if v.size:
            self.low = min(self.low, float(v.min()))
            self.high = max(self.high, float(v.max()))
            small = v < LOW
            if small.any():
                self.under = min(self.under, float(v[small].min()))
            idx = np.zeros(v.size, dtype=np.intp)
            big = ~small
            idx[big] = np.minimum(np.log(v[big] / LOW) / _LN_G + 1, _BUCKETS - 1
                                  ).astype(np.intp)
            self.counts += np.bincount(idx, weights=w, minlength=_BUCKETS)
            self.count += float(v.size if w is None else w.sum())
            self.total += float(v.sum() if w is None else v @ w)
        del v, w  # the buffers' exports end before they are cleared
        self.values = array("d")
        if self.weights is not None:
            self.weights = array("d")

    def stats(self) -> dict[str, float]:
        """Mean, p50, p90, p99 in milliseconds (NaN for an empty stream)."""
        from .metrics import _stats

        if self.counts is None:
            v = np.frombuffer(self.values, dtype=float)
            w = None if self.weights is None else np.frombuffer(self.weights, dtype=float)
            return _stats(v, w)
        if self.values:
            self._fold()
        counts = self.counts
        if not self.count:
            return _stats([])
        read = _READ.copy()
        read[0] = self.under if math.isfinite(self.under) else LOW
        np.clip(read, self.low, self.high, out=read)
        cum = np.cumsum(counts)
        picks = []
        for q in (0.5, 0.9, 0.99):
            if self.weights is not None:  # the first reading whose cumulative share >= q
                i = int(np.searchsorted(cum / self.count, q))
                picks.append(float(read[min(i, _BUCKETS - 1)]))
            else:  # np.percentile's linear rule over the readings of order statistics
                h = q * (self.count - 1)
                k = math.floor(h)
                a = read[int(np.searchsorted(cum, k, side="right"))]
                b = read[int(np.searchsorted(cum, min(k + 1, self.count - 1), side="right"))]
                picks.append(float(a + (h - k) * (b - a)))
        return {"mean": self.total / self.count * 1e3, "p50": picks[0] * 1e3,
                "p90": picks[1] * 1e3, "p99": picks[2] * 1e3}
