"""How long each dashboard page takes on stores of about a million events, on this machine.

Two stores, each built once (cached under artifacts/bench/):
- `main` (dashboard-1m.db): real recorded runs: a push/pull sweep of seed_push_vs_pull at
  4 QPS and 4k input with many requests per point, a simulated twin of its push point, a
  multi-turn reuse sweep (seed_bidirectional), the bundled live run with its twin, and a
  `kvplane plan` search. Pages are opened on its biggest point run.
- `cluster` (cluster-32p32d.db): the bundled cluster_32p32d scenario (32 prefill + 32 decode
  instances, 200 requests/s of multi-turn agentic traffic) recorded for a shorter span
  (`--cluster-requests`, 50,000 requests: about 4 simulated minutes). Pages are opened on it.

Each store is timed as it is, and with `--old-copy` also as a copy kept at the store's previous
schema revision (no covering index, no stored block counts: read-only opens read it as it is,
correct but slower), so before and after come from one run. `--upgrade` migrates the store
(and reports how long that took) before timing.

The dashboard app runs in Streamlit's own test runner (the same script the server runs, in
this process) with the run picked (`?run=`), page by page: `first` with Streamlit's caches
cleared (a first visit), `warm` for a second visit (cached queries). The time is the whole
script run: queries, pandas, Plotly figure building; not the browser's drawing. Wall time and
this process's CPU time are both printed, with the load average: on a shared machine the wall
time includes waiting for a CPU. Untimed visits of every page on the small bundled live run
first pay what a server pays once per process (imports, finding installed Streamlit
components, reading the bundled profiles).

    .venv/bin/python benchmarks/dashboard_pages.py                 # build if needed, time
    .venv/bin/python benchmarks/dashboard_pages.py --stores cluster --repeat 3
    .venv/bin/python benchmarks/dashboard_pages.py --upgrade --old-copy
    .venv/bin/python benchmarks/dashboard_pages.py --stores cluster --upgrade --rollup

With `--rollup` the pages are timed without the runs' rollups (revision 0005: what the pages
show of a whole run, kept once the run is done), then the rollups are written (timed: a
recording's one-time cost) and the pages timed again on them.

Prints one line per page (seconds) and the slowest page against the 2 s goal (3 s for the
cluster run, issue 12's goal).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "dashboard" / "app.py"
BENCH = ROOT / "artifacts" / "bench"
STORES = {"main": BENCH / "dashboard-1m.db", "cluster": BENCH / "cluster-32p32d.db"}
GOALS_S = {"main": 2.0, "cluster": 3.0}


def _fresh(path: Path) -> str:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def build_main(path: Path, requests: int) -> None:
    from kvplane.sim.config import Sweep, load_scenario
    from kvplane.sim.planner import plan
    from kvplane.sim.replay_sim import replay_into_sim
    from kvplane.sim.runner import run_scenario
    from kvplane.store import open_store

    sys.path.insert(0, str(ROOT / "tests" / "dashboard"))
    from see_store import copy_live_run

    url = _fresh(path)
    t = time.perf_counter()
    live = copy_live_run(url)
    replay_into_sim(url, live)
    pp = load_scenario("seed_push_vs_pull")
    pp = pp.model_copy(update={"requests": requests, "warmup_requests": 0, "sweep": Sweep(
        modes=["push", "pull"], qps=[4.0], input_lens=[4096])})
    sweep = run_scenario(pp, db=url, jobs=2, progress=True)
    push = next(p["run_id"] for p in sweep["points"] if p["mode"] == "push")
    replay_into_sim(url, push)
    bidi = load_scenario("seed_bidirectional").model_copy(update={"requests": requests // 8})
    run_scenario(bidi, db=url, jobs=2, progress=True)
    result = plan(load_scenario("seed_push_vs_pull"), ttft_p90_ms=1500, tpot_p90_ms=20,
                  rate=4, input_len=4096, requests=40, seeds=2, max_instances=3)
    with open_store(url) as store:
        store.create_run("sim", "plan:seed_push_vs_pull", meta={"plan": result.as_dict()})
    print(f"built {path} in {time.perf_counter() - t:.0f} s", flush=True)


def build_cluster(path: Path, requests: int) -> None:
    from kvplane.sim.runner import run_scenario

    url = _fresh(path)
    t = time.perf_counter()
    run_scenario("cluster_32p32d", db=url, requests=requests, progress=True)
    print(f"built {path} in {time.perf_counter() - t:.0f} s", flush=True)


def biggest_point(path: Path) -> tuple[str, int, int]:
    con = sqlite3.connect(path)
    try:
        total = con.execute("SELECT max(rowid) FROM events").fetchone()[0]
        # events name their run by `runs.key` from revision 0004 on, by its id before
        keyed = "key" in {row[1] for row in con.execute("PRAGMA table_info(runs)")}
        ref = "r.key" if keyed else "r.id"
        run, n = max(((r, int(n)) for r, n in con.execute(
            f"SELECT r.id, (SELECT max(seq) + 1 FROM events e WHERE e.run = {ref}) FROM runs r "
            "WHERE r.kind = 'sim'") if n is not None), key=lambda x: x[1])
    finally:
        con.close()
    return run, n, total


def revision(path: Path) -> str:
    con = sqlite3.connect(path)
    try:
        return str(con.execute("SELECT version_num FROM schema_meta").fetchone()[0])
    finally:
        con.close()


Timing = tuple[str, float, float, float, float]


def time_pages(url: str, run: str, repeat: int) -> list[Timing]:
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    from kvplane.dashboard.views import PAGES

    # A running server has imported what the pages import and read the bundled profiles
    # once (cached for the process): one untimed visit of every page on the small bundled
    # live run pays that, and nothing of the store measured is cached by it.
    warm_up = AppTest.from_file(str(APP), default_timeout=600)
    os.environ["KVPLANE_DB"] = f"sqlite:///{ROOT / 'tests' / 'data' / 'live_run' / 'live.db'}"
    for title in PAGES:
        warm_up.query_params["page"] = PAGES[title].SLUG
        warm_up.session_state["page"] = title
        warm_up.run()
    st.cache_data.clear()
    os.environ["KVPLANE_DB"] = url
    out = []
    for title in PAGES:
        first: list[tuple[float, float]] = []
        warm: list[tuple[float, float]] = []
        for _ in range(repeat):
            st.cache_data.clear()
            at = AppTest.from_file(str(APP), default_timeout=600)
            # A server finds installed components once, at start; a fresh AppTest does it
            # on its first run (reading every installed package's metadata: 1-2 CPU s
            # here, with vLLM installed), which is not the page's time.
            at._bidi_component_manager = warm_up._bidi_component_manager
            at.query_params["run"] = run
            at.query_params["page"] = PAGES[title].SLUG
            for visits in (first, warm):
                t, c = time.perf_counter(), time.process_time()
                at.run()
                visits.append((time.perf_counter() - t, time.process_time() - c))
                if at.exception:
                    raise SystemExit(f"{title}: {at.exception[0].value}")
        f, w = min(first), min(warm)
        out.append((title, f[0], f[1], w[0], w[1]))
        print(f"  {title:<18} first {f[0]:6.2f} s (cpu {f[1]:5.2f})   warm {w[0]:6.2f} s "
              f"(cpu {w[1]:5.2f})   load {os.getloadavg()[0]:.1f}", flush=True)
    return out


def report(name: str, label: str, timings: list[Timing]) -> None:
    goal = GOALS_S[name]
    worst = max(timings, key=lambda x: x[1])
    print(f"  {label}: slowest first visit {worst[0]} {worst[1]:.2f} s wall = "
          f"{worst[1] / goal:.2f} x the {goal:g} s goal ({worst[2]:.2f} s CPU); most CPU on a "
          f"first visit {max(t[2] for t in timings):.2f} s; slowest warm visit "
          f"{max(t[3] for t in timings):.2f} s; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} CPUs", flush=True)


def upgrade(path: Path) -> None:
    from kvplane.store import open_store

    before = revision(path)
    t, c = time.perf_counter(), time.process_time()
    open_store(f"sqlite:///{path}").close()
    print(f"  migrated {path.name} {before} -> {revision(path)} in "
          f"{time.perf_counter() - t:.1f} s wall ({time.process_time() - c:.1f} s CPU of this "
          f"process; SQLite works in it)", flush=True)


def roll_up(path: Path) -> None:
    """Write the rollups the store's runs lack (`kvplane rollup`), timed: what a recording
    pays once when its run is done (`kvplane sim run` does it for every point)."""
    from kvplane.dashboard import rollup
    from kvplane.store import open_store

    with open_store(f"sqlite:///{path}") as store:
        counts = {r.id: store.count(r.id) for r in store.runs()}
        have = store.rollups(list(counts), "heads")
        for run_id, n in counts.items():
            if n and run_id not in have:
                t, c = time.perf_counter(), time.process_time()
                rollup.write(store, run_id)
                print(f"  rolled up run {run_id[:8]} ({n:,} events) in "
                      f"{time.perf_counter() - t:.1f} s wall ({time.process_time() - c:.1f} s "
                      "CPU)", flush=True)


def drop_rollups(path: Path) -> None:
    con = sqlite3.connect(path)
    try:
        if con.execute("SELECT 1 FROM sqlite_master WHERE name = 'run_rollups'").fetchone():
            con.execute("DELETE FROM run_rollups")
            con.commit()
    finally:
        con.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stores", default="main,cluster", help="main, cluster or both")
    ap.add_argument("--rebuild", action="store_true", help="build the stores again")
    ap.add_argument("--requests", type=int, default=16000,
                    help="requests per push/pull point when building main (16000: ~1M events)")
    ap.add_argument("--cluster-requests", type=int, default=50000,
                    help="requests of cluster_32p32d when building cluster")
    ap.add_argument("--cluster-db", type=Path, default=STORES["cluster"],
                    help="where the cluster store is kept (another file for another size)")
    ap.add_argument("--old-copy", action="store_true",
                    help="keep a copy at the store's revision before migrating, and time it too")
    ap.add_argument("--upgrade", action="store_true", help="migrate the store before timing")
    ap.add_argument("--rollup", action="store_true",
                    help="time the pages without rollups (the runs' events read), then write "
                    "the runs' rollups (timed) and time them again (revision 0005 on)")
    ap.add_argument("--repeat", type=int, default=1, help="visits per page (best kept)")
    args = ap.parse_args()
    for name in args.stores.split(","):
        path = args.cluster_db if name == "cluster" else STORES[name]
        if args.rebuild or not path.exists():
            if name == "main":
                build_main(path, args.requests)
            else:
                build_cluster(path, args.cluster_requests)
        run, n, total = biggest_point(path)
        print(f"store {name} ({path.name}, {path.stat().st_size / 2**20:,.0f} MiB, revision "
              f"{revision(path)}): {total:,} events; pages opened on run {run[:8]} "
              f"({n:,} events)", flush=True)
        variants = []
        if args.old_copy:
            old = path.with_name(f"{path.stem}-old{path.suffix}")
            _fresh(old)
            shutil.copyfile(path, old)
            variants.append((f"old store (revision {revision(old)}, as found)", old))
        if args.upgrade:
            upgrade(path)
        if args.rollup:
            drop_rollups(path)
        variants.append((f"store at revision {revision(path)}"
                         + (", no rollups" if args.rollup else ""), path))
        for label, file in variants:
            print(f" {label}:", flush=True)
            report(name, label, time_pages(f"sqlite:///{file}", run, args.repeat))
        if args.rollup:
            roll_up(path)
            label = f"store at revision {revision(path)}, with rollups"
            print(f" {label}:", flush=True)
            report(name, label, time_pages(f"sqlite:///{path}", run, args.repeat))


if __name__ == "__main__":
    main()
