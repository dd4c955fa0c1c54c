"""Router session table and routing policies."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.core.events import (
    Event,
    SessionDropped,
    SessionMissed,
    SessionRenewed,
    SessionStored,
    SessionTaken,
)
from kvplane.core.reuse import RetainedHandle
from kvplane.core.routing import Load, Policy, choose, choose_ranked, choose_scanning
from kvplane.core.sessions import Drop, Expire, Renew, SessionTable, Store, Take


def handle(lease: str, expires_at: float = 100.0, bs: int = 16) -> RetainedHandle:
    return RetainedHandle("D1", lease, 64, bs, ("a", "b", "c", "d"), expires_at)


def test_store_then_take_is_single_use() -> None:
    t = SessionTable("R")
    (s,) = t.handle(Store("t1", "c1", handle("L1"), request="r1"), 0.0)
    assert isinstance(s, SessionStored) and s.request == "r1"
    assert t.handle_of("t1", "c1") == handle("L1")
    (k,) = t.handle(Take("t1", "c1", request="r2"), 1.0)
    assert isinstance(k, SessionTaken) and k.lease == "L1"
    assert t.handle_of("t1", "c1") is None
    (m,) = t.handle(Take("t1", "c1", request="r3"), 1.0)
    assert isinstance(m, SessionMissed) and m.reason == "no handle"


def test_handle_keeps_its_own_block_size() -> None:
    t = SessionTable("R", block_size=16)
    t.handle(Store("t1", "c1", handle("L1", bs=32)), 0.0)
    h = t.handle_of("t1", "c1")
    assert h is not None and h.block_size == 32


def test_tenant_scoping() -> None:
    t = SessionTable("R")
    t.handle(Store("t1", "c1", handle("L1")), 0.0)
    (m,) = t.handle(Take("t2", "c1"), 1.0)
    assert isinstance(m, SessionMissed)
    assert t.handle_of("t1", "c1") is not None
    assert t.handle(Drop("t2", "c1", "x"), 1.0) == []
    assert t.handle(Renew("t2", "c1", 500.0, "L1"), 1.0) == []
    assert t.handle_of("t1", "c1") == handle("L1")


def test_replace_drops_the_old_handle() -> None:
    t = SessionTable("R")
    t.handle(Store("t1", "c1", handle("L1")), 0.0)
    out = t.handle(Store("t1", "c1", handle("L2")), 1.0)
    assert [type(e) for e in out] == [SessionDropped, SessionStored]
    assert isinstance(out[0], SessionDropped) and out[0].lease == "L1"
    assert out[0].reason == "replaced"
    assert t.handle_of("t1", "c1") == handle("L2")
    # storing the same lease again is not a replacement
    assert [type(e) for e in t.handle(Store("t1", "c1", handle("L2")), 2.0)] == [SessionStored]


def test_expiry_on_take_and_on_expire() -> None:
    t = SessionTable("R")
    t.handle(Store("t1", "c1", handle("L1", expires_at=10.0)), 0.0)
    t.handle(Store("t1", "c2", handle("L2", expires_at=20.0)), 0.0)
    out = t.handle(Take("t1", "c1"), 10.0)
    assert [type(e) for e in out] == [SessionDropped, SessionMissed]
    assert t.handle_of("t1", "c1") is None
    assert t.handle(Expire(), 19.0) == []
    (d,) = t.handle(Expire(), 20.0)
    assert isinstance(d, SessionDropped) and d.lease == "L2" and d.reason == "lease expired"
    assert t.handles == {}


def test_renew_moves_expiry_later_only() -> None:
    t = SessionTable("R")
    t.handle(Store("t1", "c1", handle("L1", expires_at=10.0)), 0.0)
    assert t.handle(Renew("t1", "c1", 5.0, "L1"), 1.0) == []
    (r,) = t.handle(Renew("t1", "c1", 30.0, "L1"), 1.0)
    assert isinstance(r, SessionRenewed) and r.expires_at == 30.0
    h = t.handle_of("t1", "c1")
    assert h is not None and h.expires_at == 30.0
    assert t.handle(Expire(), 20.0) == []
    (k,) = t.handle(Take("t1", "c1"), 25.0)
    assert isinstance(k, SessionTaken)


def test_drop() -> None:
    t = SessionTable("R")
    t.handle(Store("t1", "c1", handle("L1")), 0.0)
    (d,) = t.handle(Drop("t1", "c1", "decode restarted"), 1.0)
    assert isinstance(d, SessionDropped) and d.reason == "decode restarted"
    assert t.handle(Drop("t1", "c1", "again"), 1.0) == []


def test_stale_drop_or_take_event_does_not_remove_a_newer_handle() -> None:
    t = SessionTable("R")
    t.handle(Store("t1", "c1", handle("L2")), 0.0)
    t.apply(SessionTaken(at=1.0, instance="R", tenant="t1", conversation="c1", lease="L1"))
    t.apply(SessionDropped(at=1.0, instance="R", tenant="t1", conversation="c1", lease="L1",
                           reason="x"))
    t.apply(SessionRenewed(at=1.0, instance="R", tenant="t1", conversation="c1", lease="L1",
                           expires_at=999.0))
    assert t.handle_of("t1", "c1") == handle("L2")


Cmd = st.one_of(
    st.builds(Store, st.sampled_from(["t1", "t2"]), st.sampled_from(["c1", "c2"]),
              st.builds(handle, st.sampled_from(["L1", "L2", "L3"]), st.floats(0, 50),
                        st.sampled_from([16, 32]))),
    st.builds(Take, st.sampled_from(["t1", "t2"]), st.sampled_from(["c1", "c2"])),
    st.builds(Renew, st.sampled_from(["t1", "t2"]), st.sampled_from(["c1", "c2"]),
              st.floats(0, 80)),
    st.builds(Drop, st.sampled_from(["t1", "t2"]), st.sampled_from(["c1", "c2"]), st.just("x")),
    st.builds(Expire),
)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.lists(st.tuples(Cmd, st.floats(0, 5)), max_size=30))
def test_rebuild_from_events_equals_live_table(cmds: list[tuple[object, float]]) -> None:
    live = SessionTable("R")
    log: list[Event] = []
    now = 0.0
    taken: dict[str, int] = {}
    for cmd, dt in cmds:
        now += dt
        out = live.handle(cmd, now)  # type: ignore[arg-type]
        log += out
        for e in out:
            if isinstance(e, SessionTaken):
                taken[e.lease] = taken.get(e.lease, 0) + 1
    rebuilt = SessionTable("R")
    for e in log:
        rebuilt.apply(e)
    assert rebuilt.handles == live.handles
    for h in live.handles.values():
        assert h.block_size in (16, 32)


# --- routing ---------------------------------------------------------------------------------------


LOADS = [Load("d2", running=3, queued=1, free_blocks=10), Load("d1", running=1, free_blocks=5),
         Load("d3", running=1, free_blocks=50)]


def test_round_robin_is_by_name() -> None:
    picks = [choose(Policy("round_robin"), LOADS, i) for i in range(4)]
    assert picks == ["d1", "d2", "d3", "d1"]


def test_least_loaded_breaks_ties_by_free_blocks_then_name() -> None:
    assert choose(Policy("least_loaded"), LOADS, 0) == "d3"
    same = [Load("b", 1, 0, 5), Load("a", 1, 0, 5)]
    assert choose(Policy("least_loaded"), same, 0) == "a"


def test_least_loaded_takes_turns_among_ties() -> None:
    """Equally least loaded instances take turns with the count of choices: a fleet of idle
    instances is used evenly, not the first name again and again."""
    idle = [Load(f"p{k:02d}") for k in range(8)]
    picks = [choose(Policy("least_loaded"), idle, i) for i in range(16)]
    assert picks == [f"p{k % 8:02d}" for k in range(16)]
    # the turn passes over a busier instance to the next tied one, wrapping round the names
    some = [Load("a", 1), Load("b"), Load("c", 2), Load("d")]
    assert [choose(Policy("least_loaded"), some, i) for i in range(4)] == ["b", "b", "d", "d"]
    # kv_affinity without a usable affinity falls back alike
    assert choose(Policy("kv_affinity"), idle, 3, affinity="gone") == "p03"
    # a decode's free blocks still rank before the turn
    assert choose(Policy("least_loaded"), [Load("x", 0, 0, 5), Load("y", 0, 0, 9)], 0) == "y"


def test_least_loaded_spreads_a_stream_of_short_requests() -> None:
    """A driver that sees a request in flight for a short while after each choice (a
    prefill's compute) spreads a steady stream over every instance, not over the first
    names: the most used gets at most twice the share of the least used."""
    names = [f"prefill-{k}" for k in range(32)]
    busy_until = dict.fromkeys(names, -1)
    used = dict.fromkeys(names, 0)
    for i in range(6400):  # one request per tick, each busy for 17 ticks
        loads = [Load(n, running=int(busy_until[n] > i)) for n in names]
        n = choose(Policy("least_loaded"), loads, i)
        busy_until[n] = i + 17
        used[n] += 1
    assert max(used.values()) <= 2 * min(used.values()), used


def test_kv_affinity_with_slack() -> None:
    p = Policy("kv_affinity", affinity_slack=3)
    assert choose(p, LOADS, 0, affinity="d2") == "d2"  # pressure 4 <= 1 + 3
    assert choose(Policy("kv_affinity", affinity_slack=2), LOADS, 0, affinity="d2") == "d3"
    assert choose(Policy("kv_affinity", affinity_slack=0), LOADS, 0, affinity="d1") == "d1"
    assert choose(p, LOADS, 0, affinity="gone") == "d3"
    assert choose(p, LOADS, 0, affinity=None) == "d3"


def test_ranked_triples_choose_as_loads_do() -> None:
    """The simulator's form (pressure, -free blocks, name) picks what `choose` picks."""
    import random

    rng = random.Random(3)
    for _ in range(300):
        loads = [Load(f"i{k}", rng.randint(0, 3), rng.randint(0, 2), rng.randint(0, 4))
                 for k in range(rng.randint(1, 6))]
        ranked = [(ld.pressure, -ld.free_blocks, ld.instance) for ld in loads]
        for policy in (Policy("least_loaded"), Policy("kv_affinity", affinity_slack=1),
                       Policy("round_robin")):
            aff = rng.choice([None, *(ld.instance for ld in loads)])
            want = min(loads, key=lambda ld: (ld.pressure, -ld.free_blocks, ld.instance))
            if policy.kind == "round_robin":
                assert choose_ranked(policy, ranked, 5) == sorted(ld.instance
                                                                  for ld in loads)[5 % len(loads)]
            elif policy.kind == "least_loaded" or aff is None:
                assert choose_ranked(policy, ranked, 0, aff) == want.instance
            else:
                mine = next(ld for ld in loads if ld.instance == aff)
                ok = mine.pressure <= want.pressure + 1
                assert choose_ranked(policy, ranked, 0, aff) == (aff if ok else want.instance)
            assert choose(policy, loads, 5 if policy.kind == "round_robin" else 0, aff) == \
                choose_ranked(policy, ranked, 5 if policy.kind == "round_robin" else 0, aff)


def test_scanning_chooses_as_the_whole_snapshot_does() -> None:
    """`choose_scanning` (instances asked in turn order, stopping at the floor) picks what
    `choose_ranked` picks over every instance's triple, with ties, all at the floor, none at
    it; and it asks fewer instances when one at the floor comes early."""
    import random

    rng = random.Random(9)
    policy = Policy("least_loaded")
    early = 0
    for _ in range(2000):
        n = rng.randint(1, 12)
        names = sorted(f"p{k}" for k in range(n))
        idle = rng.random()
        ranked = [(0 if rng.random() < idle else rng.randint(1, 3), 0, name) for name in names]
        asked: list[int] = []

        def rank_of(i: int, ranked: list[tuple[int, int, str]] = ranked,
                    asked: list[int] = asked) -> tuple[int, int, str]:
            asked.append(i)
            return ranked[i]

        counter = rng.randint(0, 50)
        got = choose_scanning(policy, names, rank_of, counter, (0, 0))
        assert got == choose_ranked(policy, ranked, counter)
        assert len(set(asked)) == len(asked)  # each asked once at most
        early += len(asked) < n
    assert early > 500
    with pytest.raises(ValueError, match="least_loaded only"):
        choose_scanning(Policy("round_robin"), ["a"], lambda i: (0, 0, "a"), 0, (0, 0))
    with pytest.raises(ValueError, match="no instance"):
        choose_scanning(policy, [], lambda i: (0, 0, "a"), 0, (0, 0))


def test_routing_errors() -> None:
    with pytest.raises(ValueError):
        choose(Policy(), [], 0)
    with pytest.raises(ValueError, match="unknown routing policy"):
        choose(Policy("random"), LOADS, 0)  # type: ignore[arg-type]


def test_choice_is_deterministic_under_input_order() -> None:
    for kind in ("round_robin", "least_loaded", "kv_affinity"):
        p = Policy(kind)  # type: ignore[arg-type]
        assert choose(p, LOADS, 5, "d1") == choose(p, list(reversed(LOADS)), 5, "d1")
