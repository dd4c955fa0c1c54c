"""How many events per second the store takes, through the BatchingRecorder, per backend.

Generates push-mode request flows as the simulator would record them (arrival, routing, block
reservations on both sides, registration, rendezvous, one TransferPlanned with block lists of
16 to 128 blocks, a notification per TP rank, completion, first token, finish, frees), then
times `record()` for every event plus the final `close()` (everything written and committed).
Events are built before the clock starts: only the store's cost is measured.

    .venv/bin/python benchmarks/store_write.py                 # 200k events, SQLite + PostgreSQL
    .venv/bin/python benchmarks/store_write.py --events 50000 --pg-url postgresql://...
    .venv/bin/python benchmarks/store_write.py --no-postgres
    .venv/bin/python benchmarks/store_write.py --writers 4     # 4 recorders in 4 processes
    .venv/bin/python benchmarks/store_write.py --trusted       # as the simulator records

`--trusted` records as the simulator does (`BatchingRecorder(trusted=True)`: the events are
queued as they are and checked and encoded on the writer thread); by default each event is
checked and encoded in `record()`, as a live connector's recorder does.

With --writers N, N processes (say N live instances) each record an equal share of the events
into a run of their own, all at once, into one database; events/s is then all events over the
time from the first record() to the last close(), and CPU is summed over the N processes.

Without --pg-url a private PostgreSQL server is started from Debian's binaries, with fsync on
(durable, like a real deployment), and removed afterwards.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

from kvplane.core.events import (
    BlocksFreed,
    BlocksReserved,
    Event,
    FirstTokenEmitted,
    KVReceived,
    NotificationReceived,
    PrefillFinished,
    PrefillStarted,
    RegistrationArrived,
    RegistrationSent,
    RendezvousMatched,
    RequestArrived,
    RequestFinished,
    RequestRouted,
    TransferCompleted,
    TransferPlanned,
)
from kvplane.store import BatchingRecorder, open_store
from kvplane.store.pg_temp import TemporaryPostgres

BLOCK_SIZE = 16
TP = 2


def request_flow(
    i: int, t: float, rng: random.Random, prompt_tokens: tuple[int, int]
) -> list[Event]:
    """The events of one push-mode request, as the simulator records them."""
    r = f"req-{i:07d}"
    p, d = f"prefill-{i % 4}", f"decode-{i % 8}"
    prompt = rng.randint(*prompt_tokens)
    out = rng.randint(32, 512)
    n = -(-prompt // BLOCK_SIZE)
    base = rng.randrange(0, 50_000)
    src = tuple(range(base, base + n))
    dst = tuple(sorted(rng.sample(range(100_000), n)))
    ttft, tpot = rng.uniform(0.05, 0.8), rng.uniform(0.01, 0.05)
    return [
        RequestArrived(at=t, instance="router", request=r, prompt_tokens=prompt,
                       output_tokens=out, conversation=f"c{i // 3}", turn=i % 3),
        RequestRouted(at=t, instance="router", request=r, mode="push", prefill=p, decode=d),
        BlocksReserved(at=t + 0.001, instance=d, request=r, blocks=dst, purpose="remote_kv"),
        RegistrationSent(at=t + 0.001, instance=d, request=r, attempt=0, prefill=p,
                         dst_blocks=dst, num_tokens=prompt, src_tp=TP,
                         expected_notifications=TP, deadline=t + 30.0),
        BlocksReserved(at=t + 0.002, instance=p, request=r, blocks=src, purpose="prefill"),
        PrefillStarted(at=t + 0.002, instance=p, request=r, computed_tokens=prompt),
        RegistrationArrived(at=t + 0.003, instance=p, request=r, attempt=0, decode=d,
                            dst_blocks=dst, dst_tp=TP, dst_block_size=BLOCK_SIZE),
        PrefillFinished(at=t + ttft * 0.8, instance=p, request=r, attempt=0, src_blocks=src,
                        num_tokens=prompt),
        RendezvousMatched(at=t + ttft * 0.8, instance=p, request=r, attempt=0, decode=d,
                          order="registration_first"),
        TransferPlanned(at=t + ttft * 0.8, instance=p, request=r, attempt=0, direction="P->D",
                        src=p, dst=d, src_blocks=src, dst_blocks=dst, num_tokens=prompt,
                        runs=rng.randint(1, n), descriptors=n * 128, bytes=n * 128 * 4096,
                        expected_notifications=TP),
        *[NotificationReceived(at=t + ttft * 0.9, instance=d, request=r, attempt=0,
                               src_rank=k, dst_rank=k) for k in range(TP)],
        TransferCompleted(at=t + ttft * 0.9, instance=p, request=r, attempt=0, direction="P->D"),
        KVReceived(at=t + ttft * 0.9, instance=d, request=r, attempt=0, num_tokens=prompt),
        BlocksFreed(at=t + ttft * 0.9, instance=p, request=r, blocks=src, reason="sent"),
        FirstTokenEmitted(at=t + ttft, instance=d, request=r, ttft=ttft),
        RequestFinished(at=t + ttft + out * tpot, instance=d, request=r, output_tokens=out,
                        ttft=ttft, tpot=tpot, e2e=ttft + out * tpot),
        BlocksFreed(at=t + ttft + out * tpot, instance=d, request=r, blocks=dst,
                    reason="finished"),
    ]  # fmt: skip


def make_events(
    count: int, prompt_tokens: tuple[int, int] = (256, 2048), seed: int = 7
) -> list[Event]:
    rng = random.Random(seed)
    events: list[Event] = []
    i, t = 0, 0.0
    while len(events) < count:
        events += request_flow(i, t, rng, prompt_tokens)
        i, t = i + 1, t + rng.expovariate(20.0)
    return events[:count]


def vars_of(event: Event) -> list[object]:
    return [getattr(event, f.name) for f in fields(event)]


@dataclass
class Result:
    backend: str
    events: int
    record_s: float  # caller's time in record() only
    total_s: float  # record() for all + close(): everything committed
    cpu_s: float  # CPU time of this process (all threads) over total_s
    caller_cpu_s: float = float("nan")  # the recording thread's share (check, encode, queue)
    writer_cpu_s: float = float("nan")  # the recorder's writer thread's share (the inserts)

    @property
    def rate(self) -> float:
        return self.events / self.total_s


def measure(
    backend: str, url: str, events: list[Event], batch_size: int, flush_interval: float,
    trusted: bool = False,
) -> Result:
    store = open_store(url)
    try:
        run_id = store.create_run("sim", "benchmark/store_write", meta={"events": len(events)})
        recorder = BatchingRecorder(
            store, run_id, batch_size=batch_size, flush_interval=flush_interval,
            **({"trusted": True} if trusted else {}),
        )
        record = recorder.record
        cpu_start, caller_start = time.process_time(), time.thread_time()
        start = time.perf_counter()
        for event in events:
            record(event)
        recorded = time.perf_counter()
        recorder.close()
        done = time.perf_counter()
        cpu, caller = time.process_time() - cpu_start, time.thread_time() - caller_start
        stored = store.count(run_id)
        if stored != len(events):
            raise SystemExit(f"{backend}: {stored} events stored, {len(events)} recorded")
        return Result(backend, len(events), recorded - start, done - start, cpu, caller,
                      recorder.writer_cpu_s)
    finally:
        store.close()


def _writer(args: tuple[str, str, list[Event], int, float, object]) -> tuple[float, float]:
    """One of N concurrent recorders: waits at the barrier, records its share, closes.
    Returns (its end time, its CPU seconds)."""
    backend, url, events, batch_size, flush_interval, barrier = args
    store = open_store(url)
    try:
        run_id = store.create_run("sim", "benchmark/store_write", meta={"events": len(events)})
        recorder = BatchingRecorder(store, run_id, batch_size=batch_size,
                                    flush_interval=flush_interval)
        barrier.wait()  # type: ignore[attr-defined]
        cpu = time.process_time()
        for event in events:
            recorder.record(event)
        recorder.close()
        end, cpu = time.time(), time.process_time() - cpu
        if store.count(run_id) != len(events):
            raise SystemExit(f"{backend}: {store.count(run_id)} stored, {len(events)} recorded")
        return end, cpu
    finally:
        store.close()


def measure_concurrent(backend: str, url: str, events: list[Event], writers: int,
                       batch_size: int, flush_interval: float) -> Result:
    """`writers` processes, each recording len(events)/writers events into its own run."""
    import multiprocessing as mp

    open_store(url).close()  # the schema made once, before the writers race to make it
    ctx = mp.get_context("fork")
    share = len(events) // writers
    with ctx.Manager() as manager:
        barrier = manager.Barrier(writers + 1)
        with ctx.Pool(writers) as pool:
            pending = pool.map_async(_writer, [
                (backend, url, events[k * share:(k + 1) * share], batch_size, flush_interval,
                 barrier) for k in range(writers)])
            barrier.wait()
            start = time.time()
            ends = pending.get()
    total = max(end for end, _ in ends) - start
    return Result(f"{backend} x{writers}", share * writers, float("nan"), total,
                  sum(cpu for _, cpu in ends))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--batch-size", type=int, default=2000)
    parser.add_argument("--flush-interval", type=float, default=0.5)
    parser.add_argument("--pg-url", help="use this PostgreSQL database instead of a private one")
    parser.add_argument("--no-postgres", action="store_true")
    parser.add_argument("--repeat", type=int, default=1, help="runs per backend; best is shown")
    parser.add_argument("--trusted", action="store_true",
                        help="record as the simulator does: encoded on the writer thread")
    parser.add_argument("--writers", type=int, default=1,
                        help="concurrent recorders (processes), each into its own run")
    parser.add_argument(
        "--prompt-tokens", type=int, nargs=2, default=(256, 2048), metavar=("MIN", "MAX"),
        help=f"prompt length range; block lists hold prompt/{BLOCK_SIZE} ids",
    )  # fmt: skip
    args = parser.parse_args(argv)

    events = make_events(args.events, tuple(args.prompt_tokens))
    mix = Counter(type(e).__name__ for e in events)
    block_ids = sum(len(v) for e in events for v in vars_of(e) if isinstance(v, tuple))
    print(
        f"{len(events):,} events from {mix['RequestArrived']:,} push-mode requests "
        f"(prompts of {args.prompt_tokens[0]}-{args.prompt_tokens[1]} tokens), {len(mix)} types, "
        f"{block_ids / len(events):.1f} block ids per event on average; "
        f"batch_size={args.batch_size}, flush_interval={args.flush_interval}s"
    )

    targets: list[tuple[str, Callable[[], str]]] = []
    with tempfile.TemporaryDirectory(prefix="kvplane-bench-") as tmp:
        sqlite_n = iter(range(1_000_000))
        targets.append(("SQLite (WAL, synchronous=NORMAL)",
                        lambda: f"sqlite:///{Path(tmp) / f'bench{next(sqlite_n)}.db'}"))  # fmt: skip
        server: TemporaryPostgres | None = None
        if args.pg_url:
            targets.append(("PostgreSQL (given URL)", lambda: str(args.pg_url)))
        elif not args.no_postgres:
            server = TemporaryPostgres(durable=True).start()
            pg = server
            targets.append(("PostgreSQL (private, fsync on)", lambda: pg.create_database()))
        try:
            results = []
            for name, make_url in targets:
                if args.writers > 1:
                    url = make_url()
                    tries = [measure_concurrent(name, url, events, args.writers,
                                                args.batch_size, args.flush_interval)
                             for _ in range(args.repeat)]
                else:
                    tries = [
                        measure(name, make_url(), events, args.batch_size, args.flush_interval,
                                args.trusted)
                        for _ in range(args.repeat)
                    ]
                results.append(min(tries, key=lambda r: r.total_s))
        finally:
            if server is not None:
                server.stop()

    header = (
        f"{'backend':<34} {'events':>9} {'record() s':>11} {'total s':>9} {'events/s':>10}"
        f" {'our CPU s':>10} {'events/CPU-s':>13}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r.backend:<34} {r.events:>9,} {r.record_s:>11.2f} {r.total_s:>9.2f} "
              f"{r.rate:>10,.0f} {r.cpu_s:>10.2f} {r.events / r.cpu_s:>13,.0f}")  # fmt: skip
    print(
        "total = every record() call plus close(), i.e. all rows committed; events/s = events"
        " / total.\nour CPU = this process's CPU time, both threads (not the PostgreSQL server's)."
    )
    for r in results:
        if r.caller_cpu_s == r.caller_cpu_s:  # not NaN: one recorder, threads measured apart
            caller, writer = r.events / r.caller_cpu_s, r.events / r.writer_cpu_s
            print(f"{r.backend}: the recording thread {caller:,.0f} events/CPU-s, the writer "
                  f"thread {writer:,.0f}: on two free cores (they run in parallel; the driver lets "
                  f"go of the GIL) about {min(caller, writer):,.0f} events/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
