"""Choosing a decode instance (and a prefill instance) for a request.

Rules kept here:
- A policy is picked by an explicit `kind`: `round_robin`, `least_loaded`, `kv_affinity`.
- Inputs are a snapshot of loads the driver took; the choice is a pure function of it, so the
  simulator and the live router choose alike given the same snapshot.
- `kv_affinity` sends a conversation's next turn to the decode that retains its KV unless that
  instance is loaded beyond `affinity_slack` more requests than the least loaded one.
- Ties break by name, so choices are deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

PolicyKind = Literal["round_robin", "least_loaded", "kv_affinity"]


@dataclass(frozen=True, slots=True)
class Load:
    instance: str
    running: int = 0
    queued: int = 0
    free_blocks: int = 0

    @property
    def pressure(self) -> int:
        return self.running + self.queued


@dataclass(frozen=True, slots=True)
class Policy:
    kind: PolicyKind = "round_robin"
    affinity_slack: int = 4


def choose(policy: Policy, loads: Sequence[Load], counter: int, affinity: str | None = None) -> str:
    """Pick an instance. `counter` is the caller's running count of choices (round robin)."""
    return choose_ranked(policy, [(ld.running + ld.queued, -ld.free_blocks, ld.instance)
                                  for ld in loads], counter, affinity)


Ranked = tuple[int, int, str]
"""An instance's load as `choose` ranks it: (pressure, -free blocks, name)."""


def choose_ranked(policy: Policy, ranked: Sequence[Ranked], counter: int,
                  affinity: str | None = None) -> str:
    """`choose` over `Ranked` triples, for a driver that snapshots many instances per request
    (no `Load` object each): the least loaded is the least triple (fewest running and queued,
    then most free blocks, then name)."""
    if not ranked:
        raise ValueError("no instance to choose from")
    if policy.kind == "round_robin":
        return sorted(t[2] for t in ranked)[counter % len(ranked)]
    least = min(ranked)
    if policy.kind == "least_loaded":
        return least[2]
    if policy.kind == "kv_affinity":
        for pressure, _, name in ranked:
            if name == affinity and pressure <= least[0] + policy.affinity_slack:
                return name
        return least[2]
    raise ValueError(f"unknown routing policy kind {policy.kind!r}")
