"""Recorders: the null and list recorders, and the batching recorder against every backend,
including a writer killed with SIGKILL in the middle of its batches."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import text
from store_samples import every_type_samples

from kvplane.core.errors import SchemaError
from kvplane.core.events import BlocksReserved, Event, RequestArrived
from kvplane.store import (
    BatchingRecorder,
    EventRefused,
    EventStore,
    ListRecorder,
    NullRecorder,
    Recorder,
    RecorderError,
    RunNotFound,
    open_store,
)

HERE = Path(__file__).resolve().parent


def blocks(i: int) -> BlocksReserved:
    return BlocksReserved(at=float(i), instance="p0", request=f"r{i % 7}", blocks=(i, i + 1),
                          purpose="prefill")  # fmt: skip


def bad_event() -> Event:
    return BlocksReserved(at=1.0, instance="p0", blocks=(1,), purpose="nope")  # type: ignore[arg-type]


# --- null and list -----------------------------------------------------------------------------


def test_null_and_list_recorders() -> None:
    null, kept = NullRecorder(), ListRecorder()
    for recorder in (null, kept):
        assert isinstance(recorder, Recorder)
    samples = every_type_samples(1)
    for event in samples:
        null.record(event)
        kept.record(event)
    null.flush(), null.close(), kept.flush()
    assert kept.events == samples and len(kept) == len(samples)
    assert kept.of_type(RequestArrived) == [e for e in samples if isinstance(e, RequestArrived)]
    with pytest.raises(SchemaError):
        kept.record(bad_event())
    assert len(kept) == len(samples)
    kept.close()
    with pytest.raises(RecorderError):
        kept.record(samples[0])
    unchecked = ListRecorder(check=False)
    unchecked.record(bad_event())
    assert len(unchecked) == 1


# --- batching, on every backend -------------------------------------------------------------

# Checking at the call (live connectors) and trusted (the simulator: flat batches).
both_ways = pytest.mark.parametrize("trusted", [False, True], ids=["checked", "trusted"])


@both_ways
def test_batching_recorder_drains_everything_on_close(store: EventStore, trusted: bool) -> None:
    run = store.create_run("sim", "drain")
    recorder = BatchingRecorder(store, run, batch_size=256, flush_interval=30,
                                 trusted=trusted)
    assert isinstance(recorder, Recorder)
    events = [blocks(i) for i in range(10_007)]  # not a multiple of the batch size
    for event in events:
        recorder.record(event)
    recorder.close()
    recorder.close()  # idempotent
    assert recorder.written == len(events) and recorder.pending == 0
    assert store.count(run) == len(events)
    assert list(store.events(run)) == events
    with pytest.raises(RecorderError, match="closed"):
        recorder.record(events[0])


@both_ways
def test_batching_recorder_flush_makes_events_visible(store: EventStore, trusted: bool) -> None:
    run = store.create_run("sim", "flush")
    with BatchingRecorder(store, run, batch_size=1000, flush_interval=30,
                                 trusted=trusted) as recorder:
        for i in range(10):
            recorder.record(blocks(i))
        recorder.flush()
        assert store.count(run) == 10
        recorder.flush()  # nothing new: still fine
        recorder.record(blocks(10))
    assert store.count(run) == 11


@both_ways
def test_a_flush_amid_full_batches_writes_up_to_its_mark_in_order(store: EventStore,
                                                                 trusted: bool) -> None:
    """The writer pops a batch at a time; a flush's mark inside one is where it stops, and
    what came after the mark is written next, in order."""
    run = store.create_run("sim", "marks")
    events = [blocks(i) for i in range(5_000)]
    with BatchingRecorder(store, run, batch_size=700, flush_interval=30,
                          trusted=trusted) as recorder:
        recorded = 0
        for cut in (1_234, 1_235, 3_001, 5_000):
            for event in events[recorded:cut]:
                recorder.record(event)
            recorded = cut
            recorder.flush()
            assert store.count(run) == recorded
    assert list(store.events(run)) == events


def test_flushes_while_another_thread_records(store: EventStore) -> None:
    """A flush returns once all recorded before it is written, though events recorded after
    its mark share the writer's batch (they are put back and written next)."""
    run = store.create_run("sim", "marks2")
    events = [blocks(i) for i in range(20_000)]
    done = threading.Event()
    recorded = [0]
    with BatchingRecorder(store, run, batch_size=500, flush_interval=30) as recorder:
        def produce() -> None:
            for event in events:
                recorder.record(event)
                recorded[0] += 1
            done.set()

        producer = threading.Thread(target=produce)
        producer.start()
        flushes = 0
        while not done.is_set() or flushes == 0:
            before = recorded[0]
            recorder.flush()
            assert store.count(run) >= before
            flushes += 1
        producer.join()
    assert list(store.events(run)) == events


@both_ways
def test_batching_recorder_writes_partial_batches_after_the_interval(store: EventStore,
                                                                    trusted: bool) -> None:
    run = store.create_run("sim", "interval")
    with BatchingRecorder(store, run, batch_size=1000, flush_interval=0.05,
                           trusted=trusted) as recorder:
        for i in range(3):
            recorder.record(blocks(i))
        deadline = time.monotonic() + 10
        while store.count(run) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert store.count(run) == 3


def test_batching_recorder_many_producer_threads(store: EventStore) -> None:
    run = store.create_run("live", "threads")
    with BatchingRecorder(store, run, batch_size=100, flush_interval=0.05) as recorder:

        def produce(k: int) -> None:
            for i in range(1000):
                recorder.record(blocks(10_000 * k + i))

        threads = [threading.Thread(target=produce, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    got = [int(e.at) for e in store.events(run)]
    assert sorted(got) == sorted(10_000 * k + i for k in range(4) for i in range(1000))
    for k in range(4):  # each producer's events stay in its own order
        mine = [a for a in got if a // 10_000 == k]
        assert mine == sorted(mine)


def test_batching_recorder_refuses_bad_events_at_the_call(store: EventStore) -> None:
    run = store.create_run("sim", "bad")
    with BatchingRecorder(store, run, batch_size=4, flush_interval=30) as recorder:
        recorder.record(blocks(0))
        with pytest.raises(EventRefused, match="purpose"):
            recorder.record(bad_event())
        recorder.record(blocks(1))
    assert list(store.events(run)) == [blocks(0), blocks(1)]


def test_a_trusted_recorder_writes_the_same_rows(store: EventStore) -> None:
    """`trusted=True` (the simulator's events) batches rows flat, checked but for block ids:
    the stored rows are byte for byte those of the checking recorder, and read back alike."""
    events = every_type_samples(3) + [
        BlocksReserved(at=2.0, instance="d0", request="r", blocks=ids, purpose="decode")
        for ids in (tuple(range(5000, 6024)), tuple(range(9000, 8000, -1)),
                    (*range(100, 400), *range(70_000, 70_500)), (3,), ())]
    runs = []
    for trusted in (False, True):
        run = store.create_run("sim", f"trusted={trusted}")
        with BatchingRecorder(store, run, batch_size=7, trusted=trusted) as recorder:
            for event in events:
                recorder.record(event)
        assert list(store.events(run)) == events
        runs.append(run)
    query = text("SELECT seq, time, type, request, instance, blocks, payload, lists "
                 "FROM events WHERE run = (SELECT key FROM runs WHERE id = :run) ORDER BY seq")
    with store.engine.connect() as conn:
        checked, trusted = (conn.execute(query, {"run": r}).all() for r in runs)
    assert checked == trusted and len(checked) == len(events)


def test_a_trusted_recorder_still_refuses_an_unfit_event_at_the_call(store: EventStore) -> None:
    """Trusted skips only the per-id check of block lists: an event the core would refuse is
    still `EventRefused` where it was recorded, and the rest is written."""
    run = store.create_run("sim", "trusted-bad")
    with BatchingRecorder(store, run, batch_size=3, flush_interval=30, trusted=True) as recorder:
        for i in range(4):
            recorder.record(blocks(i))
        with pytest.raises(EventRefused, match="purpose"):
            recorder.record(bad_event())
        with pytest.raises(EventRefused, match="blocks"):
            recorder.record(BlocksReserved(at=1.0, instance="p0", blocks=(*range(40), 2.5),  # type: ignore[arg-type]
                                           purpose="prefill"))
        recorder.record(blocks(4))
    assert list(store.events(run)) == [blocks(i) for i in range(5)]


def test_batching_recorder_needs_a_real_run(store: EventStore) -> None:
    with pytest.raises(RunNotFound):
        BatchingRecorder(store, "no-such-run")
    run = store.create_run("sim", "args")
    with pytest.raises(ValueError):
        BatchingRecorder(store, run, batch_size=0)


@both_ways
def test_batching_recorder_reports_a_failed_writer(store: EventStore, trusted: bool) -> None:
    run = store.create_run("sim", "doomed")
    recorder = BatchingRecorder(store, run, batch_size=10, flush_interval=30, trusted=trusted)
    recorder.record(blocks(0))
    recorder.flush()
    store.delete_run(run)  # the writer's next batch has no run to go to
    for i in range(25):
        recorder.record(blocks(i))
    deadline = time.monotonic() + 10
    while recorder._thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(RecorderError, match=r"after 1 events \(25 not written\)"):
        recorder.record(blocks(99))
    with pytest.raises(RecorderError):
        recorder.close()


# --- a writer killed mid-batch ---------------------------------------------------------------


def test_writer_killed_mid_batch_leaves_only_whole_batches(store_url: str) -> None:
    batch_size = 500
    setup = open_store(store_url)
    run = setup.create_run("live", "crash")
    setup.close()
    child = subprocess.Popen(
        [sys.executable, str(HERE / "crash_writer.py"), store_url, run, str(batch_size)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.strip() == "started", child.stderr.read() if child.stderr else ""
        time.sleep(0.7)  # let it get well into later batches
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL

    reopened = open_store(store_url)
    try:
        count = reopened.count(run)
        assert count > 0 and count % batch_size == 0, count
        events = list(reopened.events(run))
        assert [int(e.at) for e in events] == list(range(count))
        # The run still takes new batches, numbered on from the last whole one.
        assert reopened.append(run, [blocks(0)]) == range(count, count + 1)
        if reopened.engine.dialect.name == "sqlite":
            with reopened.engine.connect() as conn:
                assert conn.execute(text("PRAGMA integrity_check")).scalar_one() == "ok"
    finally:
        reopened.close()


def test_a_recorder_never_closed_is_drained_at_exit(store_url: str) -> None:
    setup = open_store(store_url)
    run = setup.create_run("sim", "forgotten")
    setup.close()
    script = (
        "import sys\n"
        "from kvplane.core.events import BlocksReserved\n"
        "from kvplane.store import BatchingRecorder, open_store\n"
        "r = BatchingRecorder(open_store(sys.argv[1]), sys.argv[2], batch_size=64,"
        " flush_interval=3600)\n"
        "for i in range(1000):\n"
        "    r.record(BlocksReserved(at=i, instance='p', blocks=(i,), purpose='reuse'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, store_url, run],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with open_store(store_url) as reopened:
        assert reopened.count(run) == 1000
