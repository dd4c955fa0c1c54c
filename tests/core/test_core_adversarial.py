"""Orders a careful reviewer tries: each one was unsafe (or crashed) before, and each test here
fails on the core as it was. The machines now refuse what is unsafe (a domain error or a
recorded drop, never a bare Python exception), and `replay` flags what a log can still contain.
"""

from __future__ import annotations

import math

import pytest
from kvplane_core_harness import D, P, Pair, layout, lease_of, reader_of

from kvplane.core import decode as dc
from kvplane.core import lease as ls
from kvplane.core import prefill as pf
from kvplane.core import sessions as ss
from kvplane.core.errors import PeerError, ProtocolError
from kvplane.core.events import (
    BlocksFreed,
    BlocksReserved,
    Event,
    KVLoadFailed,
    KVReceived,
    LeaseExpired,
    LeaseGranted,
    LeasePinned,
    LeaseUnpinned,
    RegistrationDropped,
    RequestAborted,
    ReuseDecided,
    SessionStored,
    SessionTaken,
    TransferCompleted,
    TransferPlanned,
)
from kvplane.core.plan import plan_transfer
from kvplane.core.replay import replay
from kvplane.core.reuse import RetainedHandle, decide_reuse


def rules(events: list[Event], final: bool = False) -> set[str]:
    return {v.rule for v in replay(events, final=final).violations}


def planned(at: float, req: str, src_blocks: tuple[int, ...], dst_blocks: tuple[int, ...],
            instance: str = P, direction: str = "P->D", src: str = P, dst: str = D,
            attempt: int = 0) -> TransferPlanned:
    return TransferPlanned(
        at=at, instance=instance, request=req, attempt=attempt, direction=direction,  # type: ignore[arg-type]
        src=src, dst=dst, src_blocks=src_blocks, dst_blocks=dst_blocks,
        num_tokens=16 * len(dst_blocks), runs=1, descriptors=2, bytes=1, expected_notifications=1,
    )


def reserved(at: float, inst: str, req: str, blocks: tuple[int, ...],
             purpose: str = "remote_kv") -> BlocksReserved:
    return BlocksReserved(at=at, instance=inst, request=req, blocks=blocks,
                          purpose=purpose)  # type: ignore[arg-type]


def freed(at: float, inst: str, req: str, blocks: tuple[int, ...]) -> BlocksFreed:
    return BlocksFreed(at=at, instance=inst, request=req, blocks=blocks, reason="test")


# --- replay: no free while a transfer may still write ---------------------------------------------


def test_replay_flags_a_free_while_a_write_is_in_flight() -> None:
    log: list[Event] = [
        reserved(0.0, P, "r1", (1, 2), "prefill"),
        reserved(0.0, D, "r1", (7, 8)),
        planned(1.0, "r1", (1, 2), (7, 8)),
        freed(1.1, D, "r1", (7, 8)),  # decode frees what the WRITE lands in
        reserved(1.2, D, "r2", (7, 8)),  # and another request takes it
        TransferCompleted(at=2.0, instance=P, request="r1", attempt=0, direction="P->D"),
    ]
    assert "free-under-transfer" in rules(log)
    # the same log with the free after decode has the KV is fine
    ok: list[Event] = [
        *log[:3],
        KVReceived(at=1.5, instance=D, request="r1", attempt=0, num_tokens=32),
        freed(1.6, D, "r1", (7, 8)),
        TransferCompleted(at=2.0, instance=P, request="r1", attempt=0, direction="P->D"),
        freed(2.0, P, "r1", (1, 2)),
    ]
    assert rules(ok, final=True) == set()


def test_replay_flags_a_free_under_a_read_in_flight() -> None:
    log: list[Event] = [
        reserved(0.0, D, "r1", (3, 4)),
        planned(1.0, "r1", (1, 2), (3, 4), instance=D),  # decode's pull READ
        freed(1.5, D, "r1", (3, 4)),
    ]
    assert "free-under-transfer" in rules(log)


# --- push: duplicates, margins, layouts -------------------------------------------------------------


def test_a_duplicate_registration_after_a_reissue_never_tells_decode_no_kv() -> None:
    pair = Pair()
    pair.start_push("r1", 32)
    pair.deliver_all()  # the registration
    pair.p(pf.FinishPrefill("r1", 0, 32))  # matched: the WRITE is in flight
    assert pair.prefill.phase("r1", 0) == "transferring"
    pair.p(pf.Reissue("r1", 1))  # the id comes back as attempt 1
    (drop,) = pair.redeliver(0)  # a copy of attempt 0's registration
    assert isinstance(drop, RegistrationDropped)
    assert drop.reason == "duplicate registration" and not drop.final
    assert not pair.inbox  # nothing told decode "no KV"
    pair.settle()
    assert pair.decode.phase("r1", 0) == "decoding"
    assert pair.hazards == []
    assert rules(pair.log) == set()


@pytest.mark.parametrize("margin", [0.0, -1.0, math.nan, math.inf])
def test_write_margin_must_be_positive_and_finite(margin: float) -> None:
    with pytest.raises(ProtocolError):
        pf.PrefillCore(P, layout(), write_margin=margin)


def test_default_write_margin_drops_a_registration_an_instant_before_its_deadline() -> None:
    core = pf.PrefillCore(P, layout())
    assert core.write_margin > 0
    core.handle(pf.Allocate("r1", 0, (1, 2)), 0.0)
    core.handle(pf.FinishPrefill("r1", 0, 32), 1.0)
    (drop,) = core.handle(pf.Register("r1", 0, D, (7, 8), layout(), deadline=10.0), 9.999)
    assert isinstance(drop, RegistrationDropped) and drop.final
    assert drop.reason == "decode's KV deadline passed"


def test_a_layout_that_does_not_divide_is_a_recorded_drop_not_a_value_error() -> None:
    pair = Pair()  # prefill: 8 KV heads over TP 2
    pair.p(pf.Allocate("r1", 0, (1, 2)))
    (drop,) = pair.p(pf.Register("r1", 0, D, (7, 8), layout(heads=3, tp=3)))
    assert isinstance(drop, RegistrationDropped) and drop.final
    assert drop.reason.startswith("peer error:")
    # prefill is not poisoned: it finishes, holds, and serves a good registration
    pair.p(pf.FinishPrefill("r1", 0, 32))
    pair.expect_push("r1", 32)
    pair.settle()
    assert pair.decode.phase("r1", 0) == "decoding" and pair.hazards == []


def test_decode_fails_the_wait_for_a_producer_of_another_model() -> None:
    core = dc.DecodeCore(D, layout())
    evs = core.handle(dc.ExpectKV("r1", 0, P, (1, 2), 32, layout(heads=4)), 0.0)
    assert [type(e) for e in evs] == [BlocksReserved, KVLoadFailed]
    assert isinstance(evs[1], KVLoadFailed) and evs[1].reason.startswith("peer error:")
    assert core.phase("r1", 0) == "decoding"  # it computes the prompt itself


# --- decode: failure reports during its own READ; PullDone for push ---------------------------------


def pull_in_flight(pair: Pair) -> None:
    pair.p(pf.Allocate("r1", 0, (1, 2)))
    pair.p(pf.FinishPrefill("r1", 0, 32, mode="pull", hold_ttl=5.0))
    pair.deliver_all()  # relayed: decode plans its READ
    assert ("r1", 0, "P->D") in pair.flights


def test_kv_failed_during_decodes_own_read_is_ignored() -> None:
    pair = Pair()
    pull_in_flight(pair)
    assert pair.d(dc.KVFailed("r1", 0, "prefill gave up")) == []
    assert pair.decode.phase("r1", 0) == "awaiting_kv"
    pair.d(dc.Abort("r1", 0))  # even aborted, the blocks wait for the READ
    assert pair.d(dc.KVFailed("r1", 0, "again")) == []
    assert not any(isinstance(e, BlocksFreed) and e.instance == D for e in pair.log)
    pair.settle()
    assert pair.hazards == [] and rules(pair.log) == set()


def test_pull_done_for_a_push_wait_is_refused() -> None:
    pair = Pair()
    pair.start_push("r1", 32)
    with pytest.raises(ProtocolError):
        pair.d(dc.PullDone("r1", 0))


# --- duplicate block ids ----------------------------------------------------------------------------


def test_duplicate_block_ids_are_refused_everywhere() -> None:
    pair = Pair()
    pair.p(pf.Allocate("r1", 0, (1, 2)))
    (drop,) = pair.p(pf.Register("r1", 0, D, (7, 7), pair.d_layout))
    assert isinstance(drop, RegistrationDropped) and "more than once" in drop.reason
    with pytest.raises(ProtocolError):
        pair.p(pf.Allocate("r2", 0, (3, 3)))
    with pytest.raises(ProtocolError):
        pair.d(dc.Allocate("r3", 0, (5, 5)))
    # a pull expectation naming prefill's blocks twice: the wait fails, decode computes
    evs = pair.d(dc.ExpectKV("r4", 0, P, (9, 10), 32, pair.p_layout, mode="pull",
                             src_blocks=(1, 1)))
    assert isinstance(evs[-1], KVLoadFailed) and "more than once" in evs[-1].reason
    with pytest.raises(PeerError):
        plan_transfer(layout(), layout(), (1, 1), (2, 3), 32)
    log: list[Event] = [
        reserved(0.0, P, "r1", (1, 2), "prefill"),
        reserved(0.0, D, "r1", (7, 8)),
        planned(1.0, "r1", (1, 2), (7, 7)),
    ]
    assert "duplicate-blocks" in rules(log)


# --- lease pins are bounded -------------------------------------------------------------------------


def retained(pair: Pair) -> str:
    pair.push_request("r0", 64, retain=pair.retain("r0", "t1", "c1", list(range(64)), ttl=20.0))
    return lease_of("r0")


def test_a_reader_that_never_ends_loses_its_pin_and_the_lease_expires() -> None:
    pair = Pair(pin_grace=5.0)
    lease = retained(pair)
    (pin,) = pair.d(ls.BeginRead(lease, "P:stuck", duration=1.0))
    assert isinstance(pin, LeasePinned)
    pair.now = pin.until + 4.9
    pair.d(dc.Tick())
    assert lease in pair.decode.leases.leases  # within the bound: still pinned
    pair.now = 30.0  # past the pin's bound and the lease's TTL
    evs = pair.d(dc.Tick())
    assert [type(e) for e in evs] == [LeaseUnpinned, LeaseExpired, BlocksFreed]
    assert isinstance(evs[0], LeaseUnpinned) and evs[0].timed_out
    assert pair.d(ls.EndRead(lease, "P:stuck")) == []  # the late end changes nothing
    assert rules(pair.log, final=True) - {"leak"} == set()


def test_replay_flags_a_read_that_outlives_its_pin_and_a_pin_never_ended() -> None:
    pair = Pair(pin_grace=1.0)
    lease = retained(pair)
    assert pair.reuse("r1", "t1", "c1", list(range(80)), threshold=16) == "read"
    pair.stuck.add(("r1", 0, "D->P"))  # the reader breaks its contract: no cancel
    pair.advance(30.0)
    pair.tick()  # the pin times out, the lease expires under the read
    assert any(isinstance(e, LeaseUnpinned) and e.timed_out for e in pair.log)
    assert "pin-overrun" in rules(pair.log)
    pair.settle()  # the read finally ends, from blocks decode has freed
    assert pair.hazards  # the harness saw data leave freed blocks
    assert {"pin-overrun", "dead-lease-read"} <= rules(pair.log)
    pinned: list[Event] = [
        reserved(0.0, D, "r0", (1, 2), "decode"),
        LeaseGranted(at=1.0, instance=D, request="r0", lease="L", blocks=(1, 2), num_tokens=32,
                     block_hashes=(), expires_at=10.0, renewable=False, purpose="retained"),
        LeasePinned(at=2.0, instance=D, request="r0", lease="L", reader="P:x", until=3.0),
    ]
    assert "pin-never-ended" in rules(pinned, final=True)
    assert lease == lease_of("r0") and reader_of("r1", 0) == "P:r1#0"


# --- the lower ones -----------------------------------------------------------------------------------


def handle(block_size: int = 16, tokens: int = 64, expires_at: float = 100.0) -> RetainedHandle:
    return RetainedHandle(D, "L1", tokens, block_size, ("h1", "h2"), expires_at)


@pytest.mark.parametrize("bad", [handle(block_size=0), handle(tokens=-1),
                                 handle(expires_at=math.nan)])
def test_an_impossible_handle_is_never_read_nor_stored(bad: RetainedHandle) -> None:
    d = decide_reuse(now=0.0, instance=P, request="r", handle=bad, prompt_hashes=("h1", "h2"),
                     prompt_tokens=64, local_hit_tokens=0)
    assert isinstance(d, ReuseDecided) and d.outcome == "invalid"
    with pytest.raises(PeerError):
        ss.SessionTable("R").handle(ss.Store("t", "c", bad), 0.0)


def test_a_redelivered_store_cannot_make_a_handle_usable_twice() -> None:
    t = ss.SessionTable("R")
    store = ss.Store("t", "c", handle())
    t.handle(store, 0.0)
    (taken,) = t.handle(ss.Take("t", "c"), 1.0)
    assert isinstance(taken, SessionTaken)
    assert t.handle(store, 2.0) == []  # the copy arrives late
    assert t.handle_of("t", "c") is None
    # replay flags a log in which it happened anyway
    stored = SessionStored(at=0.0, instance="R", tenant="t", conversation="c", decode=D,
                           lease="L1", num_tokens=64, block_hashes=(), expires_at=100.0)
    take = SessionTaken(at=1.0, instance="R", tenant="t", conversation="c", lease="L1")
    assert "session-reuse" in rules([stored, take, stored, take])


def test_renew_names_its_lease() -> None:
    t = ss.SessionTable("R")
    t.handle(ss.Store("t", "c", handle()), 0.0)
    assert t.handle(ss.Renew("t", "c", 500.0, "L-replaced"), 1.0) == []
    h = t.handle_of("t", "c")
    assert h is not None and h.expires_at == 100.0


def test_an_abort_reaches_an_older_attempt_that_still_holds_blocks() -> None:
    core = pf.PrefillCore(P, layout())
    core.handle(pf.Allocate("r1", 0, (1, 2)), 0.0)
    core.handle(pf.Register("r1", 1, D, (7, 8), layout(), deadline=50.0), 1.0)  # attempt 1 known
    evs = core.handle(pf.Abort("r1", 0), 2.0)
    assert [type(e) for e in evs] == [RequestAborted, BlocksFreed]
    assert core.ledger.owner == {}


def test_nothing_is_accepted_for_an_attempt_aborted_during_a_reuse_read() -> None:
    pair = Pair()
    retained(pair)
    assert pair.reuse("r1", "t1", "c1", list(range(80)), threshold=16) == "read"
    pair.p(pf.Abort("r1", 0))
    (drop,) = pair.p(pf.Register("r1", 0, D, (30, 31), pair.d_layout))
    assert isinstance(drop, RegistrationDropped) and drop.reason == "request aborted"
    with pytest.raises(ProtocolError):
        pair.p(pf.Allocate("r1", 0, (40,)))
    pair.settle()
    assert pair.prefill.phase("r1", 0) == "ended" and pair.hazards == []


def test_time_never_goes_backwards_inside_a_machine() -> None:
    core = dc.DecodeCore(D, layout())
    core.handle(dc.ExpectKV("r1", 0, P, (1, 2), 32, layout(), timeout=5.0), 10.0)
    # the wall clock steps back 8 s: the deadline (15) must not re-open
    (failed, *_) = core.handle(dc.Tick(), 16.0) or [None]
    assert isinstance(failed, KVLoadFailed)
    evs = core.handle(dc.Allocate("r1", 0, (3,)), 8.0)
    assert evs[0].at == 16.0
    for bad in (math.nan, math.inf):
        with pytest.raises(ProtocolError):
            core.handle(dc.Tick(), bad)


@pytest.mark.parametrize("ttl", [math.nan, math.inf, -1.0, 0.0])
def test_a_lease_ttl_must_be_a_finite_positive_time(ttl: float) -> None:
    with pytest.raises(ProtocolError):
        ls.LeaseTable("D").decide(ls.Grant("L", "r", (1,), 16, ttl), 0.0)


def test_negative_token_counts_are_refused() -> None:
    with pytest.raises(ProtocolError):
        pf.PrefillCore(P, layout()).handle(pf.FinishPrefill("r", 0, -5), 0.0)
    with pytest.raises(ProtocolError):
        dc.DecodeCore(D, layout()).handle(dc.ExpectKV("r", 0, P, (1,), -5, layout()), 0.0)
    with pytest.raises(PeerError):
        plan_transfer(layout(), layout(), (1,), (2,), -1)


def test_memory_stays_flat_over_many_requests() -> None:
    """Ended-request state is forgotten once no event can refer to it."""
    pair = Pair(forget_after=50.0)
    for i in range(1500):
        pair.push_request(f"r{i}", 32)
        pair.advance(1.0)
    p, d = pair.prefill, pair.decode
    bound = 2 * 50 + 2  # pruned every `forget_after`: at most two windows' worth remain
    assert len(p.ended) <= bound and len(d.ended) <= bound
    assert len(p.latest) <= bound and len(p.reissued) <= bound
    assert len(d.leases.ended) <= bound and len(p.leases.ended) <= bound
    pair.assert_replay_equals_live()  # pruning happens in apply: a refold prunes alike
