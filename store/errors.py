"""What the store raises, and why.

Rules kept here:
- An event the schema refuses is an `EventRefused`, a `SchemaError` (so callers that already
  catch the core's schema errors catch it too) that names the batch index and the event type.
- Asking for a run that is not there is `RunNotFound`, also a `LookupError`.
- A background recorder that could not write, or was used after `close()`, raises
  `RecorderError` on the next call its owner makes; it never fails silently.
"""

from __future__ import annotations

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
