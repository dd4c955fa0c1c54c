"""How much it matters that one request's hops meet the host alike, in a recorded live run.

Reads a run kept by tests/live/test_live_prediction.py (`runs.db` in its log folder, or the
kept sessions in tests/data/cpu_prediction, xz-compressed; the default) and, over the pull
requests without a reuse read, takes each request's seven hops: router -> prefill scheduler,
prefill's queue, prefill's step, prefill's answer through the router, router -> decode
scheduler, decode's arrival -> KV received, KV received -> first token at the router. Prints:

- the rank correlation of the two legs through the prefill API server (in and out), and how
  often both are in their top fifth against independence's 4 %;
- the TTFT-like sum of the seven hops as recorded (joint) and with each hop kind's values
  shuffled between requests (50 shuffles): what drawing every hop on its own, as a twin without
  `host_hop_correlation` does, makes of the same hops; the p10, p50 and p90 of both;
- the `host_hop_correlation` that `kvplane calibrate live` fits from run A.

    .venv/bin/python benchmarks/live_hop_pairing.py [RUNS.db ...] [--run AB]
"""

from __future__ import annotations

import argparse
import itertools
import lzma
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def hops(store: object, run: str) -> list[tuple[float, ...]]:
    from kvplane.sim.live_calibration import _traces

    out = []
    for t in _traces(store, run).values():  # type: ignore[arg-type]
        r, pf, dec = t.arrived.get("router"), t.arrived.get("prefill"), t.arrived.get("decode")
        marks = (r, pf, t.prefill_started, t.prefill_finished, t.relayed, dec, t.kv_received,
                 t.first_token)
        if t.d2p or t.mode != "pull" or any(m is None for m in marks):
            continue
        out.append(tuple(b - a for a, b in itertools.pairwise(marks)))  # type: ignore[operator]
    return out


def q(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[int(p * (len(s) - 1))]


def ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=xs.__getitem__)
    r = [0.0] * len(xs)
    for k, i in enumerate(order):
        r[i] = float(k)
    return r


def report(db: Path, run: str, label: str) -> str:
    from kvplane.sim.calibration import calibration_for
    from kvplane.sim.live_calibration import fit_live
    from kvplane.sim.replay_sim import scenario_for_run
    from kvplane.store import open_store

    with open_store(f"sqlite:///{db}") as store:
        vec = hops(store, run)
        ab = store.run(run)
        sc = scenario_for_run(store, ab)
        fit = fit_live(store, "A", sc.model, sc.hardware, calibration_for(sc),
                       block_size=sc.engine.block_size, link=sc.link,
                       host_samples=ab.meta.get("host_samples"))
    legs_in, legs_out = [v[0] for v in vec], [v[3] for v in vec]
    rho_s = statistics.correlation(ranks(legs_in), ranks(legs_out))
    top_in, top_out = q(legs_in, 0.8), q(legs_out, 0.8)
    both = sum(1 for a, b in zip(legs_in, legs_out) if a > top_in and b > top_out) / len(vec)
    joint = [sum(v) for v in vec]
    rng = random.Random(0)
    cols = [list(c) for c in zip(*vec)]
    apart: list[float] = []
    for _ in range(50):
        apart += [sum(x) for x in zip(*(rng.sample(c, len(c)) for c in cols))]
    rho = fit.calibration.host_hop_correlation
    figs = " ".join(f"p{int(p * 100)} {q(joint, p) * 1e3:.0f}/{q(apart, p) * 1e3:.0f} ms"
                    for p in (0.1, 0.5, 0.9))
    return (f"{label}: {len(vec)} requests; prefill's legs in/out rank correlation "
            f"{rho_s:.2f}, both in their top fifth {both:.1%} (independent: 4.0%); sum of the "
            f"hops joint/shuffled {figs} (p50 {q(apart, 0.5) / q(joint, 0.5) - 1:+.1%}); "
            f"fitted host_hop_correlation {'none' if rho is None else f'{rho.value:.2f}'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dbs", nargs="*", type=Path, help="runs.db files (default: the kept "
                    "sessions in tests/data/cpu_prediction)")
    ap.add_argument("--run", default="AB", help="the run holding both workloads")
    args = ap.parse_args()
    dbs = args.dbs or sorted((ROOT / "tests" / "data" / "cpu_prediction").glob("*.db.xz"))
    with tempfile.TemporaryDirectory() as tmp:
        for db in dbs:
            local = Path(tmp) / db.name.removesuffix(".xz")
            if db.suffix == ".xz":
                with lzma.open(db) as src, local.open("wb") as dst:
                    shutil.copyfileobj(src, dst)
            else:  # a copy: opening a store may upgrade it
                shutil.copy(db, local)
            label = db.parent.name if db.name == "runs.db" else db.name.removesuffix(".xz")
            print(report(local, args.run, label), flush=True)


if __name__ == "__main__":
    sys.exit(main())
