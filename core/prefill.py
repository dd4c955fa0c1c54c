"""The prefill instance's side of the protocol.

Push (registration and rendezvous). Decode's registration and prefill's own finish arrive in
either order; the second one matches them and plans the WRITE. Rules kept:
- Matching is by (request id, attempt). A re-issued request gets a new attempt; anything that
  still arrives for an older attempt is dropped, never matched. The new attempt's registration
  may arrive before prefill hears of the re-issue: it is kept, and the re-issue ends only the
  older attempts. A late or duplicate re-issue (to an attempt not newer than one seen) is a
  no-op.
- A WRITE starts only while decode still waits for it. A registration carries decode's KV wait
  deadline; when `now + write_margin >= deadline` it is dropped (`RegistrationDropped`), never
  matched, because decode frees its blocks once the wait times out. `write_margin` is the
  longest a WRITE may take, so a WRITE this rule admits lands before decode gives up.
- A registration that cannot be planned (too few blocks, a block named twice, another model, a
  layout whose heads and ranks do not divide, a deadline that is not a finite time) is dropped
  and recorded, not raised: the finished request stays held for another registration, the hold
  time-out or an abort, so a misbehaving peer never strands prefill's blocks.
- Each drop says whether decode must stop waiting (`final`). A second copy of a registration
  that still stands (held, or its WRITE in flight) is a duplicate, `final=False`, whatever
  happened to the request since: telling decode "no KV" then would free blocks the WRITE still
  lands in. The duplicate check comes before every other reason.
- An abort reaches an attempt that still holds blocks even when a newer attempt is known; once
  an abort is pending (during a reuse read) no registration or allocation is accepted for it.
- Ended attempts are remembered for `forget_after` seconds, then forgotten, so memory stays flat
  in long runs. A message that old for a forgotten attempt finds it "absent": a registration is
  then dropped by its deadline (long passed), anything else changes nothing.
- Prefill holds a finished request's blocks until the WRITE completes or fails, until the request
  is aborted, or until `hold_timeout` passes with no registration. Blocks under an in-flight
  WRITE are never freed: an abort during a transfer frees them when the transfer ends.
- A registration for a request that already ended is dropped (and recorded), never held.
- Every matched transfer ends exactly once: `TransferCompleted` or `TransferFailed`.
- Blocks a D->P reuse read still writes into are never freed either: an abort or a re-issue
  during the read frees them when it ends; finishing, preempting, releasing or starting a second
  read meanwhile is a `ProtocolError`.

Pull. A finished prefill's blocks go under a renewable lease (`pull_hold`, vLLM's
`kv_lease_duration`, 30 s); decode's read-done releases it, heartbeats extend it, and expiry
frees the blocks if the reader never comes.

Bidirectional reuse. `DecideReuse` applies `kvplane.core.reuse.decide_reuse`; a READ from
decode's retained blocks is planned into blocks prefill reserved with purpose `reuse`.

Phases of a push entry: `waiting` (registration and/or computing, not finished), `held`
(finished, no registration yet), `transferring` (matched, WRITE in flight).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from .blocks import join
from .checks import duplicates, finite, ours, theirs
from .errors import PeerError, ProtocolError
from .events import (
    BlocksFreed,
    BlocksReserved,
    Event,
    HoldTimedOut,
    LeaseGranted,
    PrefillFinished,
    RegistrationArrived,
    RegistrationDropped,
    RendezvousMatched,
    RequestAborted,
    RequestPreempted,
    RequestReissued,
    TransferCompleted,
    TransferFailed,
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
    peer_layout,
    plan_transfer,
    planned_event,
)
from .reuse import RetainedHandle, decide_reuse

# --- commands -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Allocate:
    request: str
    attempt: int
    blocks: tuple[int, ...]
    purpose: Literal["prefill", "reuse"] = "prefill"


@dataclass(frozen=True, slots=True)
class Register:
    request: str
    attempt: int
    decode: str
    dst_blocks: tuple[int, ...]
    dst_layout: KVLayout
    deadline: float | None = None  # decode's KV wait deadline (`RegistrationSent.deadline`)


@dataclass(frozen=True, slots=True)
class FinishPrefill:
    request: str
    attempt: int
    num_tokens: int
    mode: Literal["push", "pull"] = "push"
    hold_ttl: float = 30.0  # pull: vLLM's kv_lease_duration


@dataclass(frozen=True, slots=True)
class TransferDone:
    request: str
    attempt: int
    ok: bool = True
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Abort:
    request: str
    attempt: int


@dataclass(frozen=True, slots=True)
class Preempt:
    request: str
    attempt: int


@dataclass(frozen=True, slots=True)
class Reissue:
    request: str
    attempt: int  # the new attempt


@dataclass(frozen=True, slots=True)
class PullReadDone:
    request: str
    attempt: int


@dataclass(frozen=True, slots=True)
class DecideReuse:
    request: str
    attempt: int
    handle: RetainedHandle | None
    prompt_hashes: tuple[str, ...]
    prompt_tokens: int
    local_hit_tokens: int
    threshold: int = 64
    estimated_read: float = 0.0
    margin: float = 0.05


@dataclass(frozen=True, slots=True)
class StartReuseRead:
    request: str
    attempt: int
    handle: RetainedHandle
    src_blocks: tuple[int, ...]  # decode's retained blocks (the matched prefix)
    src_layout: KVLayout
    num_tokens: int
    # prefill's destination blocks for the read; None: the request's blocks from the start.
    # Give them when a local prefix hit covers the first blocks and the read lands after it.
    dst_blocks: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class ReuseReadDone:
    request: str
    attempt: int
    ok: bool = True
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Release_:
    """Prefill is done with a request's blocks (its KV left, or it failed): free what it owns."""

    request: str
    attempt: int
    reason: str = "finished"


@dataclass(frozen=True, slots=True)
class Tick:
    pass


LEASE_COMMANDS = (Grant, Heartbeat, BeginRead, EndRead, Release, LeaseTick)

PrefillCommand = (
    Allocate
    | Register
    | FinishPrefill
    | TransferDone
    | Abort
    | Preempt
    | Reissue
    | PullReadDone
    | DecideReuse
    | StartReuseRead
    | ReuseReadDone
    | Release_
    | Tick
    | LeaseCommand
)


# --- state -----------------------------------------------------------------------------------------


@dataclass(slots=True)
class Entry:
    attempt: int
    phase: str = "waiting"
    blocks: tuple[int, ...] = ()
    registration: RegistrationArrived | None = None
    finished: PrefillFinished | None = None
    abort_pending: bool = False
    reading: bool = False  # a D->P reuse read in flight


READ_BY_DECODE = "read by decode"  # why a pull hold ends when decode's read-done arrives
DUPLICATE = "duplicate registration"  # a copy of a registration that still stands


def hold_lease_id(request: str, attempt: int) -> str:
    return f"{request}#{attempt}/hold"


Key = tuple[str, int]


class PrefillCore(Machine[PrefillCommand]):
    name = "prefill"

    def __init__(
        self,
        instance: str,
        layout: KVLayout,
        hold_timeout: float = 30.0,
        write_margin: float = 1.0,
        forget_after: float = 600.0,
        pin_grace: float = 5.0,
    ) -> None:
        super().__init__(instance)
        # write_margin: the longest a WRITE may take. Zero would match a registration an instant
        # before decode gives up, and the WRITE would land in blocks decode has freed.
        ours("prefill", "write_margin", finite(write_margin, "write_margin", minimum=1e-3))
        ours("prefill", "hold_timeout", finite(hold_timeout, "hold_timeout", minimum=1e-3))
        ours("prefill", "forget_after", finite(forget_after, "forget_after", minimum=1e-3))
        self.layout = layout
        self.hold_timeout = hold_timeout
        self.write_margin = write_margin
        self.forget_after = forget_after
        self.ledger = Ledger()
        self.leases = LeaseTable(instance, pin_grace=pin_grace, forget_after=forget_after)
        self.entries: dict[Key, Entry] = {}
        self.latest: dict[str, int] = {}  # newest attempt seen per request
        self.reissued: dict[str, int] = {}  # attempt of the last re-issue per request
        self.ended: dict[Key, float] = {}  # ended attempts, with when they ended
        self._pruned_at = 0.0

    # helpers ------------------------------------------------------------------------------------
    def phase(self, request: str, attempt: int) -> str:
        if (request, attempt) in self.ended:
            return "ended"
        e = self.entries.get((request, attempt))
        return e.phase if e else "absent"

    def layout_of(self, reg: RegistrationArrived) -> KVLayout:
        """Decode's layout: same model, its own block size and TP (from the registration)."""
        return peer_layout(self.layout, block_size=reg.dst_block_size, tp=reg.dst_tp)

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

    def _stale(self, request: str, attempt: int) -> str | None:
        if (request, attempt) in self.ended:
            return "request already ended"
        if attempt < self.latest.get(request, attempt):
            return "stale attempt"
        return None

    def _plan_push(
        self, now: float, reg: RegistrationArrived, fin: PrefillFinished, order: str
    ) -> list[Event]:
        plan = plan_transfer(
            self.layout, self.layout_of(reg), fin.src_blocks, reg.dst_blocks, fin.num_tokens
        )
        return [
            RendezvousMatched(
                at=now,
                instance=self.instance,
                request=fin.request,
                attempt=fin.attempt,
                decode=reg.decode,
                order=order,  # type: ignore[arg-type]
            ),
            planned_event(
                plan, at=now, instance=self.instance, request=fin.request or "",
                attempt=fin.attempt, direction="P->D", src=self.instance, dst=reg.decode,
                src_blocks=fin.src_blocks, dst_blocks=reg.dst_blocks,
            ),
        ]

    def _late(self, now: float, reg: RegistrationArrived | Register) -> bool:
        return reg.deadline is not None and now + self.write_margin >= reg.deadline

    def _dropped(
        self, now: float, request: str, attempt: int, reason: str, final: bool = True
    ) -> Event:
        return RegistrationDropped(
            at=now, instance=self.instance, request=request, attempt=attempt, reason=reason,
            final=final,
        )

    def _peer_problem(self, cmd: Register) -> str | None:
        """Why a registration can never be planned, or None."""
        try:
            if cmd.deadline is not None:
                theirs(finite(cmd.deadline, "the registration's deadline", minimum=None))
            theirs(duplicates(cmd.dst_blocks))
            check_peer_layout(self.layout, cmd.dst_layout)
            dst = peer_layout(self.layout, block_size=cmd.dst_layout.block_size,
                              tp=cmd.dst_layout.tp)
            fan_out(self.layout, dst)
        except PeerError as exc:
            return f"peer error: {exc}"
        return None

    def _match(
        self, now: float, reg: RegistrationArrived, fin: PrefillFinished, order: str
    ) -> list[Event]:
        req = fin.request or ""
        if self._late(now, reg):
            return [self._dropped(now, req, fin.attempt, "decode's KV deadline passed")]
        try:
            return self._plan_push(now, reg, fin, order)
        except PeerError as exc:
            return [self._dropped(now, req, fin.attempt, f"peer error: {exc}")]

    # decide -------------------------------------------------------------------------------------
    def decide(self, cmd: PrefillCommand, now: float) -> list[Event]:
        now = self.now_of(now)
        if isinstance(cmd, Tick):
            return self._tick(now)
        if isinstance(cmd, LEASE_COMMANDS):
            return self.leases.decide(cmd, now)
        key = (cmd.request, cmd.attempt)
        return self._dispatch(TABLE, self.phase(*key), cmd, now)

    def _tick(self, now: float) -> list[Event]:
        out: list[Event] = []
        for key, e in self.entries.items():
            if e.phase == "held" and e.finished and now - e.finished.at >= self.hold_timeout:
                out.append(
                    HoldTimedOut(
                        at=now,
                        instance=self.instance,
                        request=key[0],
                        attempt=key[1],
                        waited=now - e.finished.at,
                    )
                )
                out += self._free(now, key, "no registration before the hold time-out")
        return out + self.leases.decide(LeaseTick(), now)

    def _allocate(self, cmd: Allocate, now: float) -> list[Event]:
        if self._stale(cmd.request, cmd.attempt):
            raise ProtocolError(self.name, "stale", "Allocate", cmd.request)
        e = self.entries.get((cmd.request, cmd.attempt))
        if e is not None and e.abort_pending:
            raise ProtocolError(self.name, "aborting", "Allocate", "the request was aborted")
        ours(self.name, "Allocate", duplicates(cmd.blocks))
        return [
            BlocksReserved(
                at=now,
                instance=self.instance,
                request=cmd.request,
                attempt=cmd.attempt,
                blocks=cmd.blocks,
                purpose=cmd.purpose,
            )
        ]

    def _register(self, cmd: Register, now: float) -> list[Event]:
        e = self.entries.get((cmd.request, cmd.attempt))
        if e is not None and e.registration is not None:
            # first: a copy of a registration that stands must never tell decode "no KV"
            return [self._dropped(now, cmd.request, cmd.attempt, DUPLICATE, final=False)]
        reason = self._stale(cmd.request, cmd.attempt)
        if reason is None and e is not None and e.abort_pending:
            reason = "request aborted"
        if reason is None:
            reason = self._peer_problem(cmd)
        if reason is None and self._late(now, cmd):
            reason = "decode's KV deadline passed"
        if reason is not None:
            return [self._dropped(now, cmd.request, cmd.attempt, reason)]
        arrived = RegistrationArrived(
            at=now,
            instance=self.instance,
            request=cmd.request,
            attempt=cmd.attempt,
            decode=cmd.decode,
            dst_blocks=cmd.dst_blocks,
            dst_tp=cmd.dst_layout.tp,
            dst_block_size=cmd.dst_layout.block_size,
            deadline=cmd.deadline,
        )
        if e is not None and e.phase == "held":
            assert e.finished is not None
            return [arrived, *self._match(now, arrived, e.finished, "prefill_first")]
        return [arrived]

    def _finish(self, cmd: FinishPrefill, now: float) -> list[Event]:
        key = (cmd.request, cmd.attempt)
        e = self.entries.get(key)
        if e is not None and e.reading:
            raise ProtocolError(self.name, "reading", "FinishPrefill", "a reuse read is in flight")
        if e is not None and e.abort_pending:
            raise ProtocolError(self.name, "aborting", "FinishPrefill", "the request was aborted")
        ours(self.name, "FinishPrefill", finite(cmd.num_tokens, "num_tokens"))
        if cmd.mode == "pull":
            ours(self.name, "FinishPrefill", finite(cmd.hold_ttl, "hold_ttl", minimum=1e-3))
        src = e.blocks if e else ()
        fin = PrefillFinished(
            at=now,
            instance=self.instance,
            request=cmd.request,
            attempt=cmd.attempt,
            src_blocks=src,
            num_tokens=cmd.num_tokens,
        )
        if cmd.mode == "pull":
            grant = Grant(
                hold_lease_id(*key),
                cmd.request,
                src,
                cmd.num_tokens,
                cmd.hold_ttl,
                renewable=True,
                purpose="pull_hold",
                attempt=cmd.attempt,
            )
            return [fin, *self.leases.decide(grant, now)]
        if e is not None and e.registration is not None:
            return [fin, *self._match(now, e.registration, fin, "registration_first")]
        return [fin]

    def _transfer_done(self, cmd: TransferDone, now: float) -> list[Event]:
        key = (cmd.request, cmd.attempt)
        done = ended_event(cmd.ok, at=now, instance=self.instance, request=cmd.request,
                           attempt=cmd.attempt, direction="P->D",
                           reason=cmd.reason or "transfer failed")
        return [done, *self._free(now, key, "KV sent" if cmd.ok else "send failed")]

    def _abort(self, cmd: Abort, now: float) -> list[Event]:
        key = (cmd.request, cmd.attempt)
        phase = self.phase(*key)
        e = self.entries.get(key)
        if phase == "ended" or (e is None and self._stale(*key)):
            return []  # an abort after the end changes nothing
        if e is not None and e.abort_pending:
            return []
        aborted = RequestAborted(
            at=now, instance=self.instance, request=cmd.request, attempt=cmd.attempt, phase=phase
        )
        if phase == "transferring" or (e is not None and e.reading):
            return [aborted]  # blocks are freed when the transfer in flight ends
        return [aborted, *self._free(now, key, "aborted")]

    def _preempt(self, cmd: Preempt, now: float) -> list[Event]:
        key = (cmd.request, cmd.attempt)
        e = self.entries.get(key)
        if e is not None and e.reading:
            raise ProtocolError(self.name, "reading", "Preempt", "a reuse read is in flight")
        return [
            RequestPreempted(
                at=now, instance=self.instance, request=cmd.request, attempt=cmd.attempt
            ),
            *self._free(now, key, "preempted"),
        ]

    def _reissue(self, cmd: Reissue, now: float) -> list[Event]:
        # The new attempt may already be known (its registration came first). A re-issue to an
        # attempt older than one already seen, or a second one to the same attempt, is a late or
        # duplicate message: the newer attempt already superseded it, so it changes nothing.
        last = max(self.latest.get(cmd.request, -1), self.reissued.get(cmd.request, -1) + 1)
        if cmd.attempt < last:
            return []
        out: list[Event] = [
            RequestReissued(
                at=now, instance=self.instance, request=cmd.request, attempt=cmd.attempt
            )
        ]
        for key, e in self.entries.items():
            older = key[0] == cmd.request and key[1] < cmd.attempt
            if older and e.phase != "transferring" and not e.reading:
                out += self._free(now, key, "re-issued")
        return out

    def _pull_read_done(self, cmd: PullReadDone, now: float) -> list[Event]:
        return self.leases.decide(
            Release(hold_lease_id(cmd.request, cmd.attempt), READ_BY_DECODE), now
        )

    def _decide_reuse(self, cmd: DecideReuse, now: float) -> list[Event]:
        return [
            decide_reuse(
                now=now,
                instance=self.instance,
                request=cmd.request,
                handle=cmd.handle,
                prompt_hashes=cmd.prompt_hashes,
                prompt_tokens=cmd.prompt_tokens,
                local_hit_tokens=cmd.local_hit_tokens,
                threshold=cmd.threshold,
                estimated_read=cmd.estimated_read,
                margin=cmd.margin,
            )
        ]

    def _start_read(self, cmd: StartReuseRead, now: float) -> list[Event]:
        e = self.entries.get((cmd.request, cmd.attempt))
        if e is not None and e.reading:
            raise ProtocolError(self.name, "reading", "StartReuseRead", "a read is in flight")
        if e is not None and e.abort_pending:
            raise ProtocolError(self.name, "aborting", "StartReuseRead", "the request was aborted")
        own = e.blocks if e else ()
        dst = own if cmd.dst_blocks is None else cmd.dst_blocks
        if not set(dst) <= set(own):
            raise ProtocolError(self.name, "reading", "StartReuseRead",
                                "destination blocks are not reserved for this request")
        plan = plan_transfer(cmd.src_layout, self.layout, cmd.src_blocks, dst, cmd.num_tokens)
        return [
            planned_event(
                plan, at=now, instance=self.instance, request=cmd.request,
                attempt=cmd.attempt, direction="D->P", src=cmd.handle.decode, dst=self.instance,
                src_blocks=cmd.src_blocks, dst_blocks=dst,
            )
        ]

    def _read_done(self, cmd: ReuseReadDone, now: float) -> list[Event]:
        e = self.entries.get((cmd.request, cmd.attempt))
        if e is None or not e.reading:
            raise ProtocolError(
                self.name,
                self.phase(cmd.request, cmd.attempt),
                "ReuseReadDone",
                "no read in flight",
            )
        done = ended_event(cmd.ok, at=now, instance=self.instance, request=cmd.request,
                           attempt=cmd.attempt, direction="D->P",
                           reason=cmd.reason or "read failed")
        if e.abort_pending:
            return [done, *self._free(now, (cmd.request, cmd.attempt), "aborted")]
        return [done]

    def _release(self, cmd: Release_, now: float) -> list[Event]:
        e = self.entries.get((cmd.request, cmd.attempt))
        if e is not None and e.reading:
            raise ProtocolError(self.name, "reading", "Release_", "a reuse read is in flight")
        return self._free(now, (cmd.request, cmd.attempt), cmd.reason)

    # apply --------------------------------------------------------------------------------------
    def apply(self, ev: Event) -> PrefillCore:
        at = ev.at
        self.clock = max(self.clock, at)  # `saw`, inline: this runs for every event
        if at - self._pruned_at >= self.forget_after:
            self._prune(at)
        kind = type(ev)  # event types are final: the type names the event
        fold = _FOLD.get(kind)
        if fold is not None:  # not a lease's event (the two tables share no type)
            leases = self.leases
            leases.clock = max(leases.clock, at)  # `leases.apply` with another's event
            fold(self, ev, (ev.request or "", getattr(ev, "attempt", 0)))
            return self
        if kind is LeaseGranted and ev.purpose == "pull_hold":  # type: ignore[attr-defined]
            # custody of the finished prefill's blocks passes to the hold lease
            self._end((ev.request or "", ev.attempt))  # type: ignore[attr-defined]
        self.leases.apply(ev)
        return self

    def _on_reissued(self, ev: RequestReissued, key: Key) -> None:
        req = key[0]
        for k, e in list(self.entries.items()):
            if k[0] != req or k[1] >= ev.attempt or e.phase == "transferring":
                continue  # a WRITE in flight frees its blocks when it ends
            if e.reading:
                e.abort_pending = True  # freed when the read ends
            else:
                self._end(k)
        self.latest[req] = max(self.latest.get(req, ev.attempt), ev.attempt)
        self.reissued[req] = ev.attempt

    def _on_reserved(self, ev: BlocksReserved, key: Key) -> None:
        self.ledger.apply(ev)
        e = self._open(key)
        e.blocks = join((e.blocks, ev.blocks))  # with their runs (`blocks.join`)

    def _on_freed(self, ev: BlocksFreed, key: Key) -> None:
        self.ledger.apply(ev)
        e = self.entries.get(key)
        if e is None:
            return
        if ev.blocks == e.blocks:  # the usual case: all of them
            e.blocks = ()
        else:
            gone = set(ev.blocks)
            e.blocks = tuple(b for b in e.blocks if b not in gone)

    def _on_registration(self, ev: RegistrationArrived, key: Key) -> None:
        self._open(key).registration = ev

    def _on_dropped(self, ev: RegistrationDropped, key: Key) -> None:
        cur = self.entries.get(key)
        if cur is not None and cur.phase == "held":
            cur.registration = None  # it could not be matched: wait for another one

    def _on_finished(self, ev: PrefillFinished, key: Key) -> None:
        e = self._open(key)
        e.finished = ev
        e.phase = "held"

    def _on_matched(self, ev: RendezvousMatched, key: Key) -> None:
        self.entries[key].phase = "transferring"

    def _on_planned(self, ev: TransferPlanned, key: Key) -> None:
        if ev.direction == "D->P":
            self._open(key).reading = True

    def _on_transfer_end(self, ev: TransferCompleted | TransferFailed, key: Key) -> None:
        e = self.entries[key]
        if ev.direction == "D->P":
            e.reading = False
            if e.abort_pending:
                self._end(key)
        else:
            self._end(key)

    def _on_aborted(self, ev: RequestAborted, key: Key) -> None:
        cur = self.entries.get(key)
        if cur is not None and (cur.phase == "transferring" or cur.reading):
            cur.abort_pending = True
        else:
            self._end(key)

    def _on_hold_timed_out(self, ev: HoldTimedOut, key: Key) -> None:
        self._end(key)

    def _on_preempted(self, ev: RequestPreempted, key: Key) -> None:
        cur = self.entries.get(key)
        if cur is not None:
            cur.finished = None
            cur.phase = "waiting"

    def _open(self, key: Key) -> Entry:
        e = self.entries.get(key)
        if e is None:
            e = self.entries[key] = Entry(key[1])
            self.latest[key[0]] = max(self.latest.get(key[0], key[1]), key[1])
        return e

    def _end(self, key: Key) -> None:
        self.entries.pop(key, None)
        self.ended[key] = self.clock

    def _prune(self, now: float) -> None:
        """Forget attempts that ended over `forget_after` ago, and requests with nothing left.
        Runs as events are applied (never in `decide`), so a replayed log prunes alike."""
        self._pruned_at = now
        cutoff = now - self.forget_after
        self.ended = {k: t for k, t in self.ended.items() if t > cutoff}
        live = {k[0] for k in self.entries} | {k[0] for k in self.ended}
        self.latest = {r: a for r, a in self.latest.items() if r in live}
        self.reissued = {r: a for r, a in self.reissued.items() if r in live}
        self.leases.prune(now)


_W, _H, _T, _A, _E = "waiting", "held", "transferring", "absent", "ended"
# how `apply` folds each event type that is not a lease's (others change nothing here)
_FOLD: dict[type, Callable[[PrefillCore, Any, Key], None]] = {
    RequestReissued: PrefillCore._on_reissued,
    BlocksReserved: PrefillCore._on_reserved,
    BlocksFreed: PrefillCore._on_freed,
    RegistrationArrived: PrefillCore._on_registration,
    RegistrationDropped: PrefillCore._on_dropped,
    PrefillFinished: PrefillCore._on_finished,
    RendezvousMatched: PrefillCore._on_matched,
    TransferPlanned: PrefillCore._on_planned,
    TransferCompleted: PrefillCore._on_transfer_end,
    TransferFailed: PrefillCore._on_transfer_end,
    RequestAborted: PrefillCore._on_aborted,
    HoldTimedOut: PrefillCore._on_hold_timed_out,
    RequestPreempted: PrefillCore._on_preempted,
}

TABLE: dict[tuple[str, type], Callable[..., list[Event]]] = {
    **{(p, Allocate): PrefillCore._allocate for p in (_A, _W)},
    **{(p, Register): PrefillCore._register for p in (_A, _W, _H, _T, _E)},
    **{(p, FinishPrefill): PrefillCore._finish for p in (_A, _W)},
    (_T, TransferDone): PrefillCore._transfer_done,
    **{(p, Abort): PrefillCore._abort for p in (_A, _W, _H, _T, _E)},
    **{(p, Preempt): PrefillCore._preempt for p in (_A, _W)},
    **{(p, Reissue): PrefillCore._reissue for p in (_A, _W, _H, _T, _E)},
    **{(p, PullReadDone): PrefillCore._pull_read_done for p in (_A, _W, _H, _E)},
    **{(p, DecideReuse): PrefillCore._decide_reuse for p in (_A, _W)},
    **{(p, StartReuseRead): PrefillCore._start_read for p in (_A, _W)},
    **{(p, ReuseReadDone): PrefillCore._read_done for p in (_A, _W)},
    # a held request's blocks wait for a WRITE: end it with Abort (or the hold time-out)
    **{(p, Release_): PrefillCore._release for p in (_A, _W, _E)},
}
