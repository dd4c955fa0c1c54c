"""How much faster than real time the simulator runs, on one core.

Prints:
- simulated seconds per wall second for the push and the pull 8 QPS, 16k-input point of the
  push/pull reproduction over 10 simulated minutes (1P1D), every core event made and dropped
  (a null recorder: the store's speed is benchmarks/store_write.py's business);
- the wall time of a 100,000-request multi-turn run (reuse on).

Usage: python benchmarks/sim_speed.py [--minutes 10] [--requests 100000]
Goal: at least 1,000x faster than real time for 1P1D.
"""

from __future__ import annotations

import argparse
import time

from kvplane.sim.config import load_scenario
from kvplane.sim.runner import simulate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--requests", type=int, default=100_000)
    args = ap.parse_args()

    pp = load_scenario("seed_push_vs_pull")
    n = int(8 * 60 * args.minutes)
    pp = pp.model_copy(update={"requests": n, "warmup_requests": 0})
    print(f"push/pull, 8 QPS, 16k in, {n} requests (~{args.minutes:g} simulated minutes)")
    for p in pp.points():
        if p.qps != 8 or p.input_len != 16384:
            continue
        events = 0

        def count(_e: object) -> None:
            nonlocal events
            events += 1

        t = time.perf_counter()
        _, s = simulate(p, count, drain=False)
        wall = time.perf_counter() - t
        print(f"  {p.mode:<5} simulated {s['simulated_s']:8.1f} s in {wall:6.2f} s wall: "
              f"{s['simulated_s'] / wall:8.0f}x real time, {events / wall:9.0f} core events/s, "
              f"TTFT {s['ttft_ms']['mean']:.0f} ms")

    bd = load_scenario("seed_bidirectional")
    bd = bd.model_copy(update={"requests": args.requests})
    point = next(p for p in bd.points() if p.bidirectional)
    t = time.perf_counter()
    _, s = simulate(point, None, drain=False)
    wall = time.perf_counter() - t
    print(f"multi-turn, reuse on, {args.requests} requests: {wall:.1f} s wall for "
          f"{s['simulated_s']:.0f} simulated s ({s['simulated_s'] / wall:.0f}x real time), "
          f"{s['finished']} finished, reuse {s['reuse']}")


if __name__ == "__main__":
    main()
