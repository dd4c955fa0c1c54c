"""KvplaneConnector's worker half: the KV cache registered with NIXL, and a transfer thread that
carries out the scheduler half's orders.

How it works:
- `register_kv_caches` registers every layer's cache tensor with one `Transport` (NIXL, UCX,
  host memory on CPU). Layers are laid end to end in layer order, so "block b of layer l" is
  the byte offset `region_start[l] + b * block_stride`. Both sides run the same model, so the
  same order on both sides.
- The handshake (`KvplaneHandshake`: the transport's `local_info()` plus the block geometry)
  goes to the scheduler process through vLLM (`get_handshake_metadata`), which serves it on the
  side channel.
- One daemon thread, `kvplane-xfer`, owns the transport: it turns block runs into byte runs,
  posts READs and WRITEs, polls them, sends notifications, and drains incoming notifications.
  A peer's handshake is fetched from the peer's side channel by a separate small pool
  (`kvplane-handshake`) the first time an order needs that peer; the order waits (with its
  deadline) while other peers' transfers go on, so an unreachable peer delays only the orders
  addressed to it, never another tenant's transfer.
- A READ of a peer's leased blocks (pull hold, retained KV) first pins the lease on the peer's
  side channel (`pin/`, on the same pool): a lease that is gone or would expire before the READ
  ends refuses, and the READ fails instead of reading freed blocks; `unpin/` follows the READ. The engine
  thread only hands it orders and takes back facts through queues, so preparing descriptors,
  handshakes and waiting never happen on the engine loop (decode's loop in push mode only
  queues a registration order).
- Failures (peer unreachable, transfer failed or too slow) come back as facts with ok=False and
  a reason; the scheduler half's core decides what follows. A peer whose transfer failed is
  forgotten, so the next order handshakes again (a restarted peer has a new agent).
"""

from __future__ import annotations

import base64
import collections
import concurrent.futures as cf
import json
import logging
import math
import os
import queue
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvplane.live.connector_wire import (
    Endpoint,
    Fact,
    KvplaneHandshake,
    KvplaneMeta,
    KvplaneWorkerMeta,
    Order,
    decode_notif,
    fact_to_bytes,
)
from kvplane.live.sidechannel import FactSender, fetch, rank_key

logger = logging.getLogger(__name__)
# KVPLANE_LOG_TRANSFERS=1: one INFO line per finished READ or WRITE (method, descriptors, time
# from post to done), for benchmarks/transfer_vllm_pd.py
LOG_TRANSFERS = os.environ.get("KVPLANE_LOG_TRANSFERS", "") not in ("", "0")


Plane = tuple[int, int, int, int]  # (offset in the block, lines, line stride, token stride)
MIN_TOKENS = 16  # block sizes between which parts of blocks move are multiples of this


@dataclass(frozen=True, slots=True)
class Geometry:
    """How token slots map to bytes on one rank: region i is layer i's cache.

    Inside a block, when known: `heads` heads `head_stride` apart, and per head the `planes`
    (K and V, or MLA's one latent) as `(offset, lines, line_stride, token_stride)`: token `t`
    of line `i` of plane `p` of head `h` of block `b` in layer `l` is at `start[l] +
    b * block_stride + h * head_stride + offset_p + i * line_stride_p + t * token_stride_p`,
    and a run of tokens inside one line is one run of bytes. A token-major plane (FlashAttention
    HND, MLA, the CPU backend's V) is one line of `block_size` tokens; a channel-major plane (the
    CPU backend's K, stored transposed by its kernel) has a line per channel.
    `heads` 0: nothing is known inside a block (only whole blocks move); `planes` empty: the
    heads are known but not the tokens inside them (whole head slices of whole blocks move)."""

    region_sizes: tuple[int, ...]
    block_stride: int
    block_bytes: int
    num_blocks: int
    block_size: int = 0  # tokens per block of the cache tensor (vLLM's kernel block)
    heads: int = 0  # KV heads on this rank
    head_stride: int = 0
    head_bytes: int = 0  # bytes of one head's part of one block (all its planes)
    planes: tuple[Plane, ...] = ()

    @property
    def heads_known(self) -> bool:
        return self.block_size > 0 and self.heads > 0 and self.head_bytes > 0

    @property
    def tokens_known(self) -> bool:
        """Token runs inside a block can be moved: every plane token-major (a channel-major
        plane's pieces would be a few bytes each)."""
        return self.heads_known and bool(self.planes) and all(p[1] == 1 for p in self.planes)

    def plane_bytes(self, plane: Plane) -> int:
        """Bytes of one plane of one head in one block."""
        _, lines, line_stride, token_stride = plane
        return lines * line_stride if lines > 1 else self.block_size * token_stride

    def starts(self) -> list[int]:
        out, pos = [], 0
        for n in self.region_sizes:
            out.append(pos)
            pos += n
        return out

    def granule(self) -> int:
        """The largest size every offset and length of a transfer is a multiple of: a whole
        block; a head's part of it, and each plane's, when heads are known; with tokens known,
        `MIN_TOKENS` tokens of a plane (a piece of a block between block sizes that are
        multiples of MIN_TOKENS). NIXL's descriptor lists are cut into granules once per peer,
        so a granule stays at hundreds of bytes or more."""
        g = math.gcd(self.block_stride, self.block_bytes)
        if self.heads_known:
            g = math.gcd(g, math.gcd(self.head_stride, self.head_bytes))
            for plane in self.planes:
                g = math.gcd(g, math.gcd(plane[0], self.plane_bytes(plane)))
            if self.tokens_known:
                for plane in self.planes:
                    g = math.gcd(g, MIN_TOKENS * plane[3])
        return g or 1

    def layout(self) -> Any:
        """The transport's block layout of this rank: one piece per layer and block."""
        from kvplane.live.staging import BlockLayout

        return BlockLayout(tuple(self.starts()), self.block_stride, self.block_bytes,
                           self.num_blocks)

    def to_dict(self) -> dict[str, Any]:
        return {"region_sizes": list(self.region_sizes), "block_stride": self.block_stride,
                "block_bytes": self.block_bytes, "num_blocks": self.num_blocks,
                "block_size": self.block_size, "heads": self.heads,
                "head_stride": self.head_stride, "head_bytes": self.head_bytes,
                "planes": [list(p) for p in self.planes]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Geometry:
        planes = tuple((int(p[0]), int(p[1]), int(p[2]), int(p[3]))
                       for p in d.get("planes") or [])
        return cls(tuple(int(x) for x in d["region_sizes"]), int(d["block_stride"]),
                   int(d["block_bytes"]), int(d["num_blocks"]), int(d.get("block_size", 0)),
                   int(d.get("heads", 0)), int(d.get("head_stride", 0)),
                   int(d.get("head_bytes", 0)), planes)


def encode_rank_payload(info: bytes, geometry: Geometry) -> bytes:
    return json.dumps({"info": base64.b64encode(info).decode("ascii"),
                       "geometry": geometry.to_dict()}).encode()


def decode_rank_payload(data: bytes) -> tuple[bytes, Geometry]:
    d = json.loads(data)
    return base64.b64decode(d["info"]), Geometry.from_dict(d["geometry"])


Heads = tuple[int, int, int]  # (first head on the source rank, on the destination rank, count)


def byte_runs(runs: Iterable[tuple[int, int, int]], local: Geometry, remote: Geometry,
              local_is_src: bool, heads: Heads | None = None) -> list[tuple[int, int, int]]:
    """Token-slot runs `(src_slot, dst_slot, tokens)` as byte runs `(local, remote, length)`,
    layer by layer; `heads` picks a slice of the heads (tensor parallelism of unequal sizes),
    None: all of them (both sides hold the same heads).

    Whole blocks move as one run each (merged while adjacent on both sides) when both sides
    have one block geometry and all heads move; otherwise each (plane, head, piece of a run
    inside one block on both sides) is a run, merged with the previous one while both sides
    stay contiguous."""
    if len(local.region_sizes) != len(remote.region_sizes):
        raise ValueError(f"layer count differs: ours {len(local.region_sizes)}, peer's "
                         f"{len(remote.region_sizes)}")
    src, dst = (local, remote) if local_is_src else (remote, local)
    runs = list(runs)
    if heads is None:
        if src.heads != dst.heads:
            raise ValueError(f"ranks hold {src.heads} and {dst.heads} heads: a head slice is "
                             "needed")
        heads = (0, 0, src.heads)
    whole = (heads[0] == heads[1] == 0 and heads[2] == src.heads == dst.heads
             and src.block_size == dst.block_size and src.block_bytes == dst.block_bytes)
    bs = src.block_size or 1
    aligned = src.block_size == dst.block_size and all(
        s % bs == 0 and d % bs == 0 for s, d, _ in runs)
    if whole and aligned:
        out = _whole_blocks(runs, src, dst, bs)
    elif aligned:
        out = _head_blocks(runs, src, dst, heads)
    else:
        out = _fine(runs, src, dst, heads)
    return out if local_is_src else [(d, s, n) for s, d, n in out]


def _append(out: list[tuple[int, int, int]], so: int, do: int, n: int) -> None:
    """Add a run, merged into the previous one when both sides continue it."""
    if out and out[-1][0] + out[-1][2] == so and out[-1][1] + out[-1][2] == do:
        out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
    else:
        out.append((so, do, n))


def _check_heads(src: Geometry, dst: Geometry, heads: Heads) -> None:
    for g, side in ((src, "source"), (dst, "destination")):
        if not g.heads_known:
            raise ValueError(f"the {side}'s KV cache layout is not head-major (HND), so a "
                             "head slice of a block cannot be addressed; both sides need "
                             "vLLM's HND layout")
    h_src, h_dst, count = heads
    if h_src + count > src.heads or h_dst + count > dst.heads or count <= 0:
        raise ValueError(f"head slice {heads} does not fit {src.heads} / {dst.heads} heads")
    if len(src.planes) != len(dst.planes):
        raise ValueError(f"the source has {len(src.planes)} planes, the destination "
                         f"{len(dst.planes)}")


def _head_blocks(runs: list[tuple[int, int, int]], src: Geometry, dst: Geometry,
                 heads: Heads) -> list[tuple[int, int, int]]:
    """Equal block sizes, a slice of the heads: each head's part of each whole block (what is
    inside a head's part need not be known). Each plane apart when the planes lie outside
    the heads (K/V apart, FlashAttention); one run per head and block when they lie inside."""
    _check_heads(src, dst, heads)
    if src.head_bytes != dst.head_bytes:
        raise ValueError(f"one head of one block is {src.head_bytes} bytes on the source, "
                         f"{dst.head_bytes} on the destination")
    out: list[tuple[int, int, int]] = []
    ss, ds = src.starts(), dst.starts()
    bs = src.block_size
    inner = src.head_stride >= src.head_bytes and dst.head_stride >= dst.head_bytes
    parts = ([(0, 0, src.head_bytes)] if inner or not src.planes else
             [(sp[0], dp[0], src.plane_bytes(sp)) for sp, dp in zip(src.planes, dst.planes)])
    if not inner and not src.planes:
        raise ValueError("the planes of a head are not known: cannot move a head slice")
    for layer in range(len(ss)):
        for s_off, d_off, nbytes in parts:
            for h in range(heads[2]):
                sh = ss[layer] + (heads[0] + h) * src.head_stride + s_off
                dh = ds[layer] + (heads[1] + h) * dst.head_stride + d_off
                for s_slot, d_slot, tokens in runs:
                    sb, db, count = s_slot // bs, d_slot // bs, -(-tokens // bs)
                    if sb + count > src.num_blocks or db + count > dst.num_blocks:
                        raise ValueError(f"token run {(s_slot, d_slot, tokens)} is past the "
                                         "cache")
                    for i in range(count):
                        _append(out, sh + (sb + i) * src.block_stride,
                                dh + (db + i) * dst.block_stride, nbytes)
    return out


def _whole_blocks(runs: list[tuple[int, int, int]], src: Geometry, dst: Geometry,
                  bs: int) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    ss, ds = src.starts(), dst.starts()
    for layer in range(len(ss)):
        for s_slot, d_slot, tokens in runs:
            sb, db, count = s_slot // bs, d_slot // bs, -(-tokens // bs)
            if sb + count > src.num_blocks or db + count > dst.num_blocks:
                raise ValueError(f"token run {(s_slot, d_slot, tokens)} is past the cache")
            if src.block_stride == src.block_bytes and dst.block_stride == dst.block_bytes:
                out.append((ss[layer] + sb * src.block_stride, ds[layer] + db * dst.block_stride,
                            count * src.block_bytes))
            else:
                out += [(ss[layer] + (sb + i) * src.block_stride,
                         ds[layer] + (db + i) * dst.block_stride, src.block_bytes)
                        for i in range(count)]
    return out


def _fine(runs: list[tuple[int, int, int]], src: Geometry, dst: Geometry,
          heads: Heads) -> list[tuple[int, int, int]]:
    """Unequal block sizes (or runs off block boundaries): per layer, plane, head and line,
    each piece of a run inside one block on both sides."""
    _check_heads(src, dst, heads)
    for g, side in ((src, "source"), (dst, "destination")):
        if not g.tokens_known:
            raise ValueError(f"the {side}'s KV cache keeps its tokens in a form kvplane "
                             "cannot move in parts of a block (not head-major, or a plane "
                             "stored channel-major, as vLLM's CPU backend keeps K), so blocks "
                             "of different sizes cannot be matched; give prefill and decode "
                             "one block size")
    chunk = math.gcd(src.block_size, dst.block_size)
    if chunk % MIN_TOKENS:
        raise ValueError(f"block sizes {src.block_size} and {dst.block_size}: parts of "
                         f"blocks move in multiples of {MIN_TOKENS} tokens")
    shapes = [(p[1], p[3]) for p in src.planes], [(p[1], p[3]) for p in dst.planes]
    if shapes[0] != shapes[1]:
        raise ValueError(f"the planes differ: (lines, token bytes) {shapes[0]} on the source, "
                         f"{shapes[1]} on the destination")
    h_src, h_dst, count = heads
    out: list[tuple[int, int, int]] = []
    ss, ds = src.starts(), dst.starts()
    sbs, dbs = src.block_size, dst.block_size
    for s_slot, d_slot, tokens in runs:
        if (s_slot + tokens - 1) // sbs >= src.num_blocks or \
                (d_slot + tokens - 1) // dbs >= dst.num_blocks:
            raise ValueError(f"token run {(s_slot, d_slot, tokens)} is past the cache")
    for layer in range(len(ss)):
        for sp, dp in zip(src.planes, dst.planes):
            tb = sp[3]
            for h in range(count):
                for line in range(sp[1]):
                    s_base = ss[layer] + (h_src + h) * src.head_stride + sp[0] + line * sp[2]
                    d_base = ds[layer] + (h_dst + h) * dst.head_stride + dp[0] + line * dp[2]
                    for s_slot, d_slot, tokens in runs:
                        t = 0
                        # the last piece is rounded up to the chunk: it stays inside both
                        # sides' last blocks (their bounds are multiples of it)
                        end = -(-tokens // chunk) * chunk
                        while t < end:
                            s, d = s_slot + t, d_slot + t
                            n = min(sbs - s % sbs, dbs - d % dbs, end - t)
                            _append(out, s_base + (s // sbs) * src.block_stride + (s % sbs) * tb,
                                    d_base + (d // dbs) * dst.block_stride + (d % dbs) * tb,
                                    n * tb)
                            t += n
    return out


Inside = tuple[int, int, int, int, tuple[Plane, ...]]  # see block_inside
UNKNOWN: Inside = (0, 0, 0, 0, ())


def whole_block_runs(order: Order, local: Geometry, remote: Geometry
                     ) -> list[tuple[int, int, int]] | None:
    """The order's token-slot runs as whole-block runs `(src_block, dst_block, count)` when
    whole blocks are what moves (all heads, one block geometry on both sides, runs on block
    boundaries; the last block moves whole); None when only byte runs can say it."""
    bs = local.block_size
    if order.heads or bs <= 0 or (local.block_size, local.block_bytes) != (
            remote.block_size, remote.block_bytes) or local.heads != remote.heads:
        return None
    if any(s % bs or d % bs for s, d, _ in order.runs):
        return None
    return [(s // bs, d // bs, -(-n // bs)) for s, d, n in order.runs]


def block_ids(runs: Iterable[tuple[int, int, int]], local: Geometry, remote: Geometry,
              local_is_src: bool) -> tuple[Any, Any]:
    """Block runs `(src, dst, count)` as two block-id arrays (ours, the peer's), one entry per
    block in run order: what `Transport.post_blocks` plans from (numpy, no per-run loop)."""
    import numpy as np

    if len(local.region_sizes) != len(remote.region_sizes):
        raise ValueError(f"layer count differs: ours {len(local.region_sizes)}, peer's "
                         f"{len(remote.region_sizes)}")
    if local.block_bytes != remote.block_bytes:
        raise ValueError(f"block bytes differ: ours {local.block_bytes}, peer's "
                         f"{remote.block_bytes}")
    arr = np.asarray(list(runs), dtype=np.int64).reshape(-1, 3)
    src, dst, count = arr[:, 0], arr[:, 1], arr[:, 2]
    lb, rb = (src, dst) if local_is_src else (dst, src)
    bad = (count <= 0) | (lb < 0) | (rb < 0) | (lb + count > local.num_blocks) | (
        rb + count > remote.num_blocks)
    if bad.any():
        raise ValueError(f"block run {tuple(int(x) for x in arr[bad][0])} is past the cache")
    within = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count,
                                                                   count)
    return np.repeat(lb, count) + within, np.repeat(rb, count) + within


@dataclass(frozen=True, slots=True)
class CacheRegion:
    """One layer's KV cache as NIXL sees it: a flat view of its memory, blocks outermost."""

    name: str
    flat: Any  # a contiguous 1-D tensor over the layer's whole cache
    num_blocks: int
    block_stride: int  # bytes from one block to the next
    block_bytes: int  # bytes of one block (all its K/V, heads and tokens)
    dtype: str
    inside: Inside = UNKNOWN  # see block_inside

    @property
    def nbytes(self) -> int:
        return int(self.flat.numel()) * int(self.flat.element_size())


def _dense_inner(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True when dims 1.. (in any order, as a layout permutation leaves them) pack one block
    densely: sorted by stride, each stride is the product of the sizes inside it."""
    inner = sorted(((st, sz) for st, sz in zip(strides[1:], shape[1:]) if sz != 1))
    expected = 1
    for st, sz in inner:
        if st != expected:
            return False
        expected *= sz
    return True


def block_inside(shape: tuple[int, ...], strides: tuple[int, ...], elt: int, block_size: int,
                 heads: int, head_size: int = 0, dtype: str = "") -> Inside:
    """(block_size, heads, head_stride, head_bytes, planes) of a block-major cache tensor
    (strides in elements; see Geometry), read from its memory order: innermost one token's
    channels, then the tokens of the block, then the heads, then the planes (K/V apart).
    `block_size`, `heads` and `head_size` are what vLLM says this rank has; the tensor's block
    may be a divisor of `block_size` (a smaller kernel block).

    vLLM's CPU backend keeps K and V side by side in the channels (`2 * head_size`): its
    kernel writes V token-major into the second half of a head's block but K transposed into
    the first (a line of `block_size` tokens per channel), as its float32 kernels do; other
    dtypes there may tile K, so their tokens are left unknown (whole head slices of whole
    blocks still move). UNKNOWN when the layout is not head-major."""
    dims = sorted(((st, sz) for st, sz in zip(strides[1:], shape[1:]) if sz != 1),
                  reverse=True)  # outermost first
    if len(dims) < 2 or block_size <= 0 or heads <= 0:
        return UNKNOWN
    (tok_st, tok_sz), (c_st, c_sz) = dims[-2], dims[-1]
    if c_st != 1 or tok_st != c_sz or block_size % tok_sz:
        return UNKNOWN
    rest = dims[:-2]
    head_st = tok_st * tok_sz
    if heads > 1:
        if not rest or rest[-1][1] != heads:
            return UNKNOWN
        head_st = rest[-1][0]
        rest = rest[:-1]
    if len(rest) > 1:
        return UNKNOWN
    n_planes, plane_st = (rest[0][1], rest[0][0]) if rest else (1, 0)
    bs, e = tok_sz, elt
    head_bytes = n_planes * bs * c_sz * e
    planes: tuple[Plane, ...]
    if n_planes == 1 and head_size and c_sz == 2 * head_size:  # the CPU backend's K|V
        half = bs * head_size * e
        planes = ((0, head_size, bs * e, e), (half, 1, 0, head_size * e)) \
            if dtype == "float32" else ()
    else:
        planes = tuple((p * plane_st * e, 1, 0, c_sz * e) for p in range(n_planes))
    return (bs, heads, head_st * e, head_bytes, planes)


def cache_region(name: str, t: Any, block_size: int = 0, heads: int = 0,
                 head_size: int = 0) -> CacheRegion:
    """One layer's cache tensor as a region: blocks must be the outermost dimension and each
    block one dense run of bytes (any order inside it: vLLM's NHD or HND, K and V together or
    MLA's single latent, any dtype including FP8). vLLM hands permuted views for HND; the
    region is the memory under the view, so it is registered as a flat alias of it. With
    `block_size` and `heads` (this rank's), a head-major block's inside is read too, so that
    parts of blocks can move (`block_inside`)."""
    import torch

    shape, strides = tuple(int(x) for x in t.shape), tuple(int(x) for x in t.stride())
    if len(shape) < 2:
        raise ValueError(f"KV cache of {name} has shape {shape}: no block dimension")
    num_blocks, elt = shape[0], t.element_size()
    block_elems = math.prod(shape[1:])
    if not _dense_inner(shape, strides) or strides[0] < block_elems:
        raise ValueError(
            f"KV cache of {name} is not block-major (shape {shape}, strides {strides}): "
            "kvplane needs blocks outermost and each block dense; vLLM's layout for this "
            "attention backend does not give that (see docs/deploy.md, KV cache layout)")
    span = strides[0] * (num_blocks - 1) + block_elems
    flat = torch.as_strided(t, (span,), (1,))
    dtype = str(t.dtype).replace("torch.", "")
    return CacheRegion(name, flat, num_blocks, strides[0] * elt, block_elems * elt, dtype,
                       block_inside(shape, strides, elt, block_size, heads, head_size, dtype))


def cache_regions(kv_caches: dict[str, Any], block_size: int = 0, heads: int = 0,
                  head_size: int = 0) -> list[CacheRegion]:
    """Every layer's region in layer order, a layer sharing another's cache counted once; all
    layers must agree on block count and geometry (one KV cache group)."""
    seen: set[int] = set()
    out: list[CacheRegion] = []
    for name in sorted(kv_caches, key=_layer_index):
        t = kv_caches[name]
        if isinstance(t, (list, tuple)):
            raise ValueError(  # noqa: TRY004 - a layout we refuse, like the others
                f"KV cache of {name} is split in {len(t)} tensors (separate K and V); "
                "kvplane needs one tensor per layer")
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out.append(cache_region(name, t, block_size, heads, head_size))
    if not out:
        raise ValueError("vLLM registered no KV cache tensors")
    first = out[0]
    for r in out[1:]:
        if (r.num_blocks, r.block_stride, r.block_bytes, r.inside) != (
                first.num_blocks, first.block_stride, first.block_bytes, first.inside):
            raise ValueError(
                f"KV cache of {r.name} ({r.num_blocks} blocks of {r.block_bytes} bytes, "
                f"stride {r.block_stride}) differs from {first.name}'s ({first.num_blocks}, "
                f"{first.block_bytes}, {first.block_stride}): layers of several KV cache "
                "groups or sizes are not supported")
    return out


def geometry_of(regions: list[CacheRegion], block_size: int) -> Geometry:
    """The rank's geometry from its regions (`cache_regions`); `block_size` (vLLM's) stands
    for the tensor's block when its inside is unknown."""
    first = regions[0]
    kbs, heads, head_stride, head_bytes, planes = first.inside
    return Geometry(tuple(r.nbytes for r in regions), first.block_stride, first.block_bytes,
                    first.num_blocks, kbs or block_size, heads, head_stride, head_bytes, planes)


def _layer_index(name: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", name))


@dataclass(slots=True)
class _InFlight:
    order: Order
    peer: str
    transfer: Any
    started: float


@dataclass(slots=True)
class Stats:
    """What moved since the last report (worker -> vLLM's metrics)."""

    bytes: list[int] = field(default_factory=list)
    descriptors: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    failed: int = 0
    fallbacks: int = 0  # transfers that went by another method than the estimate chose

    def empty(self) -> bool:
        return not self.bytes and not self.failed

    def to_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "descriptors": self.descriptors, "seconds": self.seconds,
                "ops": self.ops, "failed": self.failed, "fallbacks": self.fallbacks}


def _log_transfer(f: _InFlight) -> None:
    res = f.transfer.result
    logger.info("kvplane transfer %s %d %s %s: %d bytes, %s, %d descriptors, %.3f ms%s",
                f.order.xfer, f.order.attempt, f.order.kind,
                "ok" if res is not None and res.ok else "failed",
                res.nbytes if res is not None else 0, f.transfer.method,
                res.descriptors if res is not None else 0,
                (time.perf_counter() - f.started) * 1e3,
                f" (fallback {res.fallback})" if res is not None and res.fallback else "")


class TransferThread:
    """Owns the transport once started; see the module docstring."""

    def __init__(self, transport: Any, geometry: Geometry, rank: int, name: str,
                 sender: FactSender | None = None) -> None:
        self.transport = transport
        self.sender = sender
        self.geometry = geometry
        self.rank = rank
        self.orders: queue.SimpleQueue[Order] = queue.SimpleQueue()
        self.facts: collections.deque[Fact] = collections.deque()
        # (op, ok, bytes, descriptors, seconds, fell back from the estimate's first method)
        self.stats: collections.deque[tuple[str, bool, int, int, float, bool]] = (
            collections.deque())
        # a peer is one rank of another instance: (host, port, rank)
        self._peers: dict[tuple[str, int, int], tuple[str, Geometry]] = {}
        # handshakes being fetched off this thread, and the orders waiting for them
        self._fetching: dict[tuple[str, int, int], cf.Future[bytes]] = {}
        self._waiting: dict[tuple[str, int, int], list[Order]] = {}
        self._pool = cf.ThreadPoolExecutor(4, thread_name_prefix="kvplane-handshake")
        self._pinning: list[tuple[cf.Future[bytes], Order]] = []
        self._inflight: list[_InFlight] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvplane-xfer-{name}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.sender is not None:
            self.sender.close()

    # ---- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        idle = 0.0
        while not self._stop.is_set():
            busy = False
            try:
                while True:
                    order = self.orders.get_nowait()
                    busy = True
                    self._start(order)
            except queue.Empty:
                pass
            except Exception:
                logger.exception("kvplane: transfer thread failed to start an order")
            try:
                busy |= self._handshakes()
                busy |= self._pins()
                busy |= self._poll()
                busy |= self._drain()
            except Exception:
                logger.exception("kvplane: transfer thread failed while polling")
            if busy or self._inflight or getattr(self.transport, "busy", False):  # staging
                idle = 0.0
                time.sleep(0)
            elif self._waiting or self._pinning:
                idle = 0.0
                self._stop.wait(0.001)
            else:
                idle = min(0.002, max(idle * 2, 0.0001))
                self._stop.wait(idle)

    def emit(self, fact: Fact) -> None:
        """Straight to our scheduler process when we can; else with the next step's metadata."""
        if self.sender is None or not self.sender.send(fact_to_bytes(fact)):
            self.facts.append(fact)

    def _fact(self, order: Order, kind: str, ok: bool, reason: str = "", **kw: Any) -> None:
        self.emit(Fact(kind, order.xfer, order.attempt, time.time(), ok=ok,  # type: ignore[arg-type]
                       reason=reason, purpose=order.purpose, rank=self.rank,
                       peer_rank=order.peer_rank, **kw))

    def _handshakes(self) -> bool:
        """Orders waiting for a handshake: failed past their deadline, started once it came."""
        if not self._waiting:
            return False
        busy, now = False, time.time()
        for key in list(self._waiting):
            orders = self._waiting[key]
            late = [o for o in orders if o.deadline and now > o.deadline]
            for o in late:
                busy = True
                self._fact(o, "notify_done" if o.kind == "notify" else f"{o.kind}_done", False,
                           "deadline passed waiting for the peer's handshake")
            orders = [o for o in orders if o not in late]
            fut = self._fetching.get(key)
            if fut is None or not fut.done():
                if orders:
                    self._waiting[key] = orders
                else:
                    self._waiting.pop(key, None)
                continue
            busy = True
            del self._fetching[key]
            self._waiting.pop(key, None)
            try:
                info, geom = decode_rank_payload(fut.result())
                name = self.transport.add_peer(info)
            except Exception as exc:  # noqa: BLE001 - unreachable, nonsense or a NIXL error
                for o in orders:
                    self._fact(o, "notify_done" if o.kind == "notify" else f"{o.kind}_done",
                               False, f"handshake with {o.peer.instance} failed: {exc}")
                continue
            self._peers[key] = (name, geom)
            logger.info("kvplane: connected to %s:%d rank %d as NIXL peer %s", *key, name)
            for o in orders:
                self._start(o)
        return busy

    def _forget_peer(self, ep: Endpoint, rank: int) -> None:
        self._peers.pop((ep.host, ep.port, rank), None)

    def _pins(self) -> bool:
        """READs waiting for their pin: posted once pinned, failed if refused."""
        if not self._pinning:
            return False
        busy, still = False, []
        for fut, order in self._pinning:
            if not fut.done():
                still.append((fut, order))
                continue
            busy = True
            try:
                fut.result()
            except Exception as exc:  # noqa: BLE001 - refused, unreachable or nonsense
                self._fact(order, "read_done", False,
                           f"the source's lease is not alive (pin refused): {exc}")
                continue
            self._start(order, pinned=True)
        self._pinning = still
        return busy

    def _pin_body(self, order: Order) -> dict[str, Any]:
        """The order's pin request, its reader named per stream (our rank, the peer's rank):
        each stream's READ pins the source's lease on its own, so one stream's unpin never
        ends another's pin."""
        body: dict[str, Any] = json.loads(order.pin)
        body["reader"] = f"{body.get('reader', '')}@{self.rank}<{order.peer_rank}"
        return body

    def _ask_pin(self, order: Order) -> bytes:
        body = self._pin_body(order)
        body["duration"] = max(0.0, order.deadline - time.time()) if order.deadline else 1.0
        return fetch(order.peer.host, order.peer.port, "pin/" + json.dumps(body))

    def _unpin(self, order: Order) -> None:
        def go() -> None:
            try:
                fetch(order.peer.host, order.peer.port, "unpin/" + json.dumps(self._pin_body(order)))
            except Exception as exc:  # noqa: BLE001 - the pin then ends with the lease
                logger.warning("kvplane: unpin after the READ of %s failed: %s", order.xfer, exc)

        self._pool.submit(go)

    def _start(self, order: Order, pinned: bool = False) -> None:
        done = "notify_done" if order.kind == "notify" else f"{order.kind}_done"
        if order.deadline and time.time() > order.deadline:
            self._fact(order, done, False, "deadline passed before the transfer started")
            return
        key = (order.peer.host, order.peer.port, order.peer_rank)
        if key not in self._peers:
            # fetched off this thread; the order waits for it (see _handshakes)
            self._waiting.setdefault(key, []).append(order)
            if key not in self._fetching:
                self._fetching[key] = self._pool.submit(fetch, key[0], key[1],
                                                        rank_key(order.peer_rank))
            return
        peer, geom = self._peers[key]
        if order.kind == "read" and order.pin and not pinned:
            self._pinning.append((self._pool.submit(self._ask_pin, order), order))
            return
        if order.kind == "notify":
            res = self.transport.send_notification(peer, order.notify)
            if not res.ok:
                self._forget_peer(order.peer, order.peer_rank)
            self._fact(order, done, res.ok, res.reason)
            return
        op = "WRITE" if order.kind == "write" else "READ"
        notify = order.notify if order.kind == "write" else b""
        posted = time.perf_counter()  # the transfer's time includes posting (planning, NIXL)
        try:
            whole = whole_block_runs(order, self.geometry, geom)
            if whole is not None:
                ours, theirs = block_ids(whole, self.geometry, geom,
                                         local_is_src=order.kind == "write")
                # Planned at block level (block-id arrays, per-layer address table): the
                # staged path then sends block ids, not a run list (live/staging.py).
                t = self.transport.post_blocks(peer, op, self.geometry.layout(), ours,
                                               geom.layout(), theirs, notify=notify)
            else:  # a head slice or parts of blocks: byte runs
                runs = byte_runs(order.runs, self.geometry, geom,
                                 local_is_src=order.kind == "write", heads=order.heads or None)
                t = self.transport.post(peer, op, runs, notify=notify)
        except ValueError as exc:  # TransportError is one: a layout that does not fit
            self._fact(order, done, False, f"cannot map blocks: {exc}")
            return
        self._inflight.append(_InFlight(order, peer, t, posted))

    def _poll(self) -> bool:
        if not self._inflight:
            return False
        from kvplane.live.transport import Status

        still, changed = [], False
        now = time.time()
        for f in self._inflight:
            status = self.transport.poll(f.transfer)
            if status is Status.PENDING and f.order.deadline and now > f.order.deadline:
                self.transport.wait(f.transfer, 0.0)  # releases the handle: TIMED_OUT
                status = f.transfer.result.status if f.transfer.result else Status.TIMED_OUT
            if status is Status.PENDING:
                still.append(f)
                continue
            changed = True
            if LOG_TRANSFERS:
                _log_transfer(f)
            self._finish(f)
        self._inflight = still
        return changed

    def _finish(self, f: _InFlight) -> None:
        res = f.transfer.result
        ok = res is not None and res.ok
        seconds = time.perf_counter() - f.started
        order = f.order
        reason = "" if ok else (res.reason if res is not None else "no result")
        if order.kind == "read" and order.pin:
            self._unpin(order)
        if ok and order.kind == "read" and order.notify:
            sent = self.transport.send_notification(f.peer, order.notify)
            if not sent.ok:
                logger.warning("kvplane: read of %s done but telling %s failed: %s",
                               order.xfer, order.peer.instance, sent.reason)
        if not ok:
            self._forget_peer(order.peer, order.peer_rank)
            logger.warning("kvplane: %s of %s %s %s: %s", order.kind.upper(), order.xfer,
                           "to" if order.kind == "write" else "from", order.peer.instance,
                           reason)
        nbytes = res.nbytes if res is not None else 0
        descs = res.descriptors if res is not None else 0
        fell_back = res is not None and bool(res.fallback)
        self.stats.append((order.kind, ok, nbytes, descs, seconds, fell_back))
        self._fact(order, f"{order.kind}_done", ok, reason, nbytes=nbytes if ok else 0,
                   descriptors=descs, seconds=seconds)

    def _drain(self) -> bool:
        got = False
        for n in self.transport.notifications():
            parsed = decode_notif(n.message)
            if parsed is None:
                continue
            kind, body = parsed
            got = True
            try:
                xfer, attempt = str(body["xfer"]), int(body["attempt"])
            except (KeyError, TypeError, ValueError):
                logger.warning("kvplane: notification without a transfer id: %r", n.message)
                continue
            self.emit(Fact("notif", xfer, attempt, time.time(), notif=kind, body=body,
                           rank=self.rank))
        return got


class WorkerHalf:
    """The worker-side logic, driven by the facade; vLLM-free apart from the tensors it gets."""

    def __init__(self, instance: str, rank: int, *, progress_thread: bool = False,
                 post_to: tuple[str, int] | None = None, backend: str = "UCX",
                 block_size: int = 0, heads: int = 0, head_size: int = 0) -> None:
        self.instance = instance
        self.head_size = head_size  # channels of one head's K (MLA: the latent)
        self.block_size = block_size  # vLLM's block size (tokens)
        self.heads = heads  # KV heads on this rank (MLA: 1)
        self.backend = backend
        self.post_to = post_to
        self.rank = rank
        self.progress_thread = progress_thread
        self.transport: Any = None
        self.geometry: Geometry | None = None
        self.thread: TransferThread | None = None
        self._reports = KvplaneMeta()
        self._load_errors: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from kvplane.live.staging import staging_for
        from kvplane.live.transport import Transport

        regions = cache_regions(kv_caches, self.block_size, self.heads, self.head_size)
        first = regions[0]
        self.geometry = geometry = geometry_of(regions, self.block_size)
        self.transport = Transport(f"{self.instance}-rank{self.rank}-{time.time_ns() % 10**9}",
                                   granule=self.geometry.granule(),
                                   progress_thread=self.progress_thread, backend=self.backend,
                                   staging=staging_for(first.flat))
        for r in regions:
            self.transport.register(r.flat)
        # IPC copies (GPU memory, a peer on this host): build the copy kernel for this
        # cache's pieces now, not on the first transfer
        self.transport.warm_up_ipc(geometry.layout().piece)
        logger.info("kvplane %s rank %d: registered %d layers x %d blocks of %d bytes "
                    "(stride %d, %s) with NIXL %s; inside a block: %s", self.instance,
                    self.rank, len(regions), first.num_blocks, first.block_bytes,
                    first.block_stride, first.dtype, self.backend,
                    f"{geometry.heads} heads x {geometry.block_size} tokens, planes "
                    f"{[list(p) for p in geometry.planes]}" if geometry.heads_known
                    else "not head-major (whole blocks only)")
        sender = FactSender(*self.post_to) if self.post_to else None
        self.thread = TransferThread(self.transport, self.geometry, self.rank, self.instance,
                                     sender)
        self.thread.start()

    def handshake(self) -> KvplaneHandshake | None:
        if self.transport is None or self.geometry is None:
            return None
        payload = encode_rank_payload(self.transport.local_info(), self.geometry)
        return KvplaneHandshake(self.rank, payload, self.geometry.block_bytes,
                                self.geometry.num_blocks, len(self.geometry.region_sizes))

    def start_step(self, meta: Any) -> None:
        """This step's orders go to the transfer thread; its reports are repeated to vLLM."""
        if not isinstance(meta, KvplaneMeta):
            return
        if self.thread is not None:
            for order in meta.orders:
                if order.rank == self.rank:  # every rank sees every order; each does its own
                    self.thread.orders.put(order)
        r = self._reports
        r.finished_sending |= meta.finished_sending
        r.finished_recving |= meta.finished_recving
        r.failed_recving |= meta.failed_recving
        r.load_error_blocks |= meta.load_error_blocks

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        r, self._reports = self._reports, KvplaneMeta()
        self._load_errors = r.load_error_blocks
        return r.finished_sending, r.finished_recving, r.failed_recving

    def load_error_blocks(self) -> set[int]:
        """Blocks of the loads that failed among the last `transfer_results()` (vLLM 0.25.1
        recomputes a failed load only when its blocks are named; see vllm_compat)."""
        out, self._load_errors = self._load_errors, set()
        return out

    def worker_meta(self) -> KvplaneWorkerMeta | None:
        if self.thread is None or not self.thread.facts:
            return None
        facts = []
        while self.thread.facts:
            facts.append(self.thread.facts.popleft())
        return KvplaneWorkerMeta(facts)

    def take_stats(self) -> Stats | None:
        if self.thread is None or not self.thread.stats:
            return None
        s = Stats()
        while self.thread.stats:
            kind, ok, nbytes, descs, seconds, fell_back = self.thread.stats.popleft()
            s.fallbacks += fell_back
            if not ok:
                s.failed += 1
                continue
            s.bytes.append(nbytes)
            s.descriptors.append(descs)
            s.seconds.append(seconds)
            s.ops.append(kind)
        return s

    def shutdown(self) -> None:
        if self.thread is not None:
            self.thread.stop()
            self.thread = None
        if self.transport is not None:
            self.transport.close()
            self.transport = None
