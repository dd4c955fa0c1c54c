"""The router's first contact with each instance: its models, its kvplane identity, and
whether it fits the router's mode and its peers' KV layouts.

Rules kept here:
- An instance is probed once (`/v1/models`, then its side channel's identity); a failure is
  looked at again after `leases.recheck_after` seconds; an instance that is slow is not down.
- One that does not fit the mode, or whose identity is unreadable, is not routed to, and the
  refusal names both sides' settings; prefill instances are paired only with decodes whose
  KV layout fits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Literal

import aiohttp

from .router_config import Role, RouterConfig, Upstream
from .router_errors import Refusal
from .router_metrics import RouterMetrics
from .router_upstream import (
    Identity,
    SettingsError,
    UpstreamError,
    describe,
    fetch_identity,
    mismatch,
    pair_mismatch,
)

log = logging.getLogger("kvplane.router")


@dataclass(slots=True)
class Contact:
    """What the router learned at first contact with one instance."""

    state: Literal["unknown", "ok", "down", "mismatch"] = "unknown"
    reason: str = ""
    timeout: bool = False
    identity: Identity | None = None
    models: tuple[str, ...] = ()
    max_model_len: int | None = None
    checked_at: float = float("-inf")  # monotonic
    lock: asyncio.Lock | None = None


class ContactsMixin:
    """Router methods about first contact (mixed into `Router`)."""

    config: RouterConfig
    contacts: dict[str, Contact]
    metrics: RouterMetrics

    # --- first contact ---------------------------------------------------------------------------

    async def contact_all(self) -> None:
        await asyncio.gather(*(self.contact(u) for u in self.config.prefill + self.config.decode))

    async def contact(self, up: Upstream) -> Contact:
        """Learn an instance's models and kvplane identity, once (failures: again later)."""
        c = self.contacts[up.id]
        if self._settled(c):
            return c
        if c.lock is None:
            c.lock = asyncio.Lock()
        async with c.lock:
            if not self._settled(c):  # another request may have probed while we waited
                await self._probe(up, c)
        return c

    def _settled(self, c: Contact) -> bool:
        """Known good, or known bad and not yet due for another look."""
        if c.state == "ok":
            return True
        age = time.monotonic() - c.checked_at
        return c.state != "unknown" and age < self.config.leases.recheck_after

    async def _probe(self, up: Upstream, c: Contact) -> None:
        limit = self.config.timeouts.control
        t = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=limit, sock_connect=self.config.timeouts.connect)
        mode = self.config.mode
        try:
            try:
                async with self.session.get(
                    up.url + "/v1/models", headers=self._upstream_auth(), timeout=timeout
                ) as resp:
                    models = await resp.json(content_type=None) if resp.status == 200 else None
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                raise describe(exc, up, "models probe", limit) from None
            data = models.get("data") if isinstance(models, dict) else None
            c.models = tuple(
                str(m["id"]) for m in data or () if isinstance(m, dict) and "id" in m
            )
            lens = [m.get("max_model_len") for m in data or () if isinstance(m, dict)]
            ints = [n for n in lens if isinstance(n, int) and not isinstance(n, bool) and n > 0]
            c.max_model_len = min(ints) if ints else None
            if self.config.check_settings:
                try:
                    ident = await fetch_identity(up, limit)
                except SettingsError as exc:
                    return self._set_contact(
                        c, "mismatch",
                        f"refusing to route to {up.role} instance {up.id} ({up.url}): its "
                        f"kvplane identity is unreadable ({exc}); router mode {mode}",
                    )
                if ident is None:
                    host, port = up.side_channel
                    return self._set_contact(
                        c, "mismatch",
                        f"refusing to route to {up.role} instance {up.id} ({up.url}): its side "
                        f"channel {host}:{port} has no kvplane identity (is KvplaneConnector "
                        f"loaded there?); router mode {mode}",
                    )
                c.identity = ident
                problem = mismatch(mode, up, ident)
                if problem is not None:
                    return self._set_contact(c, "mismatch", problem)
            self._set_contact(c, "ok", "")
        except UpstreamError as err:
            self._set_contact(c, "down", err.reason, timeout=err.kind == "timeout")
        finally:
            self.metrics.upstream_latency.labels(up.role, up.id, "control").observe(
                time.monotonic() - t
            )

    def _set_contact(
        self,
        c: Contact,
        state: Literal["ok", "down", "mismatch"],
        reason: str,
        *,
        timeout: bool = False,
    ) -> None:
        c.state, c.reason, c.timeout, c.checked_at = state, reason, timeout, time.monotonic()
        if state != "ok" and reason:
            log.warning("%s", reason)

    def _mark_down(self, instance: str, err: UpstreamError) -> None:
        """A leg could not reach the instance: skip it until the next recheck (slow is not down)."""
        if err.kind == "down" and instance in self.contacts:
            self._set_contact(self.contacts[instance], "down", err.reason)

    def known_models(self) -> tuple[str, ...]:
        if self.config.models:
            return self.config.models
        seen: dict[str, None] = {}
        for c in self.contacts.values():
            for m in c.models:
                seen.setdefault(m, None)
        return tuple(seen)

    def _usable(self, role: Role) -> list[Upstream]:
        ups = self.config.prefill if role == "prefill" else self.config.decode
        ok = [u for u in ups if self.contacts[u.id].state == "ok"]
        if ok:
            return ok
        cs = [self.contacts[u.id] for u in ups]
        reasons = "; ".join(c.reason or f"{u.id}: not contacted" for u, c in zip(ups, cs))
        if any(c.state == "mismatch" for c in cs):
            raise Refusal(502, reasons, "server_error", "kv_mode_mismatch")
        if all(c.timeout for c in cs):
            raise Refusal(504, f"no {role} instance answered: {reasons}", "server_error",
                          "upstream_timeout")
        raise Refusal(502, f"no {role} instance is reachable: {reasons}", "server_error",
                      "upstream_unavailable")

    def _pairable(self, prefills: list[Upstream], decode: Upstream) -> list[Upstream]:
        d = self.contacts[decode.id].identity
        if d is None:
            return prefills
        fits, reasons = [], []
        for p in prefills:
            ident = self.contacts[p.id].identity
            problem = pair_mismatch(p, ident, decode, d) if ident is not None else None
            if problem is None:
                fits.append(p)
            else:
                reasons.append(problem)
        if not fits:
            raise Refusal(502, "; ".join(reasons), "server_error", "kv_layout_mismatch")
        return fits
