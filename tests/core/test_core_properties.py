"""Hypothesis over every input, in every order, against the invariants replay checks.

Each example builds a prefill-decode pair (with the router's table) and takes random steps, each
drawn from the steps enabled at that moment: new requests (push, pull, a later turn that reuses
retained KV), allocation, prefill finishing, decode registering, aborts (delivered to each side
separately, so before, between and after anything), preemption, re-issue of the same id as a new
attempt, message delivery in any order, duplicates of already delivered messages, streams of a
transfer landing, transfers completing or failing, time passing (with KV-wait time-outs, hold
time-outs, lease expiry), ticks, heartbeats, lease releases, reuse reads, failure reports that
reach decode while its own pull READ is in flight (`late-fail`), and commands decided on a
stale timestamp (`jump`: a clock stepped back).

After the steps, everything is driven to rest (finish or abort every request, advance past every
TTL and time-out) and then:
- `replay(log, final=True)` reports no violation: no leak, no double free, no transfer into
  blocks not reserved for that attempt, no read of a dead lease, every transfer ended once;
- the harness saw no data land in (or leave) blocks no longer reserved: the physical check;
- every machine rebuilt by folding the log with `apply` equals the live one;
- every event round-trips through the schema.

A second property is liveness: with no failure, abort, preemption or time passing, any order of
messages (duplicates and re-issues included) still brings every request's current attempt its
KV. Both run a fixed, derandomized set in CI; `KVPLANE_CORE_EXAMPLES=N` searches at random.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st
from kvplane_core_harness import D, Msg, P, Pair, PoolExhausted, PullMeta, layout, lease_of

from kvplane.core import decode as dc
from kvplane.core import lease as ls
from kvplane.core import prefill as pf
from kvplane.core import sessions as ss
from kvplane.core.errors import ProtocolError
from kvplane.core.events import Event, KVLoadFailed, KVReceived, encode, validate
from kvplane.core.machine import Machine
from kvplane.core.replay import replay

LAYOUTS = [
    (layout(bs=16, tp=2), layout(bs=16, tp=2)),
    (layout(bs=16, tp=4), layout(bs=32, tp=2)),
    (layout(bs=32, tp=1, heads=2), layout(bs=16, tp=4, heads=2)),
]
PROMPTS = [40, 72, 100]
TOKENS = [(i * 37 + 11) % 1009 for i in range(200)]  # one conversation's token stream
# CI runs a fixed, derandomized set; KVPLANE_CORE_EXAMPLES=20000 searches deeper, at random
DEEP = int(os.environ.get("KVPLANE_CORE_EXAMPLES", "0"))
MAX_REQUESTS = 5
MAX_ATTEMPT = 2
REDELIVERABLE = (pf.Register, dc.Notify, dc.KVFailed, pf.PullReadDone, PullMeta, ss.Store,
                 ls.Release, pf.Abort, dc.Abort)


@dataclass
class Req:
    id: str
    kind: str  # push, pull or reuse (a later turn: reads retained KV first, then pushes)
    tokens: int
    attempt: int = 0
    expected: set[int] = field(default_factory=set)  # attempts decode registered for
    aborted: bool = False


Step = tuple[str, Callable[[], object]]

# how often each kind of step is picked, when any of its kind is possible: progress is likelier
# than disruption, so runs get far enough into each flow for disruption to land somewhere
WEIGHTS = {
    "deliver": 16, "land": 10, "complete": 8, "allocate": 8, "finish": 10, "expect": 8,
    "reuse": 8, "new": 4, "advance": 3, "tick": 3, "abort": 2, "preempt": 2, "reissue": 2,
    "duplicate": 4, "fail": 2, "heartbeat": 1, "release": 1, "grow": 1, "expire": 1,
    "renew": 1, "late-fail": 2, "jump": 2, "time": 2,
}


class World:
    def __init__(self, pair: Pair, weights: dict[str, int] = WEIGHTS,
                 max_requests: int = MAX_REQUESTS) -> None:
        self.pair = pair
        self.weights = weights
        self.max_requests = max_requests
        self.reqs: list[Req] = []
        self.outcomes: list[str] = []  # of reuse attempts

    # which steps are possible now -------------------------------------------------------------
    def kinds(self) -> list[list[Step]]:
        """The possible steps grouped by kind, each kind repeated by its weight."""
        by: dict[str, list[Step]] = {}
        for name, step in self.steps():
            by.setdefault(name.split(" ")[0], []).append((name, step))
        return [by[k] for k in sorted(by) for _ in range(self.weights[k])]

    def steps(self) -> list[Step]:
        pr, out = self.pair, []
        out += [(f"advance {dt}", lambda dt=dt: pr.advance(dt)) for dt in (0.3, 1.0, 2.5, 6.0)]
        out += [("tick P", lambda: pr.p(pf.Tick())), ("tick D", lambda: pr.d(dc.Tick())),
                ("expire R", lambda: pr.r(ss.Expire()))]
        out += [(f"jump {dt}", lambda dt=dt: setattr(pr, "jump", dt)) for dt in (0.5, 2.0)]
        # an engine loop's pace: a little time passes and both sides tick their time-outs
        out.append(("time 0.3", lambda: (pr.advance(0.3), pr.p(pf.Tick()), pr.d(dc.Tick()))))
        if len(self.reqs) < self.max_requests:
            for kind in ("push", "pull", "reuse"):
                for n in PROMPTS:
                    out.append((f"new {kind} {n}", lambda k=kind, n=n: self.new(k, n)))
        for r in self.reqs:
            out += self.request_steps(r)
        for i, m in enumerate(pr.inbox):
            out.append((f"deliver {m}", lambda i=i: pr.deliver(i)))
        waiting = {id(m) for m in pr.inbox}
        for i, m in enumerate(pr.sent):
            if isinstance(m.cmd, REDELIVERABLE) and id(m) not in waiting:
                out.append((f"duplicate {m}", lambda i=i: pr.redeliver(i)))
        for key, f in sorted(pr.flights.items()):
            for i in range(len(f.streams)):
                if i not in f.landed:
                    out.append((f"land {key} stream {i}", lambda k=key, i=i: pr.land(k, i)))
            if f.mode != "push" or len(f.landed) == len(f.streams):
                out.append((f"complete {key}", lambda k=key: pr.complete(k)))
            out.append((f"fail {key}", lambda k=key: pr.complete(k, ok=False, reason="lost")))
        for side, table in ((D, pr.decode.leases), (P, pr.prefill.leases)):
            for lid, lease in sorted(table.leases.items()):
                out.append((f"heartbeat {side} {lid}",
                            lambda s=side, lid=lid: pr.run(s, ls.Heartbeat(lid, 4.0))))
                if side == D:
                    out.append((f"release {lid}",
                                lambda lid=lid: pr.d(ls.Release(lid, "router let go"))))
                    out.append((f"renew R {lid}", lambda e=lease.expires_at, lid=lid: pr.r(
                        ss.Renew("t1", "c1", e, lid))))
        return out

    def request_steps(self, r: Req) -> list[Step]:
        pr, a, out = self.pair, r.attempt, []
        if r.aborted:
            return out
        pphase, dphase = pr.prefill.phase(r.id, a), pr.decode.phase(r.id, a)
        entry = pr.prefill.entries.get((r.id, a))
        known = a == 0 or pr.prefill.reissued.get(r.id) == a  # prefill's engine has attempt a
        if known and pphase == "absent" and r.kind == "reuse":
            out.append((f"reuse {r.id}#{a}", lambda: self.reuse(r)))
        elif known and pphase in ("absent", "waiting") and (entry is None or not entry.blocks):
            out.append((f"allocate P {r.id}#{a}", lambda: pr.p(pf.Allocate(
                r.id, a, pr.take_blocks(P, pr.p_layout.blocks_for(r.tokens))))))
        if pphase == "waiting" and entry is not None and entry.blocks and not entry.reading:
            mode = "pull" if r.kind == "pull" else "push"
            out.append((f"finish P {r.id}#{a}", lambda: pr.p(pf.FinishPrefill(
                r.id, a, r.tokens, mode=mode, hold_ttl=pr.hold_ttl))))  # type: ignore[arg-type]
            out.append((f"preempt {r.id}#{a}", lambda: pr.p(pf.Preempt(r.id, a))))
            out.append((f"release P {r.id}#{a}", lambda: pr.p(pf.Release_(r.id, a, "failed"))))
        if r.kind != "pull" and dphase == "absent" and a not in r.expected:
            out.append((f"expect D {r.id}#{a}", lambda: self.expect(r)))
        if r.kind == "pull" and dphase in ("awaiting_kv", "aborting"):
            # prefill's failure report reaches decode while decode's own READ is in flight
            out.append((f"late-fail D {r.id}#{a}", lambda: pr.post(D, dc.KVFailed(
                r.id, a, "prefill gave up"))))
        if dphase in ("awaiting_kv", "decoding"):
            out.append((f"grow D {r.id}#{a}", lambda: pr.d(dc.Allocate(
                r.id, a, pr.take_blocks(D, 1)))))
        if dphase == "decoding":
            out.append((f"finish D {r.id}#{a}", lambda: pr.d(dc.Finish(r.id, a))))
            out.append((f"finish D retaining {r.id}#{a}", lambda: pr.d(dc.Finish(
                r.id, a, pr.retain(r.id, "t1", "c1", TOKENS[: r.tokens], attempt=a, ttl=8.0,
                                   renewable=True)))))
        out.append((f"abort {r.id}#{a}", lambda: self.abort(r)))
        out.append((f"abort P now {r.id}#{a}", lambda: pr.p(pf.Abort(r.id, a))))
        out.append((f"abort D now {r.id}#{a}", lambda: pr.d(dc.Abort(r.id, a))))
        if a < MAX_ATTEMPT:
            out.append((f"reissue {r.id}#{a + 1}", lambda: self.reissue(r)))
        return out

    # composite steps ----------------------------------------------------------------------------
    def new(self, kind: str, n: int) -> None:
        self.reqs.append(Req(f"r{len(self.reqs)}", kind, n))

    def expect(self, r: Req) -> None:
        r.expected.add(r.attempt)
        self.pair.expect_push(r.id, r.tokens, r.attempt)

    def reuse(self, r: Req) -> None:
        outcome = self.pair.reuse(r.id, "t1", "c1", TOKENS[: r.tokens], attempt=r.attempt)
        self.outcomes.append(outcome)

    def abort(self, r: Req) -> None:
        """The router aborts: a message to each side, delivered whenever."""
        r.aborted = True
        self.pair.post(P, pf.Abort(r.id, r.attempt))
        self.pair.post(D, dc.Abort(r.id, r.attempt))

    def reissue(self, r: Req) -> None:
        """The same id comes back: decode drops the old attempt, prefill hears of the new one."""
        self.pair.post(D, dc.Abort(r.id, r.attempt))
        r.attempt += 1
        self.pair.post(P, pf.Reissue(r.id, r.attempt))


def check(pair: Pair, final: bool) -> None:
    report = replay(pair.log, final=final)
    assert report.ok, "\n".join(map(str, report.violations))
    assert pair.hazards == [], pair.hazards
    pair.assert_replay_equals_live()
    pair.assert_one_kv_outcome()


@settings(
    max_examples=DEEP or 150,
    deadline=None,
    derandomize=not DEEP,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data(), layouts=st.sampled_from(LAYOUTS), seed=st.integers(0, 3))
def test_random_interleavings_keep_every_invariant(
    data: st.DataObject, layouts: tuple[object, object], seed: int
) -> None:
    walk(data, layouts, seed)


def walk(data: st.DataObject, layouts: tuple[object, object], seed: int) -> None:
    """One random walk, driven to rest, with every check."""
    # time-outs short against the steps of time, so waits often run out mid-flow
    pair = Pair(*layouts, pool=128, seed=seed, kv_timeout=4.0, hold_timeout=4.0,  # type: ignore[arg-type]
                hold_ttl=3.0)
    world = World(pair)
    if data.draw(st.booleans(), label="a turn retained before"):
        # a finished first turn whose KV decode retains: later turns can read it back
        pair.push_request("r-first", 100, retain=pair.retain(
            "r-first", "t1", "c1", TOKENS[:100], ttl=20.0, renewable=True))
    n = data.draw(st.integers(10, 100), label="steps")
    for _ in range(n):
        kinds = world.kinds()
        x = data.draw(st.integers(0, 2**20), label="step")  # one draw: the kind, then which
        steps = kinds[x % len(kinds)]
        name, step = steps[(x // len(kinds)) % len(steps)]
        note(f"t={pair.now:.2f} {name}")
        try:
            step()
        except PoolExhausted:
            note("    (pool exhausted: skipped)")
    check(pair, final=False)
    pair.quiesce()
    check(pair, final=True)
    assert pair.idle(), pair.describe()
    for e in pair.log:
        validate(e)
        encode(e)


# Disruptions while transfers are in flight. The open walk above reaches a transfer in flight,
# then has to stumble on a re-issue, a duplicate, a failure report or a clock jump before time
# lands it; these walks start from transfers already in flight (a push matched early or just
# before decode's deadline, a pull READ, a reuse READ) and draw only among what can disturb
# them, so the orders that broke the core before are found in tens of walks.
DISRUPT = ("reissue", "duplicate Msg(to='P', cmd=Register", "duplicate Msg(to='D', cmd=KVFailed",
           "deliver", "abort", "time", "finish D", "land", "complete", "fail", "late-fail",
           "jump", "expect", "finish P", "allocate", "release", "heartbeat")
# how often each kind comes up: what disturbs a transfer more often than what ends it
DISRUPT_WEIGHTS = {
    "reissue": 3, "duplicate": 4, "deliver": 5, "abort": 1, "time": 4, "finish": 3, "land": 1,
    "complete": 1, "fail": 1, "late-fail": 3, "jump": 2, "expect": 1, "allocate": 1,
    "release": 1, "heartbeat": 1,
}


def in_flight(world: World, rng: random.Random) -> None:
    """Bring one push, one pull and (when a turn is retained) one reuse to a transfer in flight."""
    pr = world.pair
    world.new("push", 72)
    push = world.reqs[-1]
    pr.p(pf.Allocate(push.id, 0, pr.take_blocks(P, pr.p_layout.blocks_for(push.tokens))))
    world.expect(push)
    pr.deliver_all()  # the registration waits at prefill
    pr.advance(rng.choice([0.0, 1.5, 3.2, 3.6]))  # matched early, or just before the deadline
    pr.p(pf.FinishPrefill(push.id, 0, push.tokens))  # matched: the WRITE is in flight
    world.new("pull", 40)
    pull = world.reqs[-1]
    pr.p(pf.Allocate(pull.id, 0, pr.take_blocks(P, pr.p_layout.blocks_for(pull.tokens))))
    pr.p(pf.FinishPrefill(pull.id, 0, pull.tokens, mode="pull", hold_ttl=pr.hold_ttl))
    pr.deliver_all()  # relayed: decode's READ is in flight
    if pr.router.handles:
        world.new("reuse", 100)
        world.reuse(world.reqs[-1])


@settings(max_examples=DEEP or 300, deadline=None, derandomize=not DEEP,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(rng=st.randoms(use_true_random=False))
def test_disruptions_of_transfers_in_flight_keep_every_invariant(rng: random.Random) -> None:
    disrupted_walk(rng)


def disrupted_walk(rng: random.Random) -> None:
    """Every choice comes from one drawn generator, uniformly: Hypothesis' own draws lean to
    small values and first options, which keeps a walk in a few kinds of step; these walks want
    every kind, layout and delay equally often. A failure still replays from its seed."""
    p_layout, d_layout = rng.choice(LAYOUTS)
    pair = Pair(p_layout, d_layout, pool=128, seed=rng.randint(0, 3), kv_timeout=4.0,
                hold_timeout=4.0, hold_ttl=3.0)
    world = World(pair, max_requests=3)
    if rng.random() < 0.5:  # a turn retained before: a reuse READ joins the flights
        pair.push_request("r-first", 100, retain=pair.retain(
            "r-first", "t1", "c1", TOKENS[:100], ttl=20.0, renewable=True))
    in_flight(world, rng)
    for _ in range(rng.randint(3, 30)):
        by: dict[str, list[Step]] = {}
        for s in world.steps():
            if s[0].startswith(DISRUPT):
                by.setdefault(s[0].split(" ")[0], []).append(s)
        kinds = [by[k] for k in sorted(by) for _ in range(DISRUPT_WEIGHTS[k])]
        name, step = rng.choice(rng.choice(kinds))
        note(f"t={pair.now:.2f} {name}")
        try:
            step()
        except PoolExhausted:
            note("    (pool exhausted: skipped)")
    check(pair, final=False)
    pair.quiesce()
    check(pair, final=True)


PROGRESS = ("allocate", "finish P", "expect", "deliver", "land", "complete", "reuse")
CALM = ("new", "duplicate", "reissue", *PROGRESS)


@settings(max_examples=DEEP // 4 or 60, deadline=None, derandomize=not DEEP,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), layouts=st.sampled_from(LAYOUTS), seed=st.integers(0, 3))
def test_every_request_gets_its_kv_when_nothing_goes_wrong(
    data: st.DataObject, layouts: tuple[object, object], seed: int
) -> None:
    """Liveness: with no failure, abort, preemption or time passing, messages in any order (and
    duplicated, and re-issues racing the new attempt's registration) still bring every request's
    current attempt its KV."""
    pair = Pair(*layouts, pool=128, seed=seed)  # type: ignore[arg-type]
    world = World(pair)
    if data.draw(st.booleans(), label="a turn retained before"):
        pair.push_request("r-first", 100, retain=pair.retain(
            "r-first", "t1", "c1", TOKENS[:100], ttl=20.0, renewable=True))
    for _ in range(data.draw(st.integers(5, 60), label="steps")):
        steps = [s for s in world.steps() if s[0].startswith(CALM)]
        name, step = steps[data.draw(st.integers(0, len(steps) - 1), label="step")]
        note(name)
        step()
    for _ in range(2000):  # then only progress, in a fixed order, until nothing moves
        steps = [s for s in world.steps() if s[0].startswith(PROGRESS)]
        if not steps:
            break
        steps[0][1]()
    received = {(e.request, e.attempt) for e in pair.log if isinstance(e, KVReceived)}
    for r in world.reqs:
        assert (r.id, r.attempt) in received, f"{r.id}#{r.attempt} never got its KV"
    current = {(r.id, r.attempt) for r in world.reqs}
    failed = [e for e in pair.log if isinstance(e, KVLoadFailed)]
    # only superseded attempts may fail (prefill drops their registrations as stale)
    assert not [e for e in failed if (e.request, e.attempt) in current], failed
    pair.quiesce()
    check(pair, final=True)


def test_world_reaches_every_kind_of_step() -> None:
    """Guard against a harness that quietly stopped offering some inputs."""
    pair = Pair(pool=128)
    world = World(pair)
    seen: set[str] = set()
    rng = random.Random(7)
    for _ in range(3000):
        name, step = rng.choice(rng.choice(world.kinds()))
        seen.add(name.split(" ")[0])
        try:
            step()
        except PoolExhausted:
            pass
        if len(world.reqs) >= MAX_REQUESTS and rng.random() < 0.01:
            pair.quiesce()
            check(pair, final=True)
            pair = Pair(pool=128, seed=rng.randint(0, 9))
            world = World(pair)
    pair.quiesce()
    check(pair, final=True)
    want = {"advance", "tick", "expire", "new", "reuse", "allocate", "finish", "preempt",
            "expect", "grow", "abort", "reissue", "deliver", "duplicate", "land", "complete",
            "fail", "heartbeat", "release", "renew", "late-fail", "jump", "time"}
    assert want <= seen, want - seen


def test_lease_of_names() -> None:
    assert lease_of("r0", 1) == "D/r0#1/kv"
    assert isinstance(Msg(P, None), Msg)


# --- the walks find the bugs reviewers found by hand -----------------------------------------------
# Each entry puts one old behaviour back (as it was before the adversarial review) and the
# disrupted walks must then fail: proof that the generators reach those orders by themselves.


def _old_register(self: pf.PrefillCore, cmd: pf.Register, now: float) -> list[Event]:
    """Before: the stale-attempt check ran first, so a copy of a registration whose WRITE is in
    flight, arriving after a re-issue, was dropped for good and decode was told "no KV"."""
    if cmd.attempt < self.latest.get(cmd.request, cmd.attempt):
        return [self._dropped(now, cmd.request, cmd.attempt, "stale attempt")]
    return NEW_REGISTER(self, cmd, now)


def _old_kv_failed(self: dc.DecodeCore, cmd: dc.KVFailed, now: float) -> list[Event]:
    """Before: a failure report was taken even while decode's own pull READ was in flight."""
    key = (cmd.request, cmd.attempt)
    out: list[Event] = [KVLoadFailed(at=now, instance=self.instance, request=cmd.request,
                                     attempt=cmd.attempt, reason=cmd.reason)]
    if self.entries[key].phase == "aborting":
        out += self._free(now, key, "aborted; KV will not come")
    return out


NEW_REGISTER = pf.PrefillCore._register


def _patch_register(mp: pytest.MonkeyPatch) -> None:
    for key in [k for k in pf.TABLE if k[1] is pf.Register]:
        mp.setitem(pf.TABLE, key, _old_register)


def _patch_kv_failed(mp: pytest.MonkeyPatch) -> None:
    for phase in ("awaiting_kv", "aborting"):
        mp.setitem(dc.TABLE, (phase, dc.KVFailed), _old_kv_failed)


OLD_BUGS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "duplicate registration after a re-issue dropped as stale": _patch_register,
    "zero write margin": lambda mp: mp.setattr(
        pf.PrefillCore, "_late", lambda self, now, reg: reg.deadline is not None
        and now >= reg.deadline),
    "KVFailed taken under decode's own READ": _patch_kv_failed,
    "time going backwards inside a machine": lambda mp: mp.setattr(
        Machine, "now_of", lambda self, now: now),
}


@pytest.mark.parametrize("bug", sorted(OLD_BUGS))
def test_the_disrupted_walks_find_each_old_bug(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    OLD_BUGS[bug](monkeypatch)

    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(rng=st.randoms(use_true_random=False))
    def walks(rng: random.Random) -> None:
        disrupted_walk(rng)

    # a violation or hazard (AssertionError) or a machine refusing what followed (ProtocolError)
    with pytest.raises((AssertionError, ProtocolError)):
        walks()
