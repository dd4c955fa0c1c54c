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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

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
    leases: dict[str, Lease] = field(default_factory=dict)
    ended: dict[str, str] = field(default_factory=dict)  # lease -> "expired" | "released"

    # decide ----------------------------------------------------------------------------------
    def decide(self, cmd: LeaseCommand, now: float) -> list[Event]:
        if isinstance(cmd, Grant):
            if cmd.lease in self.leases or cmd.lease in self.ended:
                raise ProtocolError("lease", "granted", "Grant", f"lease {cmd.lease} exists")
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
                if ls is not None and not ls.pins and ls.expires_at <= now:
                    out += self._end(ls, now, None)
            return out
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
            if isinstance(cmd, Release):
                return []  # releasing what is already gone is a no-op: idempotent by design
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
                raise ProtocolError("lease", ls.phase, "EndRead", f"{cmd.reader} holds no pin")
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
        elif isinstance(e, LeaseReleased):
            self.leases.pop(e.lease, None)
            self.ended[e.lease] = "released"
        elif isinstance(e, (ReadRefused, LeaseRenewalRefused)):
            pass
        else:
            return False
        return True

    def next_expiry(self) -> float | None:
        return min((ls.expires_at for ls in self.leases.values()), default=None)
