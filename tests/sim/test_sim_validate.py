"""Validation rules: published figures only from the data file, intervals over seeds, fitted
figures never counted, and a fit that records what it used and recovers what it was given."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvplane.sim.calibration import FREE, fit
from kvplane.sim.config import PublishedFigure, Scenario, load_published, load_scenario
from kvplane.sim.profiles import CalibrationProfile, load_profile
from kvplane.sim.stats import mean_interval, t_quantile_975
from kvplane.sim.validate import Check

ROOT = Path(__file__).resolve().parents[2]


def test_published_figures_come_from_one_file() -> None:
    studies = load_published()
    assert {"push_vs_pull", "bidirectional", "vllm_prs"} <= set(studies)
    ids = [f.id for s in studies.values() for f in s.figures]
    assert len(ids) == len(set(ids))
    pp = studies["push_vs_pull"]
    ratio = pp.figure("pp-ttft-ratio-8qps-16k")
    assert ratio.value == pytest.approx(pp.figure("pp-ttft-pull-8qps-16k").value
                                        / pp.figure("pp-ttft-push-8qps-16k").value)
    for name in ("seed_push_vs_pull", "seed_bidirectional"):
        text = (ROOT / "scenarios" / f"{name}.yaml").read_text()
        assert "figures:" not in text  # a scenario names its study, never types a figure
        sc = load_scenario(name)
        assert sc.published is not None and sc.published.figures


def test_validate_types_no_number() -> None:
    """Published values, tolerances and the 'nearly identical' ratio all come from data."""
    tree = ast.parse((ROOT / "sim" / "validate.py").read_text())
    literals = {float(n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant)
                and isinstance(n.value, float)}  # integers here are arithmetic (1 - tol)
    published = {float(v) for s in load_published().values() for f in s.figures
                 for v in (f.value, f.low, f.high, f.tolerance) if v is not None}
    assert 1.0 in published and 0.15 in published  # the probe can see what it looks for
    assert literals & published == set(), literals & published


def test_interval_of_the_mean() -> None:
    iv = mean_interval([1.0, 2.0, 3.0])
    assert iv.mean == 2.0
    assert iv.high - iv.mean == pytest.approx(t_quantile_975(2) * 1.0 / 3 ** 0.5)
    assert mean_interval([5.0]).low == 5.0
    assert iv.overlaps(2.9, 10.0) and not iv.overlaps(10.0, 11.0)
    assert iv.within(1.5, 2.5) == 1


def _figure(tol: float | None = 0.1) -> PublishedFigure:
    return PublishedFigure(id="x", metric="ttft_ms", value=100.0, tolerance=tol, source="s")


def test_a_check_passes_on_its_interval_and_counts_only_when_predicted() -> None:
    near = Check(_figure(), "near", [105.0, 115.0, 125.0])  # mean 115, interval reaches 110
    assert near.within and near.ok and near.verdict == "pass"
    far = Check(_figure(), "far", [150.0, 151.0, 152.0])
    assert not far.within and not far.ok and far.verdict == "FAIL"
    fitted = Check(_figure(), "fitted", [150.0, 151.0, 152.0], fitted_by=["step_overhead"])
    assert fitted.ok and not fitted.counted and fitted.verdict.startswith("fitted")
    context = Check(_figure(None), "ctx", [150.0, 151.0])
    assert context.ok and not context.counted


def test_bundled_calibration_names_what_it_was_fitted_to() -> None:
    cal = load_profile("calib-dense-p5en-h200-tp8", "calibration")
    assert isinstance(cal, CalibrationProfile)
    ids = {f.id for s in load_published().values() for f in s.figures}
    used = cal.fitted_figures()
    assert used and set(used) <= ids
    assert "bd-prefill-off-24k" in used and "pp-ttft-light-equal" not in used
    # the 2k prefill duration fixed the removed per-request delay; it is a prediction now
    assert "bd-prefill-off-2k" not in used


def test_fit_recovers_constants_it_was_given_and_records_its_figures() -> None:
    """Price the fittable figures with a known calibration, fit from a perturbed start: the
    constants those figures determine come back, the rest are kept and marked so."""
    from kvplane.sim import calibration as C

    truth = load_profile("calib-dense-p5en-h200-tp8", "calibration")
    assert isinstance(truth, CalibrationProfile)
    setting = C._default_setting()
    pricers = C._pricers(setting)
    use = ["pp-tpot-light", "bd-prefill-off-2k", "bd-prefill-off-24k", "bd-read-2k",
           "bd-read-24k", "bd-ttft-off-24k"]
    # figures made by the true constants, replacing the published ones
    fake = {fid: [(p(truth), p) for _, p in pricers[fid]] for fid in use}
    start = truth.model_copy(update={
        n: getattr(truth, n).model_copy(update={"value": getattr(truth, n).value * 1.3})
        for n in FREE if n != "step_overhead"})
    orig = C._pricers
    C._pricers = lambda s: fake  # type: ignore[assignment]
    try:
        result = fit(use, start, "t", setting)
    finally:
        C._pricers = orig  # type: ignore[assignment]
    for n in FREE:
        assert getattr(result.calibration, n).value == pytest.approx(getattr(truth, n).value,
                                                                      rel=0.02), n
    assert set(result.calibration.compute_utilization.fitted_to) >= {"bd-prefill-off-2k"}
    assert all(abs(r) < 1e-3 for r in result.residuals.values())


def test_fit_keeps_what_its_figures_do_not_determine() -> None:
    result = fit(["bd-read-2k", "bd-read-24k"])
    assert "compute_utilization" in result.kept
    assert result.calibration.compute_utilization.fitted_to == \
        load_profile("calib-dense-p5en-h200-tp8", "calibration").compute_utilization.fitted_to  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="cannot price"):
        fit(["pp-ttft-ratio-8qps-16k"])


def test_fit_holds_a_constant_where_asked() -> None:
    result = fit(["pp-tpot-light", "bd-prefill-off-2k", "bd-prefill-off-24k"],
                 hold={"prefill_request_overhead": 0.0})
    held = result.calibration.prefill_request_overhead
    assert held.value == 0.0 and held.fitted_to == [] and "held" in held.source
    assert "prefill_request_overhead" in result.kept
    assert "prefill_request_overhead" not in result.fitted
    # without the intercept the 2k prefill duration cannot be met
    assert result.residuals["bd-prefill-off-2k"] < -0.3
    with pytest.raises(ValueError, match="cannot hold"):
        fit(["bd-read-2k"], hold={"no_such_constant": 1.0})


def test_a_recorded_scenario_keeps_its_resolved_study() -> None:
    from kvplane.sim.config import scenario_from_data

    sc = load_scenario("seed_bidirectional")
    again = scenario_from_data(sc.model_dump(mode="json"), file="recorded")
    assert again.published == sc.published


def test_validate_end_to_end_sorts_every_figure_into_predicted_fitted_or_context() -> None:
    from kvplane.sim.validate import run_validation

    def fresh_pools(name: str) -> Scenario:
        # what is checked here is how figures are sorted, not the pools' history: each point on
        # fresh servers keeps this a one-minute run (the sweep history is test_sim_history's)
        sc = load_scenario(name)
        return sc.model_copy(update={"engine": sc.engine.model_copy(
            update={"pool_history": "none"})})

    ok, text = run_validation(jobs=1, seeds=2, sensitivity_table=False,
                              scenario_loader=fresh_pools)
    predicted = text.split("## Predicted (counted)")[1].split("## Fitted")[0]
    # the verdict is the predicted rows' (a fitted row outside its band never fails it)
    assert ok == ("| FAIL |" not in predicted), text
    fitted = text.split("## Fitted")[1].split("What each fitted figure")[0]
    cal = load_profile("calib-dense-p5en-h200-tp8", "calibration")
    assert isinstance(cal, CalibrationProfile)
    used = cal.fitted_figures()
    for study in ("push_vs_pull", "bidirectional"):
        for f in load_published()[study].figures:
            if f.tolerance is None:
                continue
            row = f"`{f.id}`"
            assert (row in fitted) == (f.id in used or any(i in used for i in f.ratio_of or ())), f.id
            assert (row in predicted) != (row in fitted), f.id


def test_prefill_duration_is_the_harness_window_and_the_fit_prices_the_same_one() -> None:
    """The bidirectional study's prefill duration is its proxy's whole call to prefill (the
    request's leg in, the compute, the answer's leg back: docs/published.md section 2).
    validate reads that window off the simulator, and the fit prices it: for a lone request
    the two agree exactly, with the serving legs zero (the GPU calibration) and set."""
    from kvplane.sim.calibration import _pricers, _Setting, apply_calibration, calibration_for
    from kvplane.sim.runner import simulate
    from kvplane.sim.validate import prefill_window

    sc = load_scenario("seed_bidirectional")
    plain = calibration_for(sc)
    legs = plain.model_copy(update={k: getattr(plain, k).model_copy(update={"value": v})
                                    for k, v in (("request_leg", 0.03), ("response_leg", 0.05))})
    windows, ttfts, priced = {}, {}, {}
    for cal in (plain, legs):
        for n, fid in ((2048, "bd-prefill-off-2k"), (24576, "bd-prefill-off-24k")):
            lone = sc.model_copy(update={"requests": 1, "workload": sc.workload.model_copy(
                update={"turns": sc.workload.turns.model_copy(update={"mean": 1.0}),
                        "first_prompt": sc.workload.first_prompt.model_copy(
                            update={"mean": float(n)})})})
            point = next(p for p in apply_calibration(lone, cal).points() if not p.bidirectional)
            r = simulate(point, drain=False)[0].done[0]
            assert r.prompt == n and r.prefill_end <= r.prefill_answered <= r.first_token
            setting = _Setting(sc.model, sc.hardware, sc.engine.max_num_batched_tokens,
                               {n: 1.0}, {n: 1.0}, {n: 0.0})
            pricers = _pricers(setting)
            (_, price), = pricers[fid]
            assert prefill_window(r) == pytest.approx(price(cal), rel=1e-9)
            windows[cal is legs, n] = prefill_window(r)
            ttfts[cal is legs, n] = r.first_token - r.arrival
            (_, price_ttft), = pricers[fid.replace("prefill", "ttft")]
            priced[cal is legs, n] = price_ttft(cal)
    for n in (2048, 24576):  # both legs are inside the window, once each
        assert windows[True, n] - windows[False, n] == pytest.approx(0.08, abs=1e-9)
        # a TTFT pays both legs twice (prefill and decode; prefill's answer and the first
        # token), in the simulator and in the fit's price alike
        assert ttfts[True, n] - ttfts[False, n] == pytest.approx(0.16, abs=1e-9)
        assert priced[True, n] - priced[False, n] == pytest.approx(0.16, abs=1e-9)
