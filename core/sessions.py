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
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .events import (
    Event,
    SessionDropped,
    SessionMissed,
    SessionRenewed,
    SessionStored,
    SessionTaken,
)
from .machine import Machine
from .reuse import RetainedHandle

SessionKey = tuple[str, str]


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
    name = "sessions"

    def __post_init__(self) -> None:
        Machine.__init__(self, self.instance)

    def decide(self, cmd: SessionCommand, now: float) -> list[Event]:
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
            if old is None or cmd.expires_at <= old.expires_at:
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
        if isinstance(ev, SessionStored):
            bs = ev.block_size if ev.block_size is not None else self.block_size
            self.handles[(ev.tenant, ev.conversation)] = RetainedHandle(
                ev.decode, ev.lease, ev.num_tokens, bs, ev.block_hashes, ev.expires_at
            )
        elif isinstance(ev, (SessionTaken, SessionDropped)):
            h = self.handles.get((ev.tenant, ev.conversation))
            if h is not None and h.lease == ev.lease:
                del self.handles[(ev.tenant, ev.conversation)]
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
