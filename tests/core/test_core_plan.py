"""Transfer planning: runs across block sizes, fragmentation, TP fan-out, descriptor and bytes."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.core.errors import PeerError
from kvplane.core.plan import (
    KVLayout,
    Run,
    Stream,
    count_runs,
    fan_out,
    merge_runs,
    plan_transfer,
)


def layout(bs: int = 16, tp: int = 1, heads: int = 8, layers: int = 4, hb: int = 256) -> KVLayout:
    return KVLayout(block_size=bs, tp=tp, num_layers=layers, num_kv_heads=heads, head_bytes=hb)


# --- runs -----------------------------------------------------------------------------------------


def test_adjacent_blocks_merge_into_one_run() -> None:
    assert merge_runs((4, 5, 6), 16, (10, 11, 12), 16, 48) == (Run(64, 160, 48),)


def test_runs_merge_across_different_block_sizes() -> None:
    # two adjacent 16-token producer blocks fill one 32-token consumer block
    assert merge_runs((0, 1), 16, (3,), 32, 32) == (Run(0, 96, 32),)
    # and the other way round
    assert merge_runs((3,), 32, (0, 1), 16, 32) == (Run(96, 0, 32),)
    # a gap on the producer side splits the run at the producer's block boundary
    assert merge_runs((0, 2), 16, (3,), 32, 32) == (Run(0, 96, 16), Run(32, 112, 16))
    # a gap on the consumer side splits it at the consumer's block boundary
    assert merge_runs((0, 1, 2, 3), 16, (5, 9), 32, 64) == (Run(0, 160, 32), Run(32, 288, 32))


def test_fragmented_pool_gives_one_run_per_fragment() -> None:
    runs = merge_runs((9, 3, 4, 7), 16, (0, 1, 2, 3), 16, 64)
    assert runs == (Run(144, 0, 16), Run(48, 16, 32), Run(112, 48, 16))


def test_partial_last_block_and_zero_tokens() -> None:
    assert merge_runs((2, 3), 16, (7,), 32, 20) == (Run(32, 224, 20),)
    assert merge_runs((), 16, (), 32, 0) == ()


def test_blocks_descending_on_both_sides_merge_into_one_ascending_run() -> None:
    # vLLM frees a request's blocks tail first: after the pool wraps, ids come back descending.
    # (5, 9), (4, 8), (3, 7) is the one range [3, 5] -> [7, 9] on both sides
    assert merge_runs((5, 4, 3), 16, (9, 8, 7), 16, 48) == (Run(48, 112, 48),)
    assert count_runs((5, 4, 3), 16, (9, 8, 7), 16, 48) == 1
    # a descending range, then an ascending one, then a lone block
    runs = merge_runs((5, 4, 3, 10, 11, 30), 16, (9, 8, 7, 1, 2, 0), 16, 96)
    assert runs == (Run(48, 112, 48), Run(160, 16, 32), Run(480, 0, 16))
    assert count_runs((5, 4, 3, 10, 11, 30), 16, (9, 8, 7, 1, 2, 0), 16, 96) == 3


def test_descending_on_one_side_only_does_not_merge() -> None:
    assert merge_runs((5, 4), 16, (7, 8), 16, 32) == (Run(80, 112, 16), Run(64, 128, 16))
    assert merge_runs((5, 6), 16, (8, 7), 16, 32) == (Run(80, 128, 16), Run(96, 112, 16))
    # descending by more than one block is a gap, not a range
    assert count_runs((5, 3), 16, (9, 7), 16, 32) == 2


def test_partly_filled_last_block_never_joins_a_descending_run() -> None:
    # 40 tokens: blocks 5 and 4 full, block 3 holds 8 tokens. Merged, the run would start at
    # block 3 and claim its 8 unused slots: block 3 stays its own run of 8 tokens
    runs = merge_runs((5, 4, 3), 16, (9, 8, 7), 16, 40)
    assert runs == (Run(64, 128, 32), Run(48, 112, 8))
    assert count_runs((5, 4, 3), 16, (9, 8, 7), 16, 40) == 2
    # two blocks, the second partial: two runs
    assert merge_runs((5, 4), 16, (9, 8), 16, 17) == (Run(80, 144, 16), Run(64, 128, 1))
    # an ascending run keeps its partial last block (its unused slots lie past the run's end)
    assert merge_runs((3, 4, 5), 16, (7, 8, 9), 16, 40) == (Run(48, 112, 40),)


def test_unequal_block_sizes_merge_ascending_ranges_only() -> None:
    # descending 16-token producer blocks into one 32-token consumer block: the consumer's
    # slots ascend while the producer's jump back, so nothing is contiguous on both sides
    assert merge_runs((1, 0), 16, (3,), 32, 32) == (Run(16, 96, 16), Run(0, 112, 16))
    assert merge_runs((3, 2), 32, (5, 4), 32, 64) == (Run(64, 128, 64),)  # equal sizes merge
    # both sides descend, blocks of 16 into blocks of 32: each 16-token piece is its own run
    assert merge_runs((3, 2, 1, 0), 16, (5, 4), 32, 64) == (
        Run(48, 160, 16), Run(32, 176, 16), Run(16, 128, 16), Run(0, 144, 16))
    assert count_runs((1, 0), 16, (3,), 32, 32) == 2


def test_too_few_blocks_is_the_peer_misbehaving() -> None:
    with pytest.raises(PeerError, match="source"):
        merge_runs((1,), 16, (1, 2), 16, 17)
    with pytest.raises(PeerError, match="destination"):
        merge_runs((1, 2), 16, (1,), 16, 17)
    with pytest.raises(PeerError):
        plan_transfer(layout(), layout(bs=32), (1, 2, 3), (4,), 40)


@pytest.mark.parametrize(("heads", "src_tp", "dst_tp"),
                         [(4, 1, 2), (4, 2, 1), (4, 2, 4), (4, 4, 2), (2, 1, 4), (2, 4, 1),
                          (8, 8, 2), (1, 2, 4), (4, 4, 4)])
def test_each_stream_names_where_its_heads_sit_on_both_ranks(heads: int, src_tp: int,
                                                              dst_tp: int) -> None:
    src, dst = layout(heads=heads, tp=src_tp), layout(heads=heads, tp=dst_tp)
    got: dict[int, list[int]] = {}
    for s in fan_out(src, dst):
        for i in range(s.heads):
            global_src = src.heads_of(s.src_rank)[s.src_head + i]
            global_dst = dst.heads_of(s.dst_rank)[s.dst_head + i]
            assert global_src == global_dst  # the same head at both ends
            got.setdefault(s.dst_rank, []).append(global_dst)
    # every consumer rank receives each of its heads exactly once
    assert {d: sorted(h) for d, h in got.items()} == {
        d: list(dst.heads_of(d)) for d in range(dst_tp)}


def _pool(data: st.DataObject, k: int) -> tuple[int, ...]:
    """`k` distinct block ids the way a used pool hands them out: ranges of ids, each ascending
    or descending (vLLM frees a request's blocks tail first), in any order."""
    total = k + 6
    cuts = sorted(data.draw(st.sets(st.integers(1, total - 1), max_size=total // 2)))
    segs = [list(range(a, b)) for a, b in zip([0, *cuts], [*cuts, total])]
    down = data.draw(st.lists(st.booleans(), min_size=len(segs), max_size=len(segs)))
    order = data.draw(st.permutations(range(len(segs))))
    ids = [b for i in order for b in (segs[i][::-1] if down[i] else segs[i])]
    return tuple(ids[:k])


def _check_runs(src: tuple[int, ...], src_bs: int, dst: tuple[int, ...], dst_bs: int,
                n: int) -> tuple[Run, ...]:
    """The runs pair exactly the token slots per-block planning pairs: token t of the request
    from `src[t // src_bs] * src_bs + t % src_bs` to the same on `dst`, each token once, none
    past `n`. Run by run in request order, each covers the next tokens (a descending range's
    tokens in another order inside the run)."""
    runs = merge_runs(src, src_bs, dst, dst_bs, n)
    want = [
        (src[t // src_bs] * src_bs + t % src_bs, dst[t // dst_bs] * dst_bs + t % dst_bs)
        for t in range(n)
    ]
    t = 0
    for r in runs:
        assert r.tokens > 0
        got = {(r.src_slot + i, r.dst_slot + i) for i in range(r.tokens)}
        assert got == set(want[t:t + r.tokens])
        t += r.tokens
    assert t == n
    if src_bs != dst_bs:  # ascending ranges only: two consecutive runs never continue
        for a, b in itertools.pairwise(runs):  # each other on both sides
            assert not (a.src_slot + a.tokens == b.src_slot
                        and a.dst_slot + a.tokens == b.dst_slot)
    elif n:  # maximal block by block: a run breaks only where the next block's ids are not
        k = -(-n // src_bs)  # both +1 or both -1, or before a partly filled last block that
        steps = [(s1 - s0, d1 - d0)  # would end a descending run
                 for s0, s1, d0, d1 in zip(src[:k], src[1:k], dst[:k], dst[1:k])]
        breaks = sum(1 for st_ in steps if st_ not in ((1, 1), (-1, -1)))
        partial = k * src_bs > n and k > 1 and steps[-1] == (-1, -1)
        assert len(runs) == 1 + breaks + partial
    # the count a plan records without making the runs is their number
    assert count_runs(src, src_bs, dst, dst_bs, n) == len(runs)
    return runs


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    src_bs=st.sampled_from([1, 4, 16, 32]),
    dst_bs=st.sampled_from([1, 8, 16, 64]),
    n=st.integers(0, 200),
    data=st.data(),
)
def test_runs_cover_every_token_exactly_once(
    src_bs: int, dst_bs: int, n: int, data: st.DataObject
) -> None:
    def pool(bs: int) -> tuple[int, ...]:
        k = -(-n // bs)
        ids = data.draw(st.permutations(range(k + 6)))
        return tuple(ids[:k])

    _check_runs(pool(src_bs), src_bs, pool(dst_bs), dst_bs, n)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    bs=st.sampled_from([1, 4, 16]),
    n=st.integers(0, 200),
    shift=st.integers(0, 40),
    aligned=st.booleans(),
    data=st.data(),
)
def test_runs_of_a_used_pool_cover_the_same_slot_pairs_as_per_block_planning(
    bs: int, n: int, shift: int, aligned: bool, data: st.DataObject
) -> None:
    """Pools of ascending and descending ranges; `aligned`: the destination's ids follow the
    source's (shifted), so descending ranges meet on both sides, as after a wrapped pool."""
    k = -(-n // bs)
    src = _pool(data, k)
    dst = tuple(b + shift for b in src) if aligned else _pool(data, k)
    runs = _check_runs(src, bs, dst, bs, n)
    if aligned and n:
        # every range of the source is one run, a partly filled last block apart
        breaks = sum(1 for a, b in itertools.pairwise(src[:k]) if abs(b - a) != 1)
        partial = k * bs > n and k > 1 and src[k - 1] == src[k - 2] - 1
        assert len(runs) == 1 + breaks + partial


# --- fan-out over tensor parallelism --------------------------------------------------------------


def test_equal_tp_is_rank_to_rank() -> None:
    assert fan_out(layout(tp=2), layout(tp=2)) == (Stream(0, 0, 4), Stream(1, 1, 4))


def test_consumer_with_more_ranks_reads_slices_of_one_producer() -> None:
    assert fan_out(layout(tp=2), layout(tp=4)) == (
        Stream(0, 0, 2, 0, 0), Stream(0, 1, 2, 2, 0), Stream(1, 2, 2, 0, 0),
        Stream(1, 3, 2, 2, 0)
    )


def test_consumer_with_fewer_ranks_gathers_from_several_producers() -> None:
    assert fan_out(layout(tp=4), layout(tp=2)) == (
        Stream(0, 0, 2, 0, 0), Stream(1, 0, 2, 0, 2), Stream(2, 1, 2, 0, 0),
        Stream(3, 1, 2, 0, 2)
    )
    plan = plan_transfer(layout(tp=4), layout(tp=2), (0,), (0,), 16)
    assert plan.notifications_for(0) == 2 and plan.notifications_for(1) == 2
    assert plan.expected == {(0, 0), (1, 0), (2, 1), (3, 1)}


def test_more_ranks_than_kv_heads_replicates_heads() -> None:
    two = 2
    # consumer replicates: ranks 0,1 hold head 0; ranks 2,3 hold head 1
    assert fan_out(layout(heads=two, tp=1), layout(heads=two, tp=4)) == (
        Stream(0, 0, 1), Stream(0, 1, 1), Stream(0, 2, 1, 1, 0), Stream(0, 3, 1, 1, 0)
    )
    # producer replicates: the lowest rank holding a head writes it
    assert fan_out(layout(heads=two, tp=4), layout(heads=two, tp=1)) == (
        Stream(0, 0, 1), Stream(2, 0, 1, 0, 1)
    )
    assert fan_out(layout(heads=two, tp=4), layout(heads=two, tp=4)) == (
        Stream(0, 0, 1), Stream(0, 1, 1), Stream(2, 2, 1), Stream(2, 3, 1)
    )
    assert fan_out(layout(heads=1, tp=8), layout(heads=1, tp=2)) == (
        Stream(0, 0, 1), Stream(0, 1, 1)
    )


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    heads=st.sampled_from([1, 2, 4, 8]),
    src_tp=st.sampled_from([1, 2, 4, 8, 16]),
    dst_tp=st.sampled_from([1, 2, 4, 8, 16]),
)
def test_every_consumer_rank_gets_each_of_its_heads_once(
    heads: int, src_tp: int, dst_tp: int
) -> None:
    src, dst = layout(heads=heads, tp=src_tp), layout(heads=heads, tp=dst_tp)
    streams = fan_out(src, dst)
    assert len({(s.src_rank, s.dst_rank) for s in streams}) == len(streams)
    for d in range(dst_tp):
        assert sum(s.heads for s in streams if s.dst_rank == d) == len(dst.heads_of(d))
    for s in streams:
        assert 0 <= s.src_rank < src_tp and s.heads > 0
    # every rank's heads are in range and all heads are covered on both sides
    for lay in (src, dst):
        seen = {h for r in range(lay.tp) for h in lay.heads_of(r)}
        assert seen == set(range(heads))


def test_kv_heads_that_do_not_split_evenly_are_refused() -> None:
    with pytest.raises(ValueError, match="split"):
        layout(heads=8, tp=3)
    with pytest.raises(ValueError, match="split"):
        layout(heads=2, tp=3)
    with pytest.raises(ValueError):
        layout(bs=0)


def test_layouts_that_disagree_on_the_model_are_refused() -> None:
    with pytest.raises(PeerError, match="KV heads"):
        fan_out(layout(heads=8), layout(heads=4))
    with pytest.raises(PeerError, match="layers"):
        plan_transfer(layout(layers=4), layout(layers=8), (0,), (0,), 16)
    with pytest.raises(PeerError, match="layers or head size"):
        plan_transfer(layout(hb=256), layout(hb=128), (0,), (0,), 16)


# --- descriptors and bytes --------------------------------------------------------------------------


def test_descriptor_and_byte_counts_equal_tp() -> None:
    src, dst = layout(tp=2, layers=4, heads=8, hb=256), layout(tp=2, layers=4, heads=8, hb=256)
    plan = plan_transfer(src, dst, (0, 1, 5), (3, 4, 5), 40)
    assert plan.runs == (Run(0, 48, 32), Run(80, 80, 8))
    # per stream: runs x layers x (K, V); heads of a rank move in one descriptor
    assert plan.descriptors == 2 * (2 * 4 * 2)
    # every token of every head of every layer, K and V, exactly once
    assert plan.bytes == 40 * 4 * 2 * 8 * 256
    assert plan.num_tokens == 40
    assert plan.expected == {(0, 0), (1, 1)}


def test_descriptor_and_byte_counts_unequal_tp() -> None:
    src, dst = layout(tp=1, heads=8), layout(tp=4, heads=8)
    plan = plan_transfer(src, dst, (0, 1), (7, 2), 32)
    assert len(plan.runs) == 2
    # each stream moves a slice of 2 heads, one descriptor per head
    assert plan.descriptors == 4 * (2 * 4 * 2 * 2)
    assert plan.bytes == 32 * 4 * 2 * 8 * 256


def test_replicated_consumer_heads_are_moved_to_every_replica() -> None:
    src, dst = layout(tp=1, heads=2), layout(tp=4, heads=2)
    plan = plan_transfer(src, dst, (0,), (0,), 16)
    assert len(plan.streams) == 4
    assert plan.bytes == 16 * 4 * 2 * 4 * 256  # four consumer ranks, one head each
    assert plan.descriptors == 4 * (1 * 4 * 2 * 1)


def test_blocks_for() -> None:
    assert layout(bs=16).blocks_for(0) == 0
    assert layout(bs=16).blocks_for(16) == 1
    assert layout(bs=16).blocks_for(17) == 2
