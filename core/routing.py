"""Choosing a decode instance (and a prefill instance) for a request.

Rules kept here:
- A policy is picked by an explicit `kind`: `round_robin`, `least_loaded`, `kv_affinity`.
- Inputs are a snapshot of loads the driver took; the choice is a pure function of it, so the
  simulator and the live router choose alike given the same snapshot.
- `kv_affinity` sends a conversation's next turn to the decode that retains its KV unless that
  instance is loaded beyond `affinity_slack` more requests than the least loaded one.
- Instances equally least loaded take turns: the first of them in name order at or after the
  caller's count of choices (round robin among the tied). Breaking ties by name alone sent
  every request to the first idle instance in name order: at a 32-instance cluster the first
  names served 100x what the last did, and their transfer queues grew without bound.
- Choices are deterministic: a function of the snapshot and the count, not of input order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    (no `Load` object each): the least loaded is the least (pressure, -free blocks) pair
    (fewest running and queued, then most free blocks); among several such, the turn of the
    one at or after `counter` in name order."""
    if not ranked:
        raise ValueError("no instance to choose from")
    if policy.kind == "round_robin":
        return sorted(t[2] for t in ranked)[counter % len(ranked)]
    if policy.kind not in ("least_loaded", "kv_affinity"):
        raise ValueError(f"unknown routing policy kind {policy.kind!r}")
    least = min(ranked)
    if policy.kind == "kv_affinity":
        for pressure, _, name in ranked:
            if name == affinity and pressure <= least[0] + policy.affinity_slack:
                return name
    return _turn_among_least(ranked, least, counter)


def _turn_among_least(ranked: Sequence[Ranked], least: Ranked, counter: int) -> str:
    """The least loaded instance whose turn it is: of those ranked equal to `least` (its load
    and free blocks), the first in name order at or after position `counter` of all names."""
    tied = [t[2] for t in ranked if t[0] == least[0] and t[1] == least[1]]
    if len(tied) == 1:
        return tied[0]
    names = sorted(t[2] for t in ranked)
    turn = names[counter % len(names)]
    later = [n for n in tied if n >= turn]
    return min(later) if later else min(tied)


def choose_scanning(policy: Policy, names: Sequence[str], rank_of: Callable[[int], Ranked],
                    counter: int, floor: tuple[int, int]) -> str:
    """`choose_ranked` for `least_loaded` over instances whose loads are asked one at a time:
    `names` sorted, `rank_of(i)` the `Ranked` triple of `names[i]`, `floor` a (pressure,
    -free blocks) pair no instance can be below (for instances ranked by pressure alone:
    (0, 0)). The instances are asked in turn order, from `names[counter % len(names)]` on,
    round the end; the first found at `floor` is the least loaded whose turn it is, so the
    rest need not be asked (at a large fleet of mostly idle instances, one or two are).
    Without one at `floor`, every instance is ranked and `choose_ranked` decides: the
    choice is always `choose_ranked`'s over the whole snapshot."""
    if policy.kind != "least_loaded":
        raise ValueError(f"choose_scanning ranks least_loaded only, not {policy.kind!r}")
    n = len(names)
    if not n:
        raise ValueError("no instance to choose from")
    start = counter % n
    ranked: list[Ranked] = []
    for k in range(n):
        i = (start + k) % n
        t = rank_of(i)
        if t[0] == floor[0] and t[1] == floor[1]:
            return t[2]
        ranked.append(t)
    return choose_ranked(policy, ranked, counter)
