"""The host's state as an input of a twin: a hop's slowdown drawn given the host's run queue
sampled at its time (sim/host_state.py; the calibration's `host_state` and
`HostSlowdown.by_state`, fitted by `kvplane calibrate live` from the calibration run's samples)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvplane.cli import app
from kvplane.sim.calibration import apply_calibration, calibration_for
from kvplane.sim.config import load_scenario
from kvplane.sim.host_state import HostTimeline, state_bin
from kvplane.sim.live_calibration import _by_state, fit_live
from kvplane.sim.profiles import CalibrationProfile, HostSlowdown, HostState
from kvplane.sim.replay_sim import replay_into_sim
from kvplane.store import open_store

DATA = Path(__file__).resolve().parents[1] / "data" / "live_run"
RUN = "live-sample"
START = 1796048282.0  # the bundled run's first event (seconds since the epoch)


@pytest.fixture
def live_db(tmp_path: Path) -> str:
    shutil.copy(DATA / "live.db", tmp_path / "live.db")
    return f"sqlite:///{tmp_path / 'live.db'}"


def samples(run_queue: float, seconds: float = 12.0) -> list[list[float]]:
    """A constant run queue sampled every 0.25 s over the bundled run (its clock)."""
    return [[START - 2.0 + 0.25 * i, run_queue, 1.0] for i in range(int(seconds / 0.25))]


def test_timeline_averages_the_window_else_takes_the_nearest_sample() -> None:
    tl = HostTimeline([0.0, 1.0, 2.0, 10.0], [2, 4, 9, 30], window=1.0)
    assert tl.at(1.0) == pytest.approx(5.0)  # 0, 1 and 2 s are within 1 s
    assert tl.at(0.2) == pytest.approx(3.0)  # 0 and 1 s
    assert tl.at(6.5) == 30  # none within 1 s: the nearest (10 s)
    assert tl.at(5.5) == 9  # the nearest is 2 s
    shifted = HostTimeline.from_samples([[100.0, 7, 0.5]], window=0.5, shift=-100.0)
    assert shifted.at(0.0) == 7
    with pytest.raises(ValueError, match="as many times"):
        HostTimeline([0.0], [], window=1.0)
    assert [state_bin([5.0, 10.0], x) for x in (1.0, 5.0, 7.0, 10.0, 50.0)] == [0, 1, 1, 2, 2]


def test_factors_split_by_bin_and_a_thin_bin_borrows_its_neighbours() -> None:
    xf = [(1.0, f) for f in (1.0, 2.0, 3.0)] * 4 + [(20.0, 9.0)]  # 12 low, 1 high
    low, high = _by_state(xf, [10.0])
    assert low == sorted([1.0, 2.0, 3.0] * 4)
    # the high bin holds one hop (fewer than 8): it takes the low bin's too
    assert high == sorted([1.0, 2.0, 3.0] * 4 + [9.0])
    lo2, hi2 = _by_state([(1.0, 1.0)] * 8 + [(20.0, 5.0)] * 8, [10.0])
    assert lo2 == [1.0] * 8 and hi2 == [5.0] * 8


def conditioned(base: CalibrationProfile, low: float, high: float) -> CalibrationProfile:
    """Every hop kind: `low` x below a run queue of 10, `high` x from it on (all: both)."""
    kinds = ("request_leg", "response_leg", "transfer", "prefill_step", "first_token")
    return base.model_copy(update={
        "host_state": HostState(window=1.0, edges=[10.0], source="synthetic: for the test"),
        "host_slowdown": {k: HostSlowdown(quantiles=sorted([low, high]),
                                          by_state=[[low, low], [high, high]],
                                          source="synthetic: for the test") for k in kinds}})


def twin_ttft(db: str, cal: CalibrationProfile, host: list[list[float]] | None) -> list[float]:
    sc = apply_calibration(load_scenario("live_sample_cpu"), cal)
    with open_store(db) as store:
        twin = replay_into_sim(store, RUN, sc, host_samples=host)
        return sorted(e.ttft for e in store.events(twin, ["RequestFinished"]))  # type: ignore[attr-defined]


def test_a_twin_draws_each_hop_from_the_bin_of_the_host_state_at_its_time(live_db: str) -> None:
    base = calibration_for(load_scenario("live_sample_cpu"))
    base = base.model_copy(update={k: getattr(base, k).model_copy(update={"value": v})
                                   for k, v in (("request_leg", 0.004), ("response_leg", 0.003),
                                                ("transfer_setup", 0.007))})
    cal = conditioned(base, 1.0, 4.0)
    busy = twin_ttft(live_db, cal, samples(20.0))
    quiet = twin_ttft(live_db, cal, samples(2.0))
    # the same as a host that slows every hop by the factor of the bin the samples fall in
    assert busy == pytest.approx(twin_ttft(live_db, conditioned(base, 4.0, 4.0), None))
    assert quiet == pytest.approx(twin_ttft(live_db, conditioned(base, 1.0, 1.0), None))
    assert sum(busy) > sum(quiet)
    # without samples a twin draws from all the factors of the kind: between the two
    pooled = twin_ttft(live_db, cal, None)
    assert sum(quiet) < sum(pooled) < sum(busy)


def test_by_state_must_match_the_bins() -> None:
    base = calibration_for(load_scenario("live_sample_cpu"))
    with pytest.raises(ValueError, match="2 bins"):
        base.model_copy(update={"host_state": HostState(
            window=1.0, edges=[10.0], source="synthetic: for the test")}).model_validate(
            {**conditioned(base, 1.0, 2.0).model_dump(), "host_slowdown": {
                "request_leg": {"quantiles": [1.0, 2.0], "by_state": [[1.0, 2.0]] * 3,
                                "source": "synthetic: for the test"}}})
    with pytest.raises(ValueError, match="strictly ascending"):
        HostState(window=1.0, edges=[5.0, 5.0], source="synthetic: for the test")
    with pytest.raises(ValueError, match="ascending"):
        HostSlowdown(quantiles=[1.0, 2.0], by_state=[[3.0, 1.0]], source="synthetic: bad")


def test_fit_live_splits_the_slowdown_by_the_runs_samples(live_db: str) -> None:
    sc = load_scenario("live_sample_cpu")
    rising = [[START - 2.0 + 0.25 * i, i, 1.0] for i in range(48)]
    with open_store(live_db) as store:
        plain = fit_live(store, RUN, sc.model, sc.hardware, calibration_for(sc),
                         block_size=sc.engine.block_size)
        fit = fit_live(store, RUN, sc.model, sc.hardware, calibration_for(sc),
                       block_size=sc.engine.block_size, host_samples=rising)
    assert plain.calibration.host_state is None
    assert all(not h.by_state for h in plain.calibration.host_slowdown.values())
    state = fit.calibration.host_state
    # three bins, or fewer where cuts coincide (this run's few hops share run queues)
    assert state is not None and 1 <= len(state.edges) <= 2
    assert state.fitted_to == [f"live:{RUN}:host_samples"]
    for kind, hs in fit.calibration.host_slowdown.items():
        # the pooled table is the unconditioned fit's; each bin's factors are some of them
        # (this run has one pull request: every bin borrows all of its kind's hops)
        assert hs.quantiles == plain.calibration.host_slowdown[kind].quantiles
        assert len(hs.by_state) == len(state.edges) + 1
        assert all(set(q) <= set(hs.quantiles) for q in hs.by_state)
    # too few samples: no conditioning
    with open_store(live_db) as store:
        few = fit_live(store, RUN, sc.model, sc.hardware, calibration_for(sc),
                       block_size=sc.engine.block_size, host_samples=rising[:5])
    assert few.calibration.host_state is None


def test_cli_reads_the_host_samples_per_run(live_db: str, tmp_path: Path) -> None:
    f = tmp_path / "prediction.json"
    f.write_text(json.dumps({"host_samples": {RUN: samples(6.0)}}))
    out = tmp_path / "cal.yaml"
    res = CliRunner().invoke(app, ["calibrate", "live", RUN, "--db", live_db, "--host-samples",
                                   str(f), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "host_state: run queue" in res.output and "host_state:" in out.read_text()
    bad = CliRunner().invoke(app, ["calibrate", "live", RUN, "--db", live_db, "--predict",
                                   "other", "--host-samples", str(f)])
    assert bad.exit_code == 2 and "no samples for run 'other'" in bad.output
