"""Block lists that carry their runs (`core/blocks.py`): the runs always spell the ids, and
the list is, to everything but a reader of `runs`, the plain tuple of its ids."""

from __future__ import annotations

import pickle
import random

import pytest

from kvplane.core.blocks import RunBlocks, join, runs_of, tail
from kvplane.core.checks import duplicates, found_fine
from kvplane.core.connector_rules import LoadWindow
from kvplane.core.events import BlocksReserved
from kvplane.core.plan import count_runs


def spelled(runs: tuple[int, ...]) -> list[int]:
    """The ids a flat (start, signed length) run list stands for."""
    out: list[int] = []
    for start, length in zip(runs[::2], runs[1::2], strict=True):
        assert length != 0
        step = 1 if length > 0 else -1
        out += range(start, start + length, step)
    return out


def distinct_lists(seed: int, count: int) -> list[list[int]]:
    """Lists of distinct ids made of ascending and descending stretches, as pools hand out."""
    rng = random.Random(seed)
    lists = []
    for _ in range(count):
        used: set[int] = set()
        ids: list[int] = []
        for _ in range(rng.randint(0, 6)):
            start, step = rng.randint(0, 3000), rng.choice((1, -1))
            for i in range(rng.randint(1, 60)):
                b = start + i * step
                if b < 0 or b in used:
                    break
                used.add(b)
                ids.append(b)
        lists.append(ids)
    return lists


def with_runs(ids: list[int]) -> tuple[int, ...]:
    return RunBlocks(ids, runs_of(ids))


@pytest.mark.parametrize(("ids", "runs"), [
    ([], ()),
    ([7], (7, 1)),
    ([3, 4, 5, 9], (3, 3, 9, 1)),
    ([9, 8, 7, 1, 2], (9, -3, 1, 2)),
    ([5, 3, 1], (5, 1, 3, 1, 1, 1)),
    ([10, 11, 40, 39, 38, 0], (10, 2, 40, -3, 0, 1)),
])
def test_runs_are_cut_where_neighbours_are_not_one_apart(ids: list[int],
                                                        runs: tuple[int, ...]) -> None:
    assert runs_of(ids) == runs
    assert spelled(runs) == ids


def test_a_run_list_is_the_plain_tuple_of_its_ids() -> None:
    ids = [9, 8, 7, 20, 21]
    blocks = with_runs(ids)
    assert blocks == tuple(ids) and tuple(ids) == blocks
    assert hash(blocks) == hash(tuple(ids)) and repr(blocks) == repr(tuple(ids))
    event = BlocksReserved(at=1.0, instance="d0", request="r", blocks=blocks, purpose="decode")
    plain = BlocksReserved(at=1.0, instance="d0", request="r", blocks=tuple(ids),
                           purpose="decode")
    assert event == plain and repr(event) == repr(plain)
    back = pickle.loads(pickle.dumps(event))
    assert back == plain and type(back.blocks) is tuple  # runs never leave the process


def test_joined_lists_keep_the_runs_of_the_whole() -> None:
    for ids in distinct_lists(1, 400):
        for cut in {0, len(ids) // 3, len(ids) // 2, len(ids)}:
            parts = (with_runs(ids[:cut]), with_runs(ids[cut:]))
            got = join(parts)
            assert got == tuple(ids)
            if len(ids[:cut]) and len(ids[cut:]):
                assert type(got) is RunBlocks and got.runs == runs_of(ids), (ids, cut)
            else:  # one part only: that very tuple
                assert got is (parts[0] if ids[:cut] else parts[1] if ids else ())


def test_a_join_with_a_long_list_without_runs_is_a_plain_tuple() -> None:
    got = join((with_runs([1, 2, 3]), tuple(range(10, 30)), (31,)))
    assert type(got) is tuple and got == (1, 2, 3, *range(10, 30), 31)
    short = join((with_runs([1, 2, 3]), (4, 5), (9,)))  # short parts' runs are walked
    assert type(short) is RunBlocks and short.runs == (1, 5, 9, 1)
    plain = join(((1, 2, 3), (4, 5), (9,)))  # no part came with runs: none are made up
    assert type(plain) is tuple and plain == (1, 2, 3, 4, 5, 9)


def test_a_tail_cuts_the_runs_and_skipping_nothing_keeps_the_list() -> None:
    for ids in distinct_lists(2, 300):
        blocks = with_runs(ids)
        assert tail(blocks, 0) is blocks
        for skip in range(len(ids) + 2):
            got = tail(blocks, skip)
            assert got == tuple(ids[skip:])
            if type(got) is RunBlocks:
                assert got.runs == runs_of(ids[skip:])
            else:
                assert got == ()
    window = LoadWindow(skip_blocks=2, num_tokens=64)
    blocks = with_runs([50, 49, 48, 47, 10, 11])
    assert window.dst(blocks) == (48, 47, 10, 11) and window.dst(blocks).runs == (48, -2, 10, 2)
    assert LoadWindow(skip_blocks=0, num_tokens=64).src(blocks) is blocks


def test_the_check_remembers_a_run_list_and_refuses_a_repeat_in_one() -> None:
    blocks = with_runs(list(range(100, 140)))
    assert duplicates(blocks) is None and found_fine(blocks)
    bad = RunBlocks([1, 2, 3, 2, 1] * 3, (1, 3, 2, -2) * 3)  # a turn repeats ids
    assert duplicates(bad) is not None and not found_fine(bad)


def test_a_run_list_is_checked_per_run_with_the_answer_of_the_ids() -> None:
    for ids in distinct_lists(3, 150):
        rng = random.Random(len(ids))
        for bad in ([*ids, ids[0]] if ids else [], [*ids, -1 - rng.randint(0, 3)],
                    [*ids, *ids[rng.randint(0, max(len(ids) - 1, 0)):][:3]]):
            if len(bad) >= 2:  # a repeat or a negative id, found per run as per id
                assert (duplicates(with_runs(bad)) is None) == (duplicates(list(bad)) is None)
        assert duplicates(with_runs(ids)) is None


def test_transfer_runs_counted_per_run_equal_those_counted_per_block() -> None:
    lists = distinct_lists(4, 120)
    for src, dst in zip(lists[::2], lists[1::2], strict=True):
        nb = min(len(src), len(dst))
        for n in {1, 16 * nb - 5, 16 * nb - 16, 16 * nb} - {0}:
            if n < 1 or n > 16 * nb:
                continue
            plain = count_runs(tuple(src), 16, tuple(dst), 16, n)
            assert count_runs(with_runs(src), 16, with_runs(dst), 16, n) == plain


def test_joining_the_very_same_parts_again_gives_the_same_tuple() -> None:
    prompt, grown = with_runs(list(range(200, 264))), (7,)
    first = join([prompt, grown])
    assert join((prompt, (), grown)) is first  # the ledger's join of the entry's parts
    other = join([prompt, (8,)])
    assert other is not first and other == (*prompt, 8)
    assert join([prompt, grown]) == first and join([prompt, tuple(grown)]) == (*prompt, 7)
