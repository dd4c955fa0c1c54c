"""Block lists that carry their runs, so what reads them can work per run, not per block.

Rules kept here:
- A block list is a tuple of ids everywhere in the protocol (`events.Blocks`). A `RunBlocks`
  is such a tuple (equal to, hashed and printed as the plain tuple of its ids) that also holds
  `runs`: its ids as maximal runs of neighbours one apart, flat `(start, signed length, ...)`;
  a negative length is a descending run (`(9, -3)` is 9, 8, 7), a lone id has length 1.
- Whoever makes one vouches that `runs` spells its ids (the simulator's pools cut them from
  the arrays they hold, `sim/engine.py`); the core only passes them on and joins them
  (`join`, `tail`). A reader that wants the ids ignores `runs`; one that wants runs (the
  store's encoder: a 1,024-block prompt in 3 runs is 3 pairs to pack, not 1,024 ints to read)
  takes them as they are.
- Runs are cut exactly where two neighbours are not one apart. In a list of distinct ids (the
  core refuses any other: `checks.duplicates`) a run cannot turn round, so that cut is the
  only one and the runs of a list are unique: `runs_of(ids)` gives them for any list, and
  joining two lists' runs gives those of the joined list.
- Pickled (a result sent between processes), a `RunBlocks` is a plain tuple: the runs are a
  means of the process that made them, never part of what is stored or compared.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from operator import is_
from typing import Any, Self


class RunBlocks(tuple[int, ...]):
    """A block list (a tuple of ids) with its runs (`runs`, see the module)."""

    runs: tuple[int, ...]

    def __new__(cls, ids: Iterable[int], runs: tuple[int, ...]) -> Self:
        self = super().__new__(cls, ids)
        self.runs = runs
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (tuple, (tuple(self),))


def runs_of(ids: Sequence[int]) -> tuple[int, ...]:
    """The runs of a list of distinct ids (see the module), walked id by id (for short lists
    and checks; the simulator cuts long ones from its arrays)."""
    out: list[int] = []
    if not ids:
        return ()
    start = prev = ids[0]
    length = 1  # signed once a run has two ids
    for b in ids[1:]:
        step = b - prev
        if length == 1 and step in (1, -1):
            length = 2 * step
        elif length > 1 and step == 1:
            length += 1
        elif length < 0 and step == -1:
            length -= 1
        else:
            out += (start, length)
            start, length = b, 1
        prev = b
    out += (start, length)
    return tuple(out)


def spans(runs: tuple[int, ...]) -> Iterator[tuple[int, int]]:
    """Each run of `runs` as (lowest id, highest id)."""
    for i in range(0, len(runs), 2):
        start, length = runs[i], runs[i + 1]
        yield (start, start + length - 1) if length > 0 else (start + length + 1, start)


def runs_distinct(runs: tuple[int, ...]) -> bool:
    """Whether the ids the runs spell are distinct and none is negative: per run, not per id
    (the runs' spans, lowest first, neither overlap nor start below 0)."""
    last = -1
    for lo, hi in sorted(spans(runs)):
        if lo <= last:
            return False
        last = hi
    return True


def paired_steps(src: tuple[int, ...], dst: tuple[int, ...], nb: int) -> int:
    """Of the first `nb` places of two lists of distinct ids with their runs, how many after
    the first have ids that are both their predecessor's plus one or both minus one: the
    places inside one run of each side, both running the same way, counted per overlap of a
    run of one with a run of the other (a run of k places holds k - 1 such steps)."""
    a, b = _segments(src, nb), _segments(dst, nb)
    i = j = pairs = 0
    while i < len(a) and j < len(b):
        (lo1, hi1, d1), (lo2, hi2, d2) = a[i], b[j]
        if d1 == d2 != 0:
            pairs += max(min(hi1, hi2) - max(lo1, lo2) - 1, 0)
        if hi1 <= hi2:
            i += 1
        if hi2 <= hi1:
            j += 1
    return pairs


def _segments(runs: tuple[int, ...], nb: int) -> list[tuple[int, int, int]]:
    """The runs as places `[lo, hi)` in the list, with their way (1, -1, 0 for a lone id),
    up to place `nb`."""
    out = []
    at = 0
    for i in range(0, len(runs), 2):
        if at >= nb:
            break
        length = runs[i + 1]
        n = abs(length)
        out.append((at, min(at + n, nb), (length > 1) - (length < 0)))
        at += n
    return out


# The last join's parts and its answer: a request's blocks are joined by its own entry and
# then by the ledger, from the very same parts, when they are freed; the second gets the
# first's tuple (no copy, and found fine by `checks` already)
_last_join: tuple[tuple[tuple[int, ...], ...], tuple[int, ...]] = ((), ())


def join(parts: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """The parts one after another: a `RunBlocks` if some part came with runs and every other
    is short (its runs are then walked), else a plain tuple (as when no driver gives runs)."""
    global _last_join
    full = [part for part in parts if part]
    if len(full) <= 1:  # the very tuple (identity is what memories of lists key on)
        return full[0] if full else ()
    last_parts, last = _last_join
    if len(last_parts) == len(full) and all(map(is_, last_parts, full)):
        return last
    out = _join(full)
    _last_join = (tuple(full), out)
    return out


def _join(parts: list[tuple[int, ...]]) -> tuple[int, ...]:
    if type(parts[0]) is not RunBlocks and not any(type(p) is RunBlocks for p in parts):
        return _ids(parts)  # no driver gave runs: none are made up
    runs: list[int] = []
    for part in parts:
        if type(part) is RunBlocks:
            got = part.runs
        elif len(part) == 1:  # a decode step's new block
            got = (part[0], 1)
        elif len(part) <= 8:
            got = runs_of(part)
        else:
            return _ids(parts)
        if runs:
            runs = _joined(runs, got)
        else:
            runs = list(got)
    return RunBlocks(_ids(parts), tuple(runs))


def _ids(parts: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """The parts' ids as one plain tuple: the first (most often the long one: a prompt's
    blocks, then a decode's one-block growths) copied whole, not read id by id."""
    if len(parts) >= 2 and all(isinstance(p, tuple) for p in parts):
        rest = parts[1] if len(parts) == 2 else tuple(chain.from_iterable(parts[1:]))
        return tuple.__add__(parts[0], rest)
    return tuple(chain.from_iterable(parts))


def _joined(runs: list[int], more: tuple[int, ...]) -> list[int]:
    """`runs` followed by `more`, the two runs at the seam made one where they continue."""
    last_start, last_len = runs[-2], runs[-1]
    end = last_start + last_len - 1 if last_len > 0 else last_start + last_len + 1
    start, length = more[0], more[1]
    step = start - end
    if step in (1, -1) and (last_len == 1 or (last_len > 0) == (step > 0)) and (
            length == 1 or (length > 0) == (step > 0)):
        merged = abs(last_len) + abs(length)
        runs[-1] = merged if step > 0 else -merged
        runs += more[2:]
        return runs
    runs += more
    return runs


def tail(blocks: tuple[int, ...], skip: int) -> tuple[int, ...]:
    """`blocks` from index `skip` on: the very tuple when nothing is skipped (its identity is
    what the core's and the store's memories key on), with its runs cut when it has them."""
    if skip <= 0:
        return blocks
    if type(blocks) is not RunBlocks:
        return blocks[skip:]
    runs = blocks.runs
    left = skip
    for i in range(0, len(runs), 2):
        start, length = runs[i], runs[i + 1]
        n = abs(length)
        if left < n:
            step = 1 if length > 0 else -1
            rest = (start + left * step, (n - left) * step if n - left > 1 else 1)
            return RunBlocks(tuple.__getitem__(blocks, slice(skip, None)), rest + runs[i + 2:])
        left -= n
    return ()
