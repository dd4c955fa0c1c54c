"""Reading decode's answers on the way to the client: SSE events, tokens, kvplane params.

Rules kept here:
- Server-sent events are split at blank lines (`\\n\\n` or `\\r\\n\\r\\n`); a partial event
  waits for the rest of its bytes, so the client only ever receives whole events.
- An event whose JSON carries `kv_transfer_params` is rewritten without it: the connector's
  metadata (lease ids, block ids, hosts) is for the router, never for the client. The router
  keeps the `kvplane` object for itself. Every other event is passed on byte for byte.
- A "token" event is one with generated text (completions `text`, chat `delta.content`,
  `delta.reasoning_content` or `delta.tool_calls`); the first one sets the TTFT. The output
  token count is the engine's `usage.completion_tokens` when the stream carries usage, else
  the number of token events (vLLM sends one event per token step).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .router_upstream import kvplane_params


def _has_text(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    if isinstance(choice.get("text"), str) and choice["text"]:
        return True
    for holder in (choice.get("delta"), choice.get("message")):
        if isinstance(holder, dict):
            for key in ("content", "reasoning_content", "reasoning"):
                if isinstance(holder.get(key), str) and holder[key]:
                    return True
            if holder.get("tool_calls"):
                return True
    return False


def has_tokens(obj: Any) -> bool:
    """Does this answer (or chunk) carry generated text?"""
    if not isinstance(obj, dict):
        return False
    choices = obj.get("choices")
    return isinstance(choices, list) and any(_has_text(c) for c in choices)


def completion_tokens(obj: Any) -> int | None:
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if isinstance(usage, dict):
        n = usage.get("completion_tokens")
        if isinstance(n, int) and not isinstance(n, bool):
            return n
    return None


def strip_params(answer: dict[str, Any]) -> dict[str, Any] | None:
    """Remove `kv_transfer_params` from an answer in place; its `kvplane` object, if any."""
    inner = kvplane_params(answer)
    answer.pop("kv_transfer_params", None)
    return inner


@dataclass(slots=True)
class SSEReader:
    """Feed it decode's stream bytes; it hands back whole events for the client."""

    buffer: bytes = b""
    kvplane: dict[str, Any] | None = None  # the last kvplane object seen in the stream
    token_events: int = 0
    usage_tokens: int | None = None
    errors: list[Any] = field(default_factory=list)
    done: bool = False

    def feed(self, data: bytes) -> list[tuple[bytes, bool]]:
        """Whole events so far, each as (bytes to send, carries tokens)."""
        self.buffer += data
        out: list[tuple[bytes, bool]] = []
        while True:
            cut, sep = _split(self.buffer)
            if cut < 0:
                return out
            raw, self.buffer = self.buffer[: cut + sep], self.buffer[cut + sep :]
            out.append(self._event(raw))

    def rest(self) -> list[tuple[bytes, bool]]:
        """Whatever is left when the stream ends (an unterminated last event)."""
        if not self.buffer.strip():
            return []
        raw, self.buffer = self.buffer + b"\n\n", b""
        return [self._event(raw)]

    def _event(self, raw: bytes) -> tuple[bytes, bool]:
        lines = raw.replace(b"\r\n", b"\n").split(b"\n")
        data = b"\n".join(ln[5:].lstrip(b" ") for ln in lines if ln.startswith(b"data:"))
        if not data:
            return raw, False
        if data.strip() == b"[DONE]":
            self.done = True
            return raw, False
        try:
            obj = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return raw, False
        if not isinstance(obj, dict):
            return raw, False
        if "error" in obj:
            self.errors.append(obj["error"])
        n = completion_tokens(obj)
        if n is not None:
            self.usage_tokens = n
        tokens = has_tokens(obj)
        if tokens:
            self.token_events += 1
        if "kv_transfer_params" in obj:
            inner = strip_params(obj)
            if inner is not None:
                self.kvplane = inner
            raw = b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
        return raw, tokens

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.token_events


def _split(buf: bytes) -> tuple[int, int]:
    """Position and length of the first event separator, or (-1, 0)."""
    a, b = buf.find(b"\n\n"), buf.find(b"\r\n\r\n")
    if a < 0 and b < 0:
        return -1, 0
    if b < 0 or (0 <= a < b):
        return a, 2
    return b, 4


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
