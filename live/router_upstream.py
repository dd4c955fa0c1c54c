"""The router's side of the router <-> connector contract (docs/notes/live-protocol.md).

The wire shapes are `kvplane.live.connector_wire`'s (its `parse_leg`, `prefill_response` and
`decode_response` are the reference); this module builds the legs the router sends and reads
what comes back.

Rules kept here:
- Only the router writes `kv_transfer_params`. Everything of ours sits under `kvplane` next to
  vLLM's NIXL flags: prefill's leg has `do_remote_decode`, decode's leg `do_remote_prefill`.
  The transfer id (`xfer`) is the router's request id, also sent as `X-Request-Id` on both
  legs, so both instances' events name the same request.
- Prefill's leg is the client's request cut to one token (`max_tokens` = 1, and
  `max_completion_tokens` for chat), never streamed; with a retained handle from the
  conversation's last turn under `reuse` (bidirectional), signed by the router.
- Decode's leg is the client's request as sent (minus `conversation_id`). Pull: with the
  params prefill returned (`kvplane.pull`: prefill's held blocks) plus what to retain. Push:
  with `kvplane.source`, prefill's side-channel endpoint, sent at the same moment as prefill's
  leg. Bidirectional: `retain` true and `retain_ttl`; decode's answer then carries
  `kvplane.retained`, decode's handle.
- At first contact the router reads each instance's identity from its side channel (the
  connector's `sidechannel` server, key `identity`: endpoint, KV layout, settings) and refuses
  an instance that does not speak the contract, or a prefill/decode pair whose KV block sizes
  differ, naming both sides' settings.
- Failures come back as `UpstreamError` values with a kind (`down`, `timeout`, `status`,
  `protocol`) and a reason naming the instance, so the router answers 502 or 504 with it.
- Lease heartbeats, releases and handle look-ups are plain async functions of (instance, ...),
  so a deployment (or a test) can swap how they travel without touching the router. The
  defaults ask the side channel for `renew/<signed handle>`, `release/<signed handle>` and
  `retained/<xfer>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import struct
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from kvplane.core.router_rules import prefill_fields

from .connector_wire import PARAMS_KEY as KEY
from .connector_wire import WIRE_VERSION
from .router_config import RouterMode, Upstream
from .sidechannel import IDENTITY_KEY

RETAINED_KEY = "retained/{xfer}"
RENEW_KEY = "renew/{handle}"
RELEASE_KEY = "release/{handle}"
UNHOLD_KEY = "unhold/{handle}"

ErrorKind = Literal["down", "timeout", "status", "protocol"]


@dataclass(slots=True, eq=False)
class UpstreamError(Exception):
    """A leg that did not succeed; `status` is the HTTP status the router should answer."""

    kind: ErrorKind
    instance: str
    reason: str
    upstream_status: int | None = None
    body: Any = None  # the instance's own error body, when it sent one

    def __str__(self) -> str:
        return self.reason

    @property
    def status(self) -> int:
        if self.kind == "timeout":
            return 504
        code = self.upstream_status
        if self.kind == "status" and code is not None and 400 <= code < 500 and code != 408:
            return code  # the client's own mistake, as the engine judged it, goes back as it came
        return 502


def describe(exc: BaseException, up: Upstream, what: str, limit: float) -> UpstreamError:
    """Turn a client-side exception of a leg into an `UpstreamError` with a reason."""
    where = f"{up.role} instance {up.id} ({up.url})"
    if isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return UpstreamError("timeout", up.id, f"{where} did not answer the {what} "
                             f"within {limit:g}s")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamError("down", up.id, f"{where} is unreachable for the {what}: "
                             f"{exc.strerror or exc}")
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return UpstreamError("down", up.id, f"{where} closed the connection during the {what}")
    if isinstance(exc, aiohttp.ClientPayloadError):
        return UpstreamError("down", up.id, f"{where} broke off the {what}: {exc}")
    if isinstance(exc, (aiohttp.ClientError, OSError)):
        return UpstreamError("down", up.id, f"{where} failed the {what}: {exc!r}")
    return UpstreamError("protocol", up.id, f"{where}: {what} failed: {exc!r}")


# --- the side channel (kvplane.live.sidechannel's framing, spoken without blocking) -----------

_LEN = struct.Struct(">I")
_MAX_FRAME = 64 << 20


async def side_fetch(up: Upstream, key: str, timeout: float) -> bytes | None:
    """One payload from the instance's side channel; None if it has no such key.

    `UpstreamError` (down or timeout) when the side channel cannot be reached or breaks off.
    """
    host, port = up.side_channel
    what = f"side channel ({host}:{port}) request {key.split('/', 1)[0]!r}"

    async def go() -> bytes | None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            data = key.encode()
            writer.write(_LEN.pack(len(data)) + data)
            await writer.drain()
            (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
            if n > _MAX_FRAME:
                raise UpstreamError("protocol", up.id, f"{what}: a {n}-byte frame")
            reply = await reader.readexactly(n)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        if not reply or reply[0] != 1:
            return None
        return reply[1:]

    try:
        return await asyncio.wait_for(go(), timeout)
    except UpstreamError:
        raise
    except asyncio.IncompleteReadError:
        raise UpstreamError("down", up.id, f"{up.role} instance {up.id}: {what} "
                            "closed the connection early") from None
    except (TimeoutError, OSError) as exc:
        raise describe(exc, up, what, timeout) from None


# --- identity and settings ---------------------------------------------------------------------


class SettingsError(ValueError):
    """An instance's identity that cannot be read."""


@dataclass(frozen=True, slots=True)
class Identity:
    """What an instance's connector says about itself on its side channel (`identity`)."""

    endpoint: dict[str, Any]  # connector_wire.Endpoint: instance, host, port, engine_id
    block_size: int | None
    tp: int | None
    version: int
    modes: tuple[str, ...] | None  # None: not advertised (the connector does both)
    bidirectional: bool | None
    renewable: bool | None = None  # retained leases accept heartbeats
    signed: bool | None = None  # the connector checks the router's handle signatures
    raw: Mapping[str, Any] = field(default_factory=dict)

    def summary(self) -> str:
        parts = [f"instance={self.endpoint.get('instance')}", f"v={self.version}"]
        if self.block_size is not None:
            parts.append(f"block_size={self.block_size}")
        if self.tp is not None:
            parts.append(f"tp={self.tp}")
        if self.modes is not None:
            parts.append(f"modes={'/'.join(self.modes)}")
        for name, flag in (("bidirectional_kv_xfer", self.bidirectional),
                           ("lease_renewable", self.renewable), ("signed_handles", self.signed)):
            if flag is not None:
                parts.append(f"{name}={'on' if flag else 'off'}")
        return " ".join(parts)


def parse_identity(data: bytes) -> Identity:
    try:
        raw = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SettingsError(f"identity is not JSON: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("endpoint"), dict):
        raise SettingsError("identity has no endpoint")
    ep = raw["endpoint"]
    if not isinstance(ep.get("host"), str) or not isinstance(ep.get("port"), int):
        raise SettingsError("identity endpoint needs host and port")
    layout: dict[str, Any] = raw["layout"] if isinstance(raw.get("layout"), dict) else {}
    settings: dict[str, Any] = raw["settings"] if isinstance(raw.get("settings"), dict) else {}
    version = settings.get("v", raw.get("v", WIRE_VERSION))
    modes = settings.get("modes")
    bidi = settings.get("bidirectional_kv_xfer")
    bs, tp = layout.get("block_size"), layout.get("tp")
    renew, signed = settings.get("lease_renewable"), settings.get("signed_handles")
    return Identity(
        endpoint=dict(ep),
        block_size=bs if isinstance(bs, int) else None,
        tp=tp if isinstance(tp, int) else None,
        version=version if isinstance(version, int) else -1,
        modes=tuple(str(m) for m in modes) if isinstance(modes, list) else None,
        bidirectional=bidi if isinstance(bidi, bool) else None,
        renewable=renew if isinstance(renew, bool) else None,
        signed=signed if isinstance(signed, bool) else None,
        raw=raw,
    )


def mismatch(mode: RouterMode, up: Upstream, ident: Identity) -> str | None:
    """Why this instance cannot serve this router, naming both sides' settings; None if it can."""
    problems = []
    if ident.version != WIRE_VERSION:
        problems.append(f"contract version {ident.version} (the router speaks {WIRE_VERSION})")
    wire_mode = "push" if mode == "push" else "pull"
    if ident.modes is not None and wire_mode not in ident.modes:
        problems.append(f"it does not do {wire_mode} (router mode {mode})")
    if not problems:
        return None
    return (
        f"refusing to route to {up.role} instance {up.id} ({up.url}): its kvplane settings "
        f"[{ident.summary()}] do not fit the router [mode={mode} v={WIRE_VERSION}]: "
        + "; ".join(problems)
    )


def pair_mismatch(prefill: Upstream, p: Identity, decode: Upstream, d: Identity) -> str | None:
    """Why KV cannot move between these two instances; None if it can. Block sizes and TP
    sizes may differ (the connector plans token runs and rank streams across them); the
    model's shape (layers, KV heads, head bytes) may not."""
    pl, dl = p.raw.get("layout"), d.raw.get("layout")
    if not isinstance(pl, Mapping) or not isinstance(dl, Mapping):
        return None
    keys = ("num_layers", "num_kv_heads", "head_bytes", "planes")
    differ = [f"{k} {pl[k]} vs {dl[k]}" for k in keys if k in pl and k in dl and pl[k] != dl[k]]
    if differ:
        return (
            f"refusing to pair prefill {prefill.id} [{p.summary()}] with decode {decode.id} "
            f"[{d.summary()}]: their KV caches are of different models ({', '.join(differ)})"
        )
    return None


# --- legs -----------------------------------------------------------------------------------------


def prefill_body(
    body: Mapping[str, Any],
    *,
    chat: bool,
    mode: RouterMode,
    xfer: str,
    attempt: int,
    reuse: Mapping[str, Any] | None,
    tenant: str,
    conversation: str | None,
) -> dict[str, Any]:
    """Prefill's leg: the client's request cut to one token, with prefill's params."""
    out = prefill_fields(body, chat=chat)
    out["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        KEY: {
            "v": WIRE_VERSION,
            "role": "prefill",
            "mode": "push" if mode == "push" else "pull",
            "xfer": xfer,
            "attempt": attempt,
            "reuse": dict(reuse) if reuse is not None else None,
            "tenant": tenant,
            "conversation": conversation,
        },
    }
    return out


def decode_body(
    body: Mapping[str, Any],
    *,
    mode: RouterMode,
    xfer: str,
    attempt: int,
    prefill: str,
    pulled: Mapping[str, Any] | None,
    source: Mapping[str, Any] | None,
    retain: bool | None,
    retain_ttl: float | None,
    tenant: str,
    conversation: str | None,
) -> dict[str, Any]:
    """Decode's leg: the client's request with decode's params.

    Pull: `pulled` is the `kv_transfer_params` prefill answered with, passed on as is plus the
    router's fields. Push: `source` is prefill's side-channel endpoint. Neither: decode
    computes the prompt itself (no transfer).
    """
    out = copy.deepcopy(dict(body))
    if pulled is not None:
        params = copy.deepcopy(dict(pulled))
        inner = dict(params.get(KEY) or {})
    elif source is not None:
        params = {"do_remote_prefill": True, "do_remote_decode": False}
        inner = {"v": WIRE_VERSION, "role": "decode", "mode": "push", "xfer": xfer,
                 "attempt": attempt, "source": dict(source)}
    else:
        params = {"do_remote_prefill": False, "do_remote_decode": False}
        inner = {"v": WIRE_VERSION, "role": "decode", "mode": "push" if mode == "push" else "pull",
                 "xfer": xfer, "attempt": attempt}
    inner.update({"prefill": prefill, "tenant": tenant, "conversation": conversation})
    if retain is not None:
        inner["retain"] = retain
    if retain_ttl is not None:
        inner["retain_ttl"] = retain_ttl
    params[KEY] = inner
    out["kv_transfer_params"] = params
    return out


def kvplane_params(answer: Any) -> dict[str, Any] | None:
    """The `kvplane` object of an answer's (or a stream chunk's) `kv_transfer_params`."""
    if not isinstance(answer, dict):
        return None
    params = answer.get("kv_transfer_params")
    if not isinstance(params, dict):
        return None
    inner = params.get(KEY)
    return inner if isinstance(inner, dict) else None


# --- control calls (side channel) -------------------------------------------------------------

#: Renew a lease: `(decode instance, signed handle) -> new expiry (epoch s), or None if refused`.
Heartbeat = Callable[[Upstream, Mapping[str, Any]], Awaitable[float | None]]
#: Release a lease the router no longer needs (replaced, or read and superseded).
Release = Callable[[Upstream, Mapping[str, Any], str], Awaitable[None]]
#: Decode's retained handle for a transfer id, when its answer did not carry it (a stream).
FetchHandle = Callable[[Upstream, str], Awaitable[dict[str, Any] | None]]


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def side_heartbeat(timeout: float) -> Heartbeat:
    """Ask decode's side channel for `renew/<signed handle>`: a JSON `{"expires_at": t}`."""

    async def heartbeat(up: Upstream, handle: Mapping[str, Any]) -> float | None:
        reply = await side_fetch(up, RENEW_KEY.format(handle=_canonical(dict(handle))), timeout)
        if reply is None:
            return None
        try:
            t = json.loads(reply).get("expires_at")
        except (json.JSONDecodeError, AttributeError):
            t = None
        if isinstance(t, (int, float)) and not isinstance(t, bool):
            return float(t)
        raise UpstreamError("protocol", up.id, f"heartbeat to {up.id}: unreadable answer "
                            f"{reply[:100]!r}")

    return heartbeat


def side_release(timeout: float) -> Release:
    async def release(up: Upstream, handle: Mapping[str, Any], reason: str) -> None:
        await side_fetch(up, RELEASE_KEY.format(handle=_canonical(dict(handle))), timeout)

    return release


def side_fetch_handle(timeout: float) -> FetchHandle:
    async def fetch(up: Upstream, xfer: str) -> dict[str, Any] | None:
        reply = await side_fetch(up, RETAINED_KEY.format(xfer=xfer), timeout)
        if reply is None:
            return None
        try:
            handle = json.loads(reply)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        return handle if isinstance(handle, dict) else None

    return fetch


async def fetch_identity(up: Upstream, timeout: float) -> Identity | None:
    """The instance's identity; None if its side channel has none (not a kvplane connector)."""
    data = await side_fetch(up, IDENTITY_KEY, timeout)
    return parse_identity(data) if data is not None else None


async def side_unhold(up: Upstream, handle: Mapping[str, Any], timeout: float) -> bool:
    """Give prefill back a pull hold that decode will never read (prefill checks that the
    handle is its own). True when prefill freed the blocks."""
    reply = await side_fetch(up, UNHOLD_KEY.format(handle=_canonical(dict(handle))), timeout)
    if reply is None:
        return False
    try:
        return bool(json.loads(reply).get("released"))
    except (json.JSONDecodeError, AttributeError):
        return False
