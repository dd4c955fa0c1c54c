"""Transfer planning: which bytes go from which producer rank to which consumer rank.

Rules kept here:
- Each side maps block ids to its own physical layout at transfer time. A token `t` of the
  request lives in slot `blocks[t // block_size] * block_size + t % block_size` of a side's
  per-layer cache, so source and destination may use different block sizes.
- A *run* is a maximal range of tokens contiguous on both sides. Adjacent blocks merge into one
  run; a fragmented pool yields many runs. The walk visits block boundaries only, so planning
  costs O(blocks), not O(tokens).
- With equal block sizes, blocks whose ids *descend* by one on both sides also merge: vLLM frees
  a request's blocks tail first, so a pool that has wrapped hands the next request descending
  ids, and blocks `(p, d), (p-1, d-1), (p-2, d-2)` are the one range `[p-2, p] -> [d-2, d]` on
  both sides. Blocks are independent, so the order a range is copied in does not matter: such a
  run is stated as a plain ascending `Run` from its lowest block, and it pairs each token slot
  with the same slot as per-block planning. A partly filled last block never joins a descending
  run (the run would then claim its unused slots, beyond the request's tokens): it is a run of
  its own. Unequal block sizes merge ascending ranges only.
- Fan-out over tensor parallelism: KV heads are split evenly over a side's ranks (replicated
  when a side has more ranks than KV heads); a layout whose heads and ranks do not divide one
  another is refused when built (`ValueError`). Every head a consumer rank needs is written by the
  lowest producer rank holding it. Each (producer, consumer) pair with heads in common is one
  stream, and each stream ends with one completion notification: a consumer rank has received
  the KV when every producer rank writing to it has notified.
- Each stream names where its heads start among each side's own heads (`src_head`,
  `dst_head`), so a worker finds them inside its blocks.
- Descriptors: one per run, per layer, for K and V (or MLA's one latent: `planes`), per stream; when the two sides' TP sizes
  differ a stream moves a slice of the producer's heads, and each head of the slice becomes its
  own descriptor (head-major layout), as heterogeneous-TP transfers do in practice.
- A side that offers fewer blocks than the tokens need, names a block twice or asks for a
  negative number of tokens is the peer misbehaving (`PeerError`); so is a peer's layout whose
  heads and ranks do not divide (`peer_layout`), which our own configuration would refuse with
  `ValueError` when built.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import lru_cache
from itertools import compress, repeat
from operator import mul, ne, sub
from typing import Any

from .blocks import RunBlocks, paired_steps
from .checks import duplicates, theirs
from .errors import PeerError
from .events import Direction, TransferCompleted, TransferFailed, TransferPlanned


@dataclass(frozen=True, slots=True)
class KVLayout:
    """One side's KV cache geometry."""

    block_size: int
    tp: int
    num_layers: int
    num_kv_heads: int
    head_bytes: int  # bytes of one head's K (or V) for one token: head_dim * dtype size
    planes: int = 2  # K and V (2); MLA caches one latent per token instead (1)

    def __post_init__(self) -> None:
        for name in ("block_size", "tp", "num_layers", "num_kv_heads", "head_bytes", "planes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")
        # heads split evenly over ranks, or ranks evenly over heads (replication): otherwise
        # some head would belong to no rank and the fan-out could not place it
        small, large = sorted((self.tp, self.num_kv_heads))
        if large % small:
            raise ValueError(
                f"{self.num_kv_heads} KV heads do not split evenly over {self.tp} TP ranks"
            )

    def heads_of(self, rank: int) -> range:
        if self.tp <= self.num_kv_heads:
            per = self.num_kv_heads // self.tp
            return range(rank * per, (rank + 1) * per)
        h = rank * self.num_kv_heads // self.tp
        return range(h, h + 1)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def peer_layout(base: KVLayout, **changes: Any) -> KVLayout:
    """`base` with a peer's block size, TP and so on: a peer's impossible layout is a
    `PeerError`, never a bare `ValueError` from deep inside a decision. A function of its
    arguments (layouts are frozen), so each pair is built once (twice per request otherwise)."""
    try:
        return _peer_layout(base, tuple(sorted(changes.items())))
    except (ValueError, TypeError) as exc:
        raise PeerError(f"peer's KV layout is unusable: {exc}") from None


@lru_cache(maxsize=256)
def _peer_layout(base: KVLayout, changes: tuple[tuple[str, Any], ...]) -> KVLayout:
    return replace(base, **dict(changes))


def check_peer_layout(ours: KVLayout, theirs_: KVLayout) -> None:
    """A peer's layout must describe the same model: same layers, KV heads and head size."""
    for name in ("num_layers", "num_kv_heads", "head_bytes", "planes"):
        mine, peer = getattr(ours, name), getattr(theirs_, name)
        if mine != peer:
            raise PeerError(f"peer's {name} is {peer}, ours is {mine}: another model")


@dataclass(frozen=True, slots=True)
class Run:
    src_slot: int
    dst_slot: int
    tokens: int


@dataclass(frozen=True, slots=True)
class Stream:
    src_rank: int
    dst_rank: int
    heads: int  # KV heads this stream moves
    src_head: int = 0  # the first of them, counted among the producer rank's own heads
    dst_head: int = 0  # ... and among the consumer rank's own heads


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """A planned transfer. Its runs are counted when planned and listed only when asked for
    (`runs`, for a transport that posts them): a fragmented 16k-token transfer has hundreds."""

    run_count: int
    streams: tuple[Stream, ...]
    num_tokens: int
    descriptors: int
    bytes: int
    src_blocks: tuple[int, ...] = field(default=(), repr=False)
    src_block_size: int = 1
    dst_blocks: tuple[int, ...] = field(default=(), repr=False)
    dst_block_size: int = 1

    @property
    def runs(self) -> tuple[Run, ...]:
        """Token runs contiguous on both sides, in order (made anew at each call)."""
        return merge_runs(self.src_blocks, self.src_block_size, self.dst_blocks,
                          self.dst_block_size, self.num_tokens)

    @property
    def expected(self) -> frozenset[tuple[int, int]]:
        """The (producer rank, consumer rank) notifications that complete this transfer."""
        return frozenset((s.src_rank, s.dst_rank) for s in self.streams)

    def notifications_for(self, dst_rank: int) -> int:
        return sum(1 for s in self.streams if s.dst_rank == dst_rank)


def _check_blocks(
    src_blocks: tuple[int, ...], src_bs: int, dst_blocks: tuple[int, ...], dst_bs: int, n: int
) -> None:
    if n < 0:
        raise PeerError(f"{n} tokens to move: a token count is never negative")
    theirs(duplicates(src_blocks))
    theirs(duplicates(dst_blocks))
    if len(src_blocks) * src_bs < n:
        raise PeerError(f"source offers {len(src_blocks)} blocks of {src_bs}, {n} tokens needed")
    if len(dst_blocks) * dst_bs < n:
        raise PeerError(f"destination offers {len(dst_blocks)} blocks of {dst_bs}, {n} needed")


def _breaks(src: tuple[int, ...], dst: tuple[int, ...]) -> Iterator[bool]:
    """For each block after the first: whether a run breaks before it (its ids are neither both
    its predecessor's plus one nor both its predecessor's minus one). Iterators in C: no Python
    work per block. A run never turns round: ids +1 then -1 would name a block twice, which
    `_check_blocks` refuses."""
    # the two steps' product is 1 exactly when both are +1 or both are -1 (integers)
    return map(ne, map(mul, map(sub, src[1:], src), map(sub, dst[1:], dst)), repeat(1))


def _break_list(src: tuple[int, ...], dst: tuple[int, ...], bs: int, n: int) -> list[int]:
    """Block indices (of the first `nb = ceil(n / bs)` blocks) before which a run breaks, in
    order: `_breaks`, plus one before a partly filled last block that a descending run would
    otherwise take in."""
    nb = -(-n // bs)
    breaks = list(compress(range(1, nb), _breaks(src[:nb], dst[:nb])))
    if (nb * bs > n and nb > 1 and (not breaks or breaks[-1] != nb - 1)
            and src[nb - 1] == src[nb - 2] - 1):
        breaks.append(nb - 1)
    return breaks


def count_runs(
    src_blocks: tuple[int, ...], src_bs: int, dst_blocks: tuple[int, ...], dst_bs: int, n: int
) -> int:
    """How many runs `merge_runs` gives, without making them."""
    if src_bs != dst_bs:
        return len(merge_runs(src_blocks, src_bs, dst_blocks, dst_bs, n))
    _check_blocks(src_blocks, src_bs, dst_blocks, dst_bs, n)
    return 0 if n == 0 else 1 + _break_count(src_blocks, dst_blocks, src_bs, n)


def _break_count(src: tuple[int, ...], dst: tuple[int, ...], bs: int, n: int) -> int:
    """`len(_break_list(...))` without the list: the pairs that do not break are those whose
    steps' product is 1 (`_breaks`), counted in C (`list.count`); a descending pair at a
    partly filled last block is a break more."""
    nb = -(-n // bs)
    if (type(src) is RunBlocks and type(dst) is RunBlocks
            and 4 * (len(src.runs) + len(dst.runs)) <= nb):  # few runs: per run, not per block
        breaks = nb - 1 - paired_steps(src.runs, dst.runs, nb) if nb else 0
    else:
        src, dst = src[:nb], dst[:nb]
        breaks = nb - 1 - list(map(mul, map(sub, src[1:], src), map(sub, dst[1:], dst))).count(1)
    if (nb * bs > n and nb > 1 and src[nb - 1] == src[nb - 2] - 1
            and dst[nb - 1] == dst[nb - 2] - 1):
        breaks += 1
    return breaks


def merge_runs(
    src_blocks: tuple[int, ...], src_bs: int, dst_blocks: tuple[int, ...], dst_bs: int, n: int
) -> tuple[Run, ...]:
    """Token runs contiguous on both sides, for the first `n` tokens."""
    _check_blocks(src_blocks, src_bs, dst_blocks, dst_bs, n)
    if src_bs == dst_bs:
        return _merge_equal(src_blocks, dst_blocks, src_bs, n)
    runs: list[Run] = []
    t = 0
    while t < n:
        end = min((t // src_bs + 1) * src_bs, (t // dst_bs + 1) * dst_bs, n)
        s = src_blocks[t // src_bs] * src_bs + t % src_bs
        d = dst_blocks[t // dst_bs] * dst_bs + t % dst_bs
        if (
            runs
            and runs[-1].src_slot + runs[-1].tokens == s
            and (runs[-1].dst_slot + runs[-1].tokens == d)
        ):
            last = runs[-1]
            runs[-1] = Run(last.src_slot, last.dst_slot, last.tokens + end - t)
        else:
            runs.append(Run(s, d, end - t))
        t = end
    return tuple(runs)


def _merge_equal(
    src_blocks: tuple[int, ...], dst_blocks: tuple[int, ...], bs: int, n: int
) -> tuple[Run, ...]:
    """The common case, equal block sizes: a run breaks where the two sides' next block ids are
    not both the previous ones plus one, nor both minus one (`_break_list`). One pass over block
    pairs, a Run made per break only; a descending run starts at its last (lowest) block."""
    nb = -(-n // bs)
    if nb == 0:
        return ()
    src, dst = src_blocks[:nb], dst_blocks[:nb]
    breaks = _break_list(src, dst, bs, n)
    runs = [Run(src[a] * bs, dst[a] * bs, (b - a) * bs) if src[b - 1] >= src[a] else
            Run(src[b - 1] * bs, dst[b - 1] * bs, (b - a) * bs)
            for a, b in zip([0, *breaks], [*breaks, nb])]
    if nb * bs > n:  # the last block is partly filled: the last run ascends (or is that block)
        last = runs[-1]
        runs[-1] = Run(last.src_slot, last.dst_slot, last.tokens - (nb * bs - n))
    return tuple(runs)


@lru_cache(maxsize=256)
def fan_out(src: KVLayout, dst: KVLayout) -> tuple[Stream, ...]:
    """Which producer rank writes how many heads to which consumer rank (a function of the two
    layouts alone, so computed once per pair; a bad pair's `PeerError` is raised each time)."""
    if src.num_kv_heads != dst.num_kv_heads:
        raise PeerError(
            f"KV heads differ: producer {src.num_kv_heads}, consumer {dst.num_kv_heads}"
        )
    owner: dict[int, int] = {}
    for r in range(src.tp):
        for h in src.heads_of(r):
            owner.setdefault(h, r)
    streams: list[Stream] = []
    for d in range(dst.tp):
        # heads of a rank are consecutive and owners never decrease with the head, so each
        # producer's share of a consumer rank is one consecutive slice
        first: dict[int, int] = {}
        count: dict[int, int] = {}
        for h in dst.heads_of(d):
            first.setdefault(owner[h], h)
            count[owner[h]] = count.get(owner[h], 0) + 1
        streams.extend(
            Stream(s, d, k, first[s] - src.heads_of(s).start, first[s] - dst.heads_of(d).start)
            for s, k in sorted(count.items())
        )
    return tuple(streams)


def plan_transfer(
    src: KVLayout,
    dst: KVLayout,
    src_blocks: tuple[int, ...],
    dst_blocks: tuple[int, ...],
    num_tokens: int,
) -> TransferPlan:
    """Plan moving `num_tokens` of KV from `src_blocks` (producer) into `dst_blocks` (consumer)."""
    if (src.num_layers, src.head_bytes, src.planes) != (dst.num_layers, dst.head_bytes,
                                                        dst.planes):
        raise PeerError("producer and consumer disagree on the model's layers or head size")
    runs = count_runs(src_blocks, src.block_size, dst_blocks, dst.block_size, num_tokens)
    streams = fan_out(src, dst)
    per_head = src.tp != dst.tp
    descriptors = sum(
        runs * src.num_layers * src.planes * (s.heads if per_head else 1) for s in streams
    )
    nbytes = sum(num_tokens * src.num_layers * src.planes * s.heads * src.head_bytes
                 for s in streams)
    return TransferPlan(runs, streams, num_tokens, descriptors, nbytes, src_blocks,
                        src.block_size, dst_blocks, dst.block_size)


def planned_event(
    plan: TransferPlan, *, at: float, instance: str, request: str, attempt: int,
    direction: Direction, src: str, dst: str, src_blocks: tuple[int, ...],
    dst_blocks: tuple[int, ...],
) -> TransferPlanned:
    """The event recording a plan: the one place a plan's figures become a `TransferPlanned`."""
    return TransferPlanned(
        at=at, instance=instance, request=request, attempt=attempt, direction=direction,
        src=src, dst=dst, src_blocks=src_blocks, dst_blocks=dst_blocks,
        num_tokens=plan.num_tokens, runs=plan.run_count, descriptors=plan.descriptors,
        bytes=plan.bytes, expected_notifications=len(plan.streams),
    )


def ended_event(
    ok: bool, *, at: float, instance: str, request: str, attempt: int, direction: Direction,
    reason: str,
) -> TransferCompleted | TransferFailed:
    """How a transfer ended: completed, or failed with `reason`."""
    if ok:
        return TransferCompleted(at=at, instance=instance, request=request, attempt=attempt,
                                 direction=direction)
    return TransferFailed(at=at, instance=instance, request=request, attempt=attempt,
                          direction=direction, reason=reason)
