"""Block pools kept as runs of free block ids, so their cost is per run, not per block.

Rules kept here:
- The free blocks form a queue: allocation takes from the front, freed blocks go to the back
  in the order they are given. Without `run_blocks` a fresh pool hands out in order.
- With `run_blocks`, allocation cuts what it hands out into runs of geometric length with that
  mean (one draw of `n` lengths per allocation of `n` blocks, from the pool's own generator),
  and after each run but the last it moves one free block from the front to the back, so the
  next run starts elsewhere: the fragmentation of a long-running server's pool. (Only when
  more free blocks remain than the allocation still needs, so a nearly full pool can still
  serve it.)
- The queue holds (start, length) runs, adjacent runs merged as they are appended; memory and
  time go with the number of runs. The core is still given and gives back tuples of ids: a
  tuple this pool handed out comes back by identity and is turned into runs by a lookup; any
  other is cut into runs in one pass.
"""

from __future__ import annotations

from collections import deque
from itertools import chain

import numpy as np

Run = tuple[int, int]  # (first block id, number of blocks)
_GIVEN_SIZE = 4096  # handed-out tuples remembered (those of the requests in flight)


class RunPool:
    """Block ids of one instance, free ones as a queue of runs."""

    def __init__(self, n: int, run_blocks: float | None, seed: int) -> None:
        self.runs: deque[list[int]] = deque([[0, n]] if n else [])  # [start, length], mutable
        self.capacity = n
        self.free = n
        self.run_blocks = run_blocks
        self.rng = np.random.default_rng(seed)
        # tuples handed out, by id, with their runs: freed tuples come back as the same object
        self._given: dict[int, tuple[tuple[int, ...], list[Run]]] = {}

    def take(self, n: int) -> tuple[int, ...] | None:
        if n > self.free:
            return None
        if self.run_blocks is None:
            cut = self._cut(n)
        else:
            cut = []
            need = n
            skip = self.free > n  # only while more is free than this allocation needs
            for length in self.rng.geometric(1.0 / self.run_blocks, size=n).tolist():
                k = min(length, need)
                cut += self._cut(k)
                need -= k
                if need <= 0:
                    break
                if skip:  # the next run starts elsewhere
                    start, _ = self._cut(1)[0]
                    self._append(start, 1)
        self.free -= n
        out = tuple(chain.from_iterable(range(start, start + ln) for start, ln in cut))
        given = self._given
        if len(given) >= _GIVEN_SIZE:  # tuples split by their user never come back whole
            del given[next(iter(given))]
        given[id(out)] = (out, cut)
        return out

    def give(self, blocks: tuple[int, ...]) -> None:
        hit = self._given.pop(id(blocks), None)
        runs = hit[1] if hit is not None and hit[0] is blocks else _runs_of(blocks)
        for start, ln in runs:
            self._append(start, ln)
        self.free += len(blocks)

    def _cut(self, n: int) -> list[Run]:
        """Take `n` blocks from the front of the queue (the caller keeps `free` right)."""
        out: list[Run] = []
        runs = self.runs
        while n > 0:
            head = runs[0]
            if head[1] <= n:
                runs.popleft()
                out.append((head[0], head[1]))
                n -= head[1]
            else:
                out.append((head[0], n))
                head[0] += n
                head[1] -= n
                n = 0
        return out

    def _append(self, start: int, length: int) -> None:
        runs = self.runs
        if runs:
            tail = runs[-1]
            if tail[0] + tail[1] == start:
                tail[1] += length
                return
        runs.append([start, length])


def _runs_of(blocks: tuple[int, ...]) -> list[Run]:
    """Maximal runs of consecutive ids, in order."""
    if not blocks:
        return []
    first = blocks[0]
    if blocks[-1] - first == len(blocks) - 1 and blocks == tuple(
            range(first, first + len(blocks))):
        return [(first, len(blocks))]
    out: list[Run] = []
    start = prev = first
    for b in blocks[1:]:
        if b != prev + 1:
            out.append((start, prev - start + 1))
            start = b
        prev = b
    out.append((start, prev - start + 1))
    return out
