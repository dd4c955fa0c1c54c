"""The block-list check and its memory of lists already found fine (`core/checks.py`)."""

from __future__ import annotations

import pytest

from kvplane.core import checks
from kvplane.core.checks import duplicates, found_fine


def test_a_repeated_or_negative_id_is_refused_tuple_or_list() -> None:
    assert duplicates(tuple(range(20)) + (7,)) == "block ids [7] appear more than once"
    assert duplicates([*range(20), 7]) == "block ids [7] appear more than once"
    assert duplicates((*range(20), -3)) == "negative block id -3"
    assert duplicates(tuple(range(20))) is None


def test_a_tuple_found_fine_is_remembered_by_identity_not_by_value() -> None:
    fine = tuple(range(100, 130))
    assert duplicates(fine) is None and found_fine(fine)
    copy = tuple(range(100, 130))  # equal, another object: walked again
    assert copy == fine and copy is not fine and not found_fine(copy)
    assert not found_fine(list(fine))  # a list can change after its check: never remembered


@pytest.fixture
def memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty memory with small bounds: room for 16 between sweeps, 64 at most."""
    monkeypatch.setattr(checks, "_FINE", {})
    monkeypatch.setattr(checks, "_FINE_ROOM", 16)
    monkeypatch.setattr(checks, "_FINE_CAP", 64)
    monkeypatch.setattr(checks, "_fine_max", 16)


def _list(i: int) -> tuple[int, ...]:
    return tuple(range(i * 100, i * 100 + 20))


@pytest.mark.usefixtures("memory")
def test_lists_still_in_use_stay_known_however_many_came_after() -> None:
    held = [_list(i) for i in range(40)]  # more than the room between sweeps
    for blocks in held:
        assert duplicates(blocks) is None
    for i in range(40, 400):  # lists no one keeps: each is gone once checked
        assert duplicates(_list(i)) is None
    assert all(found_fine(b) for b in held)
    assert len(checks._FINE) <= len(held) + checks._FINE_ROOM  # the dropped ones did go


@pytest.mark.usefixtures("memory")
def test_past_the_cap_the_oldest_go_and_a_forgotten_list_is_walked_again() -> None:
    held = [_list(i) for i in range(100)]
    for blocks in held:
        assert duplicates(blocks) is None
    assert len(checks._FINE) <= checks._FINE_CAP + checks._FINE_ROOM
    assert not found_fine(held[0]) and found_fine(held[-1])
    assert duplicates(held[0]) is None and found_fine(held[0])


@pytest.mark.usefixtures("memory")
def test_a_list_with_a_repeat_is_refused_whatever_the_memory_held_before() -> None:
    # lists found fine and then dropped free their addresses; a list with a repeat made
    # after them (it may take such an address) is still walked and refused
    for i in range(200):
        assert duplicates(_list(i)) is None
    for _ in range(200):
        bad = (*_list(7), 705)
        assert duplicates(bad) == "block ids [705] appear more than once"
        assert not found_fine(bad)
