"""Per-request decisions of a KV connector, as pure functions the live connector and the
simulator share.

Rules kept here:
- One exchange, one owner. An exchange is named by (role, transfer id, attempt). The first
  engine request that names it owns it; any other request naming it (vLLM's `n > 1` and batch
  prompts copy one `kv_transfer_params` into several requests; a client may replay an id) gets
  no transfer and computes its prompt itself. A key stays claimed after its owner ends, so a
  replay later on is refused too (`Claims`, bounded memory).
- What decode loads (`decode_load`): only the prompt tokens past its own local prefix hit, and
  only when that hit ends on a block boundary; they go into the blocks after the hit, read from
  the source's blocks at the same positions (`LoadWindow.src` / `.dst`). Nothing is ever written
  into a block the consumer already had: those may be shared with other requests.
- What prefill reads from a retained handle versus computes (`reuse_split`, `reuse_read`): the
  first `ceil(remote / block_size)` blocks past prefill's own local hit take the read, from the
  retained blocks at the same positions; the rest are computed.
- Retain or not, and for how long (`retain_decision`, `retain_ttl`): a request's own wish wins
  over the instance's default, its TTL may only shorten the instance's, never below a floor.
- Deadlines of a transfer (`read_deadline`): the sooner of "now + the transfer time-out" and
  "the source's hold expiry minus a margin", so a READ never runs past the hold it relies on.
  The margins: a load is not started within `READ_MARGIN` seconds of its source's expiry, and
  a started READ ends `PIN_MARGIN` seconds before the lease it reads under could expire (the
  pin's own check, `lease.BeginRead.margin`, must stay below it, or a READ whose deadline the
  lease bounds could never be pinned).
- Attempts (`next_attempt`): a failed load ends the attempt; the engine's own compute is the
  next attempt number, so late messages for the old one are recognised as stale.
- What is hashed for reuse (`reuse_salt`): model, LoRA adapter, `cache_salt` and multimodal
  inputs go into the salt of the block-hash chain, so equal token ids under another model,
  adapter, tenant salt or image never match.

Sans-IO: no clock (time is an argument), no I/O, stdlib only.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

ClaimKey = tuple[str, str, int]

READ_MARGIN = 0.5  # [s] no load starts this close to its source's expiry
PIN_MARGIN = 0.3  # [s] a READ ends this long before the lease it reads under could expire


class Claims:
    """Which engine request owns each exchange key; the last `remember` keys are kept."""

    def __init__(self, remember: int = 65536) -> None:
        if remember <= 0:
            raise ValueError("remember must be positive")
        self.remember = remember
        self._owner: OrderedDict[ClaimKey, str] = OrderedDict()

    def claim(self, key: ClaimKey, request_id: str) -> bool:
        """True when `request_id` owns `key` (first to ask, or asking again); else False."""
        owner = self._owner.get(key)
        if owner is not None:
            return owner == request_id
        self._owner[key] = request_id
        while len(self._owner) > self.remember:
            self._owner.popitem(last=False)
        return True

    def owner(self, key: ClaimKey) -> str | None:
        return self._owner.get(key)


@dataclass(frozen=True, slots=True)
class LoadWindow:
    """The part of a prompt's KV a consumer loads: `num_tokens` from token
    `skip_blocks * block_size` on, into its blocks from index `skip_blocks` on."""

    skip_blocks: int
    num_tokens: int

    def src(self, blocks: Sequence[int]) -> tuple[int, ...]:
        return tuple(blocks[self.skip_blocks:])

    def dst(self, blocks: Sequence[int]) -> tuple[int, ...]:
        return tuple(blocks[self.skip_blocks:])


def decode_load(
    prompt_tokens: int, offered_tokens: int, local_hit: int, block_size: int
) -> LoadWindow | None:
    """What decode loads, given its block-aligned local hit; None: load nothing, compute."""
    if block_size <= 0 or local_hit < 0 or local_hit % block_size:
        return None
    have = min(prompt_tokens, offered_tokens)
    n = have - local_hit
    if n <= 0:
        return None
    return LoadWindow(local_hit // block_size, n)


def reuse_split(
    new_blocks: Sequence[int], remote_tokens: int, block_size: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(blocks the reuse read fills, blocks prefill computes) among its new blocks."""
    n = -(-max(remote_tokens, 0) // block_size)
    return tuple(new_blocks[:n]), tuple(new_blocks[n:])


def reuse_read(retained: Sequence[int], blocks: Sequence[int], local_hit: int,
               remote_tokens: int, block_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(source, destination) blocks of a reuse read of `remote_tokens` past a block-aligned
    local hit of `local_hit` tokens: decode's retained blocks and prefill's request blocks
    (`blocks`, from token 0) at the same positions."""
    skip = local_hit // block_size
    dst, _ = reuse_split(blocks[skip:], remote_tokens, block_size)
    return tuple(retained[skip:skip + len(dst)]), dst


def retain_decision(requested: bool | None, default: bool, has_blocks: bool) -> bool:
    return bool(has_blocks and (default if requested is None else requested))


def retain_ttl(default_ttl: float, requested: float | None, floor: float = 0.001) -> float:
    """The TTL of a retained lease: the instance's, shortened (never lengthened) by the
    request's."""
    if requested is None:
        return default_ttl
    return min(default_ttl, max(requested, floor))


def read_deadline(now: float, timeout: float, expires_at: float | None,
                  margin: float = 0.0) -> float:
    deadline = now + timeout
    if expires_at is not None:
        deadline = min(deadline, expires_at - margin)
    return deadline


def next_attempt(attempt: int) -> int:
    return attempt + 1


def reuse_salt(base: str, *, model: str = "", lora: str | None = None,
               cache_salt: str | None = None,
               mm_hashes: Sequence[str] = ()) -> str:
    """The salt of a request's block-hash chain: equal only when everything that shapes the KV
    besides the token ids is equal."""
    if not (model or lora or cache_salt or mm_hashes):
        return base
    parts = json.dumps([base, model, lora or "", cache_salt or "", list(mm_hashes)],
                       separators=(",", ":"))
    return hashlib.sha256(parts.encode()).hexdigest()[:32]
