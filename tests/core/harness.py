"""A pair harness: one prefill core, one decode core and the router's session table, wired by
messages the way the drivers wire them, with every event recorded in order into one log.

What the harness plays:
- the network: messages between the sides sit in `inbox` until delivered, in any order, and
  any message once sent may be delivered again (`redeliver`) to model duplicates;
- prefill's background transfer thread and the transport: a `TransferPlanned` becomes a
  `Flight`; `land` moves one stream's data (checking that both ends are still reserved for that
  attempt, the physical safety the protocol exists for) and, for a push, sends decode that
  stream's completion notification; `complete` ends the flight (ok or failed);
- the router: it relays pull metadata, stores retained handles, takes them for the next turn;
- the engines: block allocation out of a pool (random picks, so pools fragment).

The transport's one promise (the contract the core's deadlines rest on): a push WRITE or a pull
READ moves its data within `window` seconds of its plan. `advance` enforces it by landing and
completing every such flight whose window closes before the new time. The cores are configured
to match: prefill starts no WRITE within its `write_margin` (the core's default unless given,
which `window` must not exceed) of decode's deadline, decode starts no pull READ within
`window` of prefill's hold expiry. Reuse READs may overrun their estimate: decode's lease is
pinned for them, but only until the pin's bound (`until + pin_grace`), so the reader cancels a
read still running `cancel_after` seconds past its plan (a failed read), inside that bound. A
flight marked `stuck` is never cancelled: a reader that breaks the contract.

Like the live connector, the driver tells decode "no KV" (`KVFailed`) when prefill drops a
registration for good (`RegistrationDropped.final`) or a WRITE fails.

Message flow (push): decode ExpectKV -> RegistrationSent -> prefill Register; prefill
TransferPlanned -> one Notify per stream (`plan.fan_out(prefill.layout, decode.layout)`) ->
TransferDone back to prefill. Pull: prefill FinishPrefill(mode="pull") -> metadata relayed ->
decode ExpectKV(mode="pull") -> PullDone -> prefill PullReadDone. Bidirectional: decode
Finish(retain=...) -> router Store; next turn router Take -> prefill DecideReuse -> decode
BeginRead -> prefill StartReuseRead -> ReuseReadDone -> decode EndRead.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvplane.core import decode as dc
from kvplane.core import lease as ls
from kvplane.core import prefill as pf
from kvplane.core import sessions as ss
from kvplane.core.events import (
    Event,
    KVLoadFailed,
    KVReceived,
    LeaseGranted,
    LeasePinned,
    MetadataRelayed,
    RegistrationDropped,
    RegistrationSent,
    ReuseDecided,
    SessionDropped,
    SessionTaken,
    TransferCompleted,
    TransferFailed,
    TransferPlanned,
)
from kvplane.core.hashing import block_hashes
from kvplane.core.plan import KVLayout, Stream, fan_out
from kvplane.core.reuse import RetainedHandle

P, D, R = "P", "D", "R"


def layout(bs: int = 16, tp: int = 2, heads: int = 8, layers: int = 2, hb: int = 128) -> KVLayout:
    return KVLayout(block_size=bs, tp=tp, num_layers=layers, num_kv_heads=heads, head_bytes=hb)


@dataclass(frozen=True)
class PullMeta:
    """Prefill's metadata for a pull (block ids, hold expiry), on its way to decode."""

    request: str
    attempt: int
    src_blocks: tuple[int, ...]
    num_tokens: int
    expires_at: float


@dataclass(frozen=True)
class Msg:
    to: str  # P, D or R
    cmd: Any


@dataclass
class Flight:
    """A transfer the transport is carrying out."""

    planned: TransferPlanned
    mode: str  # push, pull or reuse
    streams: tuple[Stream, ...]
    landed: set[int] = field(default_factory=set)
    lease: str | None = None  # reuse: decode's lease being read
    reader: str | None = None

    @property
    def key(self) -> tuple[str, int, str]:
        return (self.planned.request or "", self.planned.attempt, self.planned.direction)

    @property
    def opened(self) -> float:
        return self.planned.at


class Pair:
    def __init__(
        self,
        p_layout: KVLayout | None = None,
        d_layout: KVLayout | None = None,
        *,
        kv_timeout: float = 8.0,
        hold_timeout: float = 6.0,
        hold_ttl: float = 5.0,
        window: float = 1.0,
        pool: int = 64,
        seed: int = 0,
        tenant_salt: bool = True,
        write_margin: float | None = None,
        pin_grace: float = 5.0,
        forget_after: float = 600.0,
    ) -> None:
        self.p_layout = p_layout or layout()
        self.d_layout = d_layout or layout()
        self.window = window
        self.kv_timeout = kv_timeout
        self.hold_ttl = hold_ttl
        self.pin_grace = pin_grace
        self.forget_after = forget_after
        self.cancel_after = window + pin_grace / 2  # the reader's cancel, inside the pin bound
        margin = {} if write_margin is None else {"write_margin": write_margin}
        self.prefill = pf.PrefillCore(P, self.p_layout, hold_timeout, pin_grace=pin_grace,
                                      forget_after=forget_after, **margin)
        self.decode = dc.DecodeCore(D, self.d_layout, pin_grace=pin_grace,
                                    forget_after=forget_after)
        self.stuck: set[tuple[str, int, str]] = set()  # reuse reads that are never cancelled
        self.jump = 0.0  # the next command is decided this many seconds in the past
        self.router = ss.SessionTable(R, block_size=self.d_layout.block_size)
        self.pool = {P: pool, D: pool}
        self.rng = random.Random(seed)
        self.tenant_salt = tenant_salt
        self.now = 0.0
        self.log: list[Event] = []
        self.inbox: list[Msg] = []
        self.sent: list[Msg] = []
        self.flights: dict[tuple[str, int, str], Flight] = {}
        self.hazards: list[str] = []  # physical safety broken: data moved into/out of freed blocks
        self.reused: dict[tuple[str, int], ReuseDecided] = {}
        self.conversations: dict[str, tuple[str, str]] = {}  # request -> (conversation, tenant)

    # --- driving the machines -------------------------------------------------------------------
    def machine(self, side: str) -> Any:
        return {P: self.prefill, D: self.decode, R: self.router}[side]

    def run(self, side: str, cmd: Any) -> list[Event]:
        now, self.jump = self.now - self.jump, 0.0  # a stale timestamp (a clock stepped back)
        events: list[Event] = self.machine(side).handle(cmd, now)
        self.log += events
        for e in events:
            self._react(side, e)
        return events

    def p(self, cmd: Any) -> list[Event]:
        return self.run(P, cmd)

    def d(self, cmd: Any) -> list[Event]:
        return self.run(D, cmd)

    def r(self, cmd: Any) -> list[Event]:
        return self.run(R, cmd)

    def post(self, to: str, cmd: Any) -> None:
        m = Msg(to, cmd)
        self.inbox.append(m)
        self.sent.append(m)

    def _react(self, side: str, e: Event) -> None:
        """What the drivers do with an event: send messages, start transfers."""
        req = e.request or ""
        if side == D and isinstance(e, RegistrationSent):
            self.post(P, pf.Register(req, e.attempt, D, e.dst_blocks, self.d_layout, e.deadline))
        elif isinstance(e, TransferPlanned):
            if e.direction == "P->D" and side == P:
                streams = fan_out(self.p_layout, self.d_layout)
                self.flights[(req, e.attempt, e.direction)] = Flight(e, "push", streams)
            elif e.direction == "P->D":
                streams = fan_out(self.p_layout, self.d_layout)
                self.flights[(req, e.attempt, e.direction)] = Flight(e, "pull", streams)
            else:
                decided = self.reused[(req, e.attempt)]
                streams = fan_out(self.d_layout, self.p_layout)
                f = Flight(e, "reuse", streams, lease=decided.lease, reader=reader_of(req, e.attempt))
                self.flights[(req, e.attempt, e.direction)] = f
        elif side == P and (
            (isinstance(e, TransferFailed) and e.direction == "P->D")
            or (isinstance(e, RegistrationDropped) and e.final)
        ):
            self.post(D, dc.KVFailed(req, e.attempt, e.reason))
        elif side == P and isinstance(e, LeaseGranted) and e.purpose == "pull_hold":
            self.post(R, PullMeta(req, e.attempt, e.blocks, e.num_tokens, e.expires_at))
        elif side == D and isinstance(e, LeaseGranted) and e.purpose == "retained":
            # decode's response stream carries the handle; the router stores it
            conv, tenant = self.conversations.get(req, (None, "t"))
            if conv is not None:
                h = RetainedHandle(
                    D, e.lease, e.num_tokens, self.d_layout.block_size, e.block_hashes,
                    e.expires_at,
                )
                self.post(R, ss.Store(tenant, conv, h, request=req))
        elif side == D and isinstance(e, TransferCompleted):
            self.post(P, pf.PullReadDone(req, e.attempt))  # decode's pull READ is done
        elif side == R and isinstance(e, SessionDropped):
            self.post(D, ls.Release(e.lease, f"router: {e.reason}"))

    # --- the network ------------------------------------------------------------------------------
    def deliver(self, i: int = 0) -> list[Event]:
        return self._deliver(self.inbox.pop(i))

    def redeliver(self, i: int) -> list[Event]:
        """Deliver an already sent message once more (a duplicate)."""
        return self._deliver(self.sent[i])

    def _deliver(self, m: Msg) -> list[Event]:
        if isinstance(m.cmd, PullMeta):
            return self._relay_pull(m.cmd)
        return self.run(m.to, m.cmd)

    def deliver_all(self, limit: int = 10_000) -> None:
        while self.inbox and limit:
            self.deliver(0)
            limit -= 1

    def _relay_pull(self, meta: PullMeta) -> list[Event]:
        """The router hands prefill's pull metadata to decode, which allocates and reads."""
        if self.decode.phase(meta.request, meta.attempt) != "absent":
            return []  # a duplicate relay: decode already has the request
        relayed = MetadataRelayed(
            at=self.now, instance=R, request=meta.request, attempt=meta.attempt, prefill=P,
            decode=D, src_blocks=meta.src_blocks, num_tokens=meta.num_tokens,
        )
        self.log.append(relayed)
        blocks = self.take_blocks(D, self.d_layout.blocks_for(meta.num_tokens))
        return [relayed, *self.d(dc.ExpectKV(
            meta.request, meta.attempt, P, blocks, meta.num_tokens, self.p_layout, mode="pull",
            src_blocks=meta.src_blocks, src_expires_at=meta.expires_at, read_margin=self.window,
        ))]

    # --- the engines' block pools -----------------------------------------------------------------
    def free_blocks(self, side: str) -> list[int]:
        owned = self.machine(side).ledger.owner
        return [b for b in range(self.pool[side]) if b not in owned]

    def take_blocks(self, side: str, n: int) -> tuple[int, ...]:
        free = self.free_blocks(side)
        if len(free) < n:
            raise PoolExhausted(f"{side}: {n} blocks wanted, {len(free)} free")
        return tuple(self.rng.sample(free, n))

    # --- the transport ------------------------------------------------------------------------------
    def land(self, key: tuple[str, int, str], i: int) -> None:
        """Stream `i` of a flight moves its data; a push also notifies decode."""
        f = self.flights[key]
        if i in f.landed:
            return
        self._check_safe(f)
        f.landed.add(i)
        if f.mode == "push":
            s = f.streams[i]
            self.post(D, dc.Notify(key[0], key[1], s.src_rank, s.dst_rank))

    def complete(self, key: tuple[str, int, str], ok: bool = True, reason: str = "") -> None:
        """The transfer ends. ok: every stream's data moved; failed: the rest never will."""
        f = self.flights[key]
        if ok:
            for i in range(len(f.streams)):
                self.land(key, i)
        del self.flights[key]
        req, att, _ = key
        if f.mode == "push":
            self.p(pf.TransferDone(req, att, ok, reason))
        elif f.mode == "pull":
            self.d(dc.PullDone(req, att, ok, reason))
        else:
            self.p(pf.ReuseReadDone(req, att, ok, reason))
            assert f.lease is not None and f.reader is not None
            self.post(D, ls.EndRead(f.lease, f.reader))

    def _check_safe(self, f: Flight) -> None:
        e = f.planned
        req = e.request or ""
        if f.mode == "reuse":
            lease = self.decode.leases.leases.get(f.lease or "")
            if lease is None or not set(e.src_blocks) <= set(lease.blocks):
                self.hazards.append(f"t={self.now}: {req}#{e.attempt} reads lease {f.lease} gone")
            if not self.prefill.ledger.owns(req, e.dst_blocks, e.attempt):
                self.hazards.append(f"t={self.now}: {req}#{e.attempt} read lands in freed blocks")
            return
        if not self.prefill.ledger.owns(req, e.src_blocks, e.attempt):
            self.hazards.append(f"t={self.now}: {req}#{e.attempt} moves data out of freed blocks")
        if not self.decode.ledger.owns(req, e.dst_blocks, e.attempt):
            self.hazards.append(f"t={self.now}: {req}#{e.attempt} writes into freed blocks")

    # --- time -------------------------------------------------------------------------------------
    def advance(self, dt: float) -> None:
        """Time passes; flights whose window closes first move all their data in it."""
        target = self.now + dt
        while True:
            due = [
                (f.opened + self.window * 0.999, f) for f in self.flights.values()
                if f.mode != "reuse" and f.opened + self.window <= target
            ] + [
                (f.opened + self.cancel_after, f) for f in self.flights.values()
                if f.mode == "reuse" and f.key not in self.stuck
                and f.opened + self.cancel_after <= target
            ]
            if not due:
                break
            at, f = min(due, key=lambda x: (x[0], x[1].key))
            self.now = max(self.now, at)
            if f.mode == "reuse":
                self.complete(f.key, ok=False, reason="read cancelled: it overran its pin")
            else:
                self.complete(f.key, ok=True)
        self.now = target

    def tick(self) -> None:
        self.p(pf.Tick())
        self.d(dc.Tick())
        self.r(ss.Expire())

    # --- whole flows --------------------------------------------------------------------------------
    def start_push(self, req: str, tokens: int, attempt: int = 0) -> None:
        """Both engines take the request: prefill allocates, decode allocates and registers."""
        self.p(pf.Allocate(req, attempt, self.take_blocks(P, self.p_layout.blocks_for(tokens))))
        self.expect_push(req, tokens, attempt)

    def expect_push(self, req: str, tokens: int, attempt: int = 0) -> None:
        blocks = self.take_blocks(D, self.d_layout.blocks_for(tokens))
        self.d(dc.ExpectKV(req, attempt, P, blocks, tokens, self.p_layout,
                           timeout=self.kv_timeout))

    def settle(self, rounds: int = 50) -> None:
        """Deliver every message and finish every flight (ok), until nothing moves."""
        for _ in range(rounds):
            moved = bool(self.inbox or self.flights)
            self.deliver_all()
            for key in sorted(self.flights):
                if key in self.flights:
                    self.complete(key, ok=True)
            if not moved:
                return
        raise AssertionError("the pair never settled")

    def push_request(self, req: str, tokens: int, *, retain: dc.Retain | None = None,
                     order: str = "registration_first") -> None:
        """A whole push request, happy path, then decode finishes it."""
        self.p(pf.Allocate(req, 0, self.take_blocks(P, self.p_layout.blocks_for(tokens))))
        if order == "registration_first":
            self.expect_push(req, tokens)
            self.deliver_all()
            self.p(pf.FinishPrefill(req, 0, tokens))
        else:
            self.p(pf.FinishPrefill(req, 0, tokens))
            self.expect_push(req, tokens)
        self.settle()
        assert self.decode.phase(req, 0) == "decoding"
        self.d(dc.Finish(req, 0, retain))
        self.settle()

    def pull_request(self, req: str, tokens: int) -> None:
        self.p(pf.Allocate(req, 0, self.take_blocks(P, self.p_layout.blocks_for(tokens))))
        self.p(pf.FinishPrefill(req, 0, tokens, mode="pull", hold_ttl=self.hold_ttl))
        self.settle()
        assert self.decode.phase(req, 0) == "decoding"
        self.d(dc.Finish(req, 0))
        self.settle()

    # --- quiescence and the checks ------------------------------------------------------------------
    def idle(self) -> bool:
        return not (
            self.inbox or self.flights or self.prefill.entries or self.decode.entries
            or self.prefill.leases.leases or self.decode.leases.leases or self.router.handles
        )

    def quiesce(self, horizon: float = 1000.0) -> None:
        """Drive everything to rest: finish or abort every request, let every TTL and time-out
        pass, deliver everything."""
        for _ in range(8):
            self.settle()
            for (req, att), e in sorted(self.decode.entries.items()):
                if e.phase == "decoding":
                    self.d(dc.Finish(req, att))
            for (req, att), e in sorted(self.prefill.entries.items()):
                if e.phase in ("waiting", "held") and not e.reading and not e.abort_pending:
                    self.p(pf.Abort(req, att))
            self.settle()
            self.advance(horizon)
            self.tick()
            self.settle()
            if self.idle():
                return
        raise AssertionError(f"never came to rest: {self.describe()}")

    def describe(self) -> str:
        return (
            f"inbox={self.inbox} flights={sorted(self.flights)} "
            f"prefill={self.prefill.entries} decode={self.decode.entries} "
            f"p-leases={self.prefill.leases.leases} d-leases={self.decode.leases.leases} "
            f"router={self.router.handles}"
        )

    def refold(self) -> tuple[pf.PrefillCore, dc.DecodeCore, ss.SessionTable]:
        """Fresh machines with every logged event of theirs applied (replay = reduce(apply))."""
        p = pf.PrefillCore(P, self.p_layout, self.prefill.hold_timeout,
                           self.prefill.write_margin, self.forget_after, self.pin_grace)
        d = dc.DecodeCore(D, self.d_layout, pin_grace=self.pin_grace,
                          forget_after=self.forget_after)
        r = ss.SessionTable(R, block_size=self.d_layout.block_size)
        for m in (p, d, r):
            fold(self.log, m)
        return p, d, r

    def assert_one_kv_outcome(self) -> None:
        """Each wait of decode for KV ends at most once: received or failed, never both."""
        seen: dict[tuple[str, int], str] = {}
        for e in self.log:
            if isinstance(e, (KVReceived, KVLoadFailed)):
                key = (e.request or "", e.attempt)
                assert key not in seen, f"{key}: {type(e).__name__} after {seen[key]}"
                seen[key] = type(e).__name__

    def assert_replay_equals_live(self) -> None:
        p, d, r = self.refold()
        assert state_of(p) == state_of(self.prefill)
        assert state_of(d) == state_of(self.decode)
        assert r.handles == self.router.handles

    # --- bidirectional reuse ------------------------------------------------------------------------
    def salt(self, tenant: str) -> str:
        return tenant if self.tenant_salt else ""

    def retain(self, req: str, tenant: str, conversation: str, tokens: Sequence[int], *,
               attempt: int = 0, ttl: float = 20.0, renewable: bool = False) -> dc.Retain:
        """What decode keeps when `req` (a turn of `conversation`) finishes."""
        self.conversations[req] = (conversation, tenant)
        hashes = block_hashes(tokens, self.d_layout.block_size, self.salt(tenant))
        return dc.Retain(lease_of(req, attempt), ttl, renewable, len(tokens), hashes)

    def reuse(self, req: str, tenant: str, conversation: str, tokens: Sequence[int], *,
              attempt: int = 0, threshold: int = 16, local_hit: int = 0) -> str:
        """The start of a later turn: take the handle, decide, pin, read. Returns the outcome
        ("read" when a READ is in flight, else why not)."""
        stored = self.router.handle_of(tenant, conversation)
        taken = self.r(ss.Take(tenant, conversation, request=req))
        handle = stored if any(isinstance(e, SessionTaken) for e in taken) else None
        hashes = block_hashes(tokens, self.d_layout.block_size, self.salt(tenant))
        (decided,) = self.p(pf.DecideReuse(
            req, attempt, handle, hashes, len(tokens), local_hit, threshold,
            estimated_read=self.window,
        ))
        assert isinstance(decided, ReuseDecided)
        self.reused[(req, attempt)] = decided
        blocks = self.take_blocks(P, self.p_layout.blocks_for(len(tokens)))
        self.p(pf.Allocate(req, attempt, blocks, purpose="reuse"))
        if decided.outcome != "read" or handle is None:
            return decided.outcome
        pinned = self.d(ls.BeginRead(handle.lease, reader_of(req, attempt), self.window))
        if not any(isinstance(e, LeasePinned) for e in pinned):
            return "refused by decode"
        held = self.decode.leases.leases[handle.lease]
        n = decided.matched_tokens
        src = held.blocks[: self.d_layout.blocks_for(n)]
        self.p(pf.StartReuseRead(req, attempt, handle, src, self.d_layout, n))
        return "read"


class PoolExhausted(Exception):
    pass


def reader_of(req: str, attempt: int) -> str:
    return f"{P}:{req}#{attempt}"


def lease_of(req: str, attempt: int = 0) -> str:
    return f"{D}/{req}#{attempt}/kv"


def state_of(m: pf.PrefillCore | dc.DecodeCore) -> dict[str, Any]:
    out = {"entries": m.entries, "ledger": m.ledger, "leases": m.leases, "ended": m.ended}
    if isinstance(m, pf.PrefillCore):
        out |= {"latest": m.latest, "reissued": m.reissued}
    return out


def fold(events: Sequence[Event], fresh: Any) -> Any:
    """Fold the events of one instance into a fresh machine (replay = reduce(apply))."""
    for e in events:
        if e.instance == fresh.instance:
            fresh.apply(e)
    return fresh
