"""Signed handles: an HMAC-SHA256 over the canonical JSON of a handle's fields.

Rules kept here:
- Whoever issues a handle that names blocks (prefill's pull handle, the router's reuse handle)
  signs every field of it with the deployment's shared key; whoever acts on one verifies the
  signature first, so a client that can reach an engine's HTTP port cannot name blocks it was
  never given.
- Canonical JSON: sorted keys, no spaces, no NaN. The signature field itself is left out.
- Signatures are compared in constant time.
- A signed handle carries its expiry (`expires_at`) and the transfer it belongs to (`xfer`):
  `check_bound` refuses one past its expiry or presented for another transfer.

Sans-IO: the key and the time are arguments.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from typing import Any

SIG = "sig"


class SignatureError(ValueError):
    """A handle that is unsigned, altered, expired or bound to another transfer."""


def mac(key: bytes, fields: Mapping[str, Any]) -> str:
    body = {k: v for k, v in fields.items() if k != SIG}
    try:
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise SignatureError(f"handle is not plain JSON: {exc}") from None
    return hmac.new(key, canonical.encode(), hashlib.sha256).hexdigest()


def sign(key: bytes, fields: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in fields.items() if k != SIG}
    out[SIG] = mac(key, out)
    return out


def verify(key: bytes, fields: Any) -> None:
    if not isinstance(fields, Mapping):
        raise SignatureError("a handle must be a JSON object")
    sig = fields.get(SIG)
    if not isinstance(sig, str):
        raise SignatureError("handle carries no signature")
    if not hmac.compare_digest(mac(key, fields), sig):
        raise SignatureError("handle signature does not match: forged or altered")


def check_bound(fields: Mapping[str, Any], *, xfer: str | None, now: float) -> None:
    """Refuse a (verified) handle past its expiry or presented for another transfer."""
    expires = fields.get("expires_at")
    if isinstance(expires, bool) or not isinstance(expires, (int, float)):
        raise SignatureError("handle carries no expiry")
    if expires <= now:
        raise SignatureError("handle has expired")
    if xfer is not None and fields.get("xfer") != xfer:
        raise SignatureError(f"handle belongs to transfer {fields.get('xfer')!r}, not {xfer!r}")
