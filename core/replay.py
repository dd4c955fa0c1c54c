"""Rebuild a run's state from its events and check the protocol's invariants.

The same check runs on a simulated run, a live run and a hand-made log. It is an independent
fold of the events (it does not reuse the machines' own bookkeeping), so a bug in a machine
shows up as a violation here instead of hiding behind itself.

Invariants (each violation names the rule, the event and why):
- `double-allocation`: a block reserved while another request owns it (or twice in one go).
- `double-free`: a block freed that the request (that attempt of it) does not own.
- `foreign-blocks`: a transfer planned into (or out of) blocks not reserved for that attempt of
  the request on that instance, or a lease granted over blocks the request does not own.
- `dead-lease-read`: a read planned from, or pinned on, a lease that expired or was released,
  or a lease that ended while a read from it was still in flight (a D->P reuse read from
  decode's retained lease, or a pull READ from prefill's hold lease).
- `transfer-outcome`: a transfer that ends twice, or ends without having been planned.
- `early-receive`: KV declared received before every expected notification arrived.
- at the end of a run that is known to be quiescent (`final=True`): `leak` (blocks still owned
  outside any live lease) and `unfinished-transfer` (planned, never ended).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .events import (
    BlocksFreed,
    BlocksReserved,
    Event,
    KVReceived,
    LeaseExpired,
    LeaseGranted,
    LeasePinned,
    LeaseReleased,
    NotificationReceived,
    RegistrationSent,
    ReuseDecided,
    TransferCompleted,
    TransferFailed,
    TransferPlanned,
)
from .ledger import Ledger
from .prefill import READ_BY_DECODE
from .sessions import SessionTable


@dataclass(frozen=True, slots=True)
class Violation:
    rule: str
    index: int
    event: Event
    message: str

    def __str__(self) -> str:
        e = self.event
        return (
            f"[{self.rule}] event #{self.index} {type(e).__name__} at t={e.at:.6f} "
            f"on {e.instance} (request {e.request}): {self.message}"
        )


@dataclass(slots=True)
class ReplayState:
    ledgers: dict[str, Ledger] = field(default_factory=dict)
    leases: dict[tuple[str, str], LeaseGranted] = field(default_factory=dict)  # live leases
    ended_leases: set[tuple[str, str]] = field(default_factory=set)
    reading_from: dict[tuple[str, str], set[tuple[str, int]]] = field(default_factory=dict)
    # (request, attempt, direction) of a read in flight -> the lease it reads from
    read_lease: dict[tuple[str, int, str], tuple[str, str]] = field(default_factory=dict)
    reuse_lease: dict[str, str] = field(default_factory=dict)  # request -> lease it reads
    planned: dict[tuple[str, int, str], int] = field(default_factory=dict)  # -> outcomes seen
    expected: dict[tuple[str, str, int], int] = field(default_factory=dict)
    notified: dict[tuple[str, str, int], set[tuple[int, int]]] = field(default_factory=dict)
    sessions: SessionTable = field(default_factory=SessionTable)
    events: int = 0

    def ledger(self, instance: str) -> Ledger:
        led = self.ledgers.get(instance)
        if led is None:
            led = self.ledgers[instance] = Ledger()
        return led


@dataclass(slots=True)
class ReplayReport:
    state: ReplayState
    violations: list[Violation]

    @property
    def ok(self) -> bool:
        return not self.violations


def apply(state: ReplayState, ev: Event, index: int = 0) -> list[Violation]:
    """Fold one event into `state`; return the violations it causes."""
    out: list[Violation] = []

    def bad(rule: str, msg: str) -> None:
        out.append(Violation(rule, index, ev, msg))

    state.events += 1
    req = ev.request or ""
    if isinstance(ev, BlocksReserved):
        for m in state.ledger(ev.instance).check_reserve(ev):
            bad("double-allocation", m)
        state.ledger(ev.instance).apply(ev)
    elif isinstance(ev, BlocksFreed):
        for m in state.ledger(ev.instance).check_free(ev):
            bad("double-free", m)
        state.ledger(ev.instance).apply(ev)
    elif isinstance(ev, LeaseGranted):
        if not state.ledger(ev.instance).owns(req, ev.blocks, ev.attempt):
            bad("foreign-blocks", f"lease {ev.lease} granted over blocks {req} does not own")
        state.leases[(ev.instance, ev.lease)] = ev
    elif isinstance(ev, (LeaseExpired, LeaseReleased)):
        key = (ev.instance, ev.lease)
        grant = state.leases.pop(key, None)
        state.ended_leases.add(key)
        if (
            isinstance(ev, LeaseReleased)
            and ev.reason == READ_BY_DECODE
            and grant is not None
            and grant.purpose == "pull_hold"
        ):
            # Decode sends read-done only after its READ finished, so this release is causally
            # after that read's end, even where another process's clock recorded the end later
            # (a live run's instances record concurrently): the reader is done.
            reader = grant.request or ""
            state.reading_from.get(key, set()).discard((reader, grant.attempt))
            state.read_lease.pop((reader, grant.attempt, "P->D"), None)
        if state.reading_from.get(key):
            bad(
                "dead-lease-read",
                f"lease {ev.lease} ended while reads "
                f"{sorted(state.reading_from[key])} were in flight",
            )
    elif isinstance(ev, LeasePinned):
        if (ev.instance, ev.lease) not in state.leases:
            bad("dead-lease-read", f"lease {ev.lease} pinned after it ended")
    elif isinstance(ev, ReuseDecided):
        if ev.outcome == "read" and ev.lease is not None:
            state.reuse_lease[req] = ev.lease
    elif isinstance(ev, TransferPlanned):
        key3 = (req, ev.attempt, ev.direction)
        if key3 in state.planned:
            bad("transfer-outcome", f"transfer {key3} planned twice")
        state.planned[key3] = 0
        if not state.ledger(ev.dst).owns(req, ev.dst_blocks, ev.attempt):
            bad(
                "foreign-blocks",
                f"{ev.direction} into blocks {ev.dst_blocks[:8]} of {ev.dst} "
                f"not reserved for {req}#{ev.attempt}",
            )
        if ev.direction == "P->D":
            if not state.ledger(ev.src).owns(req, ev.src_blocks, ev.attempt):
                bad(
                    "foreign-blocks",
                    f"source blocks {ev.src_blocks[:8]} on {ev.src} are not {req}#{ev.attempt}'s",
                )
            elif ev.instance == ev.dst:  # a pull: decode reads from prefill's hold
                for lkey, g in state.leases.items():
                    if (
                        lkey[0] == ev.src
                        and g.request == req
                        and g.attempt == ev.attempt
                        and set(ev.src_blocks) <= set(g.blocks)
                    ):
                        state.reading_from.setdefault(lkey, set()).add((req, ev.attempt))
                        state.read_lease[key3] = lkey
                        break
        if ev.direction == "D->P":
            lease = state.reuse_lease.get(req)
            lkey = (ev.src, lease or "")
            held = state.leases.get(lkey)
            if held is None:
                bad("dead-lease-read", f"read from {ev.src} without a live lease ({lease})")
            else:
                if not set(ev.src_blocks) <= set(held.blocks):
                    bad("foreign-blocks", f"read of blocks outside lease {lease}")
                state.reading_from.setdefault(lkey, set()).add((req, ev.attempt))
                state.read_lease[key3] = lkey
    elif isinstance(ev, (TransferCompleted, TransferFailed)):
        key3 = (req, ev.attempt, ev.direction)
        seen = state.planned.get(key3)
        if seen is None:
            bad("transfer-outcome", f"transfer {key3} ended but was never planned")
        elif seen >= 1:
            bad("transfer-outcome", f"transfer {key3} ended twice")
        state.planned[key3] = (seen or 0) + 1
        if key3 in state.read_lease:
            lkey = state.read_lease.pop(key3)
            state.reading_from.get(lkey, set()).discard((req, ev.attempt))
    elif isinstance(ev, RegistrationSent):
        state.expected[(ev.instance, req, ev.attempt)] = ev.expected_notifications
        state.notified[(ev.instance, req, ev.attempt)] = set()
    elif isinstance(ev, NotificationReceived):
        if not ev.duplicate:
            state.notified.setdefault((ev.instance, req, ev.attempt), set()).add(
                (ev.src_rank, ev.dst_rank)
            )
    elif isinstance(ev, KVReceived):
        k = (ev.instance, req, ev.attempt)
        if k in state.expected:
            got = len(state.notified.get(k, ()))
            if got < state.expected[k]:
                bad("early-receive", f"{got} of {state.expected[k]} notifications arrived")
            del state.expected[k]
            state.notified.pop(k, None)
    else:
        state.sessions.apply(ev)
    return out


def finish(state: ReplayState, last: Event | None) -> list[Violation]:
    """Checks that hold only once a run is quiescent: nothing leaked, nothing left in flight."""
    if last is None:
        return []
    out: list[Violation] = []
    leased = {(inst, b) for (inst, _), g in state.leases.items() for b in g.blocks}
    for inst, led in state.ledgers.items():
        stray = sorted((req, b) for b, req in led.owner.items() if (inst, b) not in leased)
        if stray:
            reqs = sorted({r for r, _ in stray})
            out.append(
                Violation(
                    "leak",
                    state.events - 1,
                    last,
                    f"{len(stray)} blocks on {inst} still owned by {reqs[:8]}",
                )
            )
    open_ = [k for k, n in state.planned.items() if n == 0]
    if open_:
        out.append(
            Violation(
                "unfinished-transfer",
                state.events - 1,
                last,
                f"{len(open_)} transfers never ended: {open_[:5]}",
            )
        )
    return out


def replay(events: Iterable[Event], *, final: bool = False) -> ReplayReport:
    """Fold every event, collecting violations. `final`: also check the run is quiescent."""
    state = ReplayState()
    violations: list[Violation] = []
    last: Event | None = None
    for i, ev in enumerate(events):
        violations += apply(state, ev, i)
        last = ev
    if final:
        violations += finish(state, last)
    return ReplayReport(state, violations)
