"""What the store raises, and why.

Rules kept here:
- An event the schema refuses is an `EventRefused`, a `SchemaError` (so callers that already
  catch the core's schema errors catch it too) that names the batch index and the event type.
- Asking for a run that is not there is `RunNotFound`, also a `LookupError`.
- A background recorder that could not write, or was used after `close()`, raises
  `RecorderError` on the next call its owner makes; it never fails silently.
- What is wrong with a store as a whole gets its own error, with a message a user can act on
  (the CLI prints it as one line): `StoreMissing`, `StoreUnreadable` (corrupt, truncated, not
  SQLite, unreachable), `NotAStore` (another application's database), `StoreTooNew` (written
  by a newer kvplane), `StoreOutdated` (older, for a caller that needs the newest revision: a
  read-only open reads older ones as they are), `StoreReadOnly` (a write through a store opened read-only).
- What is wrong with one run when it is read: `RunTooNew` (recorded under a newer event schema),
  `StoredEventUnreadable` (a payload that is not JSON or does not fit its type; names the run,
  seq and type), `SequenceGap` (seqs missing from a run that should be contiguous).
"""

from __future__ import annotations

from typing import Final

from ._core import KvplaneError, SchemaError


class StoreError(KvplaneError):
    """Base class of the store's own errors (schema refusals are `EventRefused`)."""


class RunNotFound(StoreError, LookupError):
    """No run with this id in the store."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        super().__init__(f"no run {run_id!r} in the store")


class EventRefused(SchemaError):
    """One event of a batch does not fit its schema, so the whole batch was refused."""

    def __init__(self, index: int | None, type_name: str, reason: str) -> None:
        self.index, self.type_name, self.reason = index, type_name, reason
        where = f"event #{index} ({type_name})" if index is not None else f"event {type_name}"
        tail = "; the whole batch was refused, nothing was written" if index is not None else ""
        super().__init__(f"{where} refused: {reason}{tail}")


class RecorderError(StoreError):
    """A batching recorder failed to write, or was used after it was closed."""


class StoreMissing(StoreError):
    """There is no store where one was to be read (never created on a read)."""

    def __init__(self, where: str, detail: str = "") -> None:
        self.where = where
        super().__init__(f"no store at {where}" + (f" ({detail})" if detail else ""))


class StoreUnreadable(StoreError):
    """The store is there but cannot be read: corrupt, truncated, not SQLite, unreachable."""


class NotAStore(StoreError):
    """The database is not a kvplane store (empty, or another application's)."""


class StoreTooNew(StoreError):
    """The store's schema revision is one this kvplane does not know: a newer kvplane made it."""

    def __init__(self, revision: str) -> None:
        self.revision = revision
        super().__init__(
            f"this store was written by a newer kvplane (revision {revision}); upgrade kvplane"
        )


class StoreOutdated(StoreError):
    """An older schema revision, opened read-only, so it cannot be migrated."""

    def __init__(self, where: str, revision: str, head: str) -> None:
        self.revision, self.head = revision, head
        super().__init__(
            f"the store at {where} has the older schema revision {revision} (this kvplane "
            f"reads {head}); open it once with a writing kvplane command to migrate it"
        )


class StoreReadOnly(StoreError):
    """A write was asked of a store opened read-only."""


class RunTooNew(StoreError):
    """A run recorded under a newer event schema than this kvplane's; its events are not read."""

    def __init__(self, run_id: str, version: int, ours: int) -> None:
        self.run_id, self.version, self.ours = run_id, version, ours
        super().__init__(
            f"run {run_id} was recorded with event schema version {version}, newer than this "
            f"kvplane's {ours}; upgrade kvplane to read it"
        )


class StoredEventUnreadable(StoreError, SchemaError):
    """A stored event that cannot be rebuilt: its payload is not JSON or does not fit its type."""

    def __init__(self, run_id: str, seq: int, type_name: str, reason: str) -> None:
        self.run_id, self.seq, self.type_name, self.reason = run_id, seq, type_name, reason
        super().__init__(f"run {run_id}, event seq {seq} ({type_name}): {reason}")


class SequenceGap(StoreError):
    """Events missing from a run: its seqs jump from `first - 1` to `last + 1`."""

    rule: Final = "sequence-gap"

    def __init__(self, run_id: str, first: int, last: int) -> None:
        self.run_id, self.first, self.last = run_id, first, last
        super().__init__(f"run {run_id}: {self.rule}: {self.missing}")

    @property
    def missing(self) -> str:
        if self.first == self.last:
            return f"event {self.first} missing"
        return f"events {self.first}..{self.last} missing"
