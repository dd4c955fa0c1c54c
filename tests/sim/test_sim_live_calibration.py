"""The serving stack's costs: where the simulator pays them, and how `kvplane calibrate live`
measures them from a recorded live run (the bundled tests/data/live_run)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvplane.cli import app
from kvplane.sim.calibration import apply_calibration, calibration_for
from kvplane.sim.config import Scenario, load_scenario
from kvplane.sim.live_calibration import fit_live, intervals, percentile
from kvplane.sim.profiles import CalibrationProfile, HostSlowdown, load_profile
from kvplane.sim.runner import simulate

DATA = Path(__file__).resolve().parents[1] / "data" / "live_run"


def one_request(calibration: CalibrationProfile, bidirectional: bool = False) -> float:
    """TTFT of a single 300-token pull request (no reuse) on the live CPU scenario."""
    sc = load_scenario("live_sample_cpu")
    sc = sc.model_copy(update={
        "requests": 1,
        "connector": sc.connector.model_copy(update={"bidirectional": bidirectional}),
        "workload": sc.workload.model_copy(update={
            "turns": sc.workload.turns.model_copy(update={"mean": 1.0}),
            "first_prompt": sc.workload.first_prompt.model_copy(update={"mean": 300.0})}),
    })
    _, summary = simulate(apply_calibration(sc, calibration).points()[0], drain=False)
    assert summary["finished"] == 1
    return float(summary["ttft_ms"]["mean"]) / 1e3


def with_values(cal: CalibrationProfile, **values: float) -> CalibrationProfile:
    return cal.model_copy(update={k: getattr(cal, k).model_copy(update={"value": v})
                                  for k, v in values.items()})


def base_calibration() -> CalibrationProfile:
    return calibration_for(load_scenario("live_sample_cpu"))


def test_pull_request_pays_two_request_legs_two_answers_and_one_transfer_setup() -> None:
    base = base_calibration()
    x, y, z = 0.004, 0.003, 0.007
    plain = one_request(base)
    legs = one_request(with_values(base, request_leg=x, response_leg=y, transfer_setup=z))
    # router -> prefill and router -> decode; prefill's answer and the first token through
    # the router; one P->D transfer
    assert legs - plain == pytest.approx(2 * x + 2 * y + z, abs=1e-9)


def slowed_by(base: CalibrationProfile, **factor: float) -> CalibrationProfile:
    return base.model_copy(update={"host_slowdown": {
        k: HostSlowdown(quantiles=[f, f], source="synthetic: a constant factor for the test")
        for k, f in factor.items()}})


def test_host_slowdown_scales_each_hop_by_its_kind() -> None:
    base = with_values(base_calibration(), request_leg=0.004, response_leg=0.003,
                       transfer_setup=0.007)
    plain = one_request(base)
    # two request legs x2, prefill's answer x3 (the first token's return is its own kind)
    legs = one_request(slowed_by(base, request_leg=2.0, response_leg=3.0))
    assert legs - plain == pytest.approx(2 * 0.004 + 2 * 0.003, abs=1e-9)
    # the transfer x5: its set-up and its bytes' time on the link
    xfer = one_request(slowed_by(base, transfer=5.0)) - plain
    assert 4 * 0.007 < xfer < 4 * 0.008
    # every kind x1 changes nothing
    assert one_request(slowed_by(base, request_leg=1.0, response_leg=1.0, transfer=1.0,
                                 prefill_step=1.0, first_token=1.0)) == pytest.approx(plain)


def test_host_slowdown_quantiles_must_ascend() -> None:
    with pytest.raises(ValueError, match="ascending"):
        HostSlowdown(quantiles=[2.0, 1.0], source="synthetic: bad")


@pytest.fixture
def live_db(tmp_path: Path) -> str:
    shutil.copy(DATA / "live.db", tmp_path / "live.db")
    return f"sqlite:///{tmp_path / 'live.db'}"


def recorded_legs(url: str) -> list[float]:
    """The bundled run's pull-mode legs, computed here from the raw events."""
    from kvplane.store import open_store

    with open_store(url) as store:
        evs = sorted(store.events("live-sample"), key=lambda e: e.at)
    pull = {e.request for e in evs if type(e).__name__ == "RequestRouted"
            and e.mode == "pull"}  # type: ignore[attr-defined]
    reads = {e.request for e in evs if type(e).__name__ == "TransferPlanned"
             and e.direction == "D->P"}  # type: ignore[attr-defined]
    legs = []
    for rid in pull - reads:
        mine = [e for e in evs if e.request == rid]
        arrived = {e.instance: e.at for e in reversed(mine) if type(e).__name__ == "RequestArrived"}
        relayed = next(e.at for e in mine if type(e).__name__ == "MetadataRelayed")
        legs += [arrived["prefill"] - arrived["router"], arrived["decode"] - relayed]
    return legs


def test_fit_live_measures_the_recorded_legs(live_db: str) -> None:
    from kvplane.store import open_store

    sc: Scenario = load_scenario("live_sample_cpu")
    with open_store(live_db) as store:
        fit = fit_live(store, "live-sample", sc.model, sc.hardware, base_calibration(),
                       block_size=sc.engine.block_size)
        iv = intervals(store, "live-sample")
    legs = recorded_legs(live_db)
    assert legs and sorted(iv["request_leg"]) == pytest.approx(sorted(legs))
    cal = fit.calibration
    assert cal.request_leg.value == pytest.approx(percentile(legs, 0.2))
    assert cal.request_leg.fitted_to == ["live:live-sample:request_leg"]
    assert cal.response_leg.value > 0 and cal.transfer_setup.value > 0
    assert cal.step_overhead.fitted_to == ["live:live-sample:decode_token"]
    assert set(cal.host_slowdown) == {"request_leg", "response_leg", "transfer",
                                      "prefill_step", "first_token", "decode_step"}
    assert all(min(h.quantiles) >= 0 for h in cal.host_slowdown.values())
    assert "network_utilization" in fit.kept


def test_fit_live_says_what_a_run_lacks(live_db: str) -> None:
    from kvplane.store import open_store

    sc = load_scenario("live_sample_cpu")
    with open_store(live_db) as store:  # only the push conversation: no pull-mode leg
        push = {e.request for e in store.events("live-sample", ["RequestRouted"])
                if e.mode == "push"}  # type: ignore[attr-defined]
        run = store.create_run("live", "push only")
        store.append(run, [e for e in store.events("live-sample") if e.request in push])
        with pytest.raises(ValueError, match="no request_leg"):
            fit_live(store, run, sc.model, sc.hardware, base_calibration())


def test_cli_calibrate_live_writes_a_loadable_profile(live_db: str, tmp_path: Path) -> None:
    out = tmp_path / "cal.yaml"
    res = CliRunner().invoke(app, ["calibrate", "live", "live-sample", "--db", live_db,
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "request_leg" in res.output and "kept from the prior" in res.output
    prof = load_profile(str(out), "calibration")
    assert isinstance(prof, CalibrationProfile) and prof.host_slowdown
    bad = CliRunner().invoke(app, ["calibrate", "live", "no-such-run", "--db", live_db])
    assert bad.exit_code == 2 and "no run" in bad.output


def test_host_slowdown_of_decode_steps_stretches_the_output_not_the_first_token() -> None:
    sc = load_scenario("live_sample_cpu")
    sc = sc.model_copy(update={"requests": 1, "workload": sc.workload.model_copy(update={
        "turns": sc.workload.turns.model_copy(update={"mean": 1.0})})})
    base = with_values(base_calibration(), step_overhead=0.002)

    def tpot_ttft(cal: CalibrationProfile) -> tuple[float, float]:
        _, s = simulate(apply_calibration(sc, cal).points()[0], drain=False)
        return float(s["tpot_ms"]["mean"]), float(s["ttft_ms"]["mean"])

    tpot, ttft = tpot_ttft(base)
    slow_tpot, slow_ttft = tpot_ttft(base.model_copy(update={"host_slowdown": {
        "decode_step": HostSlowdown(quantiles=[4.0, 4.0], source="synthetic: for the test")}}))
    assert slow_tpot == pytest.approx(4 * tpot, rel=1e-6)
    assert slow_ttft == pytest.approx(ttft, rel=1e-6)


def test_a_measured_per_descriptor_cost_replaces_the_links() -> None:
    from kvplane.sim.costs import TransferCost
    from kvplane.sim.profiles import Fitted

    sc = load_scenario("live_sample_cpu")
    base = base_calibration()
    link = TransferCost(sc.hardware, sc.link, base)
    per = sc.hardware.links[sc.link]
    assert link.post_per_descriptor == per.post_per_descriptor.value
    measured = base.model_copy(update={"transfer_per_descriptor": Fitted(
        value=3e-6, unit="s", source="synthetic: the test's")})
    fitted = TransferCost(sc.hardware, sc.link, measured)
    assert (fitted.post_per_descriptor, fitted.wire_per_descriptor) == (0.0, 3e-6)
    # 1,000 descriptors: the wire time grows by exactly 1,000 x 3 us more than no descriptors
    assert fitted.wire_time(1e6, 1000) - fitted.wire_time(1e6, 0) == pytest.approx(3e-3)
    assert "transfer_per_descriptor" in measured.constants()
    assert "transfer_per_descriptor" not in base.constants()


def test_fit_live_prices_transfers_on_the_scenarios_link(live_db: str) -> None:
    """The set-up and per-descriptor cost are fitted as the twin then prices them: on the
    scenario's link, with each transfer's recorded descriptors."""
    from kvplane.sim.costs import TransferCost
    from kvplane.store import open_store

    sc: Scenario = load_scenario("live_sample_cpu")
    with open_store(live_db) as store:
        fit = fit_live(store, "live-sample", sc.model, sc.hardware, base_calibration(),
                       block_size=sc.engine.block_size, link=sc.link)
        iv = intervals(store, "live-sample")
    cal = fit.calibration
    per = cal.transfer_per_descriptor
    assert per is not None and per.value >= 0 and cal.transfer_setup.value >= 0
    assert per.fitted_to == ["live:live-sample:p2d_transfer"]
    link = TransferCost(sc.hardware, sc.link, cal)
    priced = [cal.transfer_setup.value + link.wire_time(b, round(n))
              for b, n in zip(iv["p2d_bytes"], iv["p2d_descriptors"], strict=True)]
    # the fitted line sits at the quiet (lower) end of the recorded transfers
    below = sum(p <= d + 1e-9 for p, d in zip(priced, iv["p2d_transfer"], strict=True))
    assert below >= len(priced) // 2


def test_groups_recorded_together_are_compared_on_their_own_requests(live_db: str) -> None:
    """Workloads recorded together are twinned together (they shared the engines) and each is
    compared on its own requests: the groups' live and twinned TTFTs are the whole run's, split
    by request id, and a group of no finished request is refused, named."""
    from kvplane.sim.live_calibration import predict, predict_groups
    from kvplane.store import open_store

    sc = load_scenario("live_sample_cpu")
    with open_store(live_db) as store:
        fit = fit_live(store, "live-sample", sc.model, sc.hardware, base_calibration(),
                       block_size=sc.engine.block_size)
        scen = apply_calibration(sc, fit.calibration)
        ids = sorted({e.request for e in store.events("live-sample", ["RequestFinished"])
                      if e.instance == "router" and e.request is not None})
        half = {"first": ids[: len(ids) // 2], "rest": ids[len(ids) // 2:]}
        whole = predict(store, "live-sample", scen, 2)
        parts = predict_groups(store, "live-sample", scen, 2, groups=half)
        with pytest.raises(ValueError, match="in nobody"):
            predict_groups(store, "live-sample", scen, 1, groups={"nobody": ["no-such"]})
    assert set(parts) == {"first", "rest"} and parts["first"].run == "first"
    assert len(parts["first"].live) == len(half["first"])
    assert len(parts["first"].predicted) == 2 * len(half["first"])
    assert sorted(parts["first"].live + parts["rest"].live) == sorted(whole.live)
    assert sorted(parts["first"].predicted + parts["rest"].predicted) == pytest.approx(
        sorted(whole.predicted))
    assert parts["first"].reads_live + parts["rest"].reads_live == whole.reads_live


def test_cli_predicts_a_run_recorded_together_workload_by_workload(live_db: str) -> None:
    """`--requests-of RUN` compares the twin of --predict on that run's requests alone."""
    from kvplane.store import open_store

    with open_store(live_db) as store:
        ids = sorted({e.request for e in store.events("live-sample", ["RequestFinished"])
                      if e.instance == "router" and e.request is not None})
        first = set(ids[:3])
        run = store.create_run("live", "first three", run_id="first-three")
        store.append(run, [e for e in store.events("live-sample") if e.request in first])
    res = CliRunner().invoke(app, ["calibrate", "live", "live-sample", "--db", live_db,
                                   "--predict", "live-sample", "--requests-of", "first-three",
                                   "--seeds", "1"])
    assert res.exit_code == 0, res.output
    assert "run first-three: 3 requests live" in res.output
    assert "run live-sample:" not in res.output
    bad = CliRunner().invoke(app, ["calibrate", "live", "live-sample", "--db", live_db,
                                   "--predict", "live-sample", "--requests-of", "nope"])
    assert bad.exit_code == 2 and "nope" in bad.output
    alone = CliRunner().invoke(app, ["calibrate", "live", "live-sample", "--db", live_db,
                                     "--requests-of", "first-three"])
    assert alone.exit_code == 2 and "give --predict" in alone.output


def test_a_twins_slowdown_draws_keep_the_recorded_mean() -> None:
    """Each recorded factor weighs 1/n in the draws, the worst stall too: 99 hops at 1x and one
    at 1000x average 10.99x, and so do the simulator's draws (drawn as quantiles at i/(n-1),
    the two extremes weighed half: 6.05x)."""
    import statistics

    from kvplane.sim.engine import Simulation
    from kvplane.sim.runner import SimCosts, engine_config

    recorded = [1.0] * 99 + [1000.0]
    sc = apply_calibration(load_scenario("live_sample_cpu"), base_calibration().model_copy(
        update={"host_slowdown": {"request_leg": HostSlowdown(
            quantiles=recorded, source="synthetic: one stall among 100 hops")}}))
    point = sc.points()[0]
    costs = SimCosts.from_scenario(point.scenario)
    sim = Simulation(engine_config(point, costs), costs)
    draws = [sim.hop(1.0, "request_leg") for _ in range(200_000)]
    assert statistics.fmean(draws) == pytest.approx(statistics.fmean(recorded), rel=0.05)
    assert min(draws) == 1.0 and max(draws) == 1000.0
    assert sum(d == 1000.0 for d in draws) == pytest.approx(200_000 / 200, rel=0.2)


def test_the_fit_finds_a_launch_floor_under_the_line_of_longer_prefills() -> None:
    from kvplane.sim.live_calibration import _floor_line

    xs = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    line = [(x, 2.0 + 3.0 * x) for x in xs]  # no floor: the plain line
    assert _floor_line(line) == (None, pytest.approx(2.0), pytest.approx(3.0))
    floored = [(x, max(12.0, 2.0 + 3.0 * x)) for x in xs]  # 1-3 sit on a floor of 12
    floor, a, b = _floor_line(floored)
    assert floor == pytest.approx(12.0) and a == pytest.approx(2.0) and b == pytest.approx(3.0)
    flat = [(x, 70.0 + (-1.0) ** i) for i, x in enumerate(xs)]  # steps that ignore their work
    assert _floor_line(flat) == (pytest.approx(70.0), 0.0, 0.0)
    # a floor barely above the line is noise, not a floor
    noisy = [(1.0, 5.3), *line[1:]]
    assert _floor_line(noisy)[0] is None
