"""The streaming percentiles: exact while small, within ALPHA (relative) once spilled."""

from __future__ import annotations

import numpy as np
import pytest

from kvplane.sim.metrics import _stats
from kvplane.sim.quantiles import ALPHA, Quantiles


def _spread(rng: np.random.Generator, n: int) -> np.ndarray:
    # latencies over seven decades, a run of exact zeros (stalls) and a few far out
    v = np.concatenate([rng.lognormal(-3, 2.5, n), np.zeros(n // 10), [3e5, 2e6]])
    rng.shuffle(v)
    return v


def test_small_streams_are_exact() -> None:
    rng = np.random.default_rng(1)
    v = _spread(rng, 5000)
    q = Quantiles(exact_up_to=len(v))
    for x in v:
        q.add(float(x))
    assert q.exact
    assert q.stats() == _stats(v)


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_spilled_percentiles_within_alpha_of_exact(seed: int) -> None:
    rng = np.random.default_rng(seed)
    v = _spread(rng, 60_000)
    q = Quantiles(exact_up_to=10_000)
    for chunk in np.array_split(v, 37):  # values arrive one by one and in batches
        q.extend(chunk[:5])
        for x in chunk[5:]:
            q.add(float(x))
    assert not q.exact and len(q.values) <= 4096
    got, want = q.stats(), _stats(v)
    for k in ("p50", "p90", "p99"):
        assert abs(got[k] - want[k]) <= ALPHA * abs(want[k]) + 1e-3, k  # 1e-3 ms: below 1 us
    assert got["mean"] == pytest.approx(want["mean"], rel=1e-9)


def test_spilled_weighted_percentiles_within_alpha() -> None:
    rng = np.random.default_rng(5)
    v = rng.lognormal(-5, 1.0, 40_000)
    w = rng.integers(1, 40, v.size).astype(float)
    q = Quantiles(weighted=True, exact_up_to=1000)
    for i in range(0, v.size, 7):
        q.extend(v[i:i + 7], w[i:i + 7])
    got, want = q.stats(), _stats(v, w)
    for k in ("p50", "p90", "p99"):
        assert abs(got[k] - want[k]) <= ALPHA * want[k], k
    assert got["mean"] == pytest.approx(want["mean"], rel=1e-9)


def test_all_zero_and_empty_streams() -> None:
    q = Quantiles(exact_up_to=0)
    for _ in range(9000):
        q.add(0.0)
    assert q.stats() == {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    assert all(np.isnan(x) for x in Quantiles().stats().values())


def test_memory_does_not_grow_once_spilled() -> None:
    q = Quantiles(exact_up_to=100)
    for x in range(50_000):
        q.add(float(x))
        assert len(q.values) <= 4097
    assert q.counts is not None and q.counts.sum() + len(q.values) == 50_000
