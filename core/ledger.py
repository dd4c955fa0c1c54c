"""Which request owns which KV block on one instance.

Rules kept here:
- A block is owned by at most one request. Reserving an owned block, or freeing a block nobody
  owns, is a violation (double allocation, double free).
- The ledger is folded from `BlocksReserved` / `BlocksFreed` events only, so the same code
  checks a live run, a simulated run and a replayed log.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .events import BlocksFreed, BlocksReserved


@dataclass(slots=True)
class Ledger:
    owner: dict[int, str] = field(default_factory=dict)
    held: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def check_reserve(self, ev: BlocksReserved) -> list[str]:
        taken = [b for b in ev.blocks if b in self.owner]
        if taken:
            owners = sorted({self.owner[b] for b in taken})
            return [f"blocks {taken[:8]} reserved for {ev.request} still owned by {owners}"]
        return []

    def check_free(self, ev: BlocksFreed) -> list[str]:
        bad = [b for b in ev.blocks if self.owner.get(b) != ev.request]
        if bad:
            return [f"blocks {bad[:8]} freed for {ev.request} but not owned by it (double free?)"]
        return []

    def apply(self, ev: BlocksReserved | BlocksFreed) -> None:
        assert ev.request is not None
        if isinstance(ev, BlocksReserved):
            for b in ev.blocks:
                self.owner[b] = ev.request
            self.held[ev.request] = self.held.get(ev.request, ()) + ev.blocks
        else:
            freed = set(ev.blocks)
            for b in ev.blocks:
                if self.owner.get(b) == ev.request:
                    del self.owner[b]
            rest = tuple(b for b in self.held.get(ev.request, ()) if b not in freed)
            if rest:
                self.held[ev.request] = rest
            else:
                self.held.pop(ev.request, None)

    def blocks_of(self, request: str) -> tuple[int, ...]:
        return self.held.get(request, ())

    def owns(self, request: str, blocks: tuple[int, ...]) -> bool:
        return all(self.owner.get(b) == request for b in blocks)
