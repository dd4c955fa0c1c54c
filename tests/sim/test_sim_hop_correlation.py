"""One request's hops meet the host alike (the calibration's `host_hop_correlation`).

On a shared host a request whose first leg meets a stalled process tends to meet it again on
its answer a few milliseconds later. Drawn on their own, a twin's hops spread the stalls over
more requests than the recorded run did, which raises the median and the lower quantiles of
TTFT (docs/validation.md). `kvplane calibrate live` measures how alike one request's hops are
(normal scores of their ranks), and the twin draws them through a shared factor.
"""

from __future__ import annotations

import math
import random
import statistics
from pathlib import Path

import numpy as np
import pytest

from kvplane.sim.calibration import apply_calibration, calibration_for
from kvplane.sim.config import load_scenario
from kvplane.sim.engine import SimRequest, Simulation
from kvplane.sim.live_calibration import MIN_HOP_PAIRS, _hop_correlation
from kvplane.sim.profiles import CalibrationProfile, Fitted, HostSlowdown
from kvplane.sim.runner import SimCosts, engine_config

DATA = Path(__file__).resolve().parents[1] / "data" / "cpu_prediction"
KINDS = ("request_leg", "response_leg", "transfer", "prefill_step", "first_token")


def synthetic_hops(rho: float, requests: int, seed: int = 0
                   ) -> dict[str, list[tuple[float, float, float]]]:
    """(factor, began, request) per kind: each request's hops share a normal factor with
    weight rho; each kind on its own scale (a factor is exp of the mixed normal, times k)."""
    rng = random.Random(seed)
    out: dict[str, list[tuple[float, float, float]]] = {k: [] for k in KINDS}
    for who in range(requests):
        z = rng.gauss(0.0, 1.0)
        for scale, kind in enumerate(KINDS, start=1):
            mixed = math.sqrt(rho) * z + math.sqrt(1 - rho) * rng.gauss(0.0, 1.0)
            out[kind].append((scale * math.exp(mixed), float(who), float(who)))
    return out


@pytest.mark.parametrize("rho", [0.0, 0.3, 0.7])
def test_the_fit_reads_how_alike_one_requests_hops_are(rho: float) -> None:
    got = _hop_correlation(synthetic_hops(rho, 2000), None, None)
    assert got is not None
    est, pairs = got
    assert pairs == 2000 * 10  # five hops a request: ten pairs
    assert est == pytest.approx(rho, abs=0.05)


def test_too_few_pairs_fit_nothing_and_a_negative_estimate_is_zero() -> None:
    assert _hop_correlation(synthetic_hops(0.5, 2), None, None) is None  # 20 pairs
    assert MIN_HOP_PAIRS > 20
    # two hops a request, always on opposite ends: no negative weight, zero
    opposed = {"request_leg": [(float(i), 0.0, float(i)) for i in range(100)],
               "response_leg": [(float(-i), 0.0, float(i)) for i in range(100)]}
    assert _hop_correlation(opposed, None, None) == (0.0, 100)


def twin_sim(rho: float | None) -> Simulation:
    recorded = [1.0 + i for i in range(100)]
    cal = calibration_for(load_scenario("live_sample_cpu")).model_copy(update={
        "host_slowdown": {k: HostSlowdown(quantiles=recorded, source="synthetic: the test's")
                          for k in ("request_leg", "response_leg")},
        "host_hop_correlation": None if rho is None else Fitted(
            value=rho, unit="fraction", source="synthetic: the test's")})
    point = apply_calibration(load_scenario("live_sample_cpu"), cal).points()[0]
    costs = SimCosts.from_scenario(point.scenario)
    return Simulation(engine_config(point, costs), costs)


def rank_correlation(a: list[float], b: list[float]) -> float:
    """Spearman's: the correlation of the two lists' ranks."""
    return float(np.corrcoef(np.argsort(np.argsort(a)), np.argsort(np.argsort(b)))[0, 1])


def test_a_twins_request_draws_its_hops_alike_and_keeps_each_kinds_spread() -> None:
    for rho, lo, hi in ((None, -0.05, 0.05), (0.0, -0.05, 0.05), (0.8, 0.7, 0.85)):
        sim = twin_sim(rho)
        reqs = [SimRequest(id=f"r{i}", arrival=0.0, prompt=8, output=2) for i in range(5000)]
        first = [sim.hop(1.0, "request_leg", r) for r in reqs]
        answer = [sim.hop(1.0, "response_leg", r) for r in reqs]
        assert lo <= rank_correlation(first, answer) <= hi, rho
        # each kind's own draws still follow its recorded factors (uniform over 1..100)
        assert statistics.fmean(answer) == pytest.approx(50.5, rel=0.05)
        assert min(answer) >= 1.0 and max(answer) <= 100.0
    # hops of no request (a batch's decode step) draw on their own
    sim = twin_sim(0.9)
    loose = [sim.hop(1.0, "request_leg") for _ in range(3000)]
    again = [sim.hop(1.0, "response_leg") for _ in range(3000)]
    assert abs(rank_correlation(loose, again)) < 0.06


def test_the_correlation_is_a_fraction_below_one() -> None:
    base = calibration_for(load_scenario("live_sample_cpu"))
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="host_hop_correlation"):
            CalibrationProfile.model_validate({
                **base.model_dump(mode="json"),
                "host_hop_correlation": {"value": bad, "unit": "fraction",
                                         "source": "synthetic: bad"}})


def test_a_recorded_sessions_fit_finds_its_hops_alike_and_names_what_it_read(
        tmp_path: Path) -> None:
    """A kept CPU session (tests/data/cpu_prediction): one request's hops on that loaded host
    were slightly alike, and the fit says from which intervals it read it."""
    import lzma
    import shutil

    from kvplane.sim.live_calibration import fit_live
    from kvplane.sim.replay_sim import scenario_for_run
    from kvplane.store import open_store

    db = tmp_path / "runs.db"
    with lzma.open(DATA / "together-0327-runs.db.xz") as src, db.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    with open_store(f"sqlite:///{db}") as store:
        ab = store.run("AB")
        sc = scenario_for_run(store, ab)
        fit = fit_live(store, "A", sc.model, sc.hardware, calibration_for(sc),
                       block_size=sc.engine.block_size, link=sc.link,
                       host_samples=ab.meta["host_samples"])
    rho = fit.calibration.host_hop_correlation
    assert rho is not None and 0.0 < rho.value < 0.5
    assert "live:A:request_leg" in rho.fitted_to and "live:A:response_leg" in rho.fitted_to
    assert "host_hop_correlation" in fit.calibration.constants()
