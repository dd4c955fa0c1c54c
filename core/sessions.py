"""The router's conversation table: (tenant, conversation) -> decode's retained-KV handle.

Rules kept here:
- Keys are scoped by tenant: one tenant's conversation id can never reach another's handle.
- A handle is single use: `Take` removes it, so two concurrent turns of one conversation never
  read the same retained blocks twice; the turn's new handle is stored when it finishes.
- `Store` replaces any handle still there (the older one is dropped: the driver tells its decode
  to release the lease). Handles expire with their lease; heartbeat renewals move the expiry.
- Only metadata lives here (never KV), taken from decode's responses, never by polling.
- A handle keeps the block size its hashes were taken with (recorded in `SessionStored`), so a
  rebuilt table compares prefixes at the right granularity.
- The table is a fold of `Session*` events, so a restarted router rebuilds it from the store.
- Once taken or dropped, a handle's lease never comes back: a copy of its `Store` delivered
  again is ignored, so a network duplicate cannot make one retained KV readable twice. Those
  lease ids are kept until the handle's own expiry, then forgotten (memory stays flat).
- `Renew` names the lease it renews: a heartbeat answer for a lease that was replaced meanwhile
  never extends the new handle.
- A handle that cannot be right (block size not positive, negative tokens, an expiry that is not
  a finite time) is the peer misbehaving: `PeerError`, never stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .checks import finite, ours, theirs
from .events import (
    Event,
    SessionDropped,
    SessionMissed,
    SessionRenewed,
    SessionStored,
    SessionTaken,
)
from .machine import Machine
from .reuse import RetainedHandle, handle_problem

SessionKey = tuple[str, str]
PRUNE_EVERY = 60.0  # seconds of event time between sweeps of expired consumed leases


@dataclass(frozen=True, slots=True)
class Store:
    tenant: str
    conversation: str
    handle: RetainedHandle
    request: str | None = None


@dataclass(frozen=True, slots=True)
class Take:
    tenant: str
    conversation: str
    request: str | None = None


@dataclass(frozen=True, slots=True)
class Renew:
    tenant: str
    conversation: str
    expires_at: float
    lease: str  # the lease the renewal is for; a replaced handle is never extended


@dataclass(frozen=True, slots=True)
class Drop:
    tenant: str
    conversation: str
    reason: str


@dataclass(frozen=True, slots=True)
class Expire:
    """Time passed: drop every handle whose lease has run out."""


SessionCommand = Store | Take | Renew | Drop | Expire


@dataclass(slots=True)
class SessionTable(Machine[SessionCommand]):
    instance: str = "router"
    block_size: int = 16
    handles: dict[SessionKey, RetainedHandle] = field(default_factory=dict)
    consumed: dict[str, float] = field(default_factory=dict)  # lease taken/dropped -> expiry
    _pruned_at: float = 0.0
    name = "sessions"

    def __post_init__(self) -> None:
        Machine.__init__(self, self.instance)

    def decide(self, cmd: SessionCommand, now: float) -> list[Event]:
        now = self.now_of(now)
        i = self.instance
        if isinstance(cmd, Expire):
            return [
                SessionDropped(
                    at=now,
                    instance=i,
                    tenant=t,
                    conversation=c,
                    lease=h.lease,
                    reason="lease expired",
                )
                for (t, c), h in self.handles.items()
                if h.expires_at <= now
            ]
        key = (cmd.tenant, cmd.conversation)
        old = self.handles.get(key)
        if isinstance(cmd, Store):
            h = cmd.handle
            theirs(handle_problem(h))
            if h.lease in self.consumed:
                return []  # a copy of a Store whose handle was already used or dropped
            out: list[Event] = []
            if old is not None and old.lease != h.lease:
                out.append(
                    SessionDropped(
                        at=now,
                        instance=i,
                        request=cmd.request,
                        tenant=cmd.tenant,
                        conversation=cmd.conversation,
                        lease=old.lease,
                        reason="replaced",
                    )
                )
            out.append(
                SessionStored(
                    at=now,
                    instance=i,
                    request=cmd.request,
                    tenant=cmd.tenant,
                    conversation=cmd.conversation,
                    decode=h.decode,
                    lease=h.lease,
                    num_tokens=h.num_tokens,
                    block_hashes=h.block_hashes,
                    expires_at=h.expires_at,
                    block_size=h.block_size,
                )
            )
            return out
        if isinstance(cmd, Take):
            if old is None:
                return [
                    SessionMissed(
                        at=now,
                        instance=i,
                        request=cmd.request,
                        tenant=cmd.tenant,
                        conversation=cmd.conversation,
                        reason="no handle",
                    )
                ]
            if old.expires_at <= now:
                return [
                    SessionDropped(
                        at=now,
                        instance=i,
                        request=cmd.request,
                        tenant=cmd.tenant,
                        conversation=cmd.conversation,
                        lease=old.lease,
                        reason="lease expired",
                    ),
                    SessionMissed(
                        at=now,
                        instance=i,
                        request=cmd.request,
                        tenant=cmd.tenant,
                        conversation=cmd.conversation,
                        reason="expired",
                    ),
                ]
            return [
                SessionTaken(
                    at=now,
                    instance=i,
                    request=cmd.request,
                    tenant=cmd.tenant,
                    conversation=cmd.conversation,
                    lease=old.lease,
                )
            ]
        if isinstance(cmd, Renew):
            ours(self.name, "Renew", finite(cmd.expires_at, "expires_at", minimum=None))
            if old is None or old.lease != cmd.lease or cmd.expires_at <= old.expires_at:
                return []
            return [
                SessionRenewed(
                    at=now,
                    instance=i,
                    tenant=cmd.tenant,
                    conversation=cmd.conversation,
                    lease=old.lease,
                    expires_at=cmd.expires_at,
                )
            ]
        if old is None:
            return []
        return [
            SessionDropped(
                at=now,
                instance=i,
                tenant=cmd.tenant,
                conversation=cmd.conversation,
                lease=old.lease,
                reason=cmd.reason,
            )
        ]

    def apply(self, ev: Event) -> SessionTable:
        self.saw(ev)
        if self.consumed and ev.at - self._pruned_at >= PRUNE_EVERY:
            self._pruned_at = ev.at
            self.consumed = {k: t for k, t in self.consumed.items() if t > ev.at}
        if isinstance(ev, SessionStored):
            bs = ev.block_size if ev.block_size is not None else self.block_size
            self.handles[(ev.tenant, ev.conversation)] = RetainedHandle(
                ev.decode, ev.lease, ev.num_tokens, bs, ev.block_hashes, ev.expires_at
            )
        elif isinstance(ev, (SessionTaken, SessionDropped)):
            h = self.handles.get((ev.tenant, ev.conversation))
            if h is not None and h.lease == ev.lease:
                del self.handles[(ev.tenant, ev.conversation)]
                self.consumed[ev.lease] = h.expires_at
        elif isinstance(ev, SessionRenewed):
            key = (ev.tenant, ev.conversation)
            h = self.handles.get(key)
            if h is not None and h.lease == ev.lease:
                self.handles[key] = RetainedHandle(
                    h.decode, h.lease, h.num_tokens, h.block_size, h.block_hashes, ev.expires_at
                )
        return self

    def handle_of(self, tenant: str, conversation: str) -> RetainedHandle | None:
        return self.handles.get((tenant, conversation))
