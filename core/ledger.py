"""Which request (and which attempt of it) owns which KV block on one instance.

Rules kept here:
- A block is owned by at most one request attempt. Reserving an owned block, or freeing a block
  that attempt does not own, is a violation (double allocation, double free).
- Ownership is per attempt: a re-issued request's new attempt never owns its old attempt's
  blocks, so a late WRITE or free for the old attempt cannot pass as the new one's.
- The ledger is folded from `BlocksReserved` / `BlocksFreed` events only, so the same code
  checks a live run, a simulated run and a replayed log.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .events import BlocksFreed, BlocksReserved


@dataclass(slots=True)
class Ledger:
    owner: dict[int, str] = field(default_factory=dict)
    attempt_of: dict[int, int] = field(default_factory=dict)
    held: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def check_reserve(self, ev: BlocksReserved) -> list[str]:
        taken = [b for b in ev.blocks if b in self.owner]
        dup = len(set(ev.blocks)) != len(ev.blocks)
        out = []
        if taken:
            owners = sorted({self.owner[b] for b in taken})
            out.append(f"blocks {taken[:8]} reserved for {ev.request} still owned by {owners}")
        if dup:
            out.append(f"blocks {list(ev.blocks)[:8]} reserved for {ev.request} twice over")
        return out

    def check_free(self, ev: BlocksFreed) -> list[str]:
        bad = [
            b
            for b in ev.blocks
            if self.owner.get(b) != ev.request or self.attempt_of.get(b) != ev.attempt
        ]
        if bad or len(set(ev.blocks)) != len(ev.blocks):
            who = f"{ev.request}#{ev.attempt}"
            shown = bad[:8] or list(ev.blocks)[:8]
            return [f"blocks {shown} freed for {who} but not owned by it (double free?)"]
        return []

    def apply(self, ev: BlocksReserved | BlocksFreed) -> None:
        assert ev.request is not None
        if isinstance(ev, BlocksReserved):
            # bulk dict updates: a 16k-token request reserves ~1,000 blocks
            self.owner.update(dict.fromkeys(ev.blocks, ev.request))
            self.attempt_of.update(dict.fromkeys(ev.blocks, ev.attempt))
            self.held[ev.request] = self.held.get(ev.request, ()) + ev.blocks
        else:
            owner, attempt_of, req = self.owner, self.attempt_of, ev.request
            freed = set(ev.blocks)
            n = len(ev.blocks)
            if len(freed) == n and list(map(owner.get, ev.blocks)).count(req) == n:
                # the usual case, distinct and all owned: C-level pops
                deque(map(owner.pop, ev.blocks), maxlen=0)
                deque(map(attempt_of.pop, ev.blocks), maxlen=0)
            else:
                freed = {b for b in ev.blocks if owner.get(b) == req}
                for b in freed:
                    del owner[b]
                    attempt_of.pop(b, None)
            held = self.held.get(req, ())
            if len(freed) == len(held):
                self.held.pop(req, None)
                return
            rest = tuple(b for b in held if b not in freed)
            if rest:
                self.held[ev.request] = rest
            else:
                self.held.pop(ev.request, None)

    def blocks_of(self, request: str) -> tuple[int, ...]:
        return self.held.get(request, ())

    def owns(self, request: str, blocks: tuple[int, ...], attempt: int | None = None) -> bool:
        return all(
            self.owner.get(b) == request and (attempt is None or self.attempt_of.get(b) == attempt)
            for b in blocks
        )
