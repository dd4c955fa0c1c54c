"""Tensor-parallel ranks and unequal block sizes, byte for byte through real NIXL agents.

In-process, vLLM-free: each rank of each side is its own NIXL agent (UCX over host memory)
with its own KV cache tensors laid out as vLLM lays them out (the CPU backend's
[blocks, heads, block, 2 * head_dim]; FlashAttention's HND view [blocks, 2, heads, block,
head_dim]; MLA's [blocks, block, latent]). The core plans the transfer (`plan_transfer`: runs
in token slots, one stream per producer/consumer rank pair), each stream is carried out by
the rank that owns it exactly as the worker does (`byte_runs` with the stream's head slice),
and every token of every head of every layer is checked at its place in the destination's
logical view. The live tests with vLLM servers (test_connector_tp.py) run the same path end
to end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from kvplane.core.plan import KVLayout, plan_transfer
from kvplane.live.connector_wire import slot_runs
from kvplane.live.connector_worker import (
    block_inside,
    byte_runs,
    cache_regions,
    geometry_of,
)
from kvplane.live.transport import Status, Transport

LAYERS, HEADS, HEAD_DIM = 2, 4, 32


def cpu_cache(blocks: int, bs: int, heads: int) -> Any:
    """vLLM CPU attention: [blocks, heads, block, 2 * head_dim]; its float32 kernel keeps a
    head's K transposed in the first half ([head_dim][block]) and V token-major in the second
    ([block][head_dim]), as measured with vLLM 0.32's cpu_attn_reshape_and_cache."""
    import torch

    return torch.zeros(blocks, heads, bs, 2 * HEAD_DIM)


def fa_hnd_cache(blocks: int, bs: int, heads: int) -> Any:
    """FlashAttention in the HND layout: logical (blocks, 2, block, heads, dim), memory
    (blocks, 2, heads, block, dim)."""
    import torch

    return torch.zeros(blocks, 2, heads, bs, HEAD_DIM).permute(0, 1, 3, 2, 4)


def mla_cache(blocks: int, bs: int, heads: int) -> Any:
    import torch

    assert heads == 1
    return torch.zeros(blocks, bs, 64)


# one token of one head, as each layout stores it (a view that can be read and written)
def cpu_get(t: Any, blk: int, off: int, h: int) -> Any:
    bs = t.shape[2]
    area = t[blk, h].reshape(-1)  # the head's part of the block, as the kernel uses it
    k = area[: bs * HEAD_DIM].view(HEAD_DIM, bs)[:, off]
    v = area[bs * HEAD_DIM:].view(bs, HEAD_DIM)[off]
    return _Pair(k, v)


class _Pair:
    """K and V of one token in the CPU layout, which are not next to each other."""

    def __init__(self, k: Any, v: Any) -> None:
        self.k, self.v = k, v
        self.shape = (2 * HEAD_DIM,)

    def __setitem__(self, _: Any, value: Any) -> None:
        self.k[...] = value[:HEAD_DIM]
        self.v[...] = value[HEAD_DIM:]

    def reshape(self, *_: Any) -> Any:
        import torch

        return torch.cat([self.k, self.v])


def fa_get(t: Any, blk: int, off: int, h: int) -> Any:
    return t[blk, :, off, h]


def mla_get(t: Any, blk: int, off: int, h: int) -> Any:
    return t[blk, off]


LAYOUTS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "cpu": (cpu_cache, cpu_get), "fa_hnd": (fa_hnd_cache, fa_get), "mla": (mla_cache, mla_get)}


def test_block_inside_reads_each_layout() -> None:
    import torch

    def inside(t: Any, bs: int, heads: int, head_size: int = HEAD_DIM) -> Any:
        return block_inside(tuple(t.shape), tuple(t.stride()), t.element_size(), bs, heads,
                            head_size, str(t.dtype).replace("torch.", ""))

    # (block_size, heads, head_stride, head_bytes, planes (offset, lines, stride, token))
    e, hd = 4, HEAD_DIM
    assert inside(cpu_cache(3, 32, 2), 32, 2) == (
        32, 2, 32 * 2 * hd * e, 32 * 2 * hd * e, ((0, hd, 32 * e, e), (32 * hd * e, 1, 0, hd * e)))
    bf16 = torch.zeros(3, 2, 32, 2 * hd, dtype=torch.bfloat16)  # its kernel may tile K
    assert inside(bf16, 32, 2)[4] == () and inside(bf16, 32, 2)[1] == 2
    assert inside(fa_hnd_cache(3, 16, 2), 16, 2) == (
        16, 2, 16 * hd * e, 2 * 16 * hd * e, ((0, 1, 0, hd * e), (2 * 16 * hd * e, 1, 0, hd * e)))
    assert inside(mla_cache(3, 16, 1), 16, 1, 64) == (16, 1, 16 * 64 * e, 16 * 64 * e,
                                                      ((0, 1, 0, 64 * e),))
    assert inside(cpu_cache(3, 32, 1), 32, 1)[:2] == (32, 1)  # one head: no head dimension
    assert inside(cpu_cache(6, 16, 2), 32, 2)[0] == 16  # a smaller kernel block
    nhd = torch.zeros(3, 2, 16, 2, HEAD_DIM)  # tokens outside heads: not head-major
    assert inside(nhd, 16, 2) == (0, 0, 0, 0, ())
    assert inside(cpu_cache(3, 32, 2), 48, 2) == (0, 0, 0, 0, ())  # 32 does not divide 48


class Side:
    """One instance: `tp` ranks, each a NIXL agent with its own layers' caches."""

    def __init__(self, name: str, kind: str, tp: int, bs: int, blocks: int) -> None:
        make, self.get = LAYOUTS[kind]
        heads = 1 if kind == "mla" else HEADS
        self.layout = KVLayout(block_size=bs, tp=tp, num_layers=LAYERS, num_kv_heads=heads,
                               head_bytes=(64 if kind == "mla" else HEAD_DIM) * 4)
        self.bs, self.ranks = bs, []
        for r in range(tp):
            local = len(self.layout.heads_of(r))
            caches = {f"layers.{i}.attn": make(blocks, bs, local) for i in range(LAYERS)}
            regions = cache_regions(caches, bs, local, 64 if kind == "mla" else HEAD_DIM)
            geom = geometry_of(regions, bs)
            tr = Transport(f"{name}-r{r}-{time.time_ns() % 10**9}", granule=geom.granule())
            for reg in regions:
                tr.register(reg.flat)
            self.ranks.append((caches, geom, tr))

    def fill(self, blocks: tuple[int, ...], n: int, truth: Any) -> None:
        """Write truth[layer, head, token] at the tokens' places on every rank."""
        for r, (caches, _, _) in enumerate(self.ranks):
            for li, t in enumerate(caches.values()):
                for h_local, h in enumerate(self.layout.heads_of(r)):
                    for tok in range(n):
                        blk, off = blocks[tok // self.bs], tok % self.bs
                        self.get(t, blk, off, h_local)[...] = truth[li, h, tok].reshape(
                            self.get(t, blk, off, h_local).shape)

    def check(self, blocks: tuple[int, ...], n: int, truth: Any) -> None:
        import torch

        for r, (caches, _, _) in enumerate(self.ranks):
            for li, t in enumerate(caches.values()):
                for h_local, h in enumerate(self.layout.heads_of(r)):
                    for tok in range(n):
                        blk, off = blocks[tok // self.bs], tok % self.bs
                        got = self.get(t, blk, off, h_local).reshape(-1)
                        assert torch.equal(got, truth[li, h, tok].reshape(-1)), (
                            f"rank {r} layer {li} head {h} token {tok}")

    def check_untouched_outside(self, blocks: tuple[int, ...]) -> None:
        """Nothing outside `blocks` was written (the caches start zeroed) on any rank."""
        for caches, _, _ in self.ranks:
            for t in caches.values():
                others = [b for b in range(t.shape[0]) if b not in blocks]
                assert not t[others].any()

    def close(self) -> None:
        for _, _, tr in self.ranks:
            tr.close()


def move(src: Side, dst: Side, src_blocks: tuple[int, ...], dst_blocks: tuple[int, ...],
         n: int, op: str) -> int:
    """Carry out the core's plan stream by stream as the workers do: READ by the consumer
    rank, or WRITE by the producer rank. Returns the number of byte runs posted."""
    plan = plan_transfer(src.layout, dst.layout, src_blocks, dst_blocks, n)
    runs = slot_runs(plan)
    posted, total = [], 0
    for st in plan.streams:
        whole = st.heads == len(src.layout.heads_of(st.src_rank)) == len(
            dst.layout.heads_of(st.dst_rank))
        heads = None if whole else (st.src_head, st.dst_head, st.heads)
        _, s_geom, s_tr = src.ranks[st.src_rank]
        _, d_geom, d_tr = dst.ranks[st.dst_rank]
        if op == "READ":
            me, geom_me, geom_peer, peer_tr, is_src = d_tr, d_geom, s_geom, s_tr, False
        else:
            me, geom_me, geom_peer, peer_tr, is_src = s_tr, s_geom, d_geom, d_tr, True
        peer = me.add_peer(peer_tr.local_info())
        peer_tr.add_peer(me.local_info())
        br = byte_runs(runs, geom_me, geom_peer, local_is_src=is_src, heads=heads)
        total += len(br)
        posted.append((me, peer_tr, me.post(peer, op, br)))
    deadline = time.monotonic() + 30
    for me, other, t in posted:
        while me.poll(t) is Status.PENDING and time.monotonic() < deadline:
            other.progress()
        assert t.result is not None and t.result.ok, t.result
    return total


@pytest.mark.parametrize(("kind", "src_tp", "src_bs", "dst_tp", "dst_bs", "op"), [
    ("cpu", 2, 32, 1, 32, "READ"),  # prefill TP 2 -> decode TP 1 (pull)
    ("cpu", 1, 32, 2, 32, "WRITE"),  # prefill TP 1 -> decode TP 2 (push)
    ("cpu", 2, 64, 4, 64, "WRITE"),
    ("fa_hnd", 1, 16, 1, 32, "READ"),  # the GPU layout (K and V apart): unequal block sizes
    ("fa_hnd", 4, 16, 2, 32, "READ"),  # ... and TP at once
    ("fa_hnd", 1, 32, 1, 16, "WRITE"),
    ("fa_hnd", 2, 64, 4, 32, "WRITE"),
    ("mla", 2, 16, 1, 64, "READ"),  # one latent, replicated over ranks
])
def test_ranks_and_block_sizes_move_every_token_to_its_place(
        kind: str, src_tp: int, src_bs: int, dst_tp: int, dst_bs: int, op: str) -> None:
    import torch

    n = 150  # not a multiple of any block size: the last blocks are partly filled
    src = Side("src", kind, src_tp, src_bs, blocks=16)
    dst = Side("dst", kind, dst_tp, dst_bs, blocks=16)
    try:
        heads = src.layout.num_kv_heads
        width = 64 if kind == "mla" else 2 * HEAD_DIM
        truth = torch.randn(LAYERS, heads, n, width, generator=torch.Generator().manual_seed(7))
        # fragmented, shuffled block ids on both sides
        src_blocks = tuple([9, 3, 4, 5, 12, 0, 1, 2, 14, 15][:src.layout.blocks_for(n)])
        dst_blocks = tuple([6, 7, 2, 11, 12, 13, 1, 0, 3, 4][:dst.layout.blocks_for(n)])
        src.fill(src_blocks, n, truth)
        runs = move(src, dst, src_blocks, dst_blocks, n, op)
        assert runs > 0
        dst.check(dst_blocks, n, truth)
        dst.check_untouched_outside(dst_blocks)
    finally:
        src.close()
        dst.close()


@pytest.mark.parametrize(("kind", "src_tp", "dst_tp", "bs", "op"), [
    ("cpu", 1, 1, 32, "WRITE"),  # whole blocks
    ("cpu", 2, 1, 32, "READ"),  # head slices
    ("fa_hnd", 2, 4, 16, "WRITE"),  # K and V apart, head slices
])
def test_blocks_descending_on_both_sides_move_as_one_range(
        kind: str, src_tp: int, dst_tp: int, bs: int, op: str) -> None:
    """vLLM hands a request blocks in descending order once its pool has been reused: the core
    plans a range descending on both sides as one ascending run, and a partly filled last
    block as a run of its own; every token still lands in its place, nothing else is
    written."""
    import torch

    n = 150  # the last block is partly filled
    src = Side("src", kind, src_tp, bs, blocks=16)
    dst = Side("dst", kind, dst_tp, bs, blocks=16)
    try:
        k = src.layout.blocks_for(n)
        src_blocks = tuple(range(13, 13 - k, -1))  # 13, 12, ... descending
        dst_blocks = tuple(range(15, 15 - k, -1))
        plan = plan_transfer(src.layout, dst.layout, src_blocks, dst_blocks, n)
        assert plan.run_count == 2  # the full blocks as one range, the partial block alone
        width = 64 if kind == "mla" else 2 * HEAD_DIM
        truth = torch.randn(LAYERS, src.layout.num_kv_heads, n, width,
                            generator=torch.Generator().manual_seed(11))
        src.fill(src_blocks, n, truth)
        assert move(src, dst, src_blocks, dst_blocks, n, op) > 0
        dst.check(dst_blocks, n, truth)
        dst.check_untouched_outside(dst_blocks)
    finally:
        src.close()
        dst.close()


def test_equal_geometry_moves_whole_blocks_in_few_runs() -> None:
    """Same TP, same block size: one run per layer for adjacent blocks, as before."""
    src = Side("src", "cpu", 1, 32, blocks=8)
    dst = Side("dst", "cpu", 1, 32, blocks=8)
    try:
        _, s_geom, _ = src.ranks[0]
        _, d_geom, _ = dst.ranks[0]
        plan = plan_transfer(src.layout, dst.layout, (0, 1, 2), (4, 5, 6), 96)
        assert len(byte_runs(slot_runs(plan), d_geom, s_geom, local_is_src=False)) == LAYERS
    finally:
        src.close()
        dst.close()


def test_a_head_slice_needs_head_major_blocks() -> None:
    import torch

    nhd = {f"layers.{i}.attn": torch.zeros(4, 2, 32, HEADS, HEAD_DIM) for i in range(LAYERS)}
    geom = geometry_of(cache_regions(nhd, 32, HEADS, HEAD_DIM), 32)
    assert not geom.heads_known
    with pytest.raises(ValueError, match="not head-major"):
        byte_runs([(0, 0, 32)], geom, geom, local_is_src=True, heads=(0, 0, 2))
    # whole blocks still move
    assert byte_runs([(0, 32, 32)], geom, geom, local_is_src=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cpu_backend_blocks_of_other_sizes_are_refused_with_the_reason(dtype: str) -> None:
    """The CPU backend's caches (float32: K transposed, a line per channel; bf16: its kernel
    may tile K): head slices of whole blocks move, blocks of another size are refused."""
    import torch

    def geom(bs: int) -> Any:
        caches = {f"layers.{i}.attn": torch.zeros(4, 2, bs, 2 * HEAD_DIM,
                                                  dtype=getattr(torch, dtype))
                  for i in range(LAYERS)}
        return geometry_of(cache_regions(caches, bs, 2, HEAD_DIM), bs)

    g32, g64 = geom(32), geom(64)
    assert g32.heads_known and not g32.tokens_known
    assert g32.granule() >= 1024  # NIXL's descriptor lists stay small
    assert byte_runs([(32, 64, 40)], g32, g32, local_is_src=True, heads=(1, 0, 1))
    with pytest.raises(ValueError, match="give prefill and decode one block size"):
        byte_runs([(32, 64, 40)], g32, g64, local_is_src=True)


def test_granules_stay_coarse() -> None:
    """Descriptor lists are cut into granules once per peer: a piece of a block is never
    smaller than MIN_TOKENS tokens of one head's plane."""
    from kvplane.live.connector_worker import MIN_TOKENS

    for kind, heads, bs, token in (("fa_hnd", 2, 16, HEAD_DIM * 4), ("mla", 1, 64, 64 * 4)):
        make, _ = LAYOUTS[kind]
        caches = {f"layers.{i}.attn": make(4, bs, heads) for i in range(LAYERS)}
        g = geometry_of(cache_regions(caches, bs, heads, 64 if kind == "mla" else HEAD_DIM), bs)
        assert g.tokens_known and g.granule() == MIN_TOKENS * token
