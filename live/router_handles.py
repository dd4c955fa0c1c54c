"""Retained-KV handles on the wire, signed, and the tenant a request belongs to.

Rules kept here:
- A retained handle travels as decode's own dict (`connector_wire.Retained.to_dict()`:
  source endpoint, lease, blocks, layout, hashes, expiry). When the router hands one out (to
  prefill as `reuse`, to decode's side channel in a heartbeat) it adds the `tenant` and
  `conversation` it belongs to and `sig`: HMAC-SHA256 over the canonical JSON (sorted keys, no
  spaces) of every other field. Changing anything (another lease, other blocks, another tenant,
  a later expiry) breaks the signature, so a connector holding the same key detects a forged
  or altered handle before it reads or renews anything (`verify_wire`).
- Signatures are compared in constant time (`hmac.compare_digest`).
- The core's `RetainedHandle` (what the session table keeps and records) is read from the wire
  dict with every type checked (`core_handle`); the decode instance is the one the router sent
  the leg to, never what the answer claims.
- The tenant comes from the `Authorization: Bearer <key>` API key when there is one: the key's
  configured tenant, else `key-` and a hash of the key (the key itself is never kept or
  recorded). Without a key: `anonymous` where the router has API keys configured; otherwise
  (behind a gateway that authenticates) the `X-Tenant` header, else `default`. A bearer key
  always wins over `X-Tenant`, and a header can never name a keyed tenant, so a client cannot
  reach another tenant's conversations by adding a header.
- The conversation comes from the body field `conversation_id`, else the `X-Conversation-Id`
  header; it is scoped by the tenant everywhere (the session table's key is the pair).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Mapping
from typing import Any, Literal

from kvplane.core.reuse import RetainedHandle

SIG = "sig"
SCOPE = ("tenant", "conversation")

_NAME = re.compile(r"^[\x21-\x7e]{1,256}$")  # printable ASCII, no spaces, 1-256 characters


class HandleError(ValueError):
    """A handle on the wire that is malformed, or whose signature does not match."""


def _mac(key: bytes, fields: Mapping[str, Any]) -> str:
    body = {k: v for k, v in fields.items() if k != SIG}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hmac.new(key, canonical.encode(), hashlib.sha256).hexdigest()


def sign_wire(
    key: bytes, wire: Mapping[str, Any], tenant: str, conversation: str
) -> dict[str, Any]:
    """The handle as handed out: decode's dict, scoped to (tenant, conversation), signed."""
    out = {k: v for k, v in wire.items() if k not in (SIG, *SCOPE)}
    out["tenant"], out["conversation"] = tenant, conversation
    out[SIG] = _mac(key, out)
    return out


def verify_wire(key: bytes, wire: Any) -> tuple[str, str]:
    """Check a signed handle; its `(tenant, conversation)`, or `HandleError`."""
    if not isinstance(wire, Mapping):
        raise HandleError("a handle must be a JSON object")
    sig = wire.get(SIG)
    if not isinstance(sig, str):
        raise HandleError("handle carries no signature")
    if not all(isinstance(wire.get(k), str) for k in SCOPE):
        raise HandleError("handle names no tenant and conversation")
    try:
        want = _mac(key, wire)
    except (TypeError, ValueError) as exc:
        raise HandleError(f"handle is not plain JSON: {exc}") from None
    if not hmac.compare_digest(want, sig):
        raise HandleError("handle signature does not match: forged or altered")
    return str(wire["tenant"]), str(wire["conversation"])


def core_handle(wire: Mapping[str, Any], *, decode: str) -> RetainedHandle:
    """The session table's `RetainedHandle` from decode's dict, every type checked."""
    try:
        hashes = wire["block_hashes"]
        lease, num_tokens = wire["lease"], wire["num_tokens"]
        block_size, expires_at = wire["block_size"], wire["expires_at"]
    except KeyError as exc:
        raise HandleError(f"handle lacks {exc.args[0]!r}") from None
    if not isinstance(hashes, (list, tuple)) or not all(isinstance(x, str) for x in hashes):
        raise HandleError("block_hashes must be a list of strings")
    if not isinstance(lease, str) or not lease:
        raise HandleError("lease must be a non-empty string")
    for what, v in (("num_tokens", num_tokens), ("block_size", block_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise HandleError(f"{what} must be a non-negative integer")
    if block_size == 0:
        raise HandleError("block_size must be positive")
    if isinstance(expires_at, bool) or not isinstance(expires_at, (int, float)):
        raise HandleError("expires_at must be a number (seconds since the epoch)")
    return RetainedHandle(decode, lease, num_tokens, block_size, tuple(hashes), float(expires_at))


def with_expiry(wire: Mapping[str, Any], h: RetainedHandle) -> dict[str, Any]:
    """Decode's dict brought up to date with the table's handle (a renewed expiry)."""
    out = dict(wire)
    out["expires_at"] = h.expires_at
    return out


TenantSource = Literal["known_key", "unknown_key", "header", "default", "invalid"]
ANONYMOUS = "anonymous"


def tenant_of(headers: Mapping[str, str], api_keys: Mapping[str, str]) -> tuple[str, TenantSource]:
    """`(tenant, where it came from)`; source `invalid` (tenant "") for an unusable header.

    `X-Tenant` is honoured only where the router knows no API keys (it sits behind a gateway
    that authenticates); where it does, a request without a key is `anonymous`, so no header
    can borrow a keyed tenant's name. A header may not take a `key-` name either.
    """
    auth = headers.get("Authorization", "")
    if auth:
        scheme, _, token = auth.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return "", "invalid"
        known = api_keys.get(token)
        if known is not None:
            return known, "known_key"
        return "key-" + hashlib.sha256(token.encode()).hexdigest()[:16], "unknown_key"
    if api_keys:
        return ANONYMOUS, "default"
    named = headers.get("X-Tenant")
    if named is not None:
        if not _NAME.match(named) or named.startswith("key-"):
            return "", "invalid"
        return named, "header"
    return "default", "default"


def valid_name(value: object) -> bool:
    """A usable conversation id or tenant: printable ASCII, no spaces, 1-256 characters."""
    return isinstance(value, str) and bool(_NAME.match(value))
