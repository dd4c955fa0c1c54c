"""Leases: fixed vs renewable, pins, refused reads, exactly one BlocksFreed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.core.errors import ProtocolError
from kvplane.core.events import (
    BlocksFreed,
    Event,
    LeaseExpired,
    LeaseGranted,
    LeasePinned,
    LeaseReleased,
    LeaseReleaseDeferred,
    LeaseRenewalRefused,
    LeaseRenewed,
    LeaseUnpinned,
    ReadRefused,
)
from kvplane.core.lease import (
    BeginRead,
    EndRead,
    Grant,
    Heartbeat,
    LeaseCommand,
    LeaseTable,
    Release,
    Tick,
)


def run(t: LeaseTable, cmd: LeaseCommand, now: float) -> list[Event]:
    out = t.decide(cmd, now)
    for e in out:
        # BlocksFreed belongs to the owner's ledger, every other event to the table
        assert t.apply(e) is not isinstance(e, BlocksFreed)
    return out


def table(
    renewable: bool = False, ttl: float = 10.0, attempt: int = 0, pin_grace: float = 5.0
) -> LeaseTable:
    t = LeaseTable("D", pin_grace=pin_grace)
    run(t, Grant("L", "r1", (4, 5), 32, ttl, renewable, ("h1", "h2"), attempt=attempt), 0.0)
    return t


def freed(evs: list[Event]) -> list[BlocksFreed]:
    return [e for e in evs if isinstance(e, BlocksFreed)]


def test_grant_records_everything() -> None:
    t = LeaseTable("D")
    (g,) = run(t, Grant("L", "r1", (4, 5), 32, 10.0, True, ("a",), "pull_hold", 2), 3.0)
    assert isinstance(g, LeaseGranted)
    assert (g.lease, g.request, g.blocks, g.expires_at, g.renewable) == ("L", "r1", (4, 5), 13, True)
    assert (g.purpose, g.attempt, g.num_tokens, g.block_hashes) == ("pull_hold", 2, 32, ("a",))
    assert t.next_expiry() == 13.0
    with pytest.raises(ProtocolError):
        t.decide(Grant("L", "r2", (6,), 16, 10.0), 4.0)


def test_fixed_lease_refuses_heartbeats_and_expires_on_time() -> None:
    t = table(renewable=False)
    (e,) = run(t, Heartbeat("L", 100.0), 5.0)
    assert isinstance(e, LeaseRenewalRefused) and e.reason == "fixed TTL"
    assert run(t, Tick(), 9.99) == []
    out = run(t, Tick(), 10.0)
    assert [type(e) for e in out] == [LeaseExpired, BlocksFreed]
    assert freed(out)[0].blocks == (4, 5) and freed(out)[0].request == "r1"
    assert t.leases == {} and t.ended == {"L": "expired"}
    assert run(t, Tick(), 50.0) == []


def test_renewable_lease_heartbeat_extends_and_never_moves_expiry_back() -> None:
    t = table(renewable=True)
    (e,) = run(t, Heartbeat("L", 20.0), 5.0)
    assert isinstance(e, LeaseRenewed) and e.expires_at == 25.0
    (e,) = run(t, Heartbeat("L", 1.0), 6.0)  # 6 + 1 < 25: keeps 25
    assert isinstance(e, LeaseRenewed) and e.expires_at == 25.0
    assert t.leases["L"].expires_at == 25.0
    assert run(t, Tick(), 24.0) == []
    assert len(freed(run(t, Tick(), 25.0))) == 1
    (e,) = run(t, Heartbeat("L", 20.0), 26.0)
    assert isinstance(e, LeaseRenewalRefused) and e.reason == "expired"


def test_heartbeat_after_expiry_time_but_before_tick_does_not_revive() -> None:
    t = table(renewable=True)
    (e,) = run(t, Heartbeat("L", 20.0), 10.0)
    assert isinstance(e, LeaseRenewalRefused) and e.reason == "expired"
    assert len(freed(run(t, Tick(), 10.0))) == 1


@settings(max_examples=50, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.floats(0, 5), st.floats(0, 30)), max_size=12))
def test_expiry_is_monotone_under_any_heartbeats(beats: list[tuple[float, float]]) -> None:
    t = table(renewable=True)
    now, last = 0.0, 10.0
    for dt, ext in beats:
        now += dt
        run(t, Heartbeat("L", ext), now)
        if "L" not in t.leases:
            break
        assert t.leases["L"].expires_at >= last
        last = t.leases["L"].expires_at
        run(t, Tick(), now)


def test_pin_blocks_expiry_until_the_last_reader_unpins() -> None:
    t = table(ttl=10.0, pin_grace=100.0)
    (p,) = run(t, BeginRead("L", "P1", duration=2.0, margin=0.5), 1.0)
    assert isinstance(p, LeasePinned) and p.until == 3.5
    (p2,) = run(t, BeginRead("L", "P2", duration=1.0, margin=0.5), 2.0)
    assert isinstance(p2, LeasePinned)
    assert t.leases["L"].phase == "pinned"
    assert run(t, Tick(), 50.0) == []  # past expiry, but pinned
    out = run(t, EndRead("L", "P1"), 51.0)
    assert [type(e) for e in out] == [LeaseUnpinned]
    out = run(t, EndRead("L", "P2"), 52.0)
    assert [type(e) for e in out] == [LeaseUnpinned, LeaseExpired, BlocksFreed]
    assert run(t, Tick(), 60.0) == []


def test_release_waits_for_readers_and_frees_once() -> None:
    t = table(ttl=10.0)
    run(t, BeginRead("L", "P1", duration=1.0), 1.0)
    out = run(t, Release("L", "router dropped it"), 2.0)
    assert [type(e) for e in out] == [LeaseReleaseDeferred]
    assert run(t, Release("L", "again"), 2.5) == []  # already deferred
    (r,) = run(t, BeginRead("L", "P2", duration=1.0), 3.0)
    assert isinstance(r, ReadRefused) and r.reason == "released"
    out = run(t, EndRead("L", "P1"), 4.0)
    assert [type(e) for e in out] == [LeaseUnpinned, LeaseReleased, BlocksFreed]
    assert isinstance(out[1], LeaseReleased) and out[1].reason == "router dropped it"
    assert t.ended["L"] == "released"
    assert run(t, Release("L", "late"), 5.0) == []  # idempotent
    assert run(t, Tick(), 99.0) == []


def test_read_refused_when_it_would_end_after_expiry_with_margin() -> None:
    t = table(ttl=10.0)
    (r,) = run(t, BeginRead("L", "P", duration=5.0, margin=0.5), 4.6)  # ends 10.1 > 10
    assert isinstance(r, ReadRefused) and r.reason == "would expire before the read ends"
    t = table(ttl=10.0)  # a fresh table: time never goes backwards inside one
    (p,) = run(t, BeginRead("L", "P", duration=5.0, margin=0.5), 4.5)  # ends exactly at 10
    assert isinstance(p, LeasePinned)
    t2 = table(ttl=10.0)
    (r,) = run(t2, BeginRead("L", "P", duration=0.0), 10.0)
    assert isinstance(r, ReadRefused) and r.reason == "expired"
    run(t2, Tick(), 10.0)
    (r,) = run(t2, BeginRead("L", "P", duration=0.0), 10.0)
    assert isinstance(r, ReadRefused) and r.reason == "expired"
    (r,) = run(t2, BeginRead("nope", "P", duration=0.0), 10.0)
    assert isinstance(r, ReadRefused) and r.reason == "unknown"


def test_reader_protocol_misuse_is_a_protocol_error() -> None:
    t = table()
    run(t, BeginRead("L", "P", duration=1.0), 0.0)
    with pytest.raises(ProtocolError):
        t.decide(BeginRead("L", "P", duration=1.0), 0.5)
    # the end of a read that holds no pin (its pin timed out, or a copy of the message) and of
    # a read from a lease that is gone change nothing: late messages are normal
    assert t.decide(EndRead("L", "Q"), 0.5) == []
    assert t.decide(EndRead("gone", "P"), 0.5) == []
    with pytest.raises(ProtocolError):  # a NaN or negative duration is our own side's bug
        t.decide(BeginRead("L", "Q", duration=float("nan")), 0.5)
    with pytest.raises(ProtocolError):
        t.decide(BeginRead("L", "Q", duration=-1.0), 0.5)


def test_freed_events_carry_the_attempt_of_the_lease() -> None:
    t = table(ttl=1.0, attempt=3)
    assert t.leases["L"].attempt == 3
    (f,) = freed(run(t, Tick(), 2.0))
    assert f.attempt == 3


def test_renewed_expiry_delays_release_of_unpinned_lease_only_by_tick() -> None:
    t = table(renewable=True, ttl=5.0)
    run(t, BeginRead("L", "P", duration=4.0, margin=0.5), 0.0)
    run(t, Heartbeat("L", 3.0), 4.0)  # pinned and not yet expired: renew to 7
    assert t.leases["L"].expires_at == 7.0
    out = run(t, EndRead("L", "P"), 6.0)
    assert [type(e) for e in out] == [LeaseUnpinned]
    assert len(freed(run(t, Tick(), 7.0))) == 1


Op = st.one_of(
    st.tuples(st.just("hb"), st.floats(0, 10)),
    st.tuples(st.just("read"), st.sampled_from(["A", "B"]), st.floats(0, 5)),
    st.tuples(st.just("end"), st.sampled_from(["A", "B"])),
    st.tuples(st.just("release")),
    st.tuples(st.just("tick")),
    st.tuples(st.just("wait"), st.floats(0, 4)),
)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(renewable=st.booleans(), ops=st.lists(Op, max_size=25))
def test_blocks_freed_exactly_once_and_never_under_a_pin(
    renewable: bool, ops: list[tuple[object, ...]]
) -> None:
    t = table(renewable=renewable, ttl=6.0)
    now = 0.0
    frees = 0
    for op in ops:
        out: list[Event] = []
        if op[0] == "hb":
            out = run(t, Heartbeat("L", float(op[1])), now)  # type: ignore[arg-type]
        elif op[0] == "read":
            ls = t.leases.get("L")
            if ls is not None and op[1] in ls.pins:
                continue
            out = run(t, BeginRead("L", str(op[1]), float(op[2])), now)  # type: ignore[arg-type]
            for e in out:
                if isinstance(e, LeasePinned):
                    assert e.until <= t.leases["L"].expires_at
        elif op[0] == "end":
            ls = t.leases.get("L")
            if ls is None or op[1] not in ls.pins:
                continue
            out = run(t, EndRead("L", str(op[1])), now)
        elif op[0] == "release":
            out = run(t, Release("L", "done"), now)
        elif op[0] == "tick":
            out = run(t, Tick(), now)
        else:
            now += float(op[1])  # type: ignore[arg-type]
        frees += len(freed(out))
        if freed(out):
            assert "L" not in t.leases
    # drain: end every read, release, tick far ahead
    ls = t.leases.get("L")
    for reader in list(ls.pins) if ls else []:
        frees += len(freed(run(t, EndRead("L", reader), now)))
    frees += len(freed(run(t, Release("L", "drain"), now)))
    frees += len(freed(run(t, Tick(), now + 1000)))
    assert frees == 1
    assert t.leases == {}
