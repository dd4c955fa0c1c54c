"""Recorded H200 sessions of tests/gpu/gpu_prediction.py, predicted again on this machine.

Each session (tests/data/gpu_prediction/sessionN-runs.db.xz, runs A, B and C kept by the GPU
suite: vLLM 0.25.1, 1P1D on one H200, `kvplane router`, KvplaneConnector over NIXL) is fitted
from run A alone and B (multi-turn, reuse reads) and C (bursts of 16 requests a second) are
predicted under that fit: TTFT p50 within 10 %, p90 within 20 % of the recorded.
- Sessions 1-3 ran eager (`--enforce-eager`): 1 is the one whose miss (B +25 % at p50) showed
  that the fit priced transfers on another link than the twin; 2 (Llama-3.1-8B-shaped) and 3
  (Qwen2.5-14B-shaped) were recorded after that change; 3's B misses the p50 target.
- Sessions 4-9 ran as users run vLLM (compiled, CUDA graphs): 8B, 14B, a Llama-3.2-3B, a
  Qwen3-30B-A3B (mixture of experts, 7 and 9) and a Qwen3-8B shape (8). Their fit prices the
  steps vLLM replays from CUDA graphs apart from those it launches from the host
  (`graph_step_overhead`, `launch_floor`, `empty_step`: docs/validation.md, "Steps in and out
  of CUDA graphs"); before that, 6's B missed by +22 % and 7's by +97 %. Their C misses
  because both engines share the one GPU (C's prefills ran 1.6-4.6x as long as A's of the
  same lengths, which the twin, one device per engine, does not price): held to their state,
  with that cause asserted.
docs/validation.md, "On an H200", has the table.
"""

from __future__ import annotations

import lzma
import shutil
from pathlib import Path

import pytest

from kvplane.sim.calibration import apply_calibration, calibration_for
from kvplane.sim.config import Scenario
from kvplane.sim.live_calibration import (
    decode_interference,
    fit_live,
    interference_note,
    predict,
    prefill_slowdown,
)
from kvplane.sim.profiles import CalibrationProfile
from kvplane.sim.replay_sim import scenario_for_run
from kvplane.store import EventStore, open_store

DATA = Path(__file__).resolve().parents[1] / "data" / "gpu_prediction"
SEEDS = 10
TARGET = {0.5: 0.10, 0.9: 0.20}


# what each session's predictions must meet: the target, except where the recorded state is a
# known miss (session 3, the 14B model: B's p50 +12.8 %, docs/validation.md says why), held
# to that state so that it can only get better
WITHIN = {
    "session1": {"B": TARGET},
    "session2": {"B": TARGET, "C": TARGET},
    "session3-dense14b": {"B": {0.5: 0.15, 0.9: 0.20}, "C": TARGET},
    "session4-graphs": {"B": TARGET, "C": {0.5: 0.65, 0.9: 0.65}},
    "session5-graphs-dense14b": {"B": TARGET, "C": {0.5: 0.80, 0.9: 0.80}},
    "session6-graphs-dense3b": {"B": TARGET, "C": {0.5: 0.30, 0.9: 0.35}},
    "session7-graphs-moe30b": {"B": TARGET, "C": {0.5: 0.55, 0.9: 0.55}},
    "session8-graphs-qwen3-8b": {"B": TARGET, "C": {0.5: 0.65, 0.9: 0.65}},
    "session9-graphs-moe30b": {"B": TARGET, "C": {0.5: 0.60, 0.9: 0.60}},
}
# the sessions recorded eager (no CUDA graphs); the others captured decode batches up to 32
EAGER = {"session1", "session2", "session3-dense14b"}
# the sessions whose C is slowed by the decode engine sharing the GPU: C's prefills take at
# least twice as long while decode runs as while it is idle (same prompt lengths); in 4 and 5
# that is why C is under-predicted (in 3, eager, other errors of the fit hid it)
SLOWED_C = {"session3-dense14b", "session4-graphs", "session5-graphs-dense14b",
            "session8-graphs-qwen3-8b"}
# the sessions whose C is under-predicted because its prefills ran at least 1.5x as long as
# A's of the same lengths (decode beside them on the GPU; in 6 and 7 decode kept running, so
# the idle/busy split has no idle prefills of the lengths that slowed)
MISSED_FOR_IT = {"session4-graphs", "session5-graphs-dense14b", "session6-graphs-dense3b",
                 "session7-graphs-moe30b", "session8-graphs-qwen3-8b", "session9-graphs-moe30b"}


def _session(session: str, tmp_path: Path) -> str:
    db = tmp_path / f"{session}.db"
    with lzma.open(DATA / f"{session}-runs.db.xz") as src, db.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    return f"sqlite:///{db}"


def _scenario(store: EventStore, graphs: int) -> Scenario:
    """The scenario run A was recorded under, stating what its engines captured (the kept
    sessions predate `engine.cuda_graph_max_batch`)."""
    sc: Scenario = scenario_for_run(store, store.run("A"))
    return sc.model_copy(update={"engine": sc.engine.model_copy(
        update={"cuda_graph_max_batch": graphs})})


def _fit(url: str, session: str) -> tuple[Scenario, CalibrationProfile]:
    graphs = 0 if session in EAGER else 32  # what the session's engines ran
    with open_store(url) as store:
        sc = _scenario(store, graphs)
        fit = fit_live(store, "A", sc.model, sc.hardware, calibration_for(sc),
                       block_size=sc.engine.block_size, link=sc.link, graph_batch=graphs)
    return sc, fit.calibration


@pytest.mark.parametrize("session", sorted(WITHIN))
def test_h200_session_fitted_on_a_predicts_the_others(session: str, tmp_path: Path) -> None:
    url = _session(session, tmp_path)
    sc, cal = _fit(url, session)
    with open_store(url) as store:
        others = [r.id for r in store.runs() if r.id != "A"]
    per = cal.transfer_per_descriptor
    # the path (cuda_ipc inside one GPU) costs far less per descriptor than the hardware
    # profile's two-GPU NVLink figure (6 us), and about 5 ms per transfer besides
    assert per is not None and per.value < 1e-6
    assert 1e-3 < cal.transfer_setup.value < 20e-3
    if session in EAGER:  # every step launched from the host: one fixed part, as before
        assert cal.graph_step_overhead is None and cal.empty_step is None
        assert cal.launch_floor is None
    else:  # a graph's replay costs far less than a step launched from the host (whose floor,
        # per layer, is 0.67-0.78 ms for the dense models and 1.3-1.5 ms for the MoE); the step
        # that reports a finished receive takes 5-8 ms on this stack whatever the model
        assert cal.graph_step_overhead is not None and cal.empty_step is not None
        assert cal.launch_floor is not None
        layers = sc.model.num_layers.value
        assert cal.graph_step_overhead.value < 0.2 * cal.launch_floor.value * layers
        assert 0.5e-3 < cal.launch_floor.value < 2e-3, cal.launch_floor.value
        assert 3e-3 < cal.empty_step.value < 10e-3, cal.empty_step.value
    predicted = apply_calibration(sc, cal)
    errors = {}
    with open_store(url) as store:
        for run in others:
            res = predict(store, run, predicted, SEEDS)
            errors[run] = {p: res.error(p) for p in TARGET}
    assert set(WITHIN[session]) <= set(errors), errors
    for run, within in WITHIN[session].items():
        for p, tol in within.items():
            assert abs(errors[run][p]) <= tol, (session, run, errors)
    if "C" not in errors:
        return
    with open_store(url) as store:
        got = decode_interference(store, "C")
        note = interference_note(store, "C")
    assert got is not None, session
    idle, busy = got
    if session in SLOWED_C:  # the decode sharing the GPU slowed C's prefills, and we say so
        assert busy >= 2 * idle, (session, idle, busy)
        assert note is not None and "share a GPU" in note, note
    else:
        assert busy < 1.5 * idle and note is None, (session, idle, busy, note)
    if session in MISSED_FOR_IT:
        assert all(errors["C"][p] < 0 for p in TARGET), errors  # under-predicted
        with open_store(url) as store:
            slower = prefill_slowdown(store, "C", "A")
        assert slower is not None and slower >= 1.5, (session, slower)


@pytest.mark.parametrize(("fitted", "predicted"), [
    ("session4-graphs", "session5-graphs-dense14b"),
    ("session5-graphs-dense14b", "session4-graphs")])
def test_h200_fit_of_one_dense_model_predicts_another(fitted: str, predicted: str,
                                                       tmp_path: Path) -> None:
    """With CUDA graphs, the fit of one dense model (its A alone) predicts another model's
    A and B on the same GPU: the calibration belongs to (model kind, hardware). (Eager it did
    not: -20 to -40 %, kernel launches dominating; the 3B model's prefill sits on a floor of
    the host's making, which the 8B's fit does not show: docs/validation.md.)"""
    _, cal = _fit(_session(fitted, tmp_path), fitted)
    url = _session(predicted, tmp_path)
    with open_store(url) as store:
        scenario = apply_calibration(_scenario(store, 32), cal)
        for run in ("A", "B"):
            res = predict(store, run, scenario, 5)
            for p, tol in TARGET.items():
                assert abs(res.error(p)) <= tol, (fitted, predicted, run, p, res.error(p))


def test_cli_notes_prefills_slowed_by_a_decode_sharing_the_gpu(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from kvplane.cli import app

    url = _session("session4-graphs", tmp_path)
    for run, noted in (("C", True), ("B", False)):
        res = CliRunner().invoke(app, ["calibrate", "live", "A", "--db", url, "--predict", run,
                                       "--seeds", "1"])
        assert res.exit_code == 0, res.output
        assert f"run {run}:" in res.output
        assert ("note: run C's one-step prefills" in res.output) is noted, res.output
