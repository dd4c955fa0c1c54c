"""The router's conversation table and the leases behind it.

Rules kept here:
- A turn takes its conversation's handle (single use); decode's new handle is stored when the
  turn ends; a replaced or superseded lease is released on its decode (signed); a turn that
  stored nothing puts an unexpired handle back (`kvplane.core.router_rules.put_back`).
- Renewable leases of conversations active within `leases.idle_after` get heartbeats every
  `leases.heartbeat_every` seconds; idle ones are left to expire.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import aiohttp

from kvplane.core.events import (
    SessionDropped,
    SessionMissed,
    SessionTaken,
)
from kvplane.core.reuse import RetainedHandle
from kvplane.core.sessions import Drop, Expire, Renew, SessionKey, SessionTable, Store, Take

from .router_config import RouterConfig
from .router_handles import (
    sign_wire,
    with_expiry,
)
from .router_metrics import RouterMetrics
from .router_upstream import (
    UpstreamError,
)

if TYPE_CHECKING:
    from .router import Turn

log = logging.getLogger("kvplane.router")


class LeasesMixin:
    """Router methods about the conversation table and its leases (mixed into `Router`)."""

    config: RouterConfig
    table: SessionTable
    wires: dict[SessionKey, dict[str, Any]]
    metrics: RouterMetrics

    # --- the conversation table ------------------------------------------------------------------

    def _take(self, turn: Turn) -> None:
        assert turn.key is not None
        tenant, conversation = turn.key
        held = self.table.handle_of(tenant, conversation)
        events = self.table.handle(Take(tenant, conversation, turn.id), self.clock())
        self._record_all(events)
        for ev in events:
            if isinstance(ev, SessionTaken):
                turn.taken = held
                turn.taken_wire = self.wires.pop(turn.key, None)
                self.metrics.reuse_hits.inc()
            elif isinstance(ev, SessionMissed):
                self.metrics.reuse_misses.labels(ev.reason).inc()
            elif isinstance(ev, SessionDropped):
                self.metrics.leases_dropped.labels(ev.reason).inc()
                self.wires.pop(turn.key, None)

    def _store(
        self,
        key: SessionKey,
        h: RetainedHandle,
        wire: dict[str, Any] | None,
        request: str,
        now: float,
    ) -> None:
        old, old_wire = self.table.handle_of(*key), self.wires.get(key)
        events = self.table.handle(Store(key[0], key[1], h, request), now)
        self._record_all(events)
        if wire is not None:
            self.wires[key] = wire
        else:
            self.wires.pop(key, None)
        self.xfers[key] = request if wire is None or "xfer" not in wire else str(wire["xfer"])
        for ev in events:
            if isinstance(ev, SessionDropped):
                self.metrics.leases_dropped.labels(ev.reason).inc()
                if old is not None:
                    self._release_later(key, old, old_wire, ev.reason)

    def _release_later(
        self, key: SessionKey, h: RetainedHandle, wire: dict[str, Any] | None, reason: str
    ) -> None:
        up = self.config.upstream(h.decode)
        if up is None or wire is None:
            return  # without decode's full handle there is nothing to sign: it will expire
        signed = sign_wire(self.config.hmac_key, with_expiry(wire, h), key[0], key[1])
        release = self._release

        async def go() -> None:
            try:
                await release(up, signed, reason)
            except (TimeoutError, UpstreamError, aiohttp.ClientError) as exc:
                log.warning("releasing lease %s on %s failed: %s", h.lease, up.id, exc)

        self._spawn(go())

    # --- leases ----------------------------------------------------------------------------------

    async def _lease_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.leases.heartbeat_every)
            try:
                await self.lease_round()
            except Exception:  # the loop must outlive one bad round
                log.exception("lease round failed")

    def _expire(self) -> None:
        events = self.table.handle(Expire(), self.clock())
        self._record_all(events)
        for ev in events:
            if isinstance(ev, SessionDropped):
                self.metrics.leases_dropped.labels(ev.reason).inc()
                self.wires.pop((ev.tenant, ev.conversation), None)

    def active(self) -> list[tuple[SessionKey, RetainedHandle]]:
        """Conversations with a handle whose last turn ended less than `idle_after` ago."""
        now = time.monotonic()
        idle = self.config.leases.idle_after
        return [
            (key, h)
            for key, h in self.table.handles.items()
            if now - self.last_turn.get(key, float("-inf")) < idle
        ]

    async def lease_round(self) -> None:
        """Drop expired handles, then one heartbeat per active conversation's renewable lease."""
        self._expire()
        self._session_gauges()
        if not self.config.leases.renewable:
            return
        beats = []
        for key, h in self.active():
            wire = self.wires.get(key)
            if wire is not None and wire.get("renewable"):
                beats.append(self._beat(key, h, wire))
        await asyncio.gather(*beats)

    async def _beat(self, key: SessionKey, h: RetainedHandle, wire: dict[str, Any]) -> None:
        up = self.config.upstream(h.decode)
        if up is None:
            return
        signed = sign_wire(self.config.hmac_key, with_expiry(wire, h), key[0], key[1])
        t = time.monotonic()
        try:
            expires = await self._heartbeat(up, signed)
        except (TimeoutError, UpstreamError, aiohttp.ClientError) as exc:
            self.metrics.heartbeats.labels("failed").inc()
            log.warning("heartbeat for lease %s on %s failed: %s", h.lease, up.id, exc)
            return
        finally:
            self.metrics.upstream_latency.labels("decode", up.id, "control").observe(
                time.monotonic() - t
            )
        current = self.table.handle_of(*key)
        if current is None or current.lease != h.lease:
            return  # a turn took or replaced it meanwhile
        if expires is None:
            self.metrics.heartbeats.labels("refused").inc()
            self.metrics.leases_dropped.labels("renewal refused").inc()
            events = self.table.handle(Drop(key[0], key[1], "renewal refused"), self.clock())
            self.wires.pop(key, None)
        else:
            self.metrics.heartbeats.labels("renewed").inc()
            events = self.table.handle(Renew(key[0], key[1], expires, h.lease), self.clock())
        self._record_all(events)

    def _session_gauges(self) -> None:
        active = len(self.active())
        self.metrics.sessions.labels("active").set(active)
        self.metrics.sessions.labels("idle").set(len(self.table.handles) - active)
