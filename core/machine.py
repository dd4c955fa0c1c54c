"""The shape every protocol machine shares: decide, then apply.

Rules kept here:
- `decide(command, now)` looks at the state and returns the events that the command causes; it
  never changes the state. `apply(event)` folds one event into the state and is the only way
  state changes, so replaying a log (`for e in log: m.apply(e)`) rebuilds exactly the state the
  live machine had. `handle` is the two together.
- `apply` changes the state in place and returns it: a persistent copy per event would make a
  100,000-request simulation quadratic. Take a `snapshot` where an old state must be kept.
- Time is an argument (`now`); a machine never reads a clock. Time never goes backwards inside
  a machine: `now` earlier than the latest event it applied counts as that event's time (a
  wall clock stepped back by NTP must not re-open a deadline that passed), and a `now` that is
  not a finite number is refused.
- Each machine keeps its transition table at module level: (phase, command type) -> handler. A
  pair missing from the table raises `ProtocolError` naming the state and the input.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from .errors import ProtocolError
from .events import Event

Cmd = TypeVar("Cmd")


class Machine(Generic[Cmd]):
    name = "machine"

    def __init__(self, instance: str) -> None:
        self.instance = instance
        self.clock = float("-inf")  # the latest event time applied

    def now_of(self, now: float) -> float:
        """The time a command is decided at: never earlier than what the machine has seen."""
        if type(now) is float and -math.inf < now < math.inf:  # the usual case, one test
            return max(now, self.clock)
        if isinstance(now, bool) or not isinstance(now, (int, float)) or not math.isfinite(now):
            raise ProtocolError(self.name, "", "now", f"time must be a finite number, got {now!r}")
        return max(now, self.clock)

    def saw(self, event: Event) -> None:
        self.clock = max(self.clock, event.at)

    def decide(self, command: Cmd, now: float) -> list[Event]:
        raise NotImplementedError

    def apply(self, event: Event) -> Machine[Cmd]:
        raise NotImplementedError

    def handle(self, command: Cmd, now: float) -> list[Event]:
        events = self.decide(command, now)
        for e in events:
            self.apply(e)
        return events

    def _dispatch(
        self,
        table: Mapping[tuple[str, type], Callable[..., list[Event]]],
        phase: str,
        command: Any,
        now: float,
    ) -> list[Event]:
        handler = table.get((phase, type(command)))
        if handler is None:
            raise ProtocolError(self.name, phase, type(command).__name__)
        return handler(self, command, now)


def decide(machine: Machine[Cmd], command: Cmd, now: float) -> list[Event]:
    """Module-level form of `Machine.decide`: `decide(state, command, now) -> events`."""
    return machine.decide(command, now)


def apply(machine: Machine[Cmd], event: Event) -> Machine[Cmd]:
    """Module-level form of `Machine.apply`: `apply(state, event) -> state`."""
    return machine.apply(event)
