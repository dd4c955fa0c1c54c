"""Checks on the numbers and block lists that cross into the core.

Rules kept here:
- A duration, deadline or expiry is a finite number: NaN compares false with everything, so a
  NaN TTL would never expire and a NaN deadline would never pass; infinity has the same effect.
- Token counts are never negative: a negative count would plan negative bytes.
- A block list names each block once: `(7, 7)` would put two blocks' worth of KV in one. A
  list that carries its runs (`blocks.RunBlocks`, vouched for by its maker) is checked per run.
- What our own side passes wrongly is a `ProtocolError`; what a peer sent is a `PeerError`, so
  the caller records it and falls back instead of trusting it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from sys import getrefcount

from .blocks import RunBlocks, runs_distinct
from .errors import PeerError, ProtocolError


def finite(value: float, what: str, *, minimum: float | None = 0.0) -> str | None:
    """Why `value` is not an acceptable time or duration, or None when it is."""
    if type(value) is float and math.isfinite(value) and (minimum is None or value >= minimum):
        return None  # the usual case, decided in one line
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{what} must be a number, got {value!r}"
    if not math.isfinite(value):
        return f"{what} must be finite, got {value!r}"
    if minimum is not None and value < minimum:
        return f"{what} must be at least {minimum}, got {value!r}"
    return None


# Tuples of block ids found fine lately, by id; each is kept alive here so that its id stays
# its own. A block list travels from a command to its plan, events and ledger as one tuple
# (immutable), so it is checked once, not at every hop. When `_fine_room` more have come since
# the last sweep, those no one else holds any more go (nothing can ask about them again), then
# the oldest beyond `_FINE_CAP`. Lists still in use stay however many came after them: a
# saturated prefill allocates a request's blocks some 400 lists before it plans their
# transfer, and a memory that forgot by age made the plan walk those again.
_FINE: dict[int, tuple[int, ...]] = {}
_FINE_ROOM = 256
_FINE_CAP = 4096
_TUPLES = (tuple, RunBlocks)  # immutable block lists (a `RunBlocks` is a tuple with runs)
_fine_max = _FINE_ROOM


def _remember(blocks: tuple[int, ...]) -> None:
    global _fine_max
    if len(_FINE) >= _fine_max:
        for key in list(_FINE):
            if getrefcount(_FINE[key]) == 2:  # this memory's reference and the call's own
                del _FINE[key]
        for key in list(_FINE)[:max(0, len(_FINE) - _FINE_CAP)]:
            del _FINE[key]
        _fine_max = len(_FINE) + _FINE_ROOM
    _FINE[id(blocks)] = blocks


def duplicates(blocks: Sequence[int]) -> str | None:
    """Why a block list is unusable (a repeated or negative id), or None when it is fine."""
    if len(blocks) < 2:  # none or one: nothing to repeat (a decode step's new block)
        if blocks and blocks[0] < 0:
            return f"negative block id {blocks[0]}"
        return None
    if type(blocks) in _TUPLES and _FINE.get(id(blocks)) is blocks:
        return None
    if type(blocks) is RunBlocks and runs_distinct(blocks.runs):  # per run, not per id
        if len(blocks) > 8:
            _remember(blocks)
        return None
    if len(set(blocks)) != len(blocks):
        dup = sorted(b for b, n in Counter(blocks).items() if n > 1)
        return f"block ids {dup[:8]} appear more than once"
    if blocks and min(blocks) < 0:
        return f"negative block id {min(blocks)}"
    if type(blocks) in _TUPLES and len(blocks) > 8:
        _remember(blocks)  # type: ignore[arg-type]
    return None


def found_fine(blocks: Sequence[int]) -> bool:
    """Whether `duplicates` found this very tuple fine lately (no work when it did not)."""
    return type(blocks) in _TUPLES and _FINE.get(id(blocks)) is blocks


def ours(machine: str, given: str, problem: str | None) -> None:
    """Raise `ProtocolError` for a problem in what our own side passed."""
    if problem is not None:
        raise ProtocolError(machine, "", given, problem)


def theirs(problem: str | None) -> None:
    """Raise `PeerError` for a problem in what a peer sent."""
    if problem is not None:
        raise PeerError(problem)
