"""Means over seeds with their confidence intervals (Student's t, two-sided).

A simulated figure is a random variable of the workload's seed; one seed's value is one draw.
Runs over several seeds report the mean and a 95 % t-interval of it; a verdict compares the
interval, not one draw, with the tolerance band. numpy only (scipy is not a dependency), so
the t quantiles are tabulated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Interval", "mean_interval", "t_quantile_975"]

# 97.5 % quantiles of Student's t by degrees of freedom (two-sided 95 % interval).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131,
         16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 25: 2.060, 30: 2.042,
         40: 2.021, 60: 2.000, 120: 1.980}


def t_quantile_975(df: int) -> float:
    """The 97.5 % quantile of t with `df` degrees of freedom (next tabulated df below)."""
    if df < 1:
        raise ValueError("an interval needs at least two samples")
    best = max(k for k in _T975 if k <= df)
    return _T975[best] if df <= 120 else 1.960


@dataclass(frozen=True, slots=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int
    samples: tuple[float, ...]

    def overlaps(self, low: float, high: float) -> bool:
        return self.low <= high and self.high >= low

    def within(self, low: float, high: float) -> int:
        """How many single seeds fall inside [low, high]."""
        return sum(low <= s <= high for s in self.samples)

    def text(self, fmt: str = ".1f") -> str:
        if self.n < 2:
            return f"{self.mean:{fmt}}"
        return f"{self.mean:{fmt}} [{self.low:{fmt}}, {self.high:{fmt}}]"


def mean_interval(samples: Sequence[float]) -> Interval:
    """Mean and 95 % t-interval of the mean (a point when there is one sample)."""
    xs = [float(x) for x in samples]
    if not xs:
        raise ValueError("no samples")
    n = len(xs)
    mean = sum(xs) / n
    if n == 1:
        return Interval(mean, mean, mean, 1, tuple(xs))
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    half = t_quantile_975(n - 1) * math.sqrt(var / n)
    return Interval(mean, mean - half, mean + half, n, tuple(xs))
