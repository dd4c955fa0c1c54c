"""The store the dashboard tests run on, built from real runs (see `build_store`).

Imported by tests/dashboard/conftest.py and by tests/e2e/test_dashboard_browser.py.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

DATA = Path(__file__).resolve().parents[1] / "data"
APP = Path(__file__).resolve().parents[2] / "dashboard" / "app.py"


def build_store(target: Path | str) -> SimpleNamespace:
    """Record into a new store (a SQLite file at `target`, or a database URL):

    - a simulated push/pull sweep (seed_push_vs_pull's profiles, qps 1 and 4, input 1024 and
      4096, 12 requests a point, 2 of them warm-up), recorded by the runner;
    - a simulated reuse sweep (seed_bidirectional, reuse off and on, the first 27 turns
      of its conversations), whose reuse-on point holds retained-KV leases;
    - a live-like recording: the `vllm bench serve` results in tests/data/vllm_bench,
      imported as a sweep (kind import) that says it reproduces seed_push_vs_pull;
    - a simulated twin of one imported point (kind replay, parent = that point);
    - a `kvplane plan` search (a run whose meta holds the plan, no events);
    - a real live run (kind live): tests/data/live_run/live.db, recorded by `kvplane router`
      in front of two real vLLM servers running KvplaneConnector over real NIXL, copied in
      with its events merged by time, and its simulated twin under the scenario the
      run ships with (scenarios/live_sample_cpu.yaml, stamped in its meta).

    Returns the URL, the path and the run ids the tests use.
    """
    from kvplane.sim.config import load_scenario
    from kvplane.sim.imports import import_vllm_bench
    from kvplane.sim.replay_sim import replay_into_sim
    from kvplane.sim.runner import run_scenario
    from kvplane.store import open_store

    url = target if isinstance(target, str) else f"sqlite:///{target}"
    path = None if isinstance(target, str) else target
    # the live run goes in first, so the pages' defaults (the newest run) stay simulated ones
    live = copy_live_run(url)
    live_twin = replay_into_sim(url, live)  # the scenario it ships with
    pp = load_scenario("seed_push_vs_pull")
    pp = pp.model_copy(update={
        "requests": 10, "warmup_requests": 2,
        "sweep": pp.sweep.model_copy(update={"qps": [1, 4], "input_lens": [1024, 4096]}),
    })
    push_pull = run_scenario(pp, db=url, jobs=1, progress=False)
    bidi = load_scenario("seed_bidirectional").model_copy(update={"requests": 27})
    reuse = run_scenario(bidi, db=url, jobs=1, progress=False)
    imported = import_vllm_bench(url, DATA / "vllm_bench", scenario="seed_push_vs_pull")
    measured = next(p["run_id"] for p in imported["points"]
                    if p["label"] == "push_qps4_in4096_out128_iter0")
    twin = replay_into_sim(url, measured)
    by_label = {p["label"]: p["run_id"] for p in push_pull["points"]}
    reuse_on = next(p["run_id"] for p in reuse["points"] if p["bidirectional"])
    reuse_off = next(p["run_id"] for p in reuse["points"] if not p["bidirectional"])
    plan = plan_run(url)
    with open_store(url) as store:
        runs = len(store.runs())
    return SimpleNamespace(
        url=url, path=path, runs=runs,
        sweep=push_pull["run_id"], push_point=by_label["push_qps4_in4096_out128_iter0"],
        pull_point=by_label["pull_qps4_in4096_out128_iter0"],
        reuse_sweep=reuse["run_id"], reuse_on=reuse_on, reuse_off=reuse_off,
        import_sweep=imported["run_id"], measured=measured, twin=twin,
        live=live, live_twin=live_twin, plan=plan,
    )


def plan_run(url: str) -> str:
    """A small `kvplane plan` search (seed_push_vs_pull at 4 QPS, 4k input, up to 3
    instances, 2 seeds) kept in the store as the CLI keeps it."""
    from kvplane.sim.config import load_scenario
    from kvplane.sim.planner import plan
    from kvplane.store import open_store

    sc = load_scenario("seed_push_vs_pull")
    result = plan(sc, ttft_p90_ms=1500, tpot_p90_ms=20, rate=4, input_len=4096, requests=20,
                  seeds=2, max_instances=3, jobs=1)
    with open_store(url) as store:
        return store.create_run("sim", f"plan:{sc.name}", meta={
            "plan": result.as_dict(), "scenario": sc.model_dump(mode="json")})


def copy_live_run(url: str) -> str:
    """Copy the recorded live run into the store at `url`, merged by event time."""
    from kvplane.store import open_store

    # read-only: the bundled file is never written (it stays at the schema revision it was
    # recorded under, which read-only opens read as it is)
    with open_store(f"sqlite:///{DATA / 'live_run' / 'live.db'}", read_only=True) as src:
        info = src.run("live-sample")
        events = sorted(src.events(info.id), key=lambda e: e.at)
    with open_store(url) as dst:
        run = dst.create_run("live", info.scenario, meta=dict(info.meta or {}),
                             run_id=info.id)
        dst.append(run, events)
    return run
