"""Kept live-prediction sessions re-predicted with and without the host's state as an input.

Each folder given is a session of tests/live/test_live_prediction.py: `runs.db` (runs A and
B) and `prediction.json` (the HostSampler's run-queue samples of A's and B's blocks under
`host_samples`). For each, the calibration is fitted from A's events twice: with A's samples
(the slowdown split by the run queue when each hop began: `host_state`) and without (every
hop drawn from all of its kind's factors); B's twins then follow B's own samples or none, and
A's own twins A's. Nothing of B but its arrivals and its host samples enters. Prints B's TTFT
p50 and p90 errors and A's own twin's, per session, before (pooled) and after (conditioned):

    .venv/bin/python benchmarks/live_host_state.py /tmp/kvplane-live-logs/live-prediction-* \
        --seeds 30

The stores are copied to a temporary folder first (twins are written into the store).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvplane.sim.calibration import apply_calibration, calibration_for
from kvplane.sim.config import load_scenario
from kvplane.sim.live_calibration import fit_live, percentile, predict
from kvplane.store import open_store


def scenario() -> Any:
    """The live test's scenario (tests/live/live_workloads.py `live_scenario`)."""
    sc = load_scenario("live_sample_cpu")
    return sc.model_copy(update={"name": "live_prediction_cpu", "connector": sc.connector
                                 .model_copy(update={"decoder_kv_blocks_ttl": 30.0})})


def session(folder: Path, seeds: int) -> str:
    samples = json.loads((folder / "prediction.json").read_text()).get("host_samples")
    if not samples or not {"A", "B"} <= set(samples):
        return f"{folder.name}: no stamped host samples of A and B in prediction.json"
    sc = scenario()
    row = [folder.name]
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(folder / "runs.db", tmp)
        with open_store(f"sqlite:///{tmp}/runs.db") as store:
            for label, host in (("pooled", {"A": [], "B": []}), ("conditioned", samples)):
                fit = fit_live(store, "A", sc.model, sc.hardware, calibration_for(sc),
                               block_size=sc.engine.block_size, host_samples=host["A"])
                cal = apply_calibration(sc, fit.calibration)
                b = predict(store, "B", cal, seeds, host_samples=host["B"])
                a = predict(store, "A", cal, seeds, host_samples=host["A"])
                row.append(f"{label}: B p50 {b.error(0.5):+.1%} p90 {b.error(0.9):+.1%}, "
                           f"A's own {a.error(0.5):+.1%} / {a.error(0.9):+.1%}")
            row.insert(1, f"B live p50 {percentile(b.live, 0.5) * 1e3:.0f} ms, "
                          f"p90 {percentile(b.live, 0.9) * 1e3:.0f} ms")
    return " | ".join(row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sessions", nargs="+", type=Path, help="live-prediction session folders")
    ap.add_argument("--seeds", type=int, default=30, help="twins pooled per prediction")
    args = ap.parse_args()
    for folder in args.sessions:
        print(session(folder, args.seeds), flush=True)


if __name__ == "__main__":
    main()
