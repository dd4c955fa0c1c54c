"""Which request (and which attempt of it) owns which KV block on one instance.

Rules kept here:
- A block is owned by at most one request attempt. Reserving an owned block, or freeing a block
  that attempt does not own, is a violation (double allocation, double free).
- Ownership is per attempt: a re-issued request's new attempt never owns its old attempt's
  blocks, so a late WRITE or free for the old attempt cannot pass as the new one's.
- The ledger is folded from `BlocksReserved` / `BlocksFreed` events only (a
  `DecodeBlocksReserved` is its requests' `BlocksReserved`), so the same code checks a live
  run, a simulated run and a replayed log.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import repeat

from .blocks import join
from .checks import found_fine
from .events import BlocksFreed, BlocksReserved


@dataclass(slots=True, eq=False)
class Ledger:
    """Blocks held per request, as the attempts' lists (`chunks`); the per-block index (`owner`,
    `attempt_of`) is built the first time it is asked for and kept from then on. A machine
    that never asks (the simulator's, the live connector's) pays per list, not per block."""

    # request -> the block lists it reserved, in order, each with its attempt (a growing
    # request adds one list per reservation: appended, never concatenated)
    chunks: dict[str, list[tuple[int, tuple[int, ...]]]] = field(default_factory=dict)
    _owner: dict[int, str] | None = None
    _attempt_of: dict[int, int] | None = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Ledger):
            return NotImplemented
        return self.chunks == other.chunks

    def _index(self) -> None:
        owner: dict[int, str] = {}
        attempt_of: dict[int, int] = {}
        for req, chunks in self.chunks.items():
            for attempt, blocks in chunks:
                owner.update(dict.fromkeys(blocks, req))
                attempt_of.update(dict.fromkeys(blocks, attempt))
        self._owner, self._attempt_of = owner, attempt_of

    @property
    def held(self) -> dict[str, tuple[int, ...]]:
        """Request -> every block it holds, in the order reserved (made anew at each call)."""
        return {req: self._held(req) for req in self.chunks}

    def _held(self, request: str) -> tuple[int, ...]:
        chunks = self.chunks.get(request, ())
        if len(chunks) == 1:
            return chunks[0][1]
        return join([blocks for _, blocks in chunks])  # with the chunks' runs (`blocks.join`)

    @property
    def owner(self) -> dict[int, str]:
        """Block -> the request that owns it (read only)."""
        if self._owner is None:
            self._index()
        assert self._owner is not None
        return self._owner

    @property
    def attempt_of(self) -> dict[int, int]:
        """Block -> the attempt that owns it (read only)."""
        if self._attempt_of is None:
            self._index()
        assert self._attempt_of is not None
        return self._attempt_of

    def check_reserve(self, ev: BlocksReserved) -> list[str]:
        owner = self.owner
        taken = [b for b in ev.blocks if b in owner]
        dup = len(set(ev.blocks)) != len(ev.blocks)
        out = []
        if taken:
            owners = sorted({owner[b] for b in taken})
            out.append(f"blocks {taken[:8]} reserved for {ev.request} still owned by {owners}")
        if dup:
            out.append(f"blocks {list(ev.blocks)[:8]} reserved for {ev.request} twice over")
        return out

    def check_free(self, ev: BlocksFreed) -> list[str]:
        owner, attempt_of = self.owner, self.attempt_of
        bad = [
            b
            for b in ev.blocks
            if owner.get(b) != ev.request or attempt_of.get(b) != ev.attempt
        ]
        if bad or len(set(ev.blocks)) != len(ev.blocks):
            who = f"{ev.request}#{ev.attempt}"
            shown = bad[:8] or list(ev.blocks)[:8]
            return [f"blocks {shown} freed for {who} but not owned by it (double free?)"]
        return []

    def reserve(self, request: str, attempt: int, blocks: tuple[int, ...]) -> None:
        """Fold one request's reservation (a `BlocksReserved`, or one part of a
        `DecodeBlocksReserved`)."""
        if self._owner is not None and self._attempt_of is not None:
            # bulk dict updates: a 16k-token request reserves ~1,000 blocks
            self._owner.update(dict.fromkeys(blocks, request))
            self._attempt_of.update(dict.fromkeys(blocks, attempt))
        self.chunks.setdefault(request, []).append((attempt, blocks))

    def apply(self, ev: BlocksReserved | BlocksFreed) -> None:
        req = ev.request
        assert req is not None
        if type(ev) is BlocksReserved:  # event types are final
            self.reserve(req, ev.attempt, ev.blocks)
            return
        held = self._held(req)
        # repeats matter only to the per-block index (a block is popped once); a list the core
        # already found free of repeats is not checked again
        if ev.blocks == held and (self._owner is None or found_fine(ev.blocks)
                                  or len(set(held)) == len(held)):
            # the usual case: the request frees everything it holds, each block once
            freed: set[int] | tuple[int, ...] = held
            self.chunks.pop(req, None)
        else:
            # a block may be listed twice in a reserve (a check reports it): owned once
            mine = {b for _, blocks in self.chunks.get(req, ()) for b in blocks}
            freed = {b for b in ev.blocks if b in mine}
            chunks = [(a, tuple(b for b in bl if b not in freed))
                      for a, bl in self.chunks.get(req, ())]
            chunks = [(a, bl) for a, bl in chunks if bl]
            if chunks:
                self.chunks[req] = chunks
            else:
                self.chunks.pop(req, None)
        if self._owner is not None and self._attempt_of is not None:
            owner, attempt_of = self._owner, self._attempt_of
            if list(map(owner.get, freed)).count(req) == len(freed):  # all still its own
                deque(map(owner.pop, freed), maxlen=0)
                deque(map(attempt_of.pop, freed, repeat(None)), maxlen=0)
                return
            for b in freed:
                if owner.get(b) == req:
                    del owner[b]
                    attempt_of.pop(b, None)

    def blocks_of(self, request: str) -> tuple[int, ...]:
        return self._held(request)

    def owns(self, request: str, blocks: tuple[int, ...], attempt: int | None = None) -> bool:
        owner, attempt_of = self.owner, self.attempt_of
        return all(
            owner.get(b) == request and (attempt is None or attempt_of.get(b) == attempt)
            for b in blocks
        )
