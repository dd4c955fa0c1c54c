"""The machine shape: decide never changes state, apply is the only way it changes, a missing
transition names the state and the input."""

from __future__ import annotations

import copy

import pytest
from kvplane_core_harness import P, Pair, layout, state_of

from kvplane.core import decode as dc
from kvplane.core import machine
from kvplane.core import prefill as pf
from kvplane.core.errors import ProtocolError
from kvplane.core.events import (
    BlocksReserved,
    DecodeBlocksReserved,
    Event,
    KVReceived,
    expand,
)


def test_decide_is_pure_and_apply_folds() -> None:
    pair = Pair()
    pair.start_push("r1", 40)
    pair.deliver_all()
    before = copy.deepcopy(state_of(pair.prefill))
    events = machine.decide(pair.prefill, pf.FinishPrefill("r1", 0, 40), 1.0)
    assert state_of(pair.prefill) == before  # deciding changed nothing
    for e in events:
        assert machine.apply(pair.prefill, e) is pair.prefill
    assert pair.prefill.phase("r1", 0) == "transferring"


def test_a_batch_of_allocations_makes_the_events_one_by_one_would() -> None:
    """A decode macro-step's growth as one `AllocateMany`: one `DecodeBlocksReserved` holding
    the events of the `Allocate`s handled in turn, and their state (one request: its
    `BlocksReserved`); a request twice, or one that ended, is refused."""
    allocs = [dc.Allocate("a", 0, (1, 2)), dc.Allocate("b", 1, (7,)), dc.Allocate("a2", 0, (3,))]
    one, many = dc.DecodeCore("D", layout()), dc.DecodeCore("D", layout())
    for d in (one, many):
        d.handle(dc.Allocate("b", 1, (5, 6)), 0.5)
    seq = [e for a in allocs for e in one.handle(a, 1.0)]
    (grown,) = many.handle(dc.AllocateMany(tuple(allocs)), 1.0)
    assert isinstance(grown, DecodeBlocksReserved) and grown.request is None
    assert list(grown.each()) == seq
    assert state_of(many) == state_of(one)
    # `handle` folds a batch's event at once: the state a replay of it (`apply`) makes, and
    # the state a replay of the one-by-one events makes
    for events in ([grown], seq):
        replayed = dc.DecodeCore("D", layout())
        replayed.handle(dc.Allocate("b", 1, (5, 6)), 0.5)
        for e in events:
            replayed.apply(e)
        assert state_of(replayed) == state_of(many)
        assert (replayed.clock, replayed.leases.clock) == (many.clock, many.leases.clock) == (
            1.0, 1.0)
    assert many.ledger.blocks_of("b") == (5, 6, 7)
    single = dc.DecodeCore("D", layout())
    assert single.handle(dc.AllocateMany((dc.Allocate("c", 0, (9,)),)), 1.0) == [
        BlocksReserved(at=1.0, instance="D", request="c", blocks=(9,), purpose="decode")]
    assert single.handle(dc.AllocateMany(()), 1.0) == []
    with pytest.raises(ProtocolError, match="appears twice"):
        many.decide(dc.AllocateMany((dc.Allocate("c", 0, (9,)), dc.Allocate("c", 0, (8,)))), 2.0)
    many.handle(dc.Finish("a2", 0), 2.0)
    with pytest.raises(ProtocolError, match="'Allocate' is not allowed in state 'ended'"):
        many.decide(dc.AllocateMany((dc.Allocate("a2", 0, (9,)),)), 3.0)
    with pytest.raises(ProtocolError, match="appear more than once"):
        many.decide(dc.AllocateMany((dc.Allocate("d", 0, (4, 4)),)), 3.0)


def test_a_batch_of_notifications_makes_the_events_one_by_one_would() -> None:
    """A push's completion notifications as one `NotifyMany`: the same events (once the
    notifications folded into a `KVReceived` are unfolded) and state as the `Notify`s handled
    in turn: all streams, a repeat, a late one after the KV is in, an aborted wait (its
    blocks freed at the last stream), a wait that already ended; a stream the wait does not
    expect refuses the batch and changes nothing."""
    from kvplane.core.errors import PeerError

    src = layout(tp=4)

    def waiting(abort: bool = False) -> dc.DecodeCore:
        d = dc.DecodeCore("D", layout(tp=2))
        d.handle(dc.ExpectKV("r", 0, P, (3, 4, 5), 40, src, "push"), 0.0)
        if abort:
            d.handle(dc.Abort("r", 0), 0.5)
        return d

    streams = sorted(waiting().entries[("r", 0)].expected)
    assert len(streams) > 2
    cases = [
        (False, streams),
        (False, [streams[0], streams[0], *streams[1:], streams[1]]),
        (True, [*streams, streams[0]]),
        (False, streams[:1]),
    ]
    for abort, pairs in cases:
        one, many = waiting(abort), waiting(abort)
        seq = [e for a, b in pairs for e in one.handle(dc.Notify("r", 0, a, b), 1.0)]
        got = many.handle(dc.NotifyMany("r", 0, tuple(pairs)), 1.0)
        assert unfold(got) == unfold(seq)
        assert state_of(many) == state_of(one)
        # the events a run records, applied to a fresh core, make the state again
        replayed = waiting(abort)
        for e in got:
            replayed.apply(e)
        assert state_of(replayed) == state_of(many)
    # all streams at once: no `NotificationReceived`, the `KVReceived` names them
    (kv,) = waiting().handle(dc.NotifyMany("r", 0, tuple(streams)), 1.0)
    assert isinstance(kv, KVReceived) and kv.notified() == streams
    done = waiting()
    done.handle(dc.NotifyMany("r", 0, tuple(streams)), 1.0)
    again = copy.deepcopy(done)
    seq = [e for a, b in streams for e in done.handle(dc.Notify("r", 0, a, b), 2.0)]
    assert again.handle(dc.NotifyMany("r", 0, tuple(streams)), 2.0) == seq
    assert all(e.duplicate for e in seq)  # type: ignore[attr-defined]
    fresh = waiting()
    before = copy.deepcopy(state_of(fresh))
    with pytest.raises(PeerError, match="not|expected"):
        fresh.handle(dc.NotifyMany("r", 0, (streams[0], (9, 9))), 1.0)
    assert state_of(fresh) == before


def unfold(events: list[Event]) -> list[Event]:
    """`events` with each notification folded into a `KVReceived` as its own event again."""
    return list(expand(events))


def test_missing_transition_names_state_and_input() -> None:
    d = dc.DecodeCore("D", layout())
    with pytest.raises(ProtocolError) as info:
        d.decide(dc.Finish("r1", 0), 0.0)
    err = info.value
    assert (err.machine, err.state, err.given) == ("decode", "absent", "Finish")
    assert "'Finish'" in str(err) and "'absent'" in str(err)
    p = pf.PrefillCore(P, layout())
    with pytest.raises(ProtocolError, match="'TransferDone' is not allowed in state 'absent'"):
        p.decide(pf.TransferDone("r1", 0), 0.0)
    with pytest.raises(NotImplementedError):
        machine.Machine("x").decide(None, 0.0)
    with pytest.raises(NotImplementedError):
        machine.Machine("x").apply(None)  # type: ignore[arg-type]


def test_reuse_read_lands_in_the_given_destination_blocks() -> None:
    """A local prefix hit covers the first blocks: the read goes to the blocks after it."""
    from kvplane.core import prefill as P
    from kvplane.core.errors import ProtocolError
    from kvplane.core.events import TransferPlanned
    from kvplane.core.plan import KVLayout
    from kvplane.core.reuse import RetainedHandle

    lay = KVLayout(16, 1, 2, 2, 64)
    p = P.PrefillCore("p0", lay)
    p.handle(P.Allocate("r", 0, (10, 11, 12, 13)), 0.0)
    h = RetainedHandle("d0", "L", 64, 16, ("a", "b", "c", "d"), 100.0)
    ev = p.handle(P.StartReuseRead("r", 0, h, (5, 6), lay, 32, dst_blocks=(12, 13)), 1.0)
    plan = next(e for e in ev if isinstance(e, TransferPlanned))
    assert plan.dst_blocks == (12, 13) and plan.runs == 1
    p2 = P.PrefillCore("p1", lay)
    p2.handle(P.Allocate("r", 0, (10, 11)), 0.0)
    try:
        p2.handle(P.StartReuseRead("r", 0, h, (5, 6), lay, 32, dst_blocks=(40, 41)), 1.0)
    except ProtocolError as exc:
        assert "not reserved" in str(exc)
    else:
        raise AssertionError("a read into foreign blocks must be refused")


def test_fold_tables_share_no_type_with_the_lease_table() -> None:
    """`apply` of decode and prefill folds an event in its own table without asking the lease
    table: that is right only while no event type is in both."""
    from kvplane.core import decode, prefill
    from kvplane.core.lease import _LEASE_EVENTS

    assert not set(decode._FOLD) & _LEASE_EVENTS
    assert not set(prefill._FOLD) & _LEASE_EVENTS
