"""A cluster-size run on one core: wall time, CPU time and memory over simulated time.

Runs the bundled `cluster_32p32d` scenario (32 prefill + 32 decode instances, 200 requests/s of
multi-turn agentic traffic, one simulated hour) with a streaming summary (finished requests are
folded into aggregates and dropped), optionally recording every event into a SQLite store
(the recorder writes in batches from its own thread). Every `--every` simulated seconds it
prints the simulated time reached, CPU and wall seconds so far, requests finished, and the
resident memory (RSS) now; at the end the peak RSS, the RSS slope per simulated second once
the prefix caches are full (`--warm`, least squares over the samples) and how fast it went. `--budget` stops
the run after that many wall seconds and reports how far it got.

    .venv/bin/python benchmarks/cluster_scale.py                    # the hour, no recording
    .venv/bin/python benchmarks/cluster_scale.py --record --budget 600
    .venv/bin/python benchmarks/cluster_scale.py --minutes 5         # a shorter horizon
    .venv/bin/python benchmarks/cluster_scale.py --minutes 2 --baseline main   # before/after
    .venv/bin/python benchmarks/cluster_scale.py --minutes 1 --hash --baseline main  # same events?

With `--baseline REF` the same horizon is run first on git commit REF's code (exported to a
temporary folder, in a child process), then on this tree, and the speed-up is printed: the
before/after of a change measured in one run on one machine state.

Goal: the hour in < 10 minutes on one core, with memory flat in simulated time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvplane.sim.config import load_scenario
from kvplane.sim.engine import Simulation
from kvplane.sim.runner import simulate


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def compare(args: argparse.Namespace) -> None:
    """This script on `args.baseline`'s code (a child process), then on this tree's."""
    import re
    import subprocess
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from sim_speed import export

    flags = ["--minutes", str(args.minutes), "--every", str(args.every)]
    flags += ["--record"] if args.record else []
    flags += ["--hash"] if args.hash else []
    rates: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kvplane-base-") as tmp:
        base = export(args.baseline, Path(tmp))
        for name, code in ((args.baseline, str(base)), ("this tree", None)):
            env = dict(os.environ)
            if code is not None:
                env["PYTHONPATH"] = code
            print(f"--- {name}", flush=True)
            out = subprocess.run([sys.executable, __file__, *flags], env=env, check=True,
                                 capture_output=True, text=True).stdout
            print(out, end="", flush=True)
            got = re.search(r"([0-9.]+) simulated s per CPU-second", out)
            rates[name] = float(got.group(1)) if got else float("nan")
    base_rate, this_rate = rates[args.baseline], rates["this tree"]
    print(f"simulated s per CPU-second: {args.baseline} {base_rate:.2f}, this tree "
          f"{this_rate:.2f}: {this_rate / base_rate:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=60.0, help="simulated minutes of arrivals")
    ap.add_argument("--every", type=float, default=300.0, help="sample every N simulated s")
    ap.add_argument("--budget", type=float, default=0.0, help="stop after N wall seconds")
    ap.add_argument("--record", action="store_true", help="record every event into SQLite")
    ap.add_argument("--baseline", metavar="REF", help="first run git commit REF's code; ratios")
    ap.add_argument("--warm", type=float, default=600.0,
                    help="RSS slope from this simulated second on (the prefix caches full)")
    ap.add_argument("--hash", action="store_true",
                    help="hash every event's repr in order, and the summary (same-events "
                         "checks; the simulator then makes the events only a recorder reads)")
    args = ap.parse_args()
    if args.baseline:
        compare(args)
        return

    sc = load_scenario("cluster_32p32d")
    qps = 200.0
    n = int(qps * 60 * args.minutes)
    sc = sc.model_copy(update={"requests": n})
    point = sc.points()[0]
    print(f"{sc.name}: {sc.cluster.prefill_instances}P{sc.cluster.decode_instances}D, "
          f"~{qps:g} QPS multi-turn, {n:,} requests (~{args.minutes:g} simulated minutes), "
          f"recording {'on (SQLite)' if args.record else 'off'}")
    print(f"{'sim s':>7} {'CPU s':>8} {'wall s':>8} {'finished':>9} {'RSS MiB':>8}")
    cpu0, wall0 = time.process_time(), time.perf_counter()
    stopped = False
    samples: list[tuple[float, float]] = []  # (simulated s, RSS MiB)

    def run(sim: Simulation, all_done: Any, total: int) -> None:
        nonlocal stopped
        mark = 0.0
        while not all_done.triggered:
            mark += args.every
            # run to the mark, or to the end if that comes first
            sim.env.run(until=sim.env.any_of([all_done, sim.env.timeout(mark - sim.env.now)]))
            print(f"{sim.env.now:7.0f} {time.process_time() - cpu0:8.1f} "
                  f"{time.perf_counter() - wall0:8.1f} {sim.finished_count:9,} "
                  f"{rss_mib():8.0f}", flush=True)
            samples.append((sim.env.now, rss_mib()))
            if args.budget and time.perf_counter() - wall0 > args.budget:
                stopped = True
                return

    with tempfile.TemporaryDirectory(prefix="kvplane-cluster-") as tmp:
        rec = None
        store = None
        events = hashlib.sha256()
        if args.hash:
            def record(e: Any) -> None:
                events.update(repr(e).encode())
        elif args.record:
            from kvplane.store import BatchingRecorder, open_store

            store = open_store(f"sqlite:///{Path(tmp) / 'cluster.db'}")
            rec = BatchingRecorder(store, store.create_run("sim", sc.name), batch_size=5000)
            record = rec.record
        else:
            record = None
        try:
            _, s = simulate(point, record, drain=False, run=run, stream=True)
        finally:
            if rec is not None:
                rec.close()
            if store is not None:
                size = sum(f.stat().st_size for f in Path(tmp).iterdir()) / 2**20
                store.close()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    sim_s = s["simulated_s"]
    print(f"{'stopped by --budget at' if stopped else 'finished:'} {sim_s:.0f} simulated s "
          f"({sim_s / 60:.1f} min) in {cpu:.0f} CPU s, {wall:.0f} wall s: "
          f"{sim_s / cpu:.2f} simulated s per CPU-second; peak RSS {peak_rss_mib():.0f} MiB")
    print(f"{s['finished']:,} requests finished ({s['finished'] / cpu:.0f} per CPU-second); "
          f"TTFT p50/p90 {s['ttft_ms']['p50']:.0f}/{s['ttft_ms']['p90']:.0f} ms, "
          f"TPOT p50 {s['tpot_ms']['p50']:.1f} ms")
    late = [(t, m) for t, m in samples if t >= args.warm]
    if len(late) >= 3:
        slope = float(np.polyfit([t for t, _ in late], [m for _, m in late], 1)[0]) * 1024
        print(f"RSS slope from simulated second {args.warm:g} on ({len(late)} samples, "
              f"least squares): {slope:.1f} KiB per simulated second")
    if args.hash:
        summary = {k: v for k, v in s.items() if k != "wall_s"}
        print(f"events sha256 {events.hexdigest()[:16]}, summary sha256 "
              f"{hashlib.sha256(json.dumps(summary, sort_keys=True).encode()).hexdigest()[:16]}")
    if args.record:
        print(f"recorded {rec.written if rec else 0:,} events, store {size:.0f} MiB")
    if not stopped:
        hour = 3600 / sim_s * cpu
        print(f"one simulated hour at this rate: {hour / 60:.1f} CPU minutes")


if __name__ == "__main__":
    main()
