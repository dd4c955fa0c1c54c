"""Recorders: where drivers hand their events, one at a time, as they happen.

Rules kept here:
- A `Recorder` has `record(event)`, `flush()` and `close()`. Drivers depend on the protocol
  only, so a unit test passes a `NullRecorder` (keeps nothing) or a `ListRecorder` (keeps
  the events in memory) and a real run passes a `BatchingRecorder`.
- `BatchingRecorder.record` never waits for the database. It checks the event on the
  caller's thread (so a bad event fails where it was made, with `EventRefused`), then puts
  the row on a queue; a background writer thread appends full batches of `batch_size` as soon
  as they are there, and whatever is left once `flush_interval` seconds pass without a full
  batch. Every batch is one `EventStore.append_encoded`, one transaction: a crash loses the
  queued tail, never half a batch.
- `trusted=True` is for a driver whose events the core made (the simulator): `record` makes
  the row with `encoding.encode_trusted_one` (the same row, without checking block ids one
  by one; an unfit event is still `EventRefused` at the call) and appends its fields to a
  flat batch (`encoding.FlatRows`), handed to the writer when full. No object per event
  outlives the call, so the garbage collector does not walk more of the heap than without
  recording (queued rows or events did, about a sixth of recording's cost). What came from
  outside the core (an import, a request over HTTP) is checked where it enters.
- `flush()` returns once everything recorded before it is in the database; `close()` drains
  the queue, stops the writer and is idempotent. A recorder that is never closed is closed at
  interpreter exit.
- If the writer cannot write, it stops; the next `record`, `flush` or `close` raises
  `RecorderError` saying what failed and how many events were not written.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections import deque
from itertools import repeat
from types import TracebackType
from typing import Protocol, Self, cast, runtime_checkable

from ._core import Event, validate
from .encoding import WIDTH, EncodedEvent, FlatRows, encode_event, encode_trusted_one
from .errors import RecorderError
from .event_store import EventStore


@runtime_checkable
class Recorder(Protocol):
    """Where a driver sends every event it produces."""

    def record(self, event: Event) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class NullRecorder:
    """Keeps nothing; the default in unit tests."""

    def record(self, event: Event) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class ListRecorder:
    """Keeps every event in `events`, in order; checks each against the schema by default."""

    def __init__(self, *, check: bool = True) -> None:
        self.events: list[Event] = []
        self._check = check
        self.closed = False

    def record(self, event: Event) -> None:
        if self.closed:
            raise RecorderError("record() on a closed ListRecorder")
        if self._check:
            validate(event)
        self.events.append(event)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def of_type(self, *types: type[Event]) -> list[Event]:
        return [e for e in self.events if isinstance(e, types)]

    def __len__(self) -> int:
        return len(self.events)


_popleft = deque.popleft


class _FlushMark:
    """Put on the queue by `flush()`; set once the writer has written all that came before."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = threading.Event()


class BatchingRecorder:
    """Writes events to an `EventStore` in batches, from a background thread."""

    def __init__(
        self,
        store: EventStore,
        run_id: str,
        *,
        batch_size: int = 2000,
        flush_interval: float = 0.5,
        trusted: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if flush_interval <= 0:
            raise ValueError("flush_interval must be positive")
        store.run(run_id)  # RunNotFound now rather than from the writer thread later
        self.store, self.run_id = store, run_id
        self.batch_size, self.flush_interval = batch_size, flush_interval
        self.trusted = trusted
        # deque.append/popleft are atomic, so record() takes no lock. Rows, or (trusted)
        # whole batches of flat rows, filled under `_batch_lock`.
        self._queue: deque[EncodedEvent | FlatRows | _FlushMark] = deque()
        self._batch = FlatRows()
        self._batch_lock = threading.Lock()
        self._batch_values = batch_size * WIDTH
        if trusted:
            self.record = self._record_trusted  # type: ignore[method-assign]
        self._wake = threading.Event()
        self._stopping = False
        self._closed = False
        self._error: BaseException | None = None
        self._lost = 0
        self._in_flight = 0  # rows of the batch being written right now
        self._marks = 0  # flush marks in the queue: the writer must write up to them
        self._marks_lock = threading.Lock()
        self.written = 0
        self.writer_cpu_s = 0.0  # CPU seconds the writer thread spent, once it has stopped
        self._thread = threading.Thread(
            target=self._run, name=f"kvplane-recorder-{run_id[:8]}", daemon=True
        )
        self._thread.start()
        atexit.register(self.close)

    # --- the caller's side ---

    def record(self, event: Event) -> None:
        """Check the event and queue it; raises `EventRefused` for an unfit event."""
        self._raise_if_unusable()
        self._queue.append(encode_event(event))
        if len(self._queue) >= self.batch_size and not self._wake.is_set():
            self._wake.set()

    def _record_trusted(self, event: Event) -> None:
        """`record` of `trusted=True`: the row's fields onto the batch (see the module)."""
        if self._closed or self._error is not None:
            self._raise_if_unusable()
        row = encode_trusted_one(event)
        with self._batch_lock:
            batch = self._batch
            batch += row
            if len(batch) >= self._batch_values:
                self._queue.append(batch)
                self._batch = FlatRows()
                self._wake.set()

    def _hand_over(self, mark: _FlushMark | None = None) -> None:
        """A trusted recorder's partial batch onto the queue (a flush, the interval), then
        `mark` if given, after it under the same lock."""
        with self._batch_lock:
            if self._batch:
                self._queue.append(self._batch)
                self._batch = FlatRows()
            if mark is not None:
                self._queue.append(mark)

    def flush(self) -> None:
        """Wait until every event recorded so far is in the store."""
        self._raise_if_unusable()
        self._flush()
        self._raise_if_failed()

    def close(self) -> None:
        """Write everything still queued, then stop the writer. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self._error is None:
            self._flush()
        self._stopping = True
        self._wake.set()
        self._thread.join()
        self._raise_if_failed()

    @property
    def pending(self) -> int:
        """Events recorded but not yet written."""
        items = [*list(self._queue), self._batch]
        return sum(item.rows if isinstance(item, FlatRows) else 1
                   for item in items if not isinstance(item, _FlushMark))

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _flush(self) -> None:
        mark = _FlushMark()
        with self._marks_lock:
            self._marks += 1
        self._hand_over(mark)  # a partial batch goes before the mark
        self._wake.set()
        while not mark.done.wait(0.05):
            if not self._thread.is_alive():
                break

    def _raise_if_unusable(self) -> None:
        if self._closed:
            raise RecorderError(f"recorder for run {self.run_id} is closed")
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RecorderError(
                f"recorder for run {self.run_id} stopped writing after {self.written} events "
                f"({self._lost} not written): {self._error!r}"
            ) from self._error

    # --- the writer thread ---

    def _run(self) -> None:
        last_write = time.monotonic()
        try:
            while True:
                woken = self._wake.wait(self.flush_interval)
                self._wake.clear()
                # Full batches always; the rest once the interval has passed without a full
                # batch, when a flush asks for it (a mark in the queue), or when stopping.
                overdue = not woken or time.monotonic() - last_write >= self.flush_interval
                if overdue and self.trusted:
                    self._hand_over()
                if self._drain(everything=overdue or self._stopping):
                    last_write = time.monotonic()
                if self._stopping and not self._queue:
                    return
        except BaseException as exc:  # noqa: BLE001 - kept, and raised on the owner's next call
            self._error = exc
            self._lost = self._in_flight + self.pending
            for item in list(self._queue):
                if isinstance(item, _FlushMark):
                    item.done.set()
        finally:
            self.writer_cpu_s = time.thread_time()

    def _drain(self, *, everything: bool) -> bool:
        """Write what is due; True if anything was written."""
        queue, wrote = self._queue, False
        due = 1 if self.trusted else self.batch_size  # trusted: each item is a whole batch
        while queue and (everything or self._marks or len(queue) >= due):
            # popped in C (no Python step per row); only the writer pops, from the left
            items = list(map(_popleft, repeat(queue, min(len(queue), due))))
            mark: _FlushMark | None = None
            if self._marks:  # a flush is waiting: write up to its mark, put the rest back
                at = next((i for i, x in enumerate(items) if type(x) is _FlushMark), None)
                if at is not None:
                    mark = cast(_FlushMark, items[at])
                    queue.extendleft(reversed(items[at + 1:]))
                    del items[at:]
            if items:
                batch = (cast(FlatRows, items[0]) if self.trusted
                         else cast(list[EncodedEvent], items))
                rows = batch.rows if isinstance(batch, FlatRows) else len(batch)
                self._in_flight = rows
                self.store.append_encoded(self.run_id, batch)
                self.written += rows
                self._in_flight = 0
                wrote = True
            if mark is not None:
                with self._marks_lock:
                    self._marks -= 1
                mark.done.set()
        return wrote
