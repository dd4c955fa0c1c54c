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
- A push registration names the producer TP decode counts completions for
  (`registration_mismatch`): a producer of another TP refuses it rather than WRITE.
- A transfer of several TP streams (`StreamTally`) ends when its last stream ends, failed if
  any stream failed; a failure never frees blocks another stream still writes into.
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
from dataclasses import dataclass, field

from .blocks import tail
from .errors import PeerError

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
    `skip_blocks * block_size` on, into its blocks from index `skip_blocks` on; the source's
    blocks from `src_skip_blocks` on (the same tokens: differs when the block sizes do)."""

    skip_blocks: int
    num_tokens: int
    src_skip_blocks: int | None = None  # None: the same as skip_blocks

    def src(self, blocks: Sequence[int]) -> tuple[int, ...]:
        skip = self.skip_blocks if self.src_skip_blocks is None else self.src_skip_blocks
        return tail(blocks, skip) if isinstance(blocks, tuple) else tuple(blocks[skip:])

    def dst(self, blocks: Sequence[int]) -> tuple[int, ...]:
        skip = self.skip_blocks
        return tail(blocks, skip) if isinstance(blocks, tuple) else tuple(blocks[skip:])


def decode_load(
    prompt_tokens: int, offered_tokens: int, local_hit: int, block_size: int,
    src_block_size: int | None = None,
) -> LoadWindow | None:
    """What decode loads, given its block-aligned local hit; None: load nothing, compute.
    With a source of another block size (`src_block_size`) the hit must end on a block
    boundary of both sides."""
    src_bs = block_size if src_block_size is None else src_block_size
    if block_size <= 0 or src_bs <= 0 or local_hit < 0 or local_hit % block_size:
        return None
    if local_hit % src_bs:
        return None
    have = min(prompt_tokens, offered_tokens)
    n = have - local_hit
    if n <= 0:
        return None
    return LoadWindow(local_hit // block_size, n, local_hit // src_bs)


def push_window(skip_blocks: int, num_tokens: int, src_block_size: int,
                dst_block_size: int) -> LoadWindow:
    """What prefill WRITEs into a registration whose first `skip_blocks` (decode's local
    hit) it must not touch: the tokens past them, from the source's blocks at the same
    tokens. A hit that does not end on a source block boundary, or covers the whole prompt,
    is the peer's error."""
    skip_tokens = skip_blocks * dst_block_size
    if skip_tokens % src_block_size:
        raise PeerError(f"decode's hit of {skip_tokens} tokens does not end on a block of "
                        f"{src_block_size}")
    if num_tokens - skip_tokens <= 0:
        raise PeerError(f"decode's hit of {skip_blocks} blocks covers the whole prompt")
    return LoadWindow(skip_blocks, num_tokens - skip_tokens, skip_tokens // src_block_size)


def registration_mismatch(assumed_src_tp: int, our_tp: int) -> str | None:
    """Why a push registration cannot be served, None if it can: decode counts one completion
    per stream of the producer TP it assumed, so a producer of another TP would finish that
    count early (or never) and must not WRITE."""
    if assumed_src_tp == our_tp:
        return None
    return (f"decode expects a prefill of TP {assumed_src_tp}, this one has TP {our_tp}: the "
            "decode leg's source must carry prefill's layout (the router adds it)")


@dataclass(slots=True)
class StreamTally:
    """One transfer made of several (producer rank, consumer rank) streams, each ending on
    its own: the transfer ends once every stream has ended, and succeeds only if every one
    did. Until then nothing is freed or recomputed, since a stream still in flight writes
    into the blocks. A second end of a stream is ignored; a stream the plan never had is the
    peer's error."""

    expected: frozenset[tuple[int, int]]
    ended: dict[tuple[int, int], str] = field(default_factory=dict)  # stream -> "" or reason

    def end(self, stream: tuple[int, int], ok: bool, reason: str = "") -> tuple[bool, str] | None:
        """Record one stream's end; the transfer's (ok, reason) once all have ended."""
        if stream not in self.expected:
            raise PeerError(f"stream {stream} is not one of {sorted(self.expected)}")
        if stream in self.ended:
            return None
        self.ended[stream] = "" if ok else (reason or "failed")
        if len(self.ended) < len(self.expected):
            return None
        failed = [f"rank {s}->{d}: {r}" for (s, d), r in sorted(self.ended.items()) if r]
        if not failed:
            return True, ""
        if len(self.expected) == 1:
            return False, next(iter(self.ended.values()))
        return False, "; ".join(failed)


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
