"""What-if: push vs pull vs staged KV transfers at the fragmentation the simulator's own block
pool produces (scenarios/what_if_staging.yaml; no synthetic fragmentation knob).

Runs every point of the scenario (push/pull, reuse read off/on) twice on the same requests,
with `connector.transfer_staging` off (one descriptor per run, vLLM's NIXL) and on (kvplane's
transport: per transfer, runs or staged, by kvplane.core.transfer_method), and prints TTFT,
TPOT, the pool's mean run length and the ratios, within one run.

    python benchmarks/sim_staging_what_if.py [scenario.yaml]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from kvplane.sim.config import load_scenario
from kvplane.sim.runner import simulate

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = args[0] if args else str(ROOT / "scenarios" / "what_if_staging.yaml")
    base = load_scenario(path)
    rows: list[tuple[Any, dict[str, Any], dict[str, Any]]] = []
    for staging in (False, True):
        sc = base.model_copy(update={"connector": base.connector.model_copy(
            update={"transfer_staging": staging})})
        for point in sc.points():
            _, summary = simulate(point)
            if summary["finished"] != summary["submitted"]:
                print(f"{point.label}: {summary['finished']} of {summary['submitted']} finished")
                return 1
            if not staging:
                rows.append((point.label, summary, {}))
            else:
                label, off, _ = next(r for r in rows if r[0] == point.label)
                rows[rows.index((label, off, {}))] = (label, off, summary)
    print(f"{base.name}: {base.model.name} on {base.hardware.name}, {base.requests} requests "
          "per point; 'run blk': mean contiguous run of decode's blocks (the pool's own); "
          "off: one descriptor per run, on: kvplane's choice (runs or staged)")
    print(f"{'point':34} {'run blk':>7} {'TTFT ms off':>11} {'on':>8} {'x':>5}  "
          f"{'p90 off':>8} {'on':>8}  {'TPOT off':>8} {'on':>6} {'x':>5}")
    for label, off, on in rows:
        t0, t1 = off["ttft_ms"]["mean"], on["ttft_ms"]["mean"]
        p0, p1 = off["ttft_ms"]["p90"], on["ttft_ms"]["p90"]
        d0, d1 = off["tpot_ms"]["mean"], on["tpot_ms"]["mean"]
        runs = off.get("mean_run_blocks")
        print(f"{label:34} {runs if runs is None else round(runs, 2)!s:>7} {t0:11.0f} {t1:8.0f} "
              f"{t0 / t1:5.2f}  {p0:8.0f} {p1:8.0f}  {d0:8.2f} {d1:6.2f} {d0 / d1:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
