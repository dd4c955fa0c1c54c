"""Live P/D through the router: TTFT, TPOT and decode's engine-loop time in the connector, per mode.

Starts one prefill and one decode vLLM server (CPU build, the tiny test model, KvplaneConnector
over real NIXL/UCX), then, for each router mode (pull, push, bidirectional), starts
`kvplane router` in front of them, sends the same workload through its OpenAI API, stops the
router, and finally prints a table. The connector speaks both wire modes, so one server pair
serves every mode; the events of everything (router and connectors) go into one run.

The workload: `--conversations` conversations of `--turns` turns, streamed /v1/completions with
token-id prompts, greedy, `--max-tokens` each. Turn 1 is `--first-tokens` random tokens; every
later turn is the whole history (prompts and answers so far) plus `--new-tokens` new ones, so
prompts are a few hundred tokens. Conversations run `--concurrency` at a time, turns in order.
Greedy output does not depend on the mode (checked: the table says whether every mode and round
got the same tokens), so every mode gets exactly the same prompts. Only bidirectional mode
retains decode's KV and reads it back (D->P) for turns 2+. The router's bidirectional mode uses
pull legs (the router has no push-plus-reuse mode), so "bidirectional" here is pull + reuse.

Order effects are large on a CPU: the first requests of a new prompt length are slow (kernels
and allocations for new shapes). So the workload runs `--rounds` times over all modes, the mode
order rotated every round, and the first round is a warm-up that is not counted; each router
start also gets `--warmup` untimed requests (NIXL handshakes). Decode keeps stepping its engine
while it retains blocks, so after a bidirectional round the benchmark waits for the retained
leases (`--lease-ttl`) to end before the next mode starts.

What is measured:
- TTFT: client side, from sending the request to the first streamed chunk carrying a token
  (one HTTP client per thread, made before timing); "t2+" is the mean over turns 2 and later;
  "router p50" is the router's own recorded TTFT (`RequestFinished.ttft`), a cross-check.
  TPOT: (last token chunk - first token chunk) / (tokens - 1). Mean, p50, p90 over requests.
- Decode engine-loop time in the connector: the servers load `TimedKvplaneConnector` (this
  module), KvplaneConnector with every vLLM hook wrapped in a timer; each vLLM process writes
  its totals to a file every 0.2 s, and the benchmark takes the difference over each workload
  window. Hooks run in vLLM's engine loop: the scheduler hooks in the EngineCore process, the
  worker hooks inside the worker's execute_model, which the engine step waits for. Time there
  (including waiting for the connector's lock, which its side-channel thread also takes) is
  time the engine does not step the model. "set-up" is the hooks that prepare a transfer
  (get_num_new_matched_tokens, update_state_after_alloc, build_connector_meta, start_load_kv);
  "all" adds completion handling (update_connector_output, get_transfer_results,
  build_connector_worker_meta, stats) and request_finished (retention). Per request of the
  workload, and per engine step ("steps" = scheduler steps in the window). The NIXL work itself
  (posting and polling READs and WRITEs) runs on the connector's transfer thread, off the engine
  loop, in every mode. Empty steps count too: decode steps while it waits for a push WRITE and
  while it retains blocks (bidirectional), so those modes show more steps.

    .venv/bin/python benchmarks/live_pd.py                        # all three modes, ~2.5 min
    .venv/bin/python benchmarks/live_pd.py --modes pull push --concurrency 2
    .venv/bin/python benchmarks/live_pd.py --db run.db --run my-run   # keep the events

Timings on a 2-core machine say little about GPUs: compare modes within one run, never with a
threshold. Nothing here asserts a duration.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import functools
import importlib.util
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
HOOK_DIR_ENV = "KVPLANE_BENCH_HOOK_TIMES"
HANDLE_KEY = "live-pd-benchmark-handle-key-0123456789"

SETUP_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
               "start_load_kv")
OTHER_HOOKS = ("update_connector_output", "request_finished", "on_new_request",
               "has_pending_push_work", "get_transfer_results", "build_connector_worker_meta",
               "get_kv_connector_stats", "wait_for_layer_load", "save_kv_layer", "wait_for_save")
STEP_HOOK = "build_connector_meta"  # called once per scheduler step


# ---- inside the vLLM processes: the connector with timed hooks ---------------------------------

_TIMES: dict[str, list[float]] = {}  # hook -> [calls, seconds, longest]
_DUMPER: list[threading.Thread] = []


def _dump_loop(path: Path) -> None:
    while True:
        time.sleep(0.2)
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(_TIMES))
            tmp.replace(path)
        except OSError:
            pass


def _timed(name: str, fn: Any) -> Any:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            dt = time.perf_counter() - t
            rec = _TIMES.get(name)
            if rec is None:
                rec = _TIMES[name] = [0, 0.0, 0.0]
            rec[0] += 1
            rec[1] += dt
            rec[2] = max(rec[2], dt)

    wrapper.__name__ = name
    return wrapper


@functools.cache
def _build_timed() -> type:
    from kvplane.live.connector import KvplaneConnector

    methods = {name: _timed(name, getattr(KvplaneConnector, name))
               for name in SETUP_HOOKS + OTHER_HOOKS if hasattr(KvplaneConnector, name)}

    def __init__(self: Any, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        KvplaneConnector.__init__(self, vllm_config, role, kv_cache_config)
        out = os.environ.get(HOOK_DIR_ENV)
        if out and not _DUMPER:
            kind = "scheduler" if self.sched is not None else "worker"
            path = Path(out) / f"{self.cfg.instance}.{kind}.{os.getpid()}.json"
            t = threading.Thread(target=_dump_loop, args=(path,), daemon=True,
                                 name="kvplane-bench-hook-times")
            t.start()
            _DUMPER.append(t)

    cls = type("TimedKvplaneConnector", (KvplaneConnector,), {"__init__": __init__, **methods})
    cls.__module__ = __name__
    return cls


def __getattr__(name: str) -> Any:
    if name == "TimedKvplaneConnector":  # built on first use: vLLM is imported only in its servers
        return _build_timed()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def read_hook_times(folder: Path) -> dict[tuple[str, str], dict[str, list[float]]]:
    """(instance, scheduler|worker) -> hook -> [calls, seconds, longest], summed over pids."""
    out: dict[tuple[str, str], dict[str, list[float]]] = {}
    for p in folder.glob("*.json"):
        instance, kind, _pid, _ = p.name.rsplit(".", 3)
        try:
            data = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        hooks = out.setdefault((instance, kind), {})
        for hook, (calls, secs, longest) in data.items():
            h = hooks.setdefault(hook, [0, 0.0, 0.0])
            h[0] += calls
            h[1] += secs
            h[2] = max(h[2], longest)
    return out


# ---- the benchmark driver ---------------------------------------------------------------------


def _load(name: str) -> ModuleType:
    full = f"kvplane_live_{name}"
    if full not in sys.modules:
        path = ROOT / "tests" / "live" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(full, path)
        assert spec is not None and spec.loader is not None
        sys.modules[full] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[full]


def timed_server_class() -> type:
    servers = _load("servers")

    class TimedServer(servers.VllmServer):  # type: ignore[misc,name-defined]
        def command(self) -> list[str]:
            cmd = list(super().command())
            i = cmd.index("--kv-transfer-config") + 1
            ktc = json.loads(cmd[i])
            ktc["kv_connector"] = "TimedKvplaneConnector"
            ktc["kv_connector_module_path"] = Path(__file__).stem
            cmd[i] = json.dumps(ktc)
            return cmd

    return TimedServer


@dataclass
class Router:
    """`kvplane router` (as `python -m kvplane`, so no console script is needed) in front of
    one prefill/decode pair; shared by the live benchmarks."""

    prefill: Any
    decode: Any
    db: Path
    run: str
    logs: Path
    lease_ttl: float
    handle_key: str = HANDLE_KEY
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, mode: str) -> None:
        import httpx

        self.port = _load("servers").free_port()

        def spec(s: Any) -> str:
            return f"{s.url},id={s.name},side=127.0.0.1:{s.side_port}"

        cmd = [sys.executable, "-m", "kvplane", "router", "--prefill", spec(self.prefill),
               "--decode", spec(self.decode), "--mode", mode, "--port", str(self.port),
               "--db", str(self.db), "--run-id", self.run, "--lease-ttl", str(self.lease_ttl),
               "--log-level", "WARNING"]
        log_path = self.logs / f"router-{self.prefill.name}-{mode}.log"
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "KVPLANE_HANDLE_KEY": self.handle_key},
                                         start_new_session=True)
        deadline = time.monotonic() + 90
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited: see {log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("router not healthy after 90 s")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None


@dataclass
class Result:
    conversation: int
    turn: int
    prompt_tokens: int
    output: list[int]
    ttft: float
    tpot: float
    xfer: str


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


_CLIENTS = threading.local()


def _client() -> Any:
    """One HTTP client per thread, made before any request is timed (building one costs tens of
    milliseconds here: it loads the CA bundle)."""
    import httpx

    c = getattr(_CLIENTS, "client", None)
    if c is None:
        c = _CLIENTS.client = httpx.Client(timeout=300)
    return c


def stream_one(url: str, toks: list[int], max_tokens: int, conversation: str | None
               ) -> tuple[list[int], float, float, str]:
    """One streamed request: (output token ids, TTFT, TPOT, the router's request id)."""
    xfer, ids, ttft, tpot = _load("servers").stream_completion(_client(), url, toks, max_tokens,
                                                               conversation)
    if not ids:
        raise RuntimeError("no tokens streamed")
    return ids, ttft, tpot, xfer


def workload_args(ap: argparse.ArgumentParser, *, conversations: int, turns: int,
                  first_tokens: int, new_tokens: int, max_tokens: int) -> None:
    """The options `run_workload` reads, with a benchmark's own defaults."""
    ap.add_argument("--conversations", type=int, default=conversations)
    ap.add_argument("--turns", type=int, default=turns)
    ap.add_argument("--first-tokens", type=int, default=first_tokens)
    ap.add_argument("--new-tokens", type=int, default=new_tokens)
    ap.add_argument("--max-tokens", type=int, default=max_tokens)
    ap.add_argument("--concurrency", type=int, default=1)


def run_workload(url: str, args: argparse.Namespace, tag: str) -> list[Result]:
    def conversation(c: int) -> list[Result]:
        out, history = [], prompt(10_000 + c, args.first_tokens)
        for turn in range(1, args.turns + 1):
            toks = history if turn == 1 else history + prompt(20_000 + 100 * c + turn,
                                                              args.new_tokens)
            ids, ttft, tpot, xfer = stream_one(url, toks, args.max_tokens, f"{tag}-c{c}")
            out.append(Result(c, turn, len(toks), ids, ttft, tpot, xfer))
            history = toks + ids
        return out

    with cf.ThreadPoolExecutor(args.concurrency) as pool:
        results = [r for f in [pool.submit(conversation, c) for c in range(args.conversations)]
                   for r in f.result()]
    return results


def pct(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100)."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary(xs: list[float]) -> tuple[float, float, float]:
    return sum(xs) / len(xs), pct(xs, 50), pct(xs, 90)


def hook_delta(before: dict[Any, Any], after: dict[Any, Any], key: tuple[str, str]
               ) -> dict[str, tuple[float, float]]:
    """hook -> (calls, seconds) between two snapshots."""
    a, b = after.get(key, {}), before.get(key, {})
    return {h: (v[0] - b.get(h, [0, 0.0])[0], v[1] - b.get(h, [0, 0.0])[1])
            for h, v in a.items()}


@dataclass
class ModeReport:
    mode: str
    results: list[Result] = field(default_factory=list)
    decode_sched: dict[str, tuple[float, float]] = field(default_factory=dict)
    decode_worker: dict[str, tuple[float, float]] = field(default_factory=dict)
    reuse_reads: int = 0
    reused_tokens: int = 0
    router_ttft: list[float] = field(default_factory=list)  # the router's RequestFinished.ttft

    def add_hooks(self, sched: dict[str, tuple[float, float]],
                  worker: dict[str, tuple[float, float]]) -> None:
        for mine, new in ((self.decode_sched, sched), (self.decode_worker, worker)):
            for hook, (calls, secs) in new.items():
                c, t = mine.get(hook, (0, 0.0))
                mine[hook] = (c + calls, t + secs)


def recorded(db: Path, run: str, xfers: set[str]) -> tuple[int, int, list[float]]:
    """From the store: reuse reads and their tokens, and the router's own TTFTs (seconds)."""
    from kvplane.core.events import RequestFinished, ReuseDecided
    from kvplane.store import open_store

    reads = tokens = 0
    ttfts = []
    with open_store(str(db)) as store:
        for e in store.events(run, types=[ReuseDecided, RequestFinished]):
            if e.request not in xfers:
                continue
            if isinstance(e, ReuseDecided) and e.outcome == "read":
                reads += 1
                tokens += e.remote_tokens
            elif isinstance(e, RequestFinished):
                ttfts.append(e.ttft)
    return reads, tokens, ttfts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", default=["pull", "push", "bidirectional"],
                    choices=["pull", "push", "bidirectional"])
    workload_args(ap, conversations=4, turns=3, first_tokens=200, new_tokens=48, max_tokens=32)
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds over all modes, the mode order rotated each round; the first "
                         "round warms up (prompt shapes the CPU kernels have not seen yet) and "
                         "is not counted, unless there is only one")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed requests each time a mode starts (NIXL handshakes)")
    ap.add_argument("--lease-ttl", type=float, default=10.0,
                    help="seconds decode retains a conversation's KV (bidirectional); after a "
                         "bidirectional round the benchmark waits this long, so that no "
                         "retained block (which keeps decode's engine stepping) outlives it")
    ap.add_argument("--db", type=Path, default=None,
                    help="SQLite file for the recorded events (default: in the log folder)")
    ap.add_argument("--run", default=None, help="run id to record under (default: a new one)")
    ap.add_argument("--logs", type=Path, default=None, help="server and router logs")
    args = ap.parse_args(argv)
    longest = args.first_tokens + (args.turns - 1) * (args.new_tokens + args.max_tokens) \
        + args.max_tokens
    if longest > 512:
        ap.error(f"the longest turn needs {longest} tokens; the servers' max-model-len is 512")

    logs = args.logs or Path(tempfile.mkdtemp(prefix="kvplane-live-pd-"))
    logs.mkdir(parents=True, exist_ok=True)
    hooks = logs / "hooks"
    hooks.mkdir(exist_ok=True)
    db = (args.db or logs / "events.db").resolve()
    db.parent.mkdir(parents=True, exist_ok=True)
    run = args.run or f"live-pd-{uuid.uuid4().hex[:8]}"
    servers = _load("servers")
    model = _load("tiny_model").tiny_model_dir()
    cfg = {"kvplane_db": str(db), "kvplane_run": run, "decoder_kv_blocks_ttl": args.lease_ttl}
    env = {"KVPLANE_HANDLE_KEY": HANDLE_KEY, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE),
                                                       os.environ.get("PYTHONPATH", "")])),
           HOOK_DIR_ENV: str(hooks)}
    Timed = timed_server_class()
    prefill = Timed("prefill", model, logs, connector=dict(cfg), env=dict(env))
    decode = Timed("decode", model, logs, connector=dict(cfg), env=dict(env))
    print(f"starting prefill and decode (logs, events and hook times in {logs}) ...",
          flush=True)
    t = time.monotonic()
    servers.start_all([prefill, decode])
    print(f"  ready in {time.monotonic() - t:.0f} s; run {run} in {db}", flush=True)
    router = Router(prefill, decode, db, run, logs, args.lease_ttl)
    reports = {m: ModeReport(m) for m in args.modes}
    outputs: dict[tuple[int, int], set[tuple[int, ...]]] = {}
    try:
        schedule = [(rnd, mode) for rnd in range(args.rounds)
                    for mode in args.modes[rnd % len(args.modes):]
                    + args.modes[:rnd % len(args.modes)]]
        for idx, (rnd, mode) in enumerate(schedule):
            counted = rnd > 0 or args.rounds == 1
            router.start(mode)
            for w in range(args.warmup):
                stream_one(router.url, prompt(90_000 + w, args.first_tokens),
                           args.max_tokens, None)
            time.sleep(0.5)
            before = read_hook_times(hooks)
            t = time.monotonic()
            results = run_workload(router.url, args, f"{mode}-r{rnd}-{run}")
            took = time.monotonic() - t
            time.sleep(0.5)  # the dump threads write every 0.2 s
            after = read_hook_times(hooks)
            router.stop()
            for r in results:
                outputs.setdefault((r.conversation, r.turn), set()).add(tuple(r.output))
            print(f"  round {rnd + 1}/{args.rounds} {mode}: {len(results)} requests in "
                  f"{took:.1f} s{'' if counted else ' (warm-up, not counted)'}", flush=True)
            if counted:
                rep = reports[mode]
                rep.results += results
                rep.add_hooks(hook_delta(before, after, ("decode", "scheduler")),
                              hook_delta(before, after, ("decode", "worker")))
                time.sleep(0.6)  # the connectors' recorders write every 0.2 s
                reads, tokens, ttfts = recorded(db, run, {r.xfer for r in results})
                rep.reuse_reads += reads
                rep.reused_tokens += tokens
                rep.router_ttft += ttfts
            if mode == "bidirectional" and idx + 1 < len(schedule):
                time.sleep(args.lease_ttl + 1.0)  # retained leases end before what's next
    finally:
        router.stop()
        servers.stop_all([prefill, decode])
    same = all(len(v) == 1 for v in outputs.values())
    with sqlite3.connect(db) as con:  # fold the WAL into the file: one self-contained file
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    print_table([reports[m] for m in args.modes], args, same)
    return 0


def print_table(reports: list[ModeReport], args: argparse.Namespace, same_outputs: bool) -> None:
    n = len(reports[0].results) if reports else 0
    print()
    print(f"workload per mode and round: {args.conversations} conversations x {args.turns} "
          f"turns, turn 1 {args.first_tokens} tokens, +{args.new_tokens} new tokens per turn, "
          f"{args.max_tokens} output tokens, concurrency {args.concurrency}; {n} requests "
          f"counted per mode; outputs identical across modes and rounds: {same_outputs}")
    head = (f"{'mode':<14}{'TTFT ms mean':>13}{'p50':>8}{'p90':>8}{'t2+':>7}{'router p50':>11}"
            f"{'TPOT ms mean':>14}{'p50':>7}{'p90':>7}{'dec setup ms/req':>18}"
            f"{'dec all ms/req':>16}{'dec us/step':>13}{'steps':>7}{'reuse reads':>13}")
    print(head)
    print("-" * len(head))
    base: dict[str, float] = {}
    for m in reports:
        nm = max(len(m.results), 1)
        ttft = [r.ttft * 1e3 for r in m.results]
        later = [r.ttft * 1e3 for r in m.results if r.turn > 1]
        tpot = [r.tpot * 1e3 for r in m.results]
        hooks = {**{f"s.{k}": v for k, v in m.decode_sched.items()},
                 **{f"w.{k}": v for k, v in m.decode_worker.items()}}
        setup = sum(v[1] for k, v in hooks.items() if k.split(".", 1)[1] in SETUP_HOOKS)
        total = sum(v[1] for v in hooks.values())
        steps = m.decode_sched.get(STEP_HOOK, (0, 0.0))[0]
        a, p50, p90 = summary(ttft)
        ta, tp50, tp90 = summary(tpot)
        later_mean = sum(later) / len(later) if later else float("nan")
        per_step = total / steps * 1e6 if steps else float("nan")
        rp50 = pct([x * 1e3 for x in m.router_ttft], 50)
        print(f"{m.mode:<14}{a:>13.1f}{p50:>8.1f}{p90:>8.1f}{later_mean:>7.1f}{rp50:>11.1f}"
              f"{ta:>14.2f}"
              f"{tp50:>7.2f}{tp90:>7.2f}{setup / nm * 1e3:>18.3f}{total / nm * 1e3:>16.3f}"
              f"{per_step:>13.1f}{steps:>7}{m.reuse_reads:>6} ({m.reused_tokens} tok)")
        mine = {"TTFT mean": a, "TTFT p50": p50, "TPOT mean": ta, "TPOT p50": tp50,
                "decode set-up": setup / nm}
        if not base:
            base.update(mine)
        else:
            print(f"{'':<14}vs {reports[0].mode}: " + ", ".join(
                f"{k} x{v / base[k]:.2f}" for k, v in mine.items() if base[k]))
    print()
    print("decode hook time by hook (ms per request; s. = scheduler process, w. = worker):")
    names = sorted({f"s.{k}" for m in reports for k in m.decode_sched}
                   | {f"w.{k}" for m in reports for k in m.decode_worker})
    print(f"{'hook':<34}" + "".join(f"{m.mode:>15}" for m in reports))
    for name in names:
        kind, hook = name.split(".", 1)
        row = []
        for m in reports:
            d = m.decode_sched if kind == "s" else m.decode_worker
            row.append(d.get(hook, (0, 0.0))[1] / max(len(m.results), 1) * 1e3)
        print(f"{name:<34}" + "".join(f"{v:>15.3f}" for v in row))


if __name__ == "__main__":
    sys.exit(main())
