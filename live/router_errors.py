"""The router's refusals: OpenAI-shaped errors, and what an instance's answer means.

Rules kept here:
- Errors are `{"error": {"message", "type", "param", "code"}}`; a `Refusal` is an answer the
  router gives instead of routing.
- An instance that judged the client's request (HTTP 4xx) has its words passed on; anything
  else an instance does wrong (5xx, not JSON, too slow, down) is the router's 502/504.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .router_config import Upstream
from .router_upstream import (
    UpstreamError,
)


@dataclass(slots=True, eq=False)
class Refusal(Exception):
    """An answer the router gives instead of routing: status and an OpenAI-shaped error."""

    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None

    def __str__(self) -> str:
        return self.message


def error_body(
    message: str, type_: str, code: str | None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def refusal_of(exc: UpstreamError) -> Refusal:
    status = exc.status
    if status < 500:  # the engine judged the client's request: pass its words on
        msg = exc.reason
        if isinstance(exc.body, dict) and isinstance(exc.body.get("error"), dict):
            msg = str(exc.body["error"].get("message", msg))
        return Refusal(status, msg, "invalid_request_error", "upstream_rejected")
    code = {
        "timeout": "upstream_timeout",
        "down": "upstream_unavailable",
        "status": "upstream_error",
        "protocol": "upstream_protocol_error",
    }[exc.kind]
    return Refusal(status, exc.reason, "server_error", code)


def answer(up: Upstream, what: str, status: int, text: str) -> dict[str, Any]:
    """An instance's JSON answer, or `UpstreamError` saying what was wrong with it."""
    try:
        body = json.loads(text) if text else None
    except json.JSONDecodeError:
        body = None
    if status != 200:
        detail = body.get("error") if isinstance(body, dict) else None
        if isinstance(detail, dict):
            msg = str(detail.get("message"))
        elif isinstance(body, dict) and isinstance(body.get("message"), str):
            msg = body["message"]  # vLLM's older error shape
        else:
            msg = text[:200] or "no body"
        raise UpstreamError(
            "status", up.id,
            f"{up.role} instance {up.id} ({up.url}) answered the {what} with HTTP {status}: "
            f"{msg}",
            status, body,
        )
    if not isinstance(body, dict):
        raise UpstreamError(
            "protocol", up.id,
            f"{up.role} instance {up.id} ({up.url}) answered the {what} with something that "
            f"is not a JSON object: {text[:200]!r}",
        )
    return body
