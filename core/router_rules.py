"""What a P/D router accepts, and what each leg of an accepted request is asked to do.

Rules kept here:
- A request is checked before any engine works on it (`check_request`): one that decode would
  refuse, or that P/D cannot serve correctly, is refused with a reason naming the field, and
  never costs a prefill or a hold. Refused: a batch of prompts (one exchange per request), beam
  search and `best_of` > 1 (no KV hand-over for candidates the engine makes up itself),
  `prompt_logprobs` and `echo` with `logprobs` (decode never computes the prompt's logits),
  `max_tokens` < 1 or longer than the model, `min_tokens` < 0 or above `max_tokens`, `n` < 1.
  `n` > 1 is served: decode's first sample loads the prompt's KV, its siblings compute it.
- The prefill leg is the client's request cut to one token (`prefill_fields`): one sample, no
  minimum length, no logprobs or echo, no structured-output constraint, not streamed; its
  output is thrown away, so nothing that only shapes the output is kept.
- The decode leg is the client's request as sent.
- Retain (`asks_retain`): the router asks decode to keep a turn's KV only in bidirectional
  mode and only for a request that names a conversation (nothing else could find it again).
- Put-back and retry (`retry_prefill_without_reuse`, `put_back`, `after_turn`): a prefill that
  failed on the server side (5xx) while reading retained KV is retried once without it, as the
  exchange's next attempt (`connector_rules.next_attempt`); when a turn ends, the handle it took
  is released once a newer one replaced it in the table, and goes back to the table only when
  the turn stored no newer one, nothing newer is there and the handle is still alive.

Pure functions of JSON-like dicts; no I/O.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True, slots=True)
class Problem:
    """Why a request is refused: the field, an OpenAI-style error code, a message."""

    param: str
    code: str
    message: str


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_request(body: Mapping[str, Any], *, chat: bool,
                  max_model_len: int | None = None) -> Problem | None:
    """The first reason to refuse `body`, or None."""
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and len(prompt) != 1 and not all(_int(t) for t in prompt)
    if not chat and batch:
        return Problem("prompt", "unsupported_value",
                       "a batch of prompts is not served in P/D: send one prompt per request")
    n = body.get("n")
    if n is not None and (not _int(n) or n < 1):
        return Problem("n", "invalid_value", "n must be a positive integer")
    temperature = body.get("temperature")
    if isinstance(n, int) and n > 1 and isinstance(temperature, (int, float)) \
            and temperature == 0:
        return Problem("n", "invalid_value",
                       "n > 1 needs sampling (temperature > 0): greedy samples are all equal")
    best_of = body.get("best_of")
    if best_of is not None and (not _int(best_of) or best_of > 1):
        return Problem("best_of", "unsupported_value",
                       "best_of > 1 is not served in P/D (use n)")
    if body.get("use_beam_search"):
        return Problem("use_beam_search", "unsupported_value",
                       "beam search is not served in P/D: every beam step is a new request "
                       "whose prompt KV would cross the link again")
    if body.get("prompt_logprobs") is not None:
        return Problem("prompt_logprobs", "unsupported_value",
                       "prompt_logprobs is not served in P/D: decode receives the prompt's KV "
                       "and never computes the prompt's logits")
    if not chat and body.get("echo") and body.get("logprobs") is not None:
        return Problem("echo", "unsupported_value",
                       "echo with logprobs needs the prompt's logprobs, which P/D does not "
                       "compute")
    fields = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    max_tokens: int | None = None
    for name in fields:
        v = body.get(name)
        if v is None:
            continue
        if not _int(v) or v < 1:
            return Problem(name, "invalid_value", f"{name} must be an integer of at least 1")
        if max_model_len is not None and v > max_model_len:
            return Problem(name, "invalid_value",
                           f"{name}={v} is more than the model's context of {max_model_len} "
                           "tokens")
        max_tokens = v if max_tokens is None else max_tokens
    min_tokens = body.get("min_tokens")
    if min_tokens is not None:
        if not _int(min_tokens) or min_tokens < 0:
            return Problem("min_tokens", "invalid_value",
                           "min_tokens must be a non-negative integer")
        if max_tokens is not None and min_tokens > max_tokens:
            return Problem("min_tokens", "invalid_value",
                           f"min_tokens={min_tokens} is more than max_tokens={max_tokens}")
    return None


# Fields that only shape the output, dropped from the one-token prefill leg.
PREFILL_DROPS = ("best_of", "min_tokens", "logprobs", "top_logprobs", "echo",
                 "prompt_logprobs", "stream_options", "response_format", "structured_outputs",
                 "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "use_beam_search", "length_penalty", "stop", "stop_token_ids",
                 "include_stop_str_in_output", "logit_bias", "bad_words")


def prefill_fields(body: Mapping[str, Any], *, chat: bool) -> dict[str, Any]:
    """The prefill leg's body: the client's request cut to one greedy-or-not token."""
    out = copy.deepcopy(dict(body))
    for name in PREFILL_DROPS:
        out.pop(name, None)
    out["max_tokens"] = 1
    if chat and "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["n"] = 1
    return out


def retry_prefill_without_reuse(had_reuse: bool, kind: str, status: int) -> bool:
    """Retry a failed prefill leg once without the retained handle?"""
    return had_reuse and kind in ("status", "protocol") and status >= 500


def asks_retain(mode: str, has_conversation: bool) -> bool:
    """Does the router ask decode to retain this request's KV for the conversation's next
    turn?"""
    return mode == "bidirectional" and has_conversation


def put_back(*, stored_new: bool, taken_expires_at: float, now: float,
             table_has_newer: bool) -> bool:
    """Give the handle a turn took back to the conversation table? Only when the turn stored
    no newer one, nothing newer is there, and it is still alive: the old KV is still a prefix
    of the conversation."""
    return not stored_new and not table_has_newer and taken_expires_at > now


TurnEnd = Literal["release", "put_back", "keep", "drop"]


def after_turn(*, stored_new: bool, taken_lease: str, current_lease: str | None,
               taken_expires_at: float, now: float) -> TurnEnd:
    """What the router does, when a turn ends, with the retained handle the turn took:
    "release" it on its decode (the table now holds a newer one), "put_back" into the table
    (`put_back`), "keep" (the table still names it), or "drop" (let its lease run out)."""
    if stored_new:
        return "keep" if current_lease == taken_lease else "release"
    if put_back(stored_new=False, taken_expires_at=taken_expires_at, now=now,
                table_has_newer=current_lease is not None):
        return "put_back"
    return "drop"
