"""Where prefill's time goes after a D->P reuse read: from the READ's end to the request's end.

Starts one prefill and one decode vLLM server (CPU build, the tiny test model, KvplaneConnector
over real NIXL/UCX) and `kvplane router` in bidirectional mode, and sends conversations whose
turns 2+ read decode's retained KV back into prefill. The servers load
`TracedKvplaneConnector` (this module): KvplaneConnector with the hooks on the reuse read's
path stamped with the wall clock, per vLLM request, into one JSON-lines file per process:

- `fact`: the scheduler process applies the worker's "read done" fact (its side-channel
  thread, or the per-step worker metadata);
- `meta`: `build_connector_meta` hands the request id to the workers as finished
  (vLLM's `schedule()`, the start of an engine step);
- `worker`: the worker's `get_transfer_results` returns it to vLLM (end of that step's
  execute_model, in the worker process);
- `output`: `update_connector_output` sees it in the step's output (vLLM's
  `update_from_output`, back in the engine process): vLLM marks the load finished;
- `alloc`: vLLM schedules the suffix's compute (the second `update_state_after_alloc`);
- the recorded events give the READ's end (`TransferCompleted`, the worker's clock) and
  `PrefillFinished` (prefill's one-token request ends).

Also counted: engine steps (`build_connector_meta` calls) between the READ's end and the
compute. `--turns`, `--conversations`, `--concurrency` shape the load (1: each request alone).

With `--report-in-step` off (`--no-report-in-step`) the connector reports a finished load the
way it did before: only through the next step's metadata and the workers (one engine step
later); on, the default, through the step output in which the scheduler learns of it (see
docs/notes/live-findings.md). Run both and compare within one run of the machine:

    .venv/bin/python benchmarks/live_reuse_gap.py                      # ~2 min
    .venv/bin/python benchmarks/live_reuse_gap.py --no-report-in-step

Timings on a shared 2-core machine vary by a factor of several with its load; nothing here
asserts a duration.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TRACE_ENV = "KVPLANE_BENCH_TRACE"
EARLY_ENV = "KVPLANE_BENCH_REPORT_IN_STEP"


# ---- inside the vLLM processes: the connector with stamped hooks -----------------------------

_LOCK = threading.Lock()
_OUT: list[Any] = []
_INSTANCE: list[str] = []


def _stamp(kind: str, **kw: Any) -> None:
    folder = os.environ.get(TRACE_ENV)
    if not folder:
        return
    with _LOCK:
        if not _OUT:
            _OUT.append(open(Path(folder) / f"trace.{os.getpid()}.jsonl", "a"))  # noqa: SIM115
        inst = _INSTANCE[0] if _INSTANCE else ""
        _OUT[0].write(json.dumps({"k": kind, "t": time.time(), "inst": inst, **kw}) + "\n")
        _OUT[0].flush()


@functools.cache
def _build_traced() -> type:
    from kvplane.live.connector import KvplaneConnector

    base = KvplaneConnector

    class TracedKvplaneConnector(base):  # type: ignore[misc,valid-type]
        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            _INSTANCE[:] = [self.cfg.instance]
            if self.sched is not None:
                self.report_in_step = self.report_in_step and os.environ.get(EARLY_ENV) != "0"
                sched, on_fact = self.sched, self.sched.on_fact

                def traced_on_fact(fact: Any) -> None:
                    on_fact(fact)
                    if fact.kind == "read_done":
                        _stamp("fact", xfer=fact.xfer, at=fact.at, purpose=fact.purpose)

                sched.on_fact = traced_on_fact  # type: ignore[method-assign]

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
            out = super().get_num_new_matched_tokens(request, num_computed_tokens)
            req = self.sched.reqs.get(request.request_id) if self.sched else None
            if req is not None:
                _stamp("match", rid=request.request_id, xfer=req.leg.xfer, n=out[0])
            return out

        def update_state_after_alloc(self, request: Any, blocks: Any, n: int) -> None:
            super().update_state_after_alloc(request, blocks, n)
            _stamp("alloc", rid=request.request_id, n=n)

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            meta = super().build_connector_meta(scheduler_output)
            _stamp("meta", rids=sorted(meta.finished_recving))
            return meta

        def update_connector_output(self, connector_output: Any) -> None:
            super().update_connector_output(connector_output)
            _stamp("output", rids=sorted(connector_output.finished_recving or ()))

        def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
            out = super().get_transfer_results(finished_req_ids)
            if out.finished_recving:
                _stamp("worker", rids=sorted(out.finished_recving))
            return out

    TracedKvplaneConnector.__module__ = __name__
    TracedKvplaneConnector.__qualname__ = "TracedKvplaneConnector"
    return TracedKvplaneConnector


def __getattr__(name: str) -> Any:
    if name == "TracedKvplaneConnector":  # built on first use: vLLM is imported only in its servers
        return _build_traced()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- the driver ---------------------------------------------------------------------------------


def traced_server_class(servers: ModuleType) -> type:
    class TracedServer(servers.VllmServer):  # type: ignore[misc,name-defined]
        def command(self) -> list[str]:
            cmd = list(super().command())
            i = cmd.index("--kv-transfer-config") + 1
            ktc = json.loads(cmd[i])
            ktc["kv_connector"] = "TracedKvplaneConnector"
            ktc["kv_connector_module_path"] = Path(__file__).stem
            cmd[i] = json.dumps(ktc)
            return cmd

    return TracedServer


def analyse(trace_dir: Path, db: Path, run: str, xfers: set[str]) -> dict[str, list[float]]:
    """Per reuse read: milliseconds from the READ's end to each later stamp."""
    rid_of: dict[str, str] = {}
    stamps: list[dict[str, Any]] = []
    for p in trace_dir.glob("trace.*.jsonl"):
        for line in p.read_text().splitlines():
            try:
                s = json.loads(line)
            except json.JSONDecodeError:
                continue
            if s.get("inst") != "prefill":
                continue
            stamps.append(s)
            if s["k"] == "match":
                rid_of[s["rid"]] = s["xfer"]
    stamps.sort(key=lambda s: s["t"])
    with sqlite3.connect(db) as con:
        rows = con.execute(
            "SELECT request, type, time, instance, payload FROM events WHERE run = "
            "(SELECT key FROM runs WHERE id = ?) AND "
            "type IN ('TransferCompleted', 'PrefillFinished', 'PrefillStarted')", (run,))
        ev: dict[str, dict[str, float]] = {}
        for xfer, typ, t, inst, payload in rows:
            if xfer not in xfers or inst != "prefill":
                continue
            if typ == "TransferCompleted" and json.loads(payload).get("direction") != "D->P":
                continue
            ev.setdefault(xfer, {})[typ] = t
    out: dict[str, list[float]] = {k: [] for k in (
        "fact", "meta", "worker", "output", "alloc", "finished", "steps", "plain_prefill")}
    for xfer, e in ev.items():
        if "TransferCompleted" not in e:
            if "PrefillStarted" in e and "PrefillFinished" in e:
                out["plain_prefill"].append((e["PrefillFinished"] - e["PrefillStarted"]) * 1e3)
            continue
        tc = e["TransferCompleted"]
        rids = {r for r, x in rid_of.items() if x == xfer}
        first: dict[str, float] = {}
        steps = 0
        for s in stamps:
            if s["t"] < tc - 0.5:
                continue
            mine = (s.get("xfer") == xfer if s["k"] == "fact"
                    else bool(rids & set(s.get("rids", [])))
                    if s["k"] in ("meta", "worker", "output") else s.get("rid") in rids)
            if s["k"] == "meta" and s["t"] >= tc and "alloc" not in first:
                steps += 1
            if mine and s["k"] not in first and (s["k"] != "alloc" or s["t"] >= tc):
                first[s["k"]] = s["t"]
        for k in ("fact", "meta", "worker", "output", "alloc"):
            if k in first:
                out[k].append((first[k] - tc) * 1e3)
        if "PrefillFinished" in e:
            out["finished"].append((e["PrefillFinished"] - tc) * 1e3)
        out["steps"].append(float(steps))
    return out


def main(argv: list[str] | None = None) -> int:
    import live_pd  # a sibling script: its directory is on sys.path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    live_pd.workload_args(ap, conversations=6, turns=4, first_tokens=100, new_tokens=36,
                          max_tokens=24)
    ap.add_argument("--report-in-step", action=argparse.BooleanOptionalAction, default=True,
                    help="report a finished load in the step output the scheduler learns of "
                         "it in (the connector's way); off: through the next step's workers")
    ap.add_argument("--logs", type=Path, default=None)
    args = ap.parse_args(argv)

    servers = live_pd._load("servers")
    logs = args.logs or Path(tempfile.mkdtemp(prefix="kvplane-reuse-gap-"))
    trace = logs / "trace"
    trace.mkdir(parents=True, exist_ok=True)
    db = (logs / "events.db").resolve()
    run = f"reuse-gap-{uuid.uuid4().hex[:8]}"
    model = live_pd._load("tiny_model").tiny_model_dir()
    cfg = {"kvplane_db": str(db), "kvplane_run": run, "decoder_kv_blocks_ttl": 30.0,
           "kv_recompute_threshold": 64}
    env = {"KVPLANE_HANDLE_KEY": live_pd.HANDLE_KEY, TRACE_ENV: str(trace),
           EARLY_ENV: "1" if args.report_in_step else "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE),
                                                       os.environ.get("PYTHONPATH", "")]))}
    Traced = traced_server_class(servers)
    prefill = Traced("prefill", model, logs, connector=dict(cfg), env=dict(env))
    decode = Traced("decode", model, logs, connector=dict(cfg), env=dict(env))
    print(f"starting prefill and decode (logs in {logs}) ...", flush=True)
    servers.start_all([prefill, decode])
    router = live_pd.Router(prefill, decode, db, run, logs, 30.0)
    try:
        router.start("bidirectional")
        warm = argparse.Namespace(**{**vars(args), "conversations": 1, "concurrency": 1})
        live_pd.run_workload(router.url, warm, f"warm-{run}")  # shapes, handshakes
        time.sleep(0.5)
        results = live_pd.run_workload(router.url, args, f"gap-{run}")
        time.sleep(1.0)  # the recorders write every 0.2 s
    finally:
        router.stop()
        servers.stop_all([prefill, decode])
    out = analyse(trace, db, run, {r.xfer for r in results})

    def row(name: str, xs: list[float]) -> str:
        if not xs:
            return f"  {name:<44} -"
        s = sorted(xs)
        return (f"  {name:<44} n={len(s):3d}  p10 {s[len(s) // 10]:7.1f}  p50 "
                f"{statistics.median(s):7.1f}  p90 {s[min(len(s) - 1, 9 * len(s) // 10)]:7.1f}")

    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"\nreport in step: {args.report_in_step}; load average {' '.join(load)}; "
          f"{len(results)} requests; ms after the READ's end (TransferCompleted):")
    for k, label in (("fact", "fact applied in the scheduler process"),
                     ("meta", "handed to the workers (build_connector_meta)"),
                     ("worker", "worker reports it (get_transfer_results)"),
                     ("output", "vLLM marks it loaded (update_connector_output)"),
                     ("alloc", "suffix scheduled (update_state_after_alloc)"),
                     ("finished", "PrefillFinished")):
        print(row(label, out[k]))
    print(row("engine steps from the READ's end to the compute", out["steps"]))
    print(row("turn 1 (no read): PrefillStarted -> Finished", out["plain_prefill"]))
    ttft = [r.ttft * 1e3 for r in results if r.turn > 1]
    print(row("client TTFT, turns 2+", ttft))
    return 0


if __name__ == "__main__":
    sys.exit(main())
