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
- `early-receive`: KV declared received before every expected notification arrived (those
  folded into the `KVReceived` itself count).
- `free-under-transfer`: blocks freed while a transfer may still move data in or out of them:
  on the instance that planned the transfer, its own side's blocks until it ends; for a push,
  decode's destination blocks until decode received the KV or prefill's WRITE ended.
  (A free followed by another request's reservation of the same blocks is how a WRITE lands in
  someone else's KV.)
- `duplicate-blocks`: a transfer, registration or lease naming one block twice.
- `pin-overrun`: a lease pin that timed out while a read from that lease was still in flight
  (the reader overran its pin and did not cancel).
- `session-reuse`: a retained-KV handle taken twice, or stored again after it was taken.
- at the end of a run that is known to be quiescent (`final=True`): `leak` (blocks still owned
  outside any live lease), `unfinished-transfer` (planned, never ended) and `pin-never-ended`
  (a lease still pinned by a reader).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .events import (
    BlocksFreed,
    BlocksReserved,
    DecodeBlocksReserved,
    Event,
    KVReceived,
    LeaseExpired,
    LeaseGranted,
    LeasePinned,
    LeaseReleased,
    LeaseUnpinned,
    NotificationReceived,
    RegistrationArrived,
    RegistrationSent,
    ReuseDecided,
    SessionStored,
    SessionTaken,
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
    # (instance, block) -> the transfers that may still move data in or out of it there
    guarded: dict[tuple[str, int], set[tuple[str, int, str]]] = field(default_factory=dict)
    guards: dict[tuple[str, int, str], list[tuple[str, tuple[int, ...]]]] = field(
        default_factory=dict)
    pins: dict[tuple[str, str], set[str]] = field(default_factory=dict)  # lease -> readers
    taken: set[tuple[str, str]] = field(default_factory=set)  # (router, lease) handles used
    events: int = 0

    def guard(self, key3: tuple[str, int, str], instance: str, blocks: tuple[int, ...]) -> None:
        self.guards.setdefault(key3, []).append((instance, blocks))
        for b in blocks:
            self.guarded.setdefault((instance, b), set()).add(key3)

    def unguard(self, key3: tuple[str, int, str], instance: str | None = None) -> None:
        """Lift the guards of a transfer (only those on `instance`, when given)."""
        kept = []
        for inst, blocks in self.guards.pop(key3, []):
            if instance is not None and inst != instance:
                kept.append((inst, blocks))
                continue
            for b in blocks:
                s = self.guarded.get((inst, b))
                if s is not None:
                    s.discard(key3)
                    if not s:
                        del self.guarded[(inst, b)]
        if kept:
            self.guards[key3] = kept

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
    elif isinstance(ev, DecodeBlocksReserved):
        ledger = state.ledger(ev.instance)
        for one in ev.each():  # each request's reservation, as its own event would be
            for m in ledger.check_reserve(one):
                bad("double-allocation", m)
            ledger.apply(one)
    elif isinstance(ev, BlocksFreed):
        for m in state.ledger(ev.instance).check_free(ev):
            bad("double-free", m)
        if state.guarded:
            under = sorted({k for b in ev.blocks for k in state.guarded.get((ev.instance, b), ())})
            if under:
                bad("free-under-transfer",
                    f"blocks freed on {ev.instance} while transfers {under[:4]} may still "
                    "move data in or out of them")
        state.ledger(ev.instance).apply(ev)
    elif isinstance(ev, LeaseGranted):
        if len(set(ev.blocks)) != len(ev.blocks):
            bad("duplicate-blocks", f"lease {ev.lease} names a block twice")
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
        state.pins.setdefault((ev.instance, ev.lease), set()).add(ev.reader)
    elif isinstance(ev, LeaseUnpinned):
        lkey = (ev.instance, ev.lease)
        state.pins.get(lkey, set()).discard(ev.reader)
        if ev.timed_out and state.reading_from.get(lkey):
            bad("pin-overrun", f"{ev.reader}'s pin on lease {ev.lease} timed out while reads "
                f"{sorted(state.reading_from[lkey])} were still in flight")
    elif isinstance(ev, SessionTaken):
        tkey = (ev.instance, ev.lease)
        if tkey in state.taken:
            bad("session-reuse", f"handle of lease {ev.lease} taken a second time")
        state.taken.add(tkey)
        state.sessions.apply(ev)
    elif isinstance(ev, SessionStored):
        if (ev.instance, ev.lease) in state.taken:
            bad("session-reuse", f"handle of lease {ev.lease} stored again after it was taken")
        state.sessions.apply(ev)
    elif isinstance(ev, (RegistrationSent, RegistrationArrived)) and len(
            set(ev.dst_blocks)) != len(ev.dst_blocks):
        bad("duplicate-blocks", f"registration of {req}#{ev.attempt} names a block twice")
        if isinstance(ev, RegistrationSent):
            state.expected[(ev.instance, req, ev.attempt)] = ev.expected_notifications
            state.notified[(ev.instance, req, ev.attempt)] = set()
    elif isinstance(ev, ReuseDecided):
        if ev.outcome == "read" and ev.lease is not None:
            state.reuse_lease[req] = ev.lease
    elif isinstance(ev, TransferPlanned):
        key3 = (req, ev.attempt, ev.direction)
        if key3 in state.planned:
            bad("transfer-outcome", f"transfer {key3} planned twice")
        state.planned[key3] = 0
        for side, blocks in (("source", ev.src_blocks), ("destination", ev.dst_blocks)):
            if len(set(blocks)) != len(blocks):
                bad("duplicate-blocks", f"{ev.direction} {side} blocks name a block twice")
        # what the transfer may still touch: the planner's own side until it ends there; for a
        # push (planned by the source) also the destination's blocks until decode has the KV
        if ev.instance == ev.src:
            state.guard(key3, ev.src, ev.src_blocks)
            if ev.direction == "P->D":
                state.guard(key3, ev.dst, ev.dst_blocks)
        elif ev.instance == ev.dst:
            state.guard(key3, ev.dst, ev.dst_blocks)
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
        state.unguard(key3)
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
        if state.guards:
            state.unguard((req, ev.attempt, "P->D"), ev.instance)  # the data has landed
        k = (ev.instance, req, ev.attempt)
        if ev.src_ranks:  # the notifications that ended the wait, folded into this event
            state.notified.setdefault(k, set()).update(ev.notified())
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
    pinned = sorted((lease, r) for (_, lease), rs in state.pins.items() for r in rs)
    if pinned:
        out.append(Violation("pin-never-ended", state.events - 1, last,
                             f"{len(pinned)} pins never ended: {pinned[:5]}"))
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
