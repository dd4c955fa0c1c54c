"""Recording a live instance's events without ever stalling its engine loop.

How it works:
- `open_recorder(url, run_id, ...)` opens the event store (SQLite file or PostgreSQL), makes sure
  the run exists (every instance of one deployment files its events under one run; whichever
  instance comes first creates it, the others find it) and wraps a `BatchingRecorder`: `record`
  checks the event and appends it to an in-memory queue, a background thread writes batches.
- `SafeRecorder` sits in front: a failing store (disk full, database gone, a bad event) is
  logged once and counted, and from then on events are dropped. An engine loop must never die
  or wait because the log could not be written; the loss is visible in `dropped` and the log.
- No URL: a `NullRecorder` (nothing recorded), so a connector without a configured store costs
  nothing.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from kvplane.core.events import Event
from kvplane.store import (
    BatchingRecorder,
    NullRecorder,
    Recorder,
    RunNotFound,
    StoreError,
    open_store,
)

logger = logging.getLogger(__name__)


class SafeRecorder:
    """Forwards to `inner`; never raises into the caller."""

    def __init__(self, inner: Recorder, name: str = "") -> None:
        self.inner = inner
        self.name = name
        self.recorded = 0
        self.dropped = 0
        self._failed: BaseException | None = None
        self._lock = threading.Lock()

    def record(self, event: Event) -> None:
        if self._failed is not None:
            self.dropped += 1
            return
        try:
            self.inner.record(event)
            self.recorded += 1
        except Exception as exc:  # noqa: BLE001 - the engine loop must go on
            self._fail(exc)
            self.dropped += 1

    def record_all(self, events: list[Event]) -> None:
        for e in events:
            self.record(e)

    def flush(self) -> None:
        if self._failed is not None:
            return
        try:
            self.inner.flush()
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def close(self) -> None:
        try:
            self.inner.close()
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._failed is None:
                self._failed = exc
                logger.error("kvplane recorder %s stopped recording (events are dropped from "
                             "now on): %r", self.name, exc)


def ensure_run(store: Any, run_id: str, scenario: str, meta: dict[str, Any]) -> str:
    """The run `run_id` (created if missing; another instance may create it at the same time)."""
    try:
        store.run(run_id)
        return run_id
    except RunNotFound:
        pass
    try:
        return str(store.create_run("live", scenario, meta=meta, run_id=run_id))
    except Exception:  # noqa: BLE001 - most likely another instance created it first
        store.run(run_id)  # raises RunNotFound if that was not it
        return run_id


def open_recorder(url: str, run_id: str, *, instance: str, scenario: str = "live",
                  meta: dict[str, Any] | None = None) -> SafeRecorder:
    """A recorder for this instance; a `NullRecorder` inside when `url` is empty or the store
    cannot be opened (logged)."""
    if not url:
        return SafeRecorder(NullRecorder(), instance)
    try:
        store = open_store(url)
        run = ensure_run(store, run_id, scenario, dict(meta or {}))
        rec = BatchingRecorder(store, run, batch_size=256, flush_interval=0.2)
    except (StoreError, Exception) as exc:  # noqa: BLE001 - never keep an engine from starting
        logger.error("kvplane: cannot open the event store %s (run %s): %r; recording "
                     "nothing", url, run_id, exc)
        return SafeRecorder(NullRecorder(), instance)
    logger.info("kvplane: recording %s's events to %s, run %s", instance, url, run)
    return SafeRecorder(rec, instance)
