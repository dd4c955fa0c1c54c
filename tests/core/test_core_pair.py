"""Prefill and decode together, through the pair harness: each flow of SPEC sections 1-3 and the
awkward orders (abort before/between/after, preempt, re-issue, time-outs, duplicates)."""

from __future__ import annotations

import pytest
from kvplane_core_harness import D, P, Pair, layout, lease_of, reader_of

from kvplane.core import decode as dc
from kvplane.core import lease as ls
from kvplane.core import prefill as pf
from kvplane.core import sessions as ss
from kvplane.core.errors import PeerError, ProtocolError
from kvplane.core.events import (
    BlocksFreed,
    Event,
    HoldTimedOut,
    KVLoadFailed,
    KVReceived,
    LeaseExpired,
    LeaseGranted,
    LeaseReleased,
    LeaseReleaseDeferred,
    NotificationReceived,
    PrefillFinished,
    RegistrationDropped,
    RegistrationSent,
    RendezvousMatched,
    RequestAborted,
    ReuseDecided,
    SessionStored,
    TransferCompleted,
    TransferFailed,
    TransferPlanned,
)
from kvplane.core.replay import replay


def done(pair: Pair) -> None:
    """Drive to rest and check everything the log and the machines can tell."""
    pair.quiesce()
    report = replay(pair.log, final=True)
    assert report.ok, "\n".join(map(str, report.violations))
    assert pair.hazards == []
    assert pair.prefill.ledger.owner == {} and pair.decode.ledger.owner == {}
    pair.assert_replay_equals_live()
    pair.assert_one_kv_outcome()


def types(events: list[Event]) -> list[type]:
    return [type(e) for e in events]


def of(pair: Pair, kind: type, request: str | None = None) -> list[Event]:
    return [e for e in pair.log if isinstance(e, kind) and (request is None or e.request == request)]


# --- push ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["registration_first", "prefill_first"])
@pytest.mark.parametrize(
    ("p_lay", "d_lay"),
    [
        (layout(bs=16, tp=2), layout(bs=16, tp=2)),
        (layout(bs=16, tp=4), layout(bs=32, tp=2)),
        (layout(bs=32, tp=1), layout(bs=16, tp=8)),
        (layout(bs=16, tp=4, heads=2), layout(bs=16, tp=8, heads=2)),
    ],
)
def test_push_happy_path(order: str, p_lay: object, d_lay: object) -> None:
    pair = Pair(p_lay, d_lay)  # type: ignore[arg-type]
    pair.push_request("r1", 100, order=order)
    (m,) = of(pair, RendezvousMatched)
    assert isinstance(m, RendezvousMatched) and m.order == order
    (plan,) = of(pair, TransferPlanned)
    (sent,) = of(pair, RegistrationSent)
    assert isinstance(plan, TransferPlanned) and isinstance(sent, RegistrationSent)
    assert plan.expected_notifications == sent.expected_notifications
    notes = of(pair, NotificationReceived)
    assert len(notes) == plan.expected_notifications
    # KV is received exactly when the last notification arrives, not before
    kv = [i for i, e in enumerate(pair.log) if isinstance(e, KVReceived)]
    last = max(i for i, e in enumerate(pair.log) if isinstance(e, NotificationReceived))
    assert kv == [last + 1]
    # prefill frees its blocks as soon as the write completes
    (c,) = of(pair, TransferCompleted)
    i = pair.log.index(c)
    assert isinstance(pair.log[i + 1], BlocksFreed) and pair.log[i + 1].instance == P
    done(pair)


def test_duplicate_and_out_of_order_notifications() -> None:
    pair = Pair(layout(tp=4), layout(tp=2))
    pair.start_push("r1", 64)
    pair.deliver_all()
    pair.p(pf.FinishPrefill("r1", 0, 64))
    key = ("r1", 0, "P->D")
    for i in (3, 0, 2, 1):
        pair.land(key, i)
    notes = list(pair.inbox)
    pair.deliver(3)  # out of order
    pair.redeliver(len(pair.sent) - 1)  # the same once more
    evs = pair.deliver(0)
    assert types(evs) == [NotificationReceived]
    dup = [e for e in of(pair, NotificationReceived) if isinstance(e, NotificationReceived)]
    assert [e.duplicate for e in dup] == [False, True, False]
    pair.deliver_all()
    assert len(of(pair, KVReceived)) == 1
    for m in notes:  # everything again, after the KV arrived
        assert all(getattr(e, "duplicate", False) for e in pair.run(m.to, m.cmd))
    assert len(of(pair, KVReceived)) == 1
    pair.complete(key)
    done(pair)


def test_notification_from_an_unexpected_stream_is_a_peer_error() -> None:
    pair = Pair(layout(tp=2), layout(tp=2))
    pair.start_push("r1", 32)
    with pytest.raises(PeerError):
        pair.d(dc.Notify("r1", 0, 1, 0))  # equal TP: rank 1 writes only to rank 1
    done(pair)


def test_abort_before_anything_then_late_registration_is_dropped() -> None:
    pair = Pair()
    assert types(pair.p(pf.Abort("r1", 0))) == [RequestAborted]
    pair.expect_push("r1", 32)
    (drop,) = pair.deliver()
    assert isinstance(drop, RegistrationDropped) and drop.reason == "request already ended"
    with pytest.raises(ProtocolError):
        pair.p(pf.Allocate("r1", 0, (1,)))
    pair.d(dc.Abort("r1", 0))  # decode waits for the time-out: nothing will be written
    assert pair.decode.phase("r1", 0) == "aborting"
    done(pair)
    assert any(isinstance(e, KVLoadFailed) for e in pair.log)


def test_abort_between_registration_and_finish() -> None:
    pair = Pair()
    pair.start_push("r1", 40)
    pair.deliver_all()
    evs = pair.p(pf.Abort("r1", 0))
    assert types(evs) == [RequestAborted, BlocksFreed]
    assert pair.p(pf.Abort("r1", 0)) == []  # twice: nothing more
    with pytest.raises(ProtocolError):
        pair.p(pf.FinishPrefill("r1", 0, 40))
    done(pair)


def test_abort_while_held_frees_at_once() -> None:
    pair = Pair()
    pair.p(pf.Allocate("r1", 0, (1, 2)))
    pair.p(pf.FinishPrefill("r1", 0, 20))
    assert types(pair.p(pf.Abort("r1", 0))) == [RequestAborted, BlocksFreed]
    pair.expect_push("r1", 20)
    (drop,) = pair.deliver()
    assert isinstance(drop, RegistrationDropped)
    done(pair)


def test_abort_during_the_write_waits_for_it_on_both_sides() -> None:
    pair = Pair()
    pair.start_push("r1", 64)
    pair.deliver_all()
    pair.p(pf.FinishPrefill("r1", 0, 64))
    assert types(pair.p(pf.Abort("r1", 0))) == [RequestAborted]  # no free under a WRITE
    assert types(pair.d(dc.Abort("r1", 0))) == [RequestAborted]
    assert pair.d(dc.Abort("r1", 0)) == []
    key = ("r1", 0, "P->D")
    pair.land(key, 0)
    pair.land(key, 1)
    pair.deliver_all()  # decode frees only once the last notification is in
    assert types(of(pair, BlocksFreed)) == [BlocksFreed] and pair.log[-1].instance == D
    pair.complete(key)
    assert isinstance(pair.log[-1], BlocksFreed) and pair.log[-1].instance == P
    assert pair.p(pf.Abort("r1", 0)) == []  # after the end: nothing
    done(pair)


def test_abort_after_the_end_changes_nothing() -> None:
    pair = Pair()
    pair.push_request("r1", 48)
    assert pair.p(pf.Abort("r1", 0)) == []
    assert pair.d(dc.Abort("r1", 0)) == []
    done(pair)


def test_preempt_frees_and_the_request_runs_again() -> None:
    pair = Pair()
    pair.start_push("r1", 48)
    pair.deliver_all()
    assert types(pair.p(pf.Preempt("r1", 0))) == [pf.RequestPreempted, BlocksFreed]
    assert pair.prefill.phase("r1", 0) == "waiting"
    pair.p(pf.Allocate("r1", 0, pair.take_blocks(P, 3)))
    evs = pair.p(pf.FinishPrefill("r1", 0, 48))
    assert types(evs) == [PrefillFinished, RendezvousMatched, TransferPlanned]
    pair.settle()
    assert pair.decode.phase("r1", 0) == "decoding"
    done(pair)


def test_reissue_gives_a_new_attempt_and_drops_the_old_one() -> None:
    pair = Pair()
    pair.start_push("r1", 48)
    pair.p(pf.FinishPrefill("r1", 0, 48))  # held; its registration still in flight
    evs = pair.p(pf.Reissue("r1", 1))
    assert types(evs) == [pf.RequestReissued, BlocksFreed]
    (drop,) = pair.deliver()  # the old attempt's registration arrives late
    assert isinstance(drop, RegistrationDropped) and drop.reason in (
        "stale attempt", "request already ended")
    pair.d(dc.Abort("r1", 0))
    pair.start_push("r1", 48, attempt=1)
    pair.deliver_all()
    pair.p(pf.FinishPrefill("r1", 1, 48))
    pair.settle()
    assert pair.decode.phase("r1", 1) == "decoding"
    assert pair.p(pf.Reissue("r1", 0)) == []  # late: attempt 1 superseded it
    assert pair.p(pf.Reissue("r1", 1)) == []  # a duplicate
    done(pair)


def test_reissue_after_the_new_attempts_registration_arrived() -> None:
    pair = Pair()
    pair.p(pf.Allocate("r1", 0, pair.take_blocks(P, 2)))
    pair.expect_push("r1", 32, attempt=1)
    pair.deliver_all()  # attempt 1's registration reaches prefill before the re-issue
    assert types(pair.p(pf.Reissue("r1", 1))) == [pf.RequestReissued, BlocksFreed]
    assert pair.prefill.entries[("r1", 1)].registration is not None
    pair.p(pf.Allocate("r1", 1, pair.take_blocks(P, 2)))
    evs = pair.p(pf.FinishPrefill("r1", 1, 32))
    assert RendezvousMatched in types(evs)
    pair.settle()
    done(pair)


def test_reissue_during_the_write_frees_the_old_attempt_when_it_ends() -> None:
    pair = Pair()
    pair.start_push("r1", 32)
    pair.deliver_all()
    pair.p(pf.FinishPrefill("r1", 0, 32))
    assert types(pair.p(pf.Reissue("r1", 1))) == [pf.RequestReissued]
    pair.settle()
    assert pair.prefill.entries == {}
    done(pair)


def test_transfer_failure_reaches_decode_which_falls_back() -> None:
    pair = Pair()
    pair.start_push("r1", 32)
    pair.deliver_all()
    pair.p(pf.FinishPrefill("r1", 0, 32))
    pair.land(("r1", 0, "P->D"), 0)
    pair.complete(("r1", 0, "P->D"), ok=False, reason="UCX error")
    assert types(pair.log[-2:]) == [TransferFailed, BlocksFreed]
    pair.deliver_all()
    assert pair.decode.phase("r1", 0) == "decoding"
    (f,) = of(pair, KVLoadFailed)
    assert isinstance(f, KVLoadFailed) and f.reason == "UCX error"
    with pytest.raises(ProtocolError):  # the background thread reporting twice is a driver bug
        pair.p(pf.TransferDone("r1", 0))
    assert pair.d(dc.KVFailed("r1", 0, "late")) == []  # a stale failure report is ignored
    done(pair)


def test_kv_wait_times_out_and_late_registration_is_never_matched() -> None:
    pair = Pair(kv_timeout=5.0)
    pair.start_push("r1", 32)
    pair.advance(5.0)
    (f, *_) = pair.d(dc.Tick())
    assert isinstance(f, KVLoadFailed)
    pair.d(dc.Finish("r1", 0))  # decode computed the prompt itself, generated, and freed
    pair.deliver_all()  # the registration arrives now: too late to write
    (drop,) = of(pair, RegistrationDropped)
    assert isinstance(drop, RegistrationDropped) and "deadline" in drop.reason
    evs = pair.p(pf.FinishPrefill("r1", 0, 32))
    assert types(evs) == [PrefillFinished]  # held: nobody registered in time
    pair.advance(10.0)
    assert types(pair.p(pf.Tick())) == [HoldTimedOut, BlocksFreed]
    done(pair)


def test_registration_first_then_prefill_finishes_too_close_to_the_deadline() -> None:
    pair = Pair(kv_timeout=5.0, window=1.0)
    pair.start_push("r1", 32)
    pair.deliver_all()
    pair.advance(4.5)  # a WRITE now could still be landing when decode gives up
    evs = pair.p(pf.FinishPrefill("r1", 0, 32))
    assert types(evs) == [PrefillFinished, RegistrationDropped]
    assert pair.prefill.phase("r1", 0) == "held"
    assert pair.prefill.entries[("r1", 0)].registration is None
    done(pair)


def test_registration_with_too_few_blocks_is_dropped_not_raised() -> None:
    pair = Pair()
    pair.p(pf.Allocate("r1", 0, pair.take_blocks(P, 4)))
    pair.d(dc.ExpectKV("r1", 0, P, (1, 2), 64, pair.p_layout))  # 2 blocks for 64 tokens
    pair.deliver_all()
    evs = pair.p(pf.FinishPrefill("r1", 0, 64))
    assert types(evs) == [PrefillFinished, RegistrationDropped]
    assert isinstance(evs[1], RegistrationDropped) and "peer error" in evs[1].reason
    assert pair.prefill.phase("r1", 0) == "held"
    # a corrected registration is still welcome
    pair.d(dc.Allocate("r1", 0, (5, 6)))
    evs = pair.p(pf.Register("r1", 0, D, (1, 2, 5, 6), pair.d_layout, None))
    assert RendezvousMatched in types(evs)
    pair.settle()
    assert pair.decode.phase("r1", 0) == "decoding"
    done(pair)


def test_registration_for_another_model_is_dropped_as_a_peer_error() -> None:
    pair = Pair()
    for other in (layout(layers=7), layout(heads=4), layout(hb=64)):
        (drop,) = pair.p(pf.Register("r1", 0, D, (1,), other))
        assert isinstance(drop, RegistrationDropped) and drop.final
        assert drop.reason.startswith("peer error: ") and "another model" in drop.reason


def test_duplicate_registration_is_dropped_and_harmless() -> None:
    pair = Pair()
    pair.start_push("r1", 32)
    pair.deliver_all()
    (drop,) = pair.redeliver(0)
    assert isinstance(drop, RegistrationDropped) and drop.reason == "duplicate registration"
    pair.p(pf.FinishPrefill("r1", 0, 32))
    pair.settle()
    assert isinstance(pair.redeliver(0)[0], RegistrationDropped)
    done(pair)


def test_hold_times_out_without_registration() -> None:
    pair = Pair(hold_timeout=6.0)
    pair.p(pf.Allocate("r1", 0, (3, 4)))
    pair.p(pf.FinishPrefill("r1", 0, 20))
    pair.advance(5.9)
    assert pair.p(pf.Tick()) == []
    pair.advance(0.1)
    assert types(pair.p(pf.Tick())) == [HoldTimedOut, BlocksFreed]
    done(pair)


def test_release_never_frees_blocks_a_write_may_still_need() -> None:
    pair = Pair()
    pair.p(pf.Allocate("r1", 0, (3, 4)))
    pair.p(pf.FinishPrefill("r1", 0, 20))
    with pytest.raises(ProtocolError):
        pair.p(pf.Release_("r1", 0))  # held: a registration may still come
    pair.p(pf.Allocate("r2", 0, (5,)))
    assert types(pair.p(pf.Release_("r2", 0))) == [BlocksFreed]
    assert pair.p(pf.Release_("r2", 0)) == []
    done(pair)


# --- pull ------------------------------------------------------------------------------------------


def test_pull_happy_path() -> None:
    pair = Pair(layout(bs=16, tp=4), layout(bs=32, tp=2))
    pair.pull_request("r1", 100)
    kinds = types(pair.log)
    assert kinds.index(LeaseGranted) < kinds.index(TransferPlanned) < kinds.index(KVReceived)
    (rel,) = of(pair, LeaseReleased)
    assert isinstance(rel, LeaseReleased) and rel.reason == "read by decode"
    assert pair.p(pf.PullReadDone("r1", 0)) == []  # a duplicate read-done: nothing
    done(pair)


def test_pull_hold_expires_when_decode_never_reads_and_heartbeats_extend_it() -> None:
    pair = Pair(hold_ttl=5.0)
    pair.p(pf.Allocate("r1", 0, (1, 2)))
    pair.p(pf.FinishPrefill("r1", 0, 20, mode="pull", hold_ttl=5.0))
    lease = pf.hold_lease_id("r1", 0)
    pair.advance(4.0)
    pair.p(ls.Heartbeat(lease, 5.0))  # expiry 9
    pair.advance(4.5)
    assert pair.p(pf.Tick()) == []
    pair.advance(1.0)
    assert types(pair.p(pf.Tick())) == [LeaseExpired, BlocksFreed]
    pair.inbox.clear()  # the metadata never reaches a decode
    done(pair)


def test_pull_read_is_not_started_when_the_hold_is_about_to_expire() -> None:
    pair = Pair(hold_ttl=5.0, window=1.0)
    pair.p(pf.Allocate("r1", 0, (1, 2)))
    pair.p(pf.FinishPrefill("r1", 0, 20, mode="pull", hold_ttl=5.0))
    pair.advance(4.2)  # the relay was slow
    pair.deliver_all()
    assert not of(pair, TransferPlanned)
    assert pair.decode.phase("r1", 0) == "decoding"  # computes the prompt itself
    done(pair)


def test_pull_read_failure_falls_back_and_the_hold_expires() -> None:
    pair = Pair()
    pair.p(pf.Allocate("r1", 0, (1, 2)))
    pair.p(pf.FinishPrefill("r1", 0, 20, mode="pull", hold_ttl=5.0))
    pair.deliver_all()
    pair.complete(("r1", 0, "P->D"), ok=False, reason="read failed")
    assert types(pair.log[-2:]) == [TransferFailed, KVLoadFailed]
    done(pair)
    assert of(pair, LeaseExpired)


def test_abort_during_a_pull_read_waits_for_it() -> None:
    pair = Pair()
    pair.p(pf.Allocate("r1", 0, (1, 2)))
    pair.p(pf.FinishPrefill("r1", 0, 20, mode="pull"))
    pair.deliver_all()
    assert types(pair.d(dc.Abort("r1", 0))) == [RequestAborted]
    pair.complete(("r1", 0, "P->D"))
    assert isinstance(pair.log[-1], BlocksFreed) and pair.log[-1].instance == D
    done(pair)


# --- bidirectional reuse ----------------------------------------------------------------------------


def conversation(n: int, seed: int = 0) -> list[int]:
    return [(seed * 101 + i * 7) % 997 for i in range(n)]


def turn_one(pair: Pair, tokens: list[int], *, tenant: str = "t1", conv: str = "c1",
             ttl: float = 20.0, renewable: bool = False) -> None:
    pair.push_request("c1-1", len(tokens),
                      retain=pair.retain("c1-1", tenant, conv, tokens, ttl=ttl,
                                         renewable=renewable))
    assert of(pair, SessionStored)


def test_two_turns_read_the_retained_kv_back() -> None:
    pair = Pair(layout(bs=16, tp=2), layout(bs=32, tp=4))
    t1 = conversation(200)
    turn_one(pair, t1)
    t2 = t1 + conversation(40, seed=5)
    assert pair.reuse("c1-2", "t1", "c1", t2) == "read"
    (d,) = of(pair, ReuseDecided)
    assert isinstance(d, ReuseDecided) and d.matched_tokens == 192
    read = [e for e in of(pair, TransferPlanned) if e.direction == "D->P"]  # type: ignore[attr-defined]
    assert len(read) == 1 and read[0].src == D and read[0].dst == P
    pair.settle()  # read done -> EndRead on decode
    assert pair.decode.leases.leases[lease_of("c1-1")].pins == {}
    # the rest of turn two runs as a push, and its KV is retained for turn three
    pair.p(pf.FinishPrefill("c1-2", 0, len(t2)))
    pair.expect_push("c1-2", len(t2))
    pair.settle()
    pair.d(dc.Finish("c1-2", 0, pair.retain("c1-2", "t1", "c1", t2)))
    pair.settle()
    h = pair.router.handle_of("t1", "c1")
    assert h is not None and h.lease == lease_of("c1-2")
    done(pair)


def test_edited_history_other_conversation_and_other_tenant_are_not_read() -> None:
    pair = Pair()
    t1 = conversation(200)
    turn_one(pair, t1)
    edited = list(t1)
    edited[3] += 1
    assert pair.reuse("x-2", "t1", "c1", edited + [1] * 30) == "mismatch"
    done(pair)

    pair = Pair()
    turn_one(pair, t1)
    assert pair.reuse("x-2", "t1", "c2", t1 + [1] * 30) == "miss"  # other conversation id
    assert pair.reuse("x-3", "t2", "c1", t1 + [1] * 30) == "miss"  # other tenant
    assert pair.reuse("x-4", "t1", "c1", conversation(240, seed=3)) == "mismatch"
    done(pair)


def test_other_tenant_salt_never_matches_even_with_the_handle() -> None:
    pair = Pair()
    t1 = conversation(200)
    turn_one(pair, t1, tenant="t1")
    handle = pair.router.handle_of("t1", "c1")
    from kvplane.core.hashing import block_hashes

    hashes = block_hashes(t1 + [1] * 30, 16, "t2")
    (d,) = pair.p(pf.DecideReuse("x", 0, handle, hashes, 230, 0, 16))
    assert isinstance(d, ReuseDecided) and d.outcome == "mismatch"
    done(pair)


def test_turn_after_the_ttl_falls_back_to_normal_prefill() -> None:
    pair = Pair()
    t1 = conversation(200)
    turn_one(pair, t1, ttl=10.0)
    pair.advance(11.0)
    assert pair.reuse("c1-2", "t1", "c1", t1 + [1] * 30) == "miss"  # router dropped it
    done(pair)

    pair = Pair()
    turn_one(pair, t1, ttl=10.0)
    pair.advance(9.5)  # alive, but a read of `window` would outlive it
    assert pair.reuse("c1-2", "t1", "c1", t1 + [1] * 30) == "refused"
    done(pair)


def test_reading_pins_the_lease_past_its_expiry_and_defers_release() -> None:
    pair = Pair()
    t1 = conversation(200)
    turn_one(pair, t1, ttl=10.0)
    pair.advance(8.0)
    assert pair.reuse("c1-2", "t1", "c1", t1 + [1] * 30) == "read"
    lease = lease_of("c1-1")
    pair.now += 2.5  # the read is slow (the harness would complete it on `advance`)
    assert pair.d(dc.Tick()) == []  # past expiry, but pinned
    assert types(pair.d(ls.Release(lease, "router dropped it"))) == [LeaseReleaseDeferred]
    pair.complete(("c1-2", 0, "D->P"))
    evs = pair.deliver()  # EndRead
    assert types(evs) == [ls.LeaseUnpinned, LeaseReleased, BlocksFreed]
    done(pair)


def test_abort_during_a_reuse_read_frees_when_it_ends() -> None:
    pair = Pair()
    t1 = conversation(200)
    turn_one(pair, t1)
    assert pair.reuse("c1-2", "t1", "c1", t1 + [1] * 30) == "read"
    assert types(pair.p(pf.Abort("c1-2", 0))) == [RequestAborted]
    with pytest.raises(ProtocolError):
        pair.p(pf.Release_("c1-2", 0))
    pair.settle()
    assert ("c1-2", 0) not in pair.prefill.entries
    done(pair)


def test_reissue_during_a_reuse_read_frees_the_old_attempt_when_it_ends() -> None:
    pair = Pair()
    t1 = conversation(200)
    turn_one(pair, t1)
    assert pair.reuse("c1-2", "t1", "c1", t1 + [1] * 30) == "read"
    assert types(pair.p(pf.Reissue("c1-2", 1))) == [pf.RequestReissued]
    pair.settle()
    assert ("c1-2", 0) not in pair.prefill.entries
    done(pair)


def test_second_read_or_finish_while_reading_is_refused() -> None:
    pair = Pair()
    t1 = conversation(200)
    turn_one(pair, t1)
    assert pair.reuse("c1-2", "t1", "c1", t1 + [1] * 30) == "read"
    h = pair.reused[("c1-2", 0)]
    assert h.outcome == "read"
    with pytest.raises(ProtocolError):
        pair.p(pf.FinishPrefill("c1-2", 0, 230))
    with pytest.raises(ProtocolError):
        pair.p(pf.Preempt("c1-2", 0))
    handle = pair.flights[("c1-2", 0, "D->P")]
    with pytest.raises(ProtocolError):
        pair.p(pf.StartReuseRead("c1-2", 0, pair_handle(pair), handle.planned.src_blocks,
                                 pair.d_layout, 192))
    pair.settle()
    done(pair)


def pair_handle(pair: Pair) -> object:
    from kvplane.core.reuse import RetainedHandle

    return RetainedHandle(D, lease_of("c1-1"), 200, 16, (), 99.0)


def test_renewable_retention_stays_while_heartbeats_come() -> None:
    pair = Pair()
    t1 = conversation(200)
    turn_one(pair, t1, ttl=10.0, renewable=True)
    lease = lease_of("c1-1")
    for _ in range(5):
        pair.advance(8.0)
        pair.d(ls.Heartbeat(lease, 10.0))
        pair.r(ss.Renew("t1", "c1", pair.decode.leases.leases[lease].expires_at, lease))
        pair.tick()
    assert pair.reuse("c1-2", "t1", "c1", t1 + [1] * 30) == "read"
    pair.settle()
    done(pair)


def test_reader_name_is_stable() -> None:
    assert reader_of("r", 2) == "P:r#2"
