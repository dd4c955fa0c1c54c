"""Every fact the protocol records, as frozen, slotted, past-tense dataclasses.

Rules kept here:
- An event is immutable and carries when it happened (`at`, seconds on the driver's clock), the
  instance that decided or observed it, and the request it concerns (if any). The run it
  belongs to is the store's business: a recorder files events under a run.
- `EVENT_TYPES` is the closed list of event types; `encode` turns an event into
  `(type name, payload dict)` of plain JSON values and `decode` turns it back, validating every
  field against the dataclass annotations. Anything unknown or ill-typed is a `SchemaError`.
- `SCHEMA_VERSION` changes whenever a field is added, removed or changes meaning.

Two families live here: *decisions* made by the state machines of the core, and
*observations* reported by a driver (a request arrived, a first token left) that the core does
not decide but the timeline and replay need.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, Union

from .errors import SchemaError

SCHEMA_VERSION = 4
# 2: RegistrationArrived.deadline, SessionStored.block_size
# 3: RegistrationDropped.final, LeaseUnpinned.timed_out, ReuseDecided outcome "invalid"
# 4: KVReceived.src_ranks / dst_ranks (the notifications that completed the wait, folded in),
#    DecodeBlocksReserved (a decode macro-step's growth of several requests in one event)

Blocks = tuple[int, ...]
Direction = Literal["P->D", "D->P"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    at: float
    instance: str
    request: str | None = None


# --- observations (reported by drivers) -------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestArrived(Event):
    prompt_tokens: int
    output_tokens: int
    conversation: str | None = None
    tenant: str = "default"
    turn: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestRouted(Event):
    mode: Literal["push", "pull"]
    prefill: str
    decode: str
    bidirectional: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillStarted(Event):
    computed_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class FirstTokenEmitted(Event):
    ttft: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestFinished(Event):
    output_tokens: int
    ttft: float
    tpot: float
    e2e: float
    ok: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStalled(Event):
    """The engine loop spent `seconds` on KV transfer set-up instead of model steps."""

    seconds: float
    cause: str


# --- block ledger -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class BlocksReserved(Event):
    attempt: int = 0
    blocks: Blocks
    purpose: Literal["prefill", "remote_kv", "reuse", "decode"]


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeBlocksReserved(Event):
    """Several requests' new output blocks, reserved on one decode instance at one instant (a
    decode macro-step's growth): the `BlocksReserved(purpose="decode")` of each, in one event
    (`each`), so that a run records a row per macro-step, not per request and macro-step.
    `requests[i]`, attempt `attempts[i]`, took `counts[i]` blocks: the next ones of `blocks`
    (every request's new blocks, in the requests' order). `request` is None."""

    requests: tuple[str, ...]
    attempts: tuple[int, ...]
    counts: tuple[int, ...]
    blocks: Blocks

    def parts(self) -> Iterator[tuple[str, int, Blocks]]:
        """(request, attempt, its new blocks) of each request, in order; `SchemaError` if the
        lists disagree (a damaged event)."""
        n, counts = len(self.requests), self.counts
        if len(self.attempts) != n or len(counts) != n or sum(counts) != len(
                self.blocks) or min(counts, default=0) < 0:
            raise SchemaError(f"DecodeBlocksReserved: {n} requests, {len(self.attempts)} "
                              f"attempts, counts {list(counts)[:8]} for {len(self.blocks)} "
                              "blocks")
        start, blocks = 0, self.blocks
        for request, attempt, count in zip(self.requests, self.attempts, counts, strict=True):
            yield request, attempt, blocks[start:start + count]
            start += count

    def each(self) -> Iterator[BlocksReserved]:
        """The `BlocksReserved` of each request, in order (`parts` as events)."""
        for request, attempt, blocks in self.parts():
            yield BlocksReserved(at=self.at, instance=self.instance, request=request,
                                 attempt=attempt, blocks=blocks, purpose="decode")


@dataclass(frozen=True, slots=True, kw_only=True)
class BlocksFreed(Event):
    attempt: int = 0
    blocks: Blocks
    reason: str


# --- push: registration and rendezvous (prefill side) ------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RegistrationSent(Event):
    attempt: int
    prefill: str
    dst_blocks: Blocks
    num_tokens: int
    src_tp: int
    expected_notifications: int
    deadline: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RegistrationArrived(Event):
    attempt: int
    decode: str
    dst_blocks: Blocks
    dst_tp: int
    dst_block_size: int
    deadline: float | None = None  # decode gives up waiting at this time (its RegistrationSent)


@dataclass(frozen=True, slots=True, kw_only=True)
class RegistrationDropped(Event):
    attempt: int
    reason: str
    # True: this registration will never be served, so decode must stop waiting (and is told).
    # False: a duplicate of a registration that still stands; decode's wait goes on.
    final: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillFinished(Event):
    attempt: int
    src_blocks: Blocks
    num_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RendezvousMatched(Event):
    attempt: int
    decode: str
    order: Literal["registration_first", "prefill_first"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestAborted(Event):
    attempt: int
    phase: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestPreempted(Event):
    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestReissued(Event):
    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class HoldTimedOut(Event):
    attempt: int
    waited: float


# --- transfers (both directions, both modes) ---------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferPlanned(Event):
    attempt: int
    direction: Direction
    src: str
    dst: str
    src_blocks: Blocks
    dst_blocks: Blocks
    num_tokens: int
    runs: int
    descriptors: int
    bytes: int
    expected_notifications: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferCompleted(Event):
    attempt: int
    direction: Direction


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferFailed(Event):
    attempt: int
    direction: Direction
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class NotificationReceived(Event):
    attempt: int
    src_rank: int
    dst_rank: int
    duplicate: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class KVReceived(Event):
    attempt: int
    num_tokens: int
    # A push: the completion notifications that arrived with this one and ended the wait, one
    # per stream (`src_ranks[i]` -> `dst_ranks[i]`), each a `NotificationReceived` folded in
    # (not a duplicate, at this time). Empty: each was recorded as its own event, or a pull.
    src_ranks: tuple[int, ...] = ()
    dst_ranks: tuple[int, ...] = ()

    def notified(self) -> list[tuple[int, int]]:
        """The (src_rank, dst_rank) streams folded in; `SchemaError` if the lists disagree."""
        if len(self.src_ranks) != len(self.dst_ranks):
            raise SchemaError(f"KVReceived: {len(self.src_ranks)} src_ranks for "
                              f"{len(self.dst_ranks)} dst_ranks")
        return list(zip(self.src_ranks, self.dst_ranks, strict=True))


@dataclass(frozen=True, slots=True, kw_only=True)
class KVLoadFailed(Event):
    attempt: int
    reason: str


# --- pull ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class MetadataRelayed(Event):
    attempt: int
    prefill: str
    decode: str
    src_blocks: Blocks
    num_tokens: int


# --- leases on held or retained blocks ---------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseGranted(Event):
    attempt: int = 0
    lease: str
    blocks: Blocks
    num_tokens: int
    block_hashes: tuple[str, ...]
    expires_at: float
    renewable: bool
    purpose: Literal["retained", "pull_hold"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseRenewed(Event):
    lease: str
    expires_at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseRenewalRefused(Event):
    lease: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class LeasePinned(Event):
    lease: str
    reader: str
    until: float


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseUnpinned(Event):
    lease: str
    reader: str
    timed_out: bool = False  # the reader never ended its read: the pin ran past its bound


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadRefused(Event):
    lease: str
    reader: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseReleaseDeferred(Event):
    """A release asked for while a read holds the lease: it takes effect when the read ends."""

    lease: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseExpired(Event):
    lease: str


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseReleased(Event):
    lease: str
    reason: str


# --- reuse decision (prefill side, bidirectional) ----------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ReuseDecided(Event):
    lease: str | None
    outcome: Literal["read", "recompute", "miss", "mismatch", "expired", "refused", "invalid"]
    prompt_tokens: int
    local_hit_tokens: int
    matched_tokens: int
    remote_tokens: int
    threshold: int


# --- router session table ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionStored(Event):
    tenant: str
    conversation: str
    decode: str
    lease: str
    num_tokens: int
    block_hashes: tuple[str, ...]
    expires_at: float
    block_size: int | None = None  # tokens per hashed block; None: the table's default


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionTaken(Event):
    tenant: str
    conversation: str
    lease: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionMissed(Event):
    tenant: str
    conversation: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionDropped(Event):
    tenant: str
    conversation: str
    lease: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionRenewed(Event):
    tenant: str
    conversation: str
    lease: str
    expires_at: float


EVENT_TYPES: dict[str, type[Event]] = {
    cls.__name__: cls
    for cls in (
        RequestArrived,
        RequestRouted,
        PrefillStarted,
        FirstTokenEmitted,
        RequestFinished,
        EngineStalled,
        BlocksReserved,
        DecodeBlocksReserved,
        BlocksFreed,
        RegistrationSent,
        RegistrationArrived,
        RegistrationDropped,
        PrefillFinished,
        RendezvousMatched,
        RequestAborted,
        RequestPreempted,
        RequestReissued,
        HoldTimedOut,
        TransferPlanned,
        TransferCompleted,
        TransferFailed,
        NotificationReceived,
        KVReceived,
        KVLoadFailed,
        MetadataRelayed,
        LeaseGranted,
        LeaseRenewed,
        LeaseRenewalRefused,
        LeasePinned,
        LeaseUnpinned,
        ReadRefused,
        LeaseReleaseDeferred,
        LeaseExpired,
        LeaseReleased,
        ReuseDecided,
        SessionStored,
        SessionTaken,
        SessionMissed,
        SessionDropped,
        SessionRenewed,
    )
}

_COMMON = ("at", "instance", "request")


def expand(events: Iterable[Event]) -> Iterator[Event]:
    """The events with those folded into others as their own again, as schema 3 recorded
    them: a `DecodeBlocksReserved` as its requests' `BlocksReserved`, a `KVReceived`'s
    notifications as a `NotificationReceived` each, just before it (and it without them)."""
    for e in events:
        if isinstance(e, DecodeBlocksReserved):
            yield from e.each()
        elif isinstance(e, KVReceived) and e.src_ranks:
            for src, dst in e.notified():
                yield NotificationReceived(at=e.at, instance=e.instance, request=e.request,
                                           attempt=e.attempt, src_rank=src, dst_rank=dst)
            yield dataclasses.replace(e, src_ranks=(), dst_ranks=())
        else:
            yield e


# --- encoding -------------------------------------------------------------------------------------


def encode(event: Event) -> tuple[str, dict[str, Any]]:
    """Split an event into its type name and a JSON-ready payload (common fields excluded)."""
    name = type(event).__name__
    if EVENT_TYPES.get(name) is not type(event):
        raise SchemaError(f"unknown event type {name!r}")
    return name, {f: _plain(getattr(event, f)) for f in _payload_fields(type(event))}


_FIELDS: dict[type[Event], tuple[str, ...]] = {}


def _payload_fields(cls: type[Event]) -> tuple[str, ...]:
    """The payload's field names of an event type (cached: encode is on the recording path)."""
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(
            f.name for f in dataclasses.fields(cls) if f.name not in _COMMON)
    return names


def decode(
    type_name: str, payload: dict[str, Any], *, at: float, instance: str, request: str | None
) -> Event:
    """Rebuild an event from its type name and payload, checking every field."""
    cls = EVENT_TYPES.get(type_name)
    if cls is None:
        raise SchemaError(f"unknown event type {type_name!r}")
    if not isinstance(payload, dict):
        raise SchemaError(f"{type_name}: payload must be an object, got {type(payload).__name__}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in _COMMON}
    unknown = set(payload) - set(fields)
    if unknown:
        raise SchemaError(f"{type_name}: unknown field(s) {sorted(unknown)}")
    values: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in payload:
            no_default = f.default is dataclasses.MISSING
            if no_default and f.default_factory is dataclasses.MISSING:
                raise SchemaError(f"{type_name}: missing field {name!r}")
            continue
        values[name] = _coerce(payload[name], hints[name], f"{type_name}.{name}")
    common = {"at": at, "instance": instance, "request": request}
    for name in _COMMON:
        values[name] = _coerce(common[name], hints[name], f"{type_name}.{name}")
    return cls(**values)


def validate(event: Event) -> None:
    """Raise `SchemaError` unless the event round-trips through its schema."""
    name, payload = encode(event)
    decode(name, payload, at=event.at, instance=event.instance, request=event.request)


_HINTS: dict[type[Event], dict[str, Any]] = {}


def _hints(cls: type[Event]) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        if all(type(v) in _FLAT for v in value):
            return list(value)
        return [_plain(v) for v in value]
    return value


_FLAT = frozenset({int, float, str, bool})


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise SchemaError(f"{where}: {value!r} is not one of {typing.get_args(hint)}")
        return value
    if origin in (Union, types.UnionType):
        errors = []
        for option in typing.get_args(hint):
            try:
                return _coerce(value, option, where)
            except SchemaError as exc:
                errors.append(str(exc))
        raise SchemaError(f"{where}: {value!r} fits none of {hint}")
    if origin is tuple:
        item = typing.get_args(hint)[0]
        if not isinstance(value, (list, tuple)):
            raise SchemaError(f"{where}: expected a list, got {type(value).__name__}")
        return tuple(_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if hint is type(None):
        if value is not None:
            raise SchemaError(f"{where}: expected null, got {value!r}")
        return None
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SchemaError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SchemaError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint in (str, bool):
        if not isinstance(value, hint):
            raise SchemaError(f"{where}: expected {hint.__name__}, got {value!r}")
        return value
    raise SchemaError(f"{where}: unsupported annotation {hint!r}")
