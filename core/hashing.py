"""Prefix identity: a chain of block hashes over token ids.

Rules kept here:
- Only full blocks are hashed; a partial last block never takes part in a prefix match.
- Hash i covers block i *and* every block before it (it folds in hash i-1), so two prompts share
  their first k hashes exactly when they share their first k blocks of tokens. A retained KV
  handle is reused only as far as its hashes match the new prompt's hashes: a conversation id
  alone proves nothing (an edited history, or another conversation's KV, never matches).
- A `salt` (e.g. the tenant and model) starts the chain, so equal token ids under another
  tenant or model never match.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def block_hashes(tokens: Sequence[int], block_size: int, salt: str = "") -> tuple[str, ...]:
    """Hash every full block of `tokens`, each hash chained to the one before it."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    out: list[str] = []
    prev = hashlib.blake2b(salt.encode(), digest_size=16).hexdigest()
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hashlib.blake2b(digest_size=16)
        h.update(prev.encode())
        h.update(b"|")
        h.update(",".join(map(str, tokens[start : start + block_size])).encode())
        prev = h.hexdigest()
        out.append(prev)
    return tuple(out)


def chain_ids(ids: Sequence[int | str], salt: str = "") -> tuple[str, ...]:
    """Chain hashes over opaque per-block ids (trace `hash_ids`, simulated block contents)."""
    out: list[str] = []
    prev = salt
    for i in ids:
        prev = hashlib.blake2b(f"{prev}|{i}".encode(), digest_size=8).hexdigest()
        out.append(prev)
    return tuple(out)


def matching_prefix(a: Sequence[str], b: Sequence[str]) -> int:
    """Number of leading hashes the two chains share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
