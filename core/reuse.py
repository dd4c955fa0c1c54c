"""Should prefill read decode's retained KV, or recompute? (bidirectional reuse)

Rules kept here:
- The handle names decode's lease and the chain of block hashes it holds. Only the leading
  blocks whose hashes equal the new prompt's hashes count: a handle from an edited history, or
  from another conversation, matches little or nothing and is never read past that point.
- Tokens prefill already has from its own prefix cache are not read again: the remote part is
  `matched - local_hit`, in whole blocks.
- The read happens only when the remote part is at least `kv_recompute_threshold` tokens (below
  it, connection and coordination cost more than recomputing) and the lease will still be alive
  when the read ends (`now + estimated_read + margin < expires_at`).
- A handle that cannot be right (block size not positive, a negative token count, an expiry
  that is not a finite time) is never read from: outcome `invalid`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .events import ReuseDecided
from .hashing import matching_prefix


@dataclass(frozen=True, slots=True)
class RetainedHandle:
    """What the router keeps per conversation and hands to prefill: metadata, never tensors."""

    decode: str
    lease: str
    num_tokens: int
    block_size: int
    block_hashes: tuple[str, ...]
    expires_at: float


def handle_problem(h: RetainedHandle) -> str | None:
    """Why a handle (from a peer, via the router) cannot be right, or None when it can."""
    if isinstance(h.block_size, bool) or not isinstance(h.block_size, int) or h.block_size <= 0:
        return f"handle's block size {h.block_size!r} is not a positive integer"
    if isinstance(h.num_tokens, bool) or not isinstance(h.num_tokens, int) or h.num_tokens < 0:
        return f"handle's token count {h.num_tokens!r} is not a count"
    if not isinstance(h.expires_at, (int, float)) or not math.isfinite(h.expires_at):
        return f"handle's expiry {h.expires_at!r} is not a finite time"
    return None


def decide_reuse(
    *,
    now: float,
    instance: str,
    request: str,
    handle: RetainedHandle | None,
    prompt_hashes: tuple[str, ...],
    prompt_tokens: int,
    local_hit_tokens: int,
    threshold: int = 64,
    estimated_read: float = 0.0,
    margin: float = 0.05,
) -> ReuseDecided:
    def decided(outcome: str, matched: int = 0, remote: int = 0) -> ReuseDecided:
        return ReuseDecided(
            at=now,
            instance=instance,
            request=request,
            lease=handle.lease if handle else None,
            outcome=outcome,  # type: ignore[arg-type]
            prompt_tokens=prompt_tokens,
            local_hit_tokens=local_hit_tokens,
            matched_tokens=matched,
            remote_tokens=remote,
            threshold=threshold,
        )

    if handle is None:
        return decided("miss")
    if handle_problem(handle) is not None:
        return decided("invalid")
    blocks = matching_prefix(handle.block_hashes, prompt_hashes)
    # never reuse the prompt's last token: the engine must compute at least one token itself
    matched = min(blocks * handle.block_size, handle.num_tokens, max(prompt_tokens - 1, 0))
    matched -= matched % handle.block_size
    if matched == 0:
        return decided("mismatch")
    if handle.expires_at <= now:
        return decided("expired", matched)
    remote = max(matched - local_hit_tokens, 0)
    if remote < threshold:
        return decided("recompute", matched, remote)
    if now + estimated_read + margin >= handle.expires_at:
        return decided("refused", matched, remote)
    return decided("read", matched, remote)
