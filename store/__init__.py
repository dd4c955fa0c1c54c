"""kvplane.store: the event store (SQLite by default, PostgreSQL for shared deployments).

Write side: `open_store(url)` -> `EventStore` (`create_run`, `append`, `events`, `count`, ...)
and the recorders drivers feed (`NullRecorder`, `ListRecorder`, `BatchingRecorder`).
Commands that only read use `open_store(url, read_only=True)`; the errors in `errors.py` say
what is wrong with a store (missing, damaged, foreign, newer) or with a run being read.
Read side for aggregate SQL: `EventStore.engine` with `runs_table` and `events_table`;
`events.run` is the run's integer `runs.key` (revision 0004), so a read picks a run's events
with `events_of(engine, run_id)` / `events_of_runs` and names a row's run with `run_id_of`.
"""

from __future__ import annotations

from .encoding import (
    EncodedEvent,
    block_count,
    encode_batch,
    encode_event,
    merge_lists,
    payload_of,
)
from .engine import DEFAULT_URL, ENV_VAR, make_engine, resolve_url
from .errors import (
    EventRefused,
    NotAStore,
    RecorderError,
    RunNotFound,
    RunTooNew,
    SequenceGap,
    StoredEventUnreadable,
    StoreError,
    StoreMissing,
    StoreOutdated,
    StoreReadOnly,
    StoreTooNew,
    StoreUnreadable,
)
from .event_store import EventStore, RunInfo, open_store
from .migrate import (
    all_types,
    by_type,
    current_revision,
    events_of,
    events_of_runs,
    fresh_rollups,
    has_block_counts,
    has_packed_lists,
    has_rollups,
    has_run_keys,
    head_revision,
    model_drift,
    run_id_of,
    run_ref,
    upgrade,
)
from .recorders import BatchingRecorder, ListRecorder, NullRecorder, Recorder
from .schema import (
    RUN_KINDS,
    EventRow,
    RollupRow,
    RunKind,
    RunRow,
    events_table,
    metadata,
    rollups_table,
    runs_table,
)

__all__ = [
    "DEFAULT_URL",
    "ENV_VAR",
    "RUN_KINDS",
    "BatchingRecorder",
    "EncodedEvent",
    "EventRefused",
    "EventRow",
    "EventStore",
    "ListRecorder",
    "NotAStore",
    "NullRecorder",
    "Recorder",
    "RecorderError",
    "RollupRow",
    "RunInfo",
    "RunKind",
    "RunNotFound",
    "RunRow",
    "RunTooNew",
    "SequenceGap",
    "StoreError",
    "StoreMissing",
    "StoreOutdated",
    "StoreReadOnly",
    "StoreTooNew",
    "StoreUnreadable",
    "StoredEventUnreadable",
    "all_types",
    "block_count",
    "by_type",
    "current_revision",
    "encode_batch",
    "encode_event",
    "events_of",
    "events_of_runs",
    "events_table",
    "fresh_rollups",
    "has_block_counts",
    "has_packed_lists",
    "has_rollups",
    "has_run_keys",
    "head_revision",
    "make_engine",
    "merge_lists",
    "metadata",
    "model_drift",
    "open_store",
    "payload_of",
    "resolve_url",
    "rollups_table",
    "run_id_of",
    "run_ref",
    "runs_table",
    "upgrade",
]
