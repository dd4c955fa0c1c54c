"""The simulator's block pool (an array with a moving head) hands out exactly what a plain
list queue does (the reference model here), for random allocations and frees."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.sim.engine import BlockPool


class ListPool:
    """The reference: free block ids as one list, allocation from the front, frees to the back."""

    def __init__(self, n: int, run_blocks: float | None, seed: int) -> None:
        self.queue = list(range(n))
        self.run_blocks = run_blocks
        self.rng = np.random.default_rng(seed)

    def take(self, n: int) -> tuple[int, ...] | None:
        q = self.queue
        if n > len(q):
            return None
        if self.run_blocks is None:
            out, self.queue = q[:n], q[n:]
            return tuple(out)
        skip = len(q) > n
        out: list[int] = []
        for length in self.rng.geometric(1.0 / self.run_blocks, size=n).tolist():
            k = min(length, n - len(out))
            out += q[:k]
            del q[:k]
            if len(out) >= n:
                break
            if skip:
                q.append(q.pop(0))
        return tuple(out)

    def give(self, blocks: tuple[int, ...]) -> None:
        self.queue.extend(blocks)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 400), st.sampled_from([None, 1.5, 6.2]), st.integers(0, 2**31),
       st.lists(st.tuples(st.booleans(), st.integers(1, 120), st.booleans()), max_size=60))
def test_block_pool_matches_the_list_queue(n: int, run_blocks: float | None, seed: int,
                                          ops: list[tuple[bool, int, bool]]) -> None:
    ref, pool = ListPool(n, run_blocks, seed), BlockPool(n, run_blocks, seed)
    held: list[tuple[int, ...]] = []
    for take, size, split in ops:
        if take or not held:
            a, b = ref.take(size), pool.take(size)
            assert a == b
            if b is not None:
                held.append(b)
        else:
            blocks = held.pop(0)
            if split and len(blocks) > 1:  # freed as pieces: other tuple objects
                for part in (blocks[: len(blocks) // 2], blocks[len(blocks) // 2:]):
                    ref.give(part)
                    pool.give(part)
            else:
                ref.give(blocks)
                pool.give(blocks)
        assert pool.free == len(ref.queue)
        assert list(pool.queue[pool.head:]) == ref.queue
