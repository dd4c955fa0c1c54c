"""How much faster than real time the simulator runs, on one core, with and without recording.

Prints, for the push and the pull point at 8 QPS, 16k-token prompts of the push/pull
reproduction (1P1D; `--minutes` simulated minutes of arrivals; the point is saturated, so the
completed rate is printed too):
- recording off (no recorder at all) and on (a `BatchingRecorder` into a fresh SQLite store,
  the default of `kvplane sim run`): simulated seconds per CPU-second and per wall second, and
  the ratio on/off: what recording costs, split into the recorder's writer thread (SQLite) and
  the rest (encoding and batching events on the simulator's thread; being the difference of
  two runs' CPU, it also holds their spread, about ±0.1-0.2 s on a shared 2-core machine);
- with `--profile`, the five functions with the most own time (cProfile, recording off);
- with `--core-share`, the protocol core's share of a run (its calls timed one by one; the
  timing adds about a microsecond a call), per request, against the CPU a request may take in
  all at 1,000x real time;
- the wall time of a `--requests` multi-turn run (reuse on, recording off).

CPU seconds are this process's, all threads (the recorder's writer included): on a shared,
loaded machine they are the steadier measure; wall seconds are printed beside them.

With `--baseline REF` (a git commit, e.g. `main`) the same points are also run on that
commit's code (exported to a temporary folder and imported from there, in a child process per
measurement, alternating with this tree's), and the table gains the ratio this/baseline: the
before/after of a change, measured in one run on one machine state.

Usage: python benchmarks/sim_speed.py [--minutes 10] [--requests 100000] [--profile]
       [--core-share] [--baseline REF] [--repeat 3]
Goals: at least 1,000x faster than real time for 1P1D; recording on costs < 20% over off.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from kvplane.sim.config import Point, load_scenario
from kvplane.sim.runner import simulate


def timed(point: Point, record: bool, tmp: str) -> tuple[float, float, dict[str, Any], int]:
    """(CPU s, wall s, summary, events written) of one point, recording into SQLite or not.
    Recording, the summary also has `writer_cpu_s`: the recorder's writer thread's share."""
    if not record:
        cpu, wall = time.process_time(), time.perf_counter()
        _, s = simulate(point, None, drain=False)
        return time.process_time() - cpu, time.perf_counter() - wall, s, 0
    from kvplane.store import BatchingRecorder, open_store

    path = Path(tmp) / f"{point.label}.db"
    for leftover in path.parent.glob(f"{path.name}*"):  # a fresh store for every repeat
        leftover.unlink()
    with open_store(f"sqlite:///{path}") as store:
        run_id = store.create_run("sim", point.label)
        cpu, wall = time.process_time(), time.perf_counter()
        try:  # the simulator's events are the core's: checked on the writer thread
            rec = BatchingRecorder(store, run_id, trusted=True)
        except TypeError:  # a baseline from before `trusted`
            rec = BatchingRecorder(store, run_id)
        _, s = simulate(point, rec.record, drain=False)
        rec.close()
        s["writer_cpu_s"] = rec.writer_cpu_s
        return time.process_time() - cpu, time.perf_counter() - wall, s, rec.written


def core_share(point: Point) -> str:
    """How much of a run (recording off) the protocol core's own calls take: every
    `machine.handle` the simulator makes, timed (CPU); per request, against what a request may
    cost in all for the run to go 1,000x faster than real time."""
    from kvplane.sim import engine

    spent, calls = [0.0], [0]
    plain = engine.Simulation.do

    def timed_do(sim: Any, machine: Any, cmd: Any) -> Any:
        t = time.process_time()  # recording off: `do` is the core's `handle` and one test
        events = plain(sim, machine, cmd)
        spent[0] += time.process_time() - t
        calls[0] += 1
        return events

    engine.Simulation.do = timed_do  # type: ignore[method-assign]
    try:
        cpu = time.process_time()
        _, s = simulate(point, None, drain=False)
        cpu = time.process_time() - cpu
    finally:
        engine.Simulation.do = plain  # type: ignore[method-assign]
    n, sim_s = s["finished"], s["simulated_s"]
    budget = sim_s / 1000 / n  # CPU a request may take in all at 1,000x real time
    return (f"  {point.mode}: the core's calls {spent[0]:.2f} of {cpu:.2f} CPU s "
            f"({spent[0] / cpu * 100:.0f} %), {calls[0] / n:.1f} a request: "
            f"{spent[0] / n * 1e6:.0f} us a request in the core, {cpu / n * 1e6:.0f} in all; "
            f"1,000x real time allows {budget * 1e6:.0f} us a request in all")


def top_five(point: Point) -> str:
    prof = cProfile.Profile(time.process_time)  # CPU time: wall time lies on a loaded machine
    prof.enable()
    simulate(point, None, drain=False)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(5)
    lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
    return "\n".join("    " + ln for ln in lines[start:start + 6])


REPO = Path(__file__).resolve().parents[1]
ROOMS = ("core", "store", "sim", "live", "dashboard", "scenarios")


def export(ref: str, into: Path) -> Path:
    """`ref`'s tree as an importable `kvplane` package under `into`; the folder for sys.path."""
    archive = into / "src.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "-C", str(REPO), "archive", ref], stdout=out, check=True)
    src = into / "src"
    with tarfile.open(archive) as tar:
        tar.extractall(src, filter="data")
    pkg = into / "pkg" / "kvplane"
    pkg.mkdir(parents=True)
    for item in (src / "kvplane").iterdir():
        (pkg / item.name).symlink_to(item)
    for room in ROOMS:
        if (src / room).is_dir():
            (pkg / room).symlink_to(src / room)
    return into / "pkg"


def child(code: Path | None, minutes: float, mode: str, record: bool) -> dict[str, Any]:
    """One measurement in a fresh process, importing `kvplane` from `code` (None: this tree)."""
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = str(code)
    cmd = [sys.executable, __file__, "--one", json.dumps([minutes, mode, record])]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def one(spec: str) -> None:
    minutes, mode, record = json.loads(spec)
    import kvplane
    p = next(p for p in points(minutes) if p.mode == mode)
    with tempfile.TemporaryDirectory(prefix="kvplane-speed-") as tmp:
        cpu, wall, s, events = timed(p, record, tmp)
    print(json.dumps({"cpu": cpu, "wall": wall, "sim_s": s["simulated_s"],
                      "finished": s["finished"], "events": events,
                      "code": str(Path(kvplane.__file__).parent)}))


def points(minutes: float) -> list[Point]:
    pp = load_scenario("seed_push_vs_pull")
    n = int(8 * 60 * minutes)
    # fresh servers per point: the speed of one point's own requests, not of the sweep before it
    engine = pp.engine.model_copy(update={"pool_history": "none"})
    pp = pp.model_copy(update={"requests": n, "warmup_requests": 0, "engine": engine})
    return [p for p in pp.points() if p.qps == 8 and p.input_len == 16384]


def compare(ref: str, minutes: float, repeat: int, modes: list[str]) -> None:
    """This tree against `ref`, each measurement in its own process, alternating."""
    print(f"this tree against {ref}: push/pull 1P1D, 8 QPS, 16k in, {int(480 * minutes)} "
          f"requests; best of {repeat} (CPU s), each in a fresh process, alternating")
    print(f"  {'mode':<5} {'recording':<9} {'code':<8} {'sim s':>7} {'CPU s':>7} "
          f"{'x real (CPU)':>12} {'done/sim s':>10} {'events':>7} {'speed-up':>8}")
    with tempfile.TemporaryDirectory(prefix="kvplane-base-") as tmp:
        base = export(ref, Path(tmp))
        for mode in modes:
            best: dict[tuple[str, bool], dict[str, Any]] = {}
            for _ in range(repeat):
                for record in (False, True):
                    for name, code in (("baseline", base), ("this", None)):
                        got = child(code, minutes, mode, record)
                        key = (name, record)
                        if key not in best or got["cpu"] < best[key]["cpu"]:
                            best[key] = got
            for record in (False, True):
                for name in ("baseline", "this"):
                    g = best[(name, record)]
                    up = best[("baseline", record)]["cpu"] / g["cpu"]
                    print(f"  {mode:<5} {'on' if record else 'off':<9} {name:<8} "
                          f"{g['sim_s']:7.1f} {g['cpu']:7.2f} {g['sim_s'] / g['cpu']:12.0f} "
                          f"{g['finished'] / g['sim_s']:10.2f} {g['events']:7d} {up:7.2f}x")
            for name in ("baseline", "this"):
                on, off = best[(name, True)]["cpu"], best[(name, False)]["cpu"]
                print(f"  {mode:<5} {name}: recording on / off (CPU) {on / off:.2f} "
                      f"(+{(on / off - 1) * 100:.0f}%)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--profile", action="store_true", help="print the top five functions")
    ap.add_argument("--core-share", action="store_true",
                    help="time the protocol core's calls: their share, per request")
    ap.add_argument("--baseline", metavar="REF", help="also run git commit REF's code; ratios")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of each point and mode; the least CPU is shown (with --baseline "
                         "too)")
    ap.add_argument("--modes", default="push,pull", help="with --baseline: which points")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child process's single measurement
    args = ap.parse_args()
    if args.one:
        one(args.one)
        return
    if args.baseline:
        compare(args.baseline, args.minutes, args.repeat, args.modes.split(","))
        if args.profile:
            for p in points(args.minutes):
                if p.mode not in args.modes.split(","):
                    continue
                print(f"  {p.mode}: top five by own time (this tree, recording off)")
                print(top_five(p))
        return

    pp = load_scenario("seed_push_vs_pull")
    n = int(8 * 60 * args.minutes)
    engine = pp.engine.model_copy(update={"pool_history": "none"})  # as in `points()`
    pp = pp.model_copy(update={"requests": n, "warmup_requests": 0, "engine": engine})
    print(f"push/pull 1P1D, 8 QPS, 16k in, {n} requests (~{args.minutes:g} simulated minutes "
          f"of arrivals; saturated)")
    print(f"  {'mode':<5} {'recording':<9} {'sim s':>8} {'CPU s':>7} {'wall s':>7} "
          f"{'x real (CPU)':>12} {'x real (wall)':>13} {'done/sim s':>10} {'events':>8}")
    with tempfile.TemporaryDirectory(prefix="kvplane-speed-") as tmp:
        for p in pp.points():
            if p.qps != 8 or p.input_len != 16384:
                continue
            cpu_off = 0.0
            for record in (False, True):
                # the least CPU of --repeat runs (off and on alternate): the run least slowed
                # by whatever else the machine is doing
                tries = []
                for _ in range(args.repeat):
                    tries.append(timed(p, record, tmp))
                cpu, wall, s, events = min(tries, key=lambda t: t[0])
                sim_s = s["simulated_s"]
                print(f"  {p.mode:<5} {'on' if record else 'off':<9} {sim_s:8.1f} {cpu:7.2f} "
                      f"{wall:7.2f} {sim_s / cpu:12.0f} {sim_s / wall:13.0f} "
                      f"{s['finished'] / sim_s:10.2f} {events:8d}")
                if record:
                    extra, writer = cpu - cpu_off, s["writer_cpu_s"]
                    print(f"  {p.mode:<5} recording on / off (CPU): {cpu / cpu_off:.2f} "
                          f"(+{(cpu / cpu_off - 1) * 100:.0f}%): {extra:.2f} CPU s for {events} "
                          f"events, {extra / max(events, 1) * 1e6:.0f} us an event; the writer "
                          f"thread {writer:.2f} s of it, the rest (the simulator's thread "
                          f"encoding, batching; and the runs' spread) {extra - writer:.2f} s")
                cpu_off = cpu
            if args.profile:
                print(f"  {p.mode}: top five by own time (recording off)")
                print(top_five(p))
            if args.core_share:
                print(core_share(p))

    if args.requests:
        bd = load_scenario("seed_bidirectional")
        bd = bd.model_copy(update={"requests": args.requests})
        point = next(p for p in bd.points() if p.bidirectional)
        cpu, wall, s, _ = timed(point, False, "")
        print(f"multi-turn, reuse on, {args.requests} requests: {cpu:.1f} CPU s ({wall:.1f} s "
              f"wall) for {s['simulated_s']:.0f} simulated s "
              f"({s['simulated_s'] / cpu:.0f}x real time per CPU-second), "
              f"{s['finished']} finished, reuse {s['reuse']}")


if __name__ == "__main__":
    main()
