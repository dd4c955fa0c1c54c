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


def test_the_memory_forgets_its_oldest_first_and_a_forgotten_list_is_walked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(checks, "_FINE", {})
    size = checks._FINE_MAX
    lists = [tuple(range(i * 1000, i * 1000 + 20)) for i in range(size + 10)]
    for blocks in lists:
        assert duplicates(blocks) is None
    assert len(checks._FINE) == size
    # the newest `size` stay known (none was cleared along with the old), the first 10 went
    assert all(found_fine(b) for b in lists[10:])
    assert not any(found_fine(b) for b in lists[:10])
    # a forgotten list is checked in full again, and a list with a repeat made after it (it
    # may take the freed list's address) is refused
    assert duplicates(lists[0]) is None and found_fine(lists[0])
    del lists
    for _ in range(size + 1):
        bad = tuple(range(20)) + (5,)
        assert duplicates(bad) == "block ids [5] appear more than once"
        assert not found_fine(bad)
