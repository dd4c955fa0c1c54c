"""Leases on KV blocks kept for someone else to read.

Two uses: decode retaining a finished request's blocks for the next turn (bidirectional reuse),
and prefill holding a finished prefill's blocks until a pulling decode has read them.

Rules kept here:
- A lease has a fixed expiry (`renewable=False`, the published design's TTL, default 480 s) or
  is renewable: each heartbeat moves the expiry to `now + extension`, never backwards.
- A read pins the lease until the read ends. Expiry and release never free blocks under a pin:
  they wait for the last reader to finish (a release asked for meanwhile is deferred).
- A read is refused when the lease is gone, or when it would end after the expiry:
  `now + duration + margin > expires_at`. Since an expiry only ever moves later, a read admitted
  by this rule finishes before the blocks can be freed even if no pin message reaches the owner.
- Expiring or releasing frees exactly the lease's blocks, once (`BlocksFreed`, carrying the
  attempt the blocks were granted under, so the owner's per-attempt books stay right).
- A pin is bounded: it lasts until the time the reader asked for (`until`) plus `pin_grace`.
  A reader that never ends its read loses the pin then (`LeaseUnpinned(timed_out=True)`), and
  expiry or a deferred release goes ahead, so one stuck reader cannot hold blocks forever. The
  reader's side keeps the other half of the bargain: it cancels a read that outlives its pin.
- TTLs, extensions and read durations are finite, non-negative numbers (a NaN TTL would never
  expire); a lease names each block once.
- Ended lease ids are remembered for `forget_after` seconds (late heartbeats and reads are then
  refused as "expired"/"released"), then forgotten ("unknown"), so memory stays flat.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .checks import duplicates, finite, ours
from .errors import ProtocolError
from .events import (
    BlocksFreed,
    Event,
    LeaseExpired,
    LeaseGranted,
    LeasePinned,
    LeaseReleased,
    LeaseReleaseDeferred,
    LeaseRenewalRefused,
    LeaseRenewed,
    LeaseUnpinned,
    ReadRefused,
)

# --- commands -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Grant:
    lease: str
    request: str
    blocks: tuple[int, ...]
    num_tokens: int
    ttl: float
    renewable: bool = False
    block_hashes: tuple[str, ...] = ()
    purpose: Literal["retained", "pull_hold"] = "retained"
    attempt: int = 0


@dataclass(frozen=True, slots=True)
class Heartbeat:
    lease: str
    extension: float


@dataclass(frozen=True, slots=True)
class BeginRead:
    lease: str
    reader: str
    duration: float
    margin: float = 0.05


@dataclass(frozen=True, slots=True)
class EndRead:
    lease: str
    reader: str


@dataclass(frozen=True, slots=True)
class Release:
    lease: str
    reason: str


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed; expire what is due (only `lease`, when given)."""

    lease: str | None = None


LeaseCommand = Grant | Heartbeat | BeginRead | EndRead | Release | Tick


# --- state -----------------------------------------------------------------------------------------


@dataclass(slots=True)
class Lease:
    lease: str
    request: str
    blocks: tuple[int, ...]
    num_tokens: int
    block_hashes: tuple[str, ...]
    expires_at: float
    renewable: bool
    purpose: str
    attempt: int = 0
    pins: dict[str, float] = field(default_factory=dict)
    release_pending: str | None = None
    expired_pending: bool = False

    @property
    def phase(self) -> str:
        return "pinned" if self.pins else "active"


@dataclass(slots=True)
class LeaseTable:
    instance: str
    pin_grace: float = 5.0
    forget_after: float = 600.0
    leases: dict[str, Lease] = field(default_factory=dict)
    ended: dict[str, str] = field(default_factory=dict)  # lease -> "expired" | "released"
    ended_at: dict[str, float] = field(default_factory=dict)
    clock: float = float("-inf")

    def __post_init__(self) -> None:
        ours("lease", "pin_grace", finite(self.pin_grace, "pin_grace"))
        ours("lease", "forget_after", finite(self.forget_after, "forget_after", minimum=1e-3))

    # decide ----------------------------------------------------------------------------------
    def decide(self, cmd: LeaseCommand, now: float) -> list[Event]:
        now = max(now, self.clock)
        if isinstance(cmd, Grant):
            if cmd.lease in self.leases or cmd.lease in self.ended:
                raise ProtocolError("lease", "granted", "Grant", f"lease {cmd.lease} exists")
            ours("lease", "Grant", finite(cmd.ttl, "ttl", minimum=1e-9))
            ours("lease", "Grant", finite(cmd.num_tokens, "num_tokens"))
            ours("lease", "Grant", duplicates(cmd.blocks))
            return [
                LeaseGranted(
                    at=now,
                    instance=self.instance,
                    request=cmd.request,
                    attempt=cmd.attempt,
                    lease=cmd.lease,
                    blocks=cmd.blocks,
                    num_tokens=cmd.num_tokens,
                    block_hashes=cmd.block_hashes,
                    expires_at=now + cmd.ttl,
                    renewable=cmd.renewable,
                    purpose=cmd.purpose,
                )
            ]
        if isinstance(cmd, Tick):
            ids = [cmd.lease] if cmd.lease is not None else list(self.leases)
            out: list[Event] = []
            for lid in ids:
                ls = self.leases.get(lid)
                if ls is not None:
                    out += self._tick(ls, now)
            return out
        if isinstance(cmd, Heartbeat):
            ours("lease", "Heartbeat", finite(cmd.extension, "extension"))
        if isinstance(cmd, BeginRead):
            ours("lease", "BeginRead", finite(cmd.duration, "duration"))
            ours("lease", "BeginRead", finite(cmd.margin, "margin"))
        ls = self.leases.get(cmd.lease)
        if ls is None:
            gone = self.ended.get(cmd.lease, "unknown")
            if isinstance(cmd, Heartbeat):
                return [
                    LeaseRenewalRefused(
                        at=now, instance=self.instance, lease=cmd.lease, reason=gone
                    )
                ]
            if isinstance(cmd, BeginRead):
                return [
                    ReadRefused(
                        at=now,
                        instance=self.instance,
                        lease=cmd.lease,
                        reader=cmd.reader,
                        reason=gone,
                    )
                ]
            if isinstance(cmd, (Release, EndRead)):
                # releasing what is gone is a no-op, idempotent by design; so is the end of a
                # read whose pin timed out and whose lease then ended
                return []
            raise ProtocolError("lease", gone, type(cmd).__name__, f"lease {cmd.lease}")
        req = ls.request
        if isinstance(cmd, Heartbeat):
            if not ls.renewable:
                return [
                    LeaseRenewalRefused(
                        at=now,
                        instance=self.instance,
                        request=req,
                        lease=ls.lease,
                        reason="fixed TTL",
                    )
                ]
            if ls.expires_at <= now and not ls.pins:
                return [
                    LeaseRenewalRefused(
                        at=now,
                        instance=self.instance,
                        request=req,
                        lease=ls.lease,
                        reason="expired",
                    )
                ]
            return [
                LeaseRenewed(
                    at=now,
                    instance=self.instance,
                    request=req,
                    lease=ls.lease,
                    expires_at=max(ls.expires_at, now + cmd.extension),
                )
            ]
        if isinstance(cmd, BeginRead):
            if cmd.reader in ls.pins:
                raise ProtocolError("lease", ls.phase, "BeginRead", f"{cmd.reader} already reads")
            reason = None
            if ls.release_pending is not None:
                reason = "released"
            elif ls.expires_at <= now:
                reason = "expired"
            elif now + cmd.duration + cmd.margin > ls.expires_at:
                reason = "would expire before the read ends"
            if reason is not None:
                return [
                    ReadRefused(
                        at=now,
                        instance=self.instance,
                        request=req,
                        lease=ls.lease,
                        reader=cmd.reader,
                        reason=reason,
                    )
                ]
            return [
                LeasePinned(
                    at=now,
                    instance=self.instance,
                    request=req,
                    lease=ls.lease,
                    reader=cmd.reader,
                    until=now + cmd.duration + cmd.margin,
                )
            ]
        if isinstance(cmd, EndRead):
            if cmd.reader not in ls.pins:
                return []  # a late end: the pin timed out already (or the message is a copy)
            out = [
                LeaseUnpinned(
                    at=now, instance=self.instance, request=req, lease=ls.lease, reader=cmd.reader
                )
            ]
            if len(ls.pins) == 1:
                if ls.release_pending is not None:
                    out += self._end(ls, now, ls.release_pending)
                elif ls.expires_at <= now:
                    out += self._end(ls, now, None)
            return out
        if isinstance(cmd, Release):
            if ls.pins:
                if ls.release_pending is not None:
                    return []
                return [
                    LeaseReleaseDeferred(
                        at=now,
                        instance=self.instance,
                        request=req,
                        lease=ls.lease,
                        reason=cmd.reason,
                    )
                ]
            return self._end(ls, now, cmd.reason)
        raise ProtocolError("lease", ls.phase, type(cmd).__name__)

    def _tick(self, ls: Lease, now: float) -> list[Event]:
        """Pins past their bound are dropped; then expiry (or a deferred release) is due."""
        gone = sorted(r for r, until in ls.pins.items() if until + self.pin_grace <= now)
        out: list[Event] = [
            LeaseUnpinned(at=now, instance=self.instance, request=ls.request, lease=ls.lease,
                          reader=r, timed_out=True)
            for r in gone
        ]
        if len(gone) < len(ls.pins):
            return out
        if gone and ls.release_pending is not None:
            return out + self._end(ls, now, ls.release_pending)
        if ls.expires_at <= now:
            return out + self._end(ls, now, None)
        return out

    def _end(self, ls: Lease, now: float, release_reason: str | None) -> list[Event]:
        end: Event
        if release_reason is None:
            end = LeaseExpired(at=now, instance=self.instance, request=ls.request, lease=ls.lease)
            why = f"lease {ls.lease} expired"
        else:
            end = LeaseReleased(
                at=now,
                instance=self.instance,
                request=ls.request,
                lease=ls.lease,
                reason=release_reason,
            )
            why = f"lease {ls.lease} released: {release_reason}"
        return [
            end,
            BlocksFreed(
                at=now,
                instance=self.instance,
                request=ls.request,
                attempt=ls.attempt,
                blocks=ls.blocks,
                reason=why,
            ),
        ]

    # apply ------------------------------------------------------------------------------------
    def apply(self, e: Event) -> bool:
        """Fold a lease event; returns False when the event is not a lease event."""
        self.clock = max(self.clock, e.at)
        if type(e) not in _LEASE_EVENTS:  # most events a machine folds: one set lookup
            return False
        if isinstance(e, LeaseGranted):
            assert e.request is not None
            self.leases[e.lease] = Lease(
                e.lease,
                e.request,
                e.blocks,
                e.num_tokens,
                e.block_hashes,
                e.expires_at,
                e.renewable,
                e.purpose,
                e.attempt,
            )
        elif isinstance(e, LeaseRenewed):
            self.leases[e.lease].expires_at = e.expires_at
        elif isinstance(e, LeasePinned):
            self.leases[e.lease].pins[e.reader] = e.until
        elif isinstance(e, LeaseUnpinned):
            self.leases[e.lease].pins.pop(e.reader, None)
        elif isinstance(e, LeaseReleaseDeferred):
            self.leases[e.lease].release_pending = e.reason
        elif isinstance(e, LeaseExpired):
            self.leases.pop(e.lease, None)
            self.ended[e.lease] = "expired"
            self.ended_at[e.lease] = e.at
        elif isinstance(e, LeaseReleased):
            self.leases.pop(e.lease, None)
            self.ended[e.lease] = "released"
            self.ended_at[e.lease] = e.at
        elif isinstance(e, (ReadRefused, LeaseRenewalRefused)):
            pass
        else:
            return False
        return True

    def prune(self, now: float) -> None:
        """Forget leases that ended over `forget_after` before `now` (called while applying)."""
        cutoff = now - self.forget_after
        old = [lid for lid, t in self.ended_at.items() if t <= cutoff]
        for lid in old:
            del self.ended_at[lid]
            self.ended.pop(lid, None)

    def next_expiry(self) -> float | None:
        return min((ls.expires_at for ls in self.leases.values()), default=None)


# every event type `LeaseTable.apply` folds (each subclasses `Event` directly)
_LEASE_EVENTS: frozenset[type] = frozenset({
    LeaseGranted, LeaseRenewed, LeasePinned, LeaseUnpinned, LeaseReleaseDeferred, LeaseExpired,
    LeaseReleased, ReadRefused, LeaseRenewalRefused,
})
