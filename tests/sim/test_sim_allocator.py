"""The block pool behaves as vLLM 0.32's: head allocation, tail-first frees, LIFO reuse of
blocks without a hash, LRU order of cached ones, hits taken from the middle."""

from __future__ import annotations

import pytest

from kvplane.sim.engine import BlockPool, FreeBlockQueue


def test_a_fresh_pool_hands_out_ids_in_order() -> None:
    pool = BlockPool(10, None, 0)
    assert pool.take(3) == (0, 1, 2)
    assert pool.take(8) is None and pool.free == 7


def test_lifo_reuse_gives_the_last_request_s_blocks_back_reversed() -> None:
    pool = BlockPool(10, None, 0, reuse="lifo")
    a = pool.take(4)
    pool.give(a)  # freed tail first, put at the front
    assert pool.take(4) == (3, 2, 1, 0)
    fifo = BlockPool(10, None, 0, reuse="fifo")
    fifo.give(fifo.take(4))
    assert fifo.take(4) == (4, 5, 6, 7)  # earlier releases: freed blocks wait at the back
    assert fifo.take(6) == (8, 9, 3, 2, 1, 0)


def test_cached_blocks_wait_at_the_back_and_hits_take_them_from_the_middle() -> None:
    pool = BlockPool(8, None, 0, prefix_caching=True)
    a = pool.take(3)
    pool.cache([11, 12], a)  # two full blocks get hashes; the partial third does not
    pool.give(a)
    assert pool.hits([11, 12, 13], 3) == [0, 1]
    assert pool.free_after_touch([0, 1]) == 6
    pool.touch([0, 1])
    assert pool.free == 6
    assert pool.take(1) == (2,)  # the unhashed block came back to the front
    pool.give((0, 1))
    # everything else first, then the cached blocks in LRU order; taking one evicts its hash
    assert pool.take(7) == (3, 4, 5, 6, 7, 1, 0)
    assert pool.hits([11, 12], 2) == []


def test_a_shared_block_returns_only_when_its_last_holder_frees_it() -> None:
    pool = BlockPool(4, None, 0, prefix_caching=True)
    a = pool.take(2)
    pool.cache([5, 6], a)
    pool.touch(list(a))  # a second holder
    pool.give(a)
    assert pool.free == 2
    pool.give(a)
    assert pool.free == 4


def test_the_queue_keeps_runs_and_counts() -> None:
    q = FreeBlockQueue(6)
    assert q.popleft_n(2) == [0, 1]
    q.prepend_n([9, 8, 7, 20])
    assert list(q.runs)[:2] == [(9, 3, -1), (20, 1, 1)]
    assert len(q) == 8
    assert q.popleft_n(5) == [9, 8, 7, 20, 2]
    with pytest.raises(ValueError):
        BlockPool(4, None, 0, reuse="random")


def test_the_synthetic_ring_cuts_as_the_per_run_walk_does() -> None:
    """The array take equals the run-by-run walk, id for id, including nearly full pools."""
    import copy

    import numpy as np

    from kvplane.sim.engine import SyntheticQueue

    rng = np.random.default_rng(7)
    fast, slow = SyntheticQueue(300), SyntheticQueue(300)
    held: list[tuple[int, ...]] = []
    for _ in range(400):
        if held and (fast.count < 40 or rng.random() < 0.45):
            blocks = held.pop(int(rng.integers(len(held))))
            fast.append(blocks)
            slow.append(blocks)
            continue
        n = int(rng.integers(0, min(fast.count, 60) + 1))
        lengths = rng.geometric(1 / 3.0, size=n)
        before = copy.deepcopy(slow)
        got = fast.take(n, lengths)
        assert got == slow.take_slow(n, lengths), (n, before.head, before.count)
        assert (fast.head, fast.count) == (slow.head, slow.count)
        assert len(set(got)) == n
        held.append(got)
    assert np.array_equal(fast.ids, slow.ids)


def test_runs_of_ascending_lists_split_where_a_step_is_not_one() -> None:
    assert FreeBlockQueue._as_runs([4, 5, 6, 9, 20, 21, 3]) == [(4, 3, 1), (9, 1, 1), (20, 2, 1),
                                                                (3, 1, 1)]
    assert FreeBlockQueue._as_runs([7]) == [(7, 1, 1)] and FreeBlockQueue._as_runs([]) == []
    assert FreeBlockQueue._as_runs([5, 4, 3, 8]) == [(5, 3, -1), (8, 1, 1)]
    assert FreeBlockQueue._as_runs([5, 4, 6, 7]) == [(5, 2, -1), (6, 2, 1)]  # both: walked


def test_the_hash_index_answers_as_a_dict_does() -> None:
    """Random inserts, removals and lookups (tombstones, rebuilds, colliding slots) against a
    dict: same answers throughout."""
    import numpy as np

    from kvplane.sim.engine import HashIndex

    rng = np.random.default_rng(11)
    index, ref = HashIndex(128), {}
    for _ in range(600):
        if ref and rng.random() < 0.4:
            keys = list(ref)
            picked = rng.permutation(len(keys))[: int(rng.integers(1, 20))].tolist()
            gone = [keys[i] for i in picked]
            index.remove(np.array(gone, dtype=np.uint64))
            for h in gone:
                del ref[h]
        elif len(ref) < 100:
            # small keys collide in their slots; big ones cover the whole uint64 range
            pool = rng.integers(0, 300, size=30) if rng.random() < 0.5 else \
                rng.integers(0, 2**64, size=30, dtype=np.uint64)
            new = [h for h in dict.fromkeys(pool.tolist()) if h not in ref][:128 - len(ref)]
            blocks = rng.integers(0, 1000, size=len(new))
            index.add(np.array(new, dtype=np.uint64), blocks)
            ref.update(zip(new, blocks.tolist()))
        probe = list(ref)[:50] + rng.integers(0, 2**64, size=10, dtype=np.uint64).tolist()
        got = index.get(np.array(probe, dtype=np.uint64)).tolist()
        assert got == [ref.get(h, -1) for h in probe]
        assert [index.get_one(h) for h in probe] == got  # the one-key walk answers alike
        assert len(index) == len(ref)


def test_distinct_checks_agree_with_a_set() -> None:
    """The hash index's and the pool's distinctness checks (scratch write-and-read-back)
    against a set, on lists with and without repeats, small keys colliding in their slots."""
    import numpy as np

    from kvplane.sim.engine import BlockPool, HashIndex

    rng = np.random.default_rng(5)
    index = HashIndex(64)
    index.add(np.arange(1, 40, dtype=np.uint64), np.arange(39))
    pool = BlockPool(300, None, 0, prefix_caching=True)
    for _ in range(300):
        n = int(rng.integers(1, 60))
        hs = rng.integers(0, 80 if rng.random() < 0.5 else 2**63, size=n).astype(np.uint64)
        assert index.distinct(hs) == (len(set(hs.tolist())) == n)
        bs = rng.integers(0, 300, size=n)
        assert pool._distinct(bs) == (len(set(bs.tolist())) == n)
    # the check leaves the index as it was
    assert index.get(np.arange(1, 40, dtype=np.uint64)).tolist() == list(range(39))


def test_runs_cut_in_one_pass_equal_the_walk() -> None:
    """`FreeBlockQueue._as_runs` (array pass) gives the block-by-block walk's runs, on lists
    of runs of both directions, with and without a repeated id."""
    import numpy as np

    from kvplane.sim.engine import FreeBlockQueue

    rng = np.random.default_rng(1)
    for _ in range(3000):
        n = int(rng.integers(0, 40))
        ids: list[int] = []
        while len(ids) < n:
            start, length = int(rng.integers(0, 200)), int(rng.integers(1, 8))
            step = 1 if rng.random() < 0.5 else -1
            ids += [start + step * k for k in range(length)]
        ids = ids[:n]
        if rng.random() < 0.5:
            ids = list(dict.fromkeys(ids))  # distinct
        assert FreeBlockQueue._as_runs(ids) == FreeBlockQueue._as_runs_walk(ids)


def test_the_free_queue_keeps_order_as_a_list_does() -> None:
    """Random takes, frees to the front and to the back (the ring wrapping round, nearly
    empty and full queues) against a plain list of the unhashed free blocks."""
    import numpy as np

    from kvplane.sim.engine import FreeBlockQueue

    rng = np.random.default_rng(3)
    n = 50
    q, ref, held = FreeBlockQueue(n), list(range(n)), []
    for _ in range(3000):
        if ref and rng.random() < 0.5:
            k = int(rng.integers(0, len(ref) + 1))
            assert q.popleft_n(k) == ref[:k]
            held += ref[:k]
            ref = ref[k:]
        elif held:
            k = int(rng.integers(1, len(held) + 1))
            order = [int(i) for i in rng.permutation(len(held))]
            back = [held[i] for i in order[:k]]
            held = [held[i] for i in order[k:]]
            if rng.random() < 0.5:
                q.prepend_n(back)
                ref = back + ref
            else:
                q.append_unhashed(back)
                ref = ref + back
        assert len(q) == len(ref) == q.in_runs
        assert [b for s, m, st in q.runs for b in range(s, s + st * m, st)] == ref


def test_prefix_hits_reuse_the_last_answer_only_where_it_still_holds() -> None:
    """`BlockPool.hits` (which re-checks the last answer's blocks on the pool's arrays before
    probing the map) against a probe of every hash, while prompts sharing prefixes are
    admitted, cached, freed and evicted."""
    import numpy as np

    from kvplane.sim.engine import BlockPool

    rng = np.random.default_rng(7)
    pool = BlockPool(120, None, 0, prefix_caching=True)
    stems = [rng.integers(1, 2**62, size=40, dtype=np.uint64) for _ in range(3)]
    held: list[tuple[int, ...]] = []
    for _ in range(400):
        stem = stems[int(rng.integers(0, 3))]
        cut = int(rng.integers(0, 41))
        hashes = np.concatenate((stem[:cut], rng.integers(1, 2**62, size=int(rng.integers(0, 20)),
                                                          dtype=np.uint64)))
        limit = int(rng.integers(0, len(hashes) + 1))
        want = []
        for h in hashes[:limit].tolist():
            b = int(pool.block_of.get(np.array([h], dtype=np.uint64))[0])
            if b < 0:
                break
            want.append(b)
        assert pool.hits(hashes, limit) == want
        n = len(hashes)
        if n and pool.free >= n and rng.random() < 0.3:
            # hits stood in for by fresh blocks (as the simulator does for a hit another
            # request holds): the take may evict the very blocks of the answer just given
            blocks = pool.take(n)
            pool.cache(hashes, blocks)
            held.append(blocks)
            # every hash of the prompt is cached now, on a block of its own or an older one
            assert (pool.block_of.get(hashes) >= 0).all()
        elif n and pool.free >= n and not (set(want) & {b for t in held for b in t}):
            pool.touch(pool.free_of(want))
            blocks = (*want, *pool.take(n - len(want)))
            pool.cache(hashes, blocks)
            held.append(blocks)
        if held and rng.random() < 0.5:
            pool.give(held.pop(int(rng.integers(0, len(held)))))
        # the map holds exactly the hashed blocks' hashes, each on its own block (eviction
        # removes entries by their block's slot, `remove_values`)
        hashed = np.flatnonzero(pool.hashed)
        assert len(pool.block_of) == len(hashed)
        assert (pool.block_of.get(pool.hash_of[hashed]) == hashed).all()


def test_cache_keeps_the_first_block_of_a_hash() -> None:
    """`BlockPool.cache`: a hash already cached keeps its block; a hash named twice in one
    prompt goes to its first block; the map and the per-block hash arrays agree."""
    import numpy as np

    from kvplane.sim.engine import BlockPool

    pool = BlockPool(16, None, 0, prefix_caching=True)
    first = pool.take(3)
    assert first is not None
    pool.cache(np.array([11, 12, 13], dtype=np.uint64), first)
    second = pool.take(4)
    assert second is not None
    # 12 is cached on first[1] already; 14 appears twice: its first block takes it
    pool.cache(np.array([12, 14, 14, 15], dtype=np.uint64), second)
    got = pool.block_of.get(np.array([11, 12, 13, 14, 15], dtype=np.uint64)).tolist()
    assert got == [first[0], first[1], first[2], second[1], second[3]]
    hashed = {b for b in range(16) if pool.hashed[b]}
    assert hashed == set(got)
    assert [int(pool.hash_of[b]) for b in got] == [11, 12, 13, 14, 15]


def test_the_hash_index_removes_by_value_as_by_key() -> None:
    """A `by_value` index (values are a pool's blocks, each held by one key at most) removes
    entries by their values' known slots: against a dict, through tombstones and rebuilds."""
    import numpy as np

    from kvplane.sim.engine import HashIndex

    rng = np.random.default_rng(13)
    index, ref = HashIndex(128, by_value=True), {}
    for _ in range(800):
        if ref and rng.random() < 0.45:
            keys = list(ref)
            picked = rng.permutation(len(keys))[: int(rng.integers(1, 20))].tolist()
            values = [ref.pop(keys[i]) for i in picked]
            index.remove_values(np.array(values, dtype=np.int64))
        else:
            held = set(ref.values())
            free = [b for b in range(128) if b not in held]
            pool = rng.integers(0, 300, size=30) if rng.random() < 0.5 else \
                rng.integers(0, 2**64, size=30, dtype=np.uint64)
            new = [h for h in dict.fromkeys(pool.tolist()) if h not in ref][:len(free)]
            values = rng.permutation(free)[:len(new)]
            index.add(np.array(new, dtype=np.uint64), values)
            ref.update(zip(new, values.tolist()))
        probe = list(ref) + rng.integers(0, 2**64, size=10, dtype=np.uint64).tolist()
        got = index.get(np.array(probe, dtype=np.uint64)).tolist()
        assert got == [ref.get(h, -1) for h in probe]
        assert len(index) == len(ref)


def test_add_absent_inserts_what_a_dict_lacks() -> None:
    """`add_absent` (one probe: find, then insert at the first free slot passed) against a
    dict filled key by key in order: the keys it reports inserted are exactly those absent
    when their turn came (a key named twice: its first), and every lookup after it answers
    as the dict does, through tombstones, rebuilds and keys whose runs meet at one slot."""
    import numpy as np

    from kvplane.sim.engine import HashIndex

    rng = np.random.default_rng(17)
    index, ref = HashIndex(256, by_value=True), {}
    twice = 0
    for _ in range(800):
        if ref and rng.random() < 0.45:
            keys = list(ref)
            picked = rng.permutation(len(keys))[: int(rng.integers(1, 30))].tolist()
            values = [ref.pop(keys[i]) for i in picked]
            index.remove_values(np.array(values, dtype=np.int64))
            continue
        held = set(ref.values())
        free = [b for b in range(256) if b not in held]
        # present keys mixed with new ones; small keys collide in their slots
        pool = rng.integers(0, 400, size=40) if rng.random() < 0.5 else \
            rng.integers(0, 2**64, size=40, dtype=np.uint64)
        cand = list(dict.fromkeys([*list(ref)[:10], *pool.tolist()]))[:len(free) - 1]
        if rng.random() < 0.2:
            cand.append(cand[int(rng.integers(len(cand)))])  # a key twice
            twice += cand[-1] not in ref
        values = rng.permutation(free)[:len(cand)]
        got = index.add_absent(np.array(cand, dtype=np.uint64), values.astype(np.int64))
        want = []
        for h, b in zip(cand, values.tolist()):
            want.append(h not in ref)
            ref.setdefault(h, b)
        assert got.tolist() == want
        probe = list(ref) + rng.integers(0, 2**64, size=10, dtype=np.uint64).tolist()
        assert index.get(np.array(probe, dtype=np.uint64)).tolist() == [ref.get(h, -1)
                                                                         for h in probe]
        assert len(index) == len(ref)
    assert twice > 0  # an absent key named twice was met


def test_while_recording_a_pool_hands_out_long_lists_with_their_runs() -> None:
    import random

    import numpy as np

    from kvplane.core.blocks import RunBlocks, runs_of
    from kvplane.sim.engine import RUNS_FROM, with_runs

    rng = random.Random(5)
    for prefix_caching in (False, True):
        pool = BlockPool(4096, None, 0, prefix_caching=prefix_caching)
        pool.with_runs = True
        held: list[tuple[int, ...]] = []
        for _ in range(300):  # take and give at random: LIFO reuse makes descending runs
            got = pool.take(rng.randint(1, 200))
            if got is not None:
                assert list(got) == sorted(set(got), key=list(got).index)  # distinct
                if type(got) is RunBlocks:
                    assert got.runs == runs_of(got)
                else:
                    assert len(got) < 16 or 8 * (len(runs_of(got)) - 1) > len(got)
                held.append(got)
            if held and rng.random() < 0.5:
                pool.give(held.pop(rng.randrange(len(held))))
        joined = pool.joined([4095, 4094], held[-1]) if held else ()
        assert joined == (4095, 4094, *held[-1]) if held else True
    ids = [5, 4, 3, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]
    got = with_runs(np.array(ids, dtype=np.int64), ids)
    assert type(got) is RunBlocks and got.runs == (5, -3, 10, 14)
    pool = BlockPool(1024, None, 0, prefix_caching=True)  # not recording: plain tuples,
    assert type(pool.take(20)) is tuple  # but for lists long enough to gain by their runs
    long = pool.take(RUNS_FROM)
    assert type(long) is RunBlocks and long.runs == runs_of(long)
    joined = pool.joined([1000, 1001], pool.take(RUNS_FROM - 2))  # a prompt: hits, new
    assert type(joined) is RunBlocks and joined.runs == runs_of(joined)


def test_a_list_spelled_from_its_runs_is_the_array_of_its_ids() -> None:
    import random

    import numpy as np

    from kvplane.core.blocks import RunBlocks, runs_of
    from kvplane.sim.engine import ids_array

    rng = random.Random(6)
    for _ in range(500):
        ids: list[int] = []
        for _ in range(rng.randint(1, 5)):  # runs of both ways, apart from one another
            start, step = rng.randint(0, 10_000) * 100 + 50, rng.choice((1, -1))
            ids += [start + step * k for k in range(rng.randint(1, 40))]
        blocks = RunBlocks(ids, runs_of(ids))
        got = ids_array(blocks)
        assert got.dtype == np.int64 and got.tolist() == ids
        assert ids_array(tuple(ids)).tolist() == ids
