"""The decode instance's side of the protocol.

Rules kept here:
- Push: decode reserves destination blocks at allocation time and sends their ids in a
  registration (`RegistrationSent`). It counts completion notifications, one per (producer rank,
  consumer rank) stream of the plan, and has the KV only when every expected one arrived.
  Duplicates are recorded and not counted; a notification from a stream that was never expected
  is the peer misbehaving (`PeerError`). Notifications that come together and end the wait
  (`NotifyMany`) are recorded in the `KVReceived` itself (its `src_ranks`, `dst_ranks`).
- Pull: decode plans the READ itself (in its engine loop: the driver charges that time) once
  prefill's metadata is relayed, and has the KV when the READ completes. The metadata says when
  prefill's hold on the blocks expires (`src_expires_at`); a READ that would not end `read_margin`
  before it is never started (`KVLoadFailed`, the prompt is computed locally), since prefill frees
  the blocks at expiry. Holds only move later, so a stale expiry errs on the safe side.
- Blocks that a transfer may still write into are never freed: an abort while a push is in
  flight waits for the remaining notifications or the time-out. A KV wait that passes its
  deadline fails (`KVLoadFailed`) and the request falls back to computing its prompt locally.
  Prefill never starts a WRITE it cannot finish before that deadline, so nothing lands after it.
- A producer's failure report (`KVFailed`) that comes after the wait ended is stale: ignored.
  So is one that comes while decode's own pull READ is in flight: that READ still writes into
  the blocks, and its own end (`PullDone`) decides. `PullDone` for a push wait is refused.
- What a peer sent that cannot be planned (blocks named twice, too few blocks, another model,
  a hold expiry that is not a finite time) fails the wait at once (`KVLoadFailed`, "peer
  error: ...") and the prompt is computed locally.
- Ended attempts are remembered for `forget_after` seconds, then forgotten (memory stays flat).
- When generation ends, decode frees the request's blocks, or, with bidirectional reuse, keeps
  them under a lease (fixed TTL or renewable) whose handle the router stores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache
from itertools import chain
from typing import Any, Literal

from .blocks import join
from .checks import duplicates, finite, ours, theirs
from .errors import PeerError, ProtocolError
from .events import (
    BlocksFreed,
    BlocksReserved,
    DecodeBlocksReserved,
    Event,
    KVLoadFailed,
    KVReceived,
    LeaseGranted,
    NotificationReceived,
    RegistrationSent,
    RequestAborted,
    TransferPlanned,
)
from .lease import BeginRead, EndRead, Grant, Heartbeat, LeaseCommand, LeaseTable, Release
from .lease import Tick as LeaseTick
from .ledger import Ledger
from .machine import Machine
from .plan import (
    KVLayout,
    check_peer_layout,
    ended_event,
    fan_out,
    plan_transfer,
    planned_event,
)

LEASE_COMMANDS = (Grant, Heartbeat, BeginRead, EndRead, Release, LeaseTick)


@lru_cache(maxsize=256)
def _expected(layout: KVLayout, src_tp: int) -> frozenset[tuple[int, int]]:
    """The notifications a push from a producer of `src_tp` ranks sends: one per stream."""
    src = replace(layout, tp=src_tp)
    return frozenset((s.src_rank, s.dst_rank) for s in fan_out(src, layout))


@lru_cache(maxsize=256)
def _ranks(pairs: tuple[tuple[int, int], ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The src and dst ranks of (src_rank, dst_rank) pairs: one pair of tuples for every
    push between the same layouts (a recorder packs a tuple it has seen once)."""
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


@lru_cache(maxsize=1024)
def _interned(values: tuple[int, ...]) -> tuple[int, ...]:
    """One tuple object for equal tuples (a macro-step's attempts, all 0, and block counts,
    mostly all 1, repeat): a recorder packs a tuple it has seen once."""
    return values


# --- commands -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ExpectKV:
    """Decode allocated `blocks` for a request whose prompt KV comes from `prefill`."""

    request: str
    attempt: int
    prefill: str
    blocks: tuple[int, ...]
    num_tokens: int
    src_layout: KVLayout
    mode: Literal["push", "pull"] = "push"
    src_blocks: tuple[int, ...] = ()  # pull: prefill's blocks, from the relayed metadata
    timeout: float = 30.0
    src_expires_at: float | None = None  # pull: when prefill's hold on src_blocks expires
    read_margin: float = 0.05  # pull: the longest the READ may take


@dataclass(frozen=True, slots=True)
class Notify:
    request: str
    attempt: int
    src_rank: int
    dst_rank: int


@dataclass(frozen=True, slots=True)
class NotifyMany:
    """A push's completion notifications arriving together (its streams ended at one
    instant), one `Notify` per (src_rank, dst_rank) pair: the state the `Notify`s one by one
    leave, and their events, except that when its first pairs are the streams still awaited
    (each once) they are recorded in the `KVReceived` they complete, not each as its own
    `NotificationReceived`; a stream the wait does not expect refuses them all."""

    request: str
    attempt: int
    pairs: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class PullDone:
    request: str
    attempt: int
    ok: bool = True
    reason: str = ""


@dataclass(frozen=True, slots=True)
class KVFailed:
    """The producer reported that the KV will not come (send failed, registration dropped)."""

    request: str
    attempt: int
    reason: str


@dataclass(frozen=True, slots=True)
class Allocate:
    request: str
    attempt: int
    blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllocateMany:
    """Several requests' new blocks at one instant (a decode macro-step's output growth), one
    `Allocate` per request: the state the `Allocate`s one by one leave, their events as one
    `DecodeBlocksReserved` (a `BlocksReserved` for one request); a request appears once."""

    allocations: tuple[Allocate, ...]


@dataclass(frozen=True, slots=True)
class Abort:
    request: str
    attempt: int


@dataclass(frozen=True, slots=True)
class Retain:
    lease: str
    ttl: float
    renewable: bool
    num_tokens: int
    block_hashes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Finish:
    request: str
    attempt: int
    retain: Retain | None = None


@dataclass(frozen=True, slots=True)
class Tick:
    pass


DecodeCommand = (
    ExpectKV | Notify | NotifyMany | PullDone | KVFailed | Allocate | AllocateMany | Abort | Finish
    | Tick
    | LeaseCommand
)


# --- state -----------------------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class Entry:
    attempt: int
    phase: str = "decoding"
    mode: str = "push"
    # the block lists reserved, in order: a growing request adds one per reservation, joined
    # only when `blocks` is read (concatenating at every reservation copied the whole list)
    parts: list[tuple[int, ...]] = field(default_factory=list)
    num_tokens: int = 0
    expected: frozenset[tuple[int, int]] = frozenset()
    received: set[tuple[int, int]] = field(default_factory=set)
    deadline: float = float("inf")
    since: float = 0.0

    @property
    def blocks(self) -> tuple[int, ...]:
        """Every block reserved, in order."""
        parts = self.parts
        if len(parts) > 1:
            parts[:] = [join(parts)]  # keeps the parts' runs (`blocks.join`)
        return parts[0] if parts else ()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Entry):
            return NotImplemented
        return (self.attempt, self.phase, self.mode, self.blocks, self.num_tokens,
                self.expected, self.received, self.deadline, self.since) == (
            other.attempt, other.phase, other.mode, other.blocks, other.num_tokens,
            other.expected, other.received, other.deadline, other.since)


Key = tuple[str, int]


class DecodeCore(Machine[DecodeCommand]):
    name = "decode"

    def __init__(
        self, instance: str, layout: KVLayout, *, pin_grace: float = 5.0,
        forget_after: float = 600.0,
    ) -> None:
        super().__init__(instance)
        self.layout = layout
        self.forget_after = forget_after
        self.ledger = Ledger()
        self.leases = LeaseTable(instance, pin_grace=pin_grace, forget_after=forget_after)
        self.entries: dict[Key, Entry] = {}
        self.ended: dict[Key, float] = {}  # ended attempts, with when they ended
        self._pruned_at = 0.0

    def phase(self, request: str, attempt: int) -> str:
        if (request, attempt) in self.ended:
            return "ended"
        e = self.entries.get((request, attempt))
        return e.phase if e else "absent"

    def _free(self, now: float, key: Key, reason: str) -> list[Event]:
        e = self.entries.get(key)
        if e is None or not e.blocks:
            return []
        return [
            BlocksFreed(
                at=now,
                instance=self.instance,
                request=key[0],
                attempt=key[1],
                blocks=e.blocks,
                reason=reason,
            )
        ]

    # decide -------------------------------------------------------------------------------------
    def decide(self, cmd: DecodeCommand, now: float) -> list[Event]:
        now = self.now_of(now)
        if isinstance(cmd, Tick):
            return self._tick(now)
        if isinstance(cmd, LEASE_COMMANDS):
            return self.leases.decide(cmd, now)
        if isinstance(cmd, AllocateMany):
            return self._allocate_many(cmd, now)
        if isinstance(cmd, NotifyMany):  # allowed in every phase, as `Notify` is
            return self._notify_many(cmd, now)
        return self._dispatch(TABLE, self.phase(cmd.request, cmd.attempt), cmd, now)

    def _tick(self, now: float) -> list[Event]:
        out: list[Event] = []
        for (req, att), e in self.entries.items():
            if e.phase in ("awaiting_kv", "aborting") and now >= e.deadline:
                out.append(
                    KVLoadFailed(
                        at=now,
                        instance=self.instance,
                        request=req,
                        attempt=att,
                        reason="timed out waiting for KV",
                    )
                )
                if e.phase == "aborting":
                    out += self._free(now, (req, att), "aborted; KV wait timed out")
        return out + self.leases.decide(LeaseTick(), now)

    def _expect(self, cmd: ExpectKV, now: float) -> list[Event]:
        ours(self.name, "ExpectKV", duplicates(cmd.blocks))
        ours(self.name, "ExpectKV", finite(cmd.timeout, "timeout", minimum=1e-9))
        ours(self.name, "ExpectKV", finite(cmd.read_margin, "read_margin"))
        ours(self.name, "ExpectKV", finite(cmd.num_tokens, "num_tokens"))
        reserved = BlocksReserved(
            at=now,
            instance=self.instance,
            request=cmd.request,
            attempt=cmd.attempt,
            blocks=cmd.blocks,
            purpose="remote_kv",
        )
        try:
            check_peer_layout(self.layout, cmd.src_layout)
            streams = fan_out(cmd.src_layout, self.layout)
            if cmd.mode == "pull":
                if cmd.src_expires_at is not None:
                    theirs(finite(cmd.src_expires_at, "prefill's hold expiry", minimum=None))
                plan = plan_transfer(
                    cmd.src_layout, self.layout, cmd.src_blocks, cmd.blocks, cmd.num_tokens
                )
        except PeerError as exc:
            return [reserved, KVLoadFailed(at=now, instance=self.instance, request=cmd.request,
                                           attempt=cmd.attempt, reason=f"peer error: {exc}")]
        if cmd.mode == "push":
            return [
                reserved,
                RegistrationSent(
                    at=now,
                    instance=self.instance,
                    request=cmd.request,
                    attempt=cmd.attempt,
                    prefill=cmd.prefill,
                    dst_blocks=cmd.blocks,
                    num_tokens=cmd.num_tokens,
                    src_tp=cmd.src_layout.tp,
                    expected_notifications=len(streams),
                    deadline=now + cmd.timeout,
                ),
            ]
        if cmd.src_expires_at is not None and now + cmd.read_margin >= cmd.src_expires_at:
            return [
                reserved,
                KVLoadFailed(
                    at=now,
                    instance=self.instance,
                    request=cmd.request,
                    attempt=cmd.attempt,
                    reason="prefill's hold expires before the read would end",
                ),
            ]
        return [
            reserved,
            planned_event(
                plan, at=now, instance=self.instance, request=cmd.request,
                attempt=cmd.attempt, direction="P->D", src=cmd.prefill, dst=self.instance,
                src_blocks=cmd.src_blocks, dst_blocks=cmd.blocks,
            ),
        ]

    def _notify(self, cmd: Notify, now: float) -> list[Event]:
        # one pair of `_notify_many` (late or stale, after the wait ended: a duplicate),
        # recorded as its own `NotificationReceived` (a live connector's notifications come
        # one by one, each from its own message)
        return self._notify_many(
            NotifyMany(cmd.request, cmd.attempt, ((cmd.src_rank, cmd.dst_rank),)), now,
            fold=False)

    def _notify_many(self, cmd: NotifyMany, now: float, fold: bool = True) -> list[Event]:
        # `_notify` for each pair, against the state the earlier pairs' events leave: the
        # wait ends at the last expected stream (its KV is received; an aborted attempt's
        # blocks are freed); every pair after it is a repeat, as `_notify` finds it. A batch
        # whose first pairs are the streams still awaited, each once, records them in the
        # `KVReceived` they complete (`src_ranks`, `dst_ranks`), not one
        # `NotificationReceived` each: that event says when they came, from which streams,
        # and that none was a repeat.
        key = (cmd.request, cmd.attempt)
        e = self.entries.get(key)
        waiting = e is not None and e.mode == "push" and e.phase in ("awaiting_kv", "aborting")
        received: set[tuple[int, int]] = set()
        folds = 0  # how many of the first pairs the `KVReceived` holds
        if e is not None and waiting:
            unexpected = [p for p in cmd.pairs if p not in e.expected]
            if unexpected:
                raise PeerError(f"{cmd.request}: notification from stream {unexpected[0]}, "
                                f"expected {sorted(e.expected)}")
            received = set(e.received)
            need = len(e.expected) - len(received)
            head = cmd.pairs[:need]
            if fold and need and len(set(head)) == need and received.isdisjoint(head):
                folds = need
        out: list[Event] = []
        for i, pair in enumerate(cmd.pairs):
            dup = not waiting or pair in received
            if i >= folds:
                out.append(NotificationReceived(
                    at=now, instance=self.instance, request=cmd.request, attempt=cmd.attempt,
                    src_rank=pair[0], dst_rank=pair[1], duplicate=dup))
            if dup or e is None:
                continue
            received.add(pair)
            if len(received) == len(e.expected):
                src_ranks, dst_ranks = _ranks(cmd.pairs[:folds])
                out.append(KVReceived(at=now, instance=self.instance, request=cmd.request,
                                      attempt=cmd.attempt, num_tokens=e.num_tokens,
                                      src_ranks=src_ranks, dst_ranks=dst_ranks))
                if e.phase == "aborting":
                    out += self._free(now, key, "aborted; transfer drained")
        return out

    def _pull_done(self, cmd: PullDone, now: float) -> list[Event]:
        key = (cmd.request, cmd.attempt)
        e = self.entries[key]
        if e.mode != "pull":
            raise ProtocolError(self.name, e.phase, "PullDone", "this wait is for a push")
        reason = cmd.reason or "read failed"
        out: list[Event] = [ended_event(
            cmd.ok, at=now, instance=self.instance, request=cmd.request, attempt=cmd.attempt,
            direction="P->D", reason=reason)]
        if cmd.ok:
            out.append(KVReceived(at=now, instance=self.instance, request=cmd.request,
                                  attempt=cmd.attempt, num_tokens=e.num_tokens))
        else:
            out.append(KVLoadFailed(at=now, instance=self.instance, request=cmd.request,
                                    attempt=cmd.attempt, reason=reason))
        if e.phase == "aborting":
            out += self._free(now, key, "aborted; read drained")
        return out

    def _kv_failed(self, cmd: KVFailed, now: float) -> list[Event]:
        key = (cmd.request, cmd.attempt)
        if self.entries[key].mode == "pull":
            return []  # our own READ is in flight into these blocks: its end decides
        out: list[Event] = [
            KVLoadFailed(
                at=now,
                instance=self.instance,
                request=cmd.request,
                attempt=cmd.attempt,
                reason=cmd.reason,
            )
        ]
        if self.entries[key].phase == "aborting":
            out += self._free(now, key, "aborted; KV will not come")
        return out

    def _stale_failure(self, cmd: KVFailed, now: float) -> list[Event]:
        return []  # the wait already ended (KV received, timed out) or never began

    def _allocate(self, cmd: Allocate, now: float) -> list[Event]:
        ours(self.name, "Allocate", duplicates(cmd.blocks))
        return [
            BlocksReserved(
                at=now,
                instance=self.instance,
                request=cmd.request,
                attempt=cmd.attempt,
                blocks=cmd.blocks,
                purpose="decode",
            )
        ]

    def _allocate_many(self, cmd: AllocateMany, now: float) -> list[Event]:
        # one request's events never change another's phase, so deciding them all against
        # the state before any is applied equals deciding them one by one. Two or more
        # requests' blocks are one `DecodeBlocksReserved` (their `BlocksReserved`, in order).
        allocations = cmd.allocations
        if len({a.request for a in allocations}) != len(allocations):
            raise ProtocolError(self.name, "", "AllocateMany", "a request appears twice")
        ended, entries = self.ended, self.entries
        for a in allocations:  # `phase` and `_allocate`'s check of each, inline
            key = (a.request, a.attempt)
            e = entries.get(key)
            phase = _E if key in ended else e.phase if e is not None else _A
            if phase not in _ALLOCATABLE:
                raise ProtocolError(self.name, phase, "Allocate")
            ours(self.name, "Allocate", duplicates(a.blocks))
        if len(allocations) == 1:
            a = allocations[0]
            return [BlocksReserved(at=now, instance=self.instance, request=a.request,
                                   attempt=a.attempt, blocks=a.blocks, purpose="decode")]
        if not allocations:
            return []
        return [DecodeBlocksReserved(
            at=now, instance=self.instance, requests=tuple(a.request for a in allocations),
            attempts=_interned(tuple(a.attempt for a in allocations)),
            counts=_interned(tuple(len(a.blocks) for a in allocations)),
            blocks=tuple(chain.from_iterable(a.blocks for a in allocations)))]

    def _abort(self, cmd: Abort, now: float) -> list[Event]:
        key = (cmd.request, cmd.attempt)
        phase = self.phase(*key)
        if phase in ("ended", "aborting"):
            return []
        aborted = RequestAborted(
            at=now, instance=self.instance, request=cmd.request, attempt=cmd.attempt, phase=phase
        )
        if phase == "awaiting_kv":
            return [aborted]  # a transfer may still write into the blocks: wait for it
        return [aborted, *self._free(now, key, "aborted")]

    def _finish(self, cmd: Finish, now: float) -> list[Event]:
        key = (cmd.request, cmd.attempt)
        e = self.entries.get(key)
        if cmd.retain is None or e is None or not e.blocks:
            return self._free(now, key, "finished")
        r = cmd.retain
        return self.leases.decide(
            Grant(
                r.lease,
                cmd.request,
                e.blocks,
                r.num_tokens,
                r.ttl,
                r.renewable,
                r.block_hashes,
                "retained",
                cmd.attempt,
            ),
            now,
        )

    def handle(self, command: DecodeCommand, now: float) -> list[Event]:
        events = self.decide(command, now)
        if type(command) is AllocateMany:
            self._fold_reserved(events)
        else:
            for e in events:
                self.apply(e)
        return events

    def _fold_reserved(self, events: list[Event]) -> None:
        """`apply` of a macro-step's reservation (a `BlocksReserved`, or a
        `DecodeBlocksReserved` of several requests), with what is the same for all of its
        requests done once: the clocks and the pruning check."""
        if not events:
            return
        (ev,) = events
        at = ev.at
        self.clock = max(self.clock, at)
        if at - self._pruned_at >= self.forget_after:
            self._prune(at)
        self.leases.clock = max(self.leases.clock, at)
        if type(ev) is BlocksReserved:
            self._on_reserved(ev, (ev.request or "", ev.attempt))
        else:
            assert type(ev) is DecodeBlocksReserved
            self._on_grown(ev, ("", 0))

    # apply --------------------------------------------------------------------------------------
    def apply(self, ev: Event) -> DecodeCore:
        at = ev.at
        self.clock = max(self.clock, at)  # `saw`, inline: this runs for every event
        if at - self._pruned_at >= self.forget_after:
            self._prune(at)
        kind = type(ev)  # event types are final: the type names the event
        key = (ev.request or "", getattr(ev, "attempt", 0))
        fold = _FOLD.get(kind)
        if fold is not None:  # not a lease's event (the two tables share no type)
            leases = self.leases
            leases.clock = max(leases.clock, at)  # `leases.apply` with another's event
            fold(self, ev, key)
            return self
        if kind is LeaseGranted:
            self._end(key)  # the blocks now belong to the lease
        self.leases.apply(ev)
        return self

    def _on_reserved(self, ev: BlocksReserved, key: Key) -> None:
        self.ledger.apply(ev)
        e = self.entries.get(key) or self._open(key, ev.at)
        if ev.blocks:
            e.parts.append(ev.blocks)

    def _on_grown(self, ev: DecodeBlocksReserved, key: Key) -> None:
        ledger, entries = self.ledger, self.entries
        for request, attempt, blocks in ev.parts():  # `_on_reserved` of each request's
            ledger.reserve(request, attempt, blocks)
            k = (request, attempt)
            e = entries.get(k) or self._open(k, ev.at)
            if blocks:
                e.parts.append(blocks)

    def _on_freed(self, ev: BlocksFreed, key: Key) -> None:
        self.ledger.apply(ev)
        self._end(key)

    def _on_registration(self, ev: RegistrationSent, key: Key) -> None:
        e = self._open(key, ev.at)
        e.phase, e.mode, e.num_tokens, e.deadline = (
            "awaiting_kv",
            "push",
            ev.num_tokens,
            ev.deadline,
        )
        e.expected = _expected(self.layout, ev.src_tp)

    def _on_planned(self, ev: TransferPlanned, key: Key) -> None:
        e = self._open(key, ev.at)
        e.phase, e.mode, e.num_tokens = "awaiting_kv", "pull", ev.num_tokens

    def _on_notification(self, ev: NotificationReceived, key: Key) -> None:
        if not ev.duplicate:
            self.entries[key].received.add((ev.src_rank, ev.dst_rank))

    def _on_kv_end(self, ev: KVReceived | KVLoadFailed, key: Key) -> None:
        cur = self.entries.get(key)
        if cur is not None and type(ev) is KVReceived and ev.src_ranks:
            cur.received.update(ev.notified())  # the notifications folded into it
        if cur is not None and cur.phase == "awaiting_kv":
            cur.phase = "decoding"

    def _on_aborted(self, ev: RequestAborted, key: Key) -> None:
        if ev.phase == "awaiting_kv":
            self.entries[key].phase = "aborting"
        else:
            self._end(key)

    def _open(self, key: Key, at: float) -> Entry:
        e = self.entries.get(key)
        if e is None:
            e = self.entries[key] = Entry(key[1], since=at)
        return e

    def _end(self, key: Key) -> None:
        if self.entries.pop(key, None) is not None:
            self.ended[key] = self.clock

    def _prune(self, now: float) -> None:
        """Forget attempts that ended over `forget_after` ago (runs while applying events)."""
        self._pruned_at = now
        cutoff = now - self.forget_after
        self.ended = {k: t for k, t in self.ended.items() if t > cutoff}
        self.leases.prune(now)


# how `apply` folds each event type that is not a lease's (others change nothing here)
_FOLD: dict[type, Callable[[DecodeCore, Any, Key], None]] = {
    BlocksReserved: DecodeCore._on_reserved,
    DecodeBlocksReserved: DecodeCore._on_grown,
    BlocksFreed: DecodeCore._on_freed,
    RegistrationSent: DecodeCore._on_registration,
    TransferPlanned: DecodeCore._on_planned,
    NotificationReceived: DecodeCore._on_notification,
    KVReceived: DecodeCore._on_kv_end,
    KVLoadFailed: DecodeCore._on_kv_end,
    RequestAborted: DecodeCore._on_aborted,
}

_A, _W, _D, _X, _E = "absent", "awaiting_kv", "decoding", "aborting", "ended"
_ALLOCATABLE = (_A, _W, _D)
TABLE: dict[tuple[str, type], Callable[..., list[Event]]] = {
    (_A, ExpectKV): DecodeCore._expect,
    **{(p, Notify): DecodeCore._notify for p in (_A, _W, _D, _X, _E)},
    **{(p, PullDone): DecodeCore._pull_done for p in (_W, _X)},
    **{(p, KVFailed): DecodeCore._kv_failed for p in (_W, _X)},
    **{(p, KVFailed): DecodeCore._stale_failure for p in (_A, _D, _E)},
    **{(p, Allocate): DecodeCore._allocate for p in _ALLOCATABLE},
    **{(p, Abort): DecodeCore._abort for p in (_A, _W, _D, _X, _E)},
    (_D, Finish): DecodeCore._finish,
}
