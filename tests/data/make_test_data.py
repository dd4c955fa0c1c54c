"""Writes the small recorded test data in tests/data (run it again only to change them).

- `vllm_bench/`: `vllm bench serve --save-result --save-detailed` result files for a 2x2x2
  push/pull sweep (qps 1 and 4, input 1024 and 4096, output 128), 16 requests each. They are
  *live-like*, not live: the per-request figures come from the simulator (seed_push_vs_pull's
  profiles) with deterministic noise added (TTFT +8 %, TPOT +4 %, lognormal jitter), so a twin
  of them has something to be wrong about. One request of pull_qps4_in4096 failed, as a
  server error would show it. Field names and units (seconds) are vllm's.
- `mooncake_trace.jsonl`: 12 requests in Mooncake's trace format (timestamp ms, lengths,
  chained hash ids of 512 tokens), two of them sharing a prefix.
- `live_run/live.db` is recorded by real servers (see live_run/README.md); this script only
  stamps the scenario it ran (scenarios/live_sample_cpu.yaml) into the run's meta, so
  `kvplane twin` needs no --scenario: `make_test_data.py live-scenario`.

    .venv/bin/python tests/data/make_test_data.py            # bench files and trace
    .venv/bin/python tests/data/make_test_data.py live-scenario
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def bench_files() -> None:
    from kvplane.sim.config import load_scenario
    from kvplane.sim.runner import simulate

    base = load_scenario("seed_push_vs_pull")
    sc = base.model_copy(update={
        "requests": 16, "warmup_requests": 0,
        "sweep": base.sweep.model_copy(update={"qps": [1, 4], "input_lens": [1024, 4096]}),
    })
    out = HERE / "vllm_bench"
    out.mkdir(exist_ok=True)
    rng = np.random.default_rng(7)
    for point in sc.points():
        sim, _ = simulate(point)
        done = sorted(sim.done, key=lambda r: r.arrival)
        n = len(done)
        noise = rng.lognormal(0.0, 0.05, size=(n, 2))
        ttft = [(r.first_token - r.arrival) * 1.08 * noise[i, 0] for i, r in enumerate(done)]
        tpot = [(r.finish - r.first_token) / max(r.output - 1, 1) * 1.04 * noise[i, 1]
                for i, r in enumerate(done)]
        lat = [ttft[i] + tpot[i] * (r.output - 1) for i, r in enumerate(done)]
        errors = [""] * n
        if point.label == "pull_qps4_in4096_out128_iter0":
            errors[5] = "HTTP 500: Internal Server Error"
            ttft[5], lat[5] = 0.0, 0.0
        ok = [not e for e in errors]
        okt = [t for t, k in zip(ttft, ok, strict=True) if k]
        okp = [t for t, k in zip(tpot, ok, strict=True) if k]
        okl = [t for t, k in zip(lat, ok, strict=True) if k]
        start0 = 1000.0  # perf_counter seconds, as vllm records them
        result = {
            "date": "20250101-120000", "backend": "vllm", "model_id": "Qwen/Qwen3-32B",
            "num_prompts": n, "request_rate": point.qps, "burstiness": 1.0,
            "max_concurrency": None, "duration": max(r.finish for r in done),
            "completed": sum(ok), "failed": n - sum(ok),
            "total_input_tokens": sum(r.prompt for r in done),
            "total_output_tokens": sum(r.output for r, k in zip(done, ok, strict=True) if k),
            "request_throughput": sum(ok) / max(r.finish for r in done),
            "mean_ttft_ms": float(np.mean(okt) * 1e3),
            "median_ttft_ms": float(np.median(okt) * 1e3),
            "p99_ttft_ms": float(np.percentile(okt, 99) * 1e3),
            "mean_tpot_ms": float(np.mean(okp) * 1e3),
            "median_tpot_ms": float(np.median(okp) * 1e3),
            "p99_tpot_ms": float(np.percentile(okp, 99) * 1e3),
            "mean_e2el_ms": float(np.mean(okl) * 1e3),
            "input_lens": [r.prompt for r in done],
            "output_lens": [r.output if k else 0 for r, k in zip(done, ok, strict=True)],
            "ttfts": [round(t, 6) for t in ttft],
            "itls": [[round(tpot[i], 5)] * (r.output - 1) if ok[i] else []
                     for i, r in enumerate(done)],
            "latencies": [round(t, 6) for t in lat],
            "start_times": [round(start0 + r.arrival, 6) for r in done],
            "errors": errors,
        }
        (out / f"{point.label}.json").write_text(json.dumps(result, separators=(",", ":")))


def trace() -> None:
    rows = []
    t = 0
    for i in range(12):
        n_in = 600 + 300 * (i % 4)
        ids = list(range(100 * i, 100 * i + -(-n_in // 512)))
        if i in (3, 7):  # share the first block with request 0
            ids[0] = 0
        rows.append({"timestamp": t, "input_length": n_in, "output_length": 32 + 8 * (i % 3),
                     "hash_ids": ids})
        t += 250
    (HERE / "mooncake_trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


LIVE_SCENARIO = "live_sample_cpu"


def stamp_live_scenario(db: Path = HERE / "live_run" / "live.db",
                        run_id: str = "live-sample") -> None:
    """Write the bundled scenario the live run ran into its meta (`scenario`, self-contained,
    and `scenario_name`), keeping what the recorder wrote there."""
    from sqlalchemy import update

    from kvplane.sim.config import load_scenario
    from kvplane.store import open_store, runs_table

    scenario = load_scenario(LIVE_SCENARIO).model_dump(mode="json")
    with open_store(f"sqlite:///{db}") as store:
        meta = {**store.run(run_id).meta, "scenario": scenario, "scenario_name": LIVE_SCENARIO}
        with store.engine.begin() as conn:
            conn.execute(update(runs_table).where(runs_table.c.id == run_id).values(meta=meta))
        with store.engine.begin() as conn:  # fold the WAL back into the one file we ship
            conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["live-scenario"]:
        stamp_live_scenario()
    else:
        bench_files()
        trace()
