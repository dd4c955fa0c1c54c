"""KvplaneConnector's scheduler half: vLLM's scheduler hooks in, kvplane.core decisions out.

How it works:
- One `PrefillCore` and one `DecodeCore` per instance (an instance is `kv_both`: each request's
  `kv_transfer_params` say which side of an exchange it is on). Every vLLM hook becomes a core
  command; the events the core returns are recorded and then carried out: a `TransferPlanned`
  becomes a READ or WRITE order for the worker's transfer thread, a `RegistrationSent` a
  notification order, a `BlocksFreed` of a finished request a `finished_sending` report, a
  `KVReceived` a `finished_recving` report. Nothing here decides a protocol question itself.
- Orders and reports leave with the next step's connector metadata; the worker carries out the
  orders on its transfer thread and repeats the reports to vLLM in that same step, so vLLM frees
  or schedules exactly what the core decided (one engine step after the decision). A load that
  finished well is reported sooner where vLLM allows it: in the step output the scheduler
  learns of it in (`take_loaded`, see connector.py).
- Facts come back from the workers (a transfer ended, a notification arrived) in the step's
  worker metadata; `update_connector_output` feeds them to the cores.
- Request identity across instances is the transfer id (`kvplane.xfer` in the params), not
  vLLM's request id: both legs of one exchange carry the same one, so a registration and its
  prefill match, and the ledgers of both instances name the same request.
- Time is the wall clock (`time.time()`): leases and deadlines cross instances, and the
  recorded events of all instances are merged by time before replay.

- The hooks are a wall (see connector.py): an error of ours or of a peer inside a hook is
  recorded and the request computes its prompt locally; vLLM's engine never sees it.
- Per-request decisions (who owns an exchange, which tokens to load into which blocks, the
  reuse/compute split, retain and TTL, deadlines, attempt numbers) are
  `kvplane.core.connector_rules`; handles are signed and checked with `kvplane.core.signing`.

Tensor parallelism: the core plans a transfer as streams between producer and consumer ranks
(`kvplane.core.plan.fan_out`); each stream becomes one order carried out by our rank of it, and
the transfer ends for the core when its last stream ends (`StreamTally`). A pull with several
streams tells prefill "read" once, after the last READ. Block sizes may differ between the two
sides (runs travel in token slots); bidirectional reuse needs equal block sizes (its block
hashes are per block) and computes the prompt otherwise. Prefix caching may be on: decode
loads only the tokens past its local hit, into the blocks after it (the recorded block ledger
then sees blocks shared between requests on prefill, which replay reports).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvplane.core import connector_rules as rules
from kvplane.core import decode as dcore
from kvplane.core import prefill as pcore
from kvplane.core import signing
from kvplane.core.errors import PeerError, ProtocolError
from kvplane.core.events import (
    BlocksFreed,
    Event,
    KVLoadFailed,
    KVReceived,
    LeaseExpired,
    LeaseGranted,
    LeasePinned,
    LeaseReleased,
    LeaseRenewed,
    LeaseUnpinned,
    PrefillStarted,
    RegistrationDropped,
    RegistrationSent,
    RequestArrived,
    ReuseDecided,
    TransferCompleted,
    TransferFailed,
    TransferPlanned,
)
from kvplane.core.hashing import block_hashes
from kvplane.core.lease import BeginRead, EndRead, Heartbeat, Release
from kvplane.core.plan import KVLayout, plan_transfer
from kvplane.live.connector_config import ConnectorConfig
from kvplane.live.connector_wire import (
    WIRE_VERSION,
    Endpoint,
    Fact,
    KvplaneMeta,
    Leg,
    Order,
    Retained,
    SourceHandle,
    decode_response,
    encode_notif,
    fact_from_bytes,
    layout_from_dict,
    layout_to_dict,
    parse_leg,
    prefill_response,
    slot_runs,
)
from kvplane.live.recording import SafeRecorder
from kvplane.live.sidechannel import IDENTITY_KEY, SideChannelServer, rank_key

logger = logging.getLogger(__name__)

_OK_FINISH = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION")
_TICK_EVERY = 0.02


@dataclass(slots=True)
class Req:
    """What the scheduler half knows about one vLLM request that takes part in an exchange."""

    rid: str  # vLLM's request id
    leg: Leg
    request: Any  # vLLM's Request object
    attempt: int  # the core attempt (a failed load on decode starts a new one)
    blocks: list[int] = field(default_factory=list)  # blocks the core knows for this attempt
    decision: list[Event] | None = None  # prefill: reuse decided, not yet applied
    expected: bool = False  # decode: ExpectKV done (one transfer per request)
    started: bool = False  # PrefillStarted recorded
    preemptions: int = 0
    local_hit: int = 0  # tokens vLLM had in its own prefix cache when the request was matched
    shared: list[int] = field(default_factory=list)  # decode: blocks of that hit (never written)
    src_layout: KVLayout | None = None  # decode: the producer layout its wait counts streams of
    # vLLM's view: "running", "waiting_kv" (async load in flight), "finished_waiting_kv"
    # (finished while a load was in flight), "delay_send" (finished, blocks kept for us), "done"
    vllm: str = "running"

    @property
    def role(self) -> str:
        return self.leg.role

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.leg.role, self.leg.xfer, self.attempt)


def _locked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run a method under the half's lock: the engine thread and the side channel's threads
    (facts posted by the workers, lease requests from the router) share the cores."""

    @functools.wraps(fn)
    def wrapper(self: SchedulerHalf, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return fn(self, *args, **kwargs)

    return wrapper


class SchedulerHalf:
    """The scheduler-side logic, free of vLLM imports so that unit tests can drive it."""

    def __init__(self, cfg: ConnectorConfig, layout: KVLayout, engine_id: str,
                 recorder: SafeRecorder, *, clock: Callable[[], float] = time.time,
                 serve: bool = True, handle_key: bytes = b"", model: str = "",
                 no_kv_in: str = "") -> None:
        self.cfg = cfg
        # why this instance never takes KV computed elsewhere ("" when it does): every leg
        # that would load or read is then computed here, with the reason recorded
        self.no_kv_in = no_kv_in
        self.key = handle_key  # signs pull handles, checks every handle (b"": unsigned)
        self.model = model
        self.claims = rules.Claims()
        self.layout = layout
        self.clock = clock
        self.recorder = recorder
        self.me = Endpoint(cfg.instance, cfg.side_channel_host, cfg.side_channel_port, engine_id)
        self.prefill = pcore.PrefillCore(cfg.instance, layout, hold_timeout=cfg.push_hold_timeout,
                                         write_margin=cfg.write_margin)
        self.decode = dcore.DecodeCore(cfg.instance, layout)
        self.reqs: dict[str, Req] = {}
        self._unclaimed: set[str] = set()  # requests refused a claim (reported once)
        self.by_key: dict[tuple[str, str, int], Req] = {}
        self.decode_of: dict[tuple[str, int], Endpoint] = {}  # push registrations: who to WRITE
        self.skip_of: dict[tuple[str, int], int] = {}  # push: leading blocks decode already has
        self.retained_of: dict[tuple[str, int], Retained] = {}  # prefill: the handle being read
        # transfers of several TP streams: the core hears of one when its last stream ends
        self.tallies: dict[tuple[str, str, int], rules.StreamTally] = {}  # (purpose, xfer, #)
        self.read_notice: dict[tuple[str, int], tuple[Endpoint, bytes]] = {}  # pull: tell once
        self.pending = KvplaneMeta()
        self._last_tick = 0.0
        # Facts the workers post straight to this process (see sidechannel.FactSender) and lease
        # requests from the router are applied on the side channel's threads as they come, so
        # an arrival is recorded when it happens even while the engine loop sleeps; the lock
        # keeps them and the engine thread's hooks apart.
        self._lock = threading.RLock()
        self.published: dict[str, Retained] = {}  # retained lease -> its handle
        self.side_channel = SideChannelServer(cfg.side_channel_host, cfg.side_channel_port,
                                              on_post=self._posted,
                                              on_request=self._control_request)
        self._serve = serve

    # ---- start-up ------------------------------------------------------------------------

    @_locked
    def set_handshakes(self, infos: dict[int, bytes]) -> None:
        """The workers' transport handshakes: serve them (and our identity) on the side
        channel."""
        self.side_channel.update({rank_key(r): info for r, info in infos.items()})
        cfg = self.cfg
        self.side_channel.set(IDENTITY_KEY, json.dumps({
            "v": WIRE_VERSION, "endpoint": self.me.to_dict(), "layout": layout_to_dict(self.layout),
            "ranks": sorted(infos),
            "settings": {"v": WIRE_VERSION, "modes": ["pull", "push"],
                         "bidirectional_kv_xfer": cfg.bidirectional_kv_xfer,
                         "decoder_kv_blocks_ttl": cfg.decoder_kv_blocks_ttl,
                         "lease_renewable": cfg.lease_renewable,
                         "lease_extension": cfg.lease_extension,
                         "kv_recompute_threshold": cfg.kv_recompute_threshold,
                         "kv_lease_duration": cfg.kv_lease_duration,
                         "kv_wait_timeout": cfg.kv_wait_timeout,
                         "signed_handles": bool(self.key),
                         "hash_salt": cfg.hash_salt}}).encode())
        if self._serve:
            self.side_channel.start()
            logger.info("kvplane %s: side channel on %s:%d", self.me.instance,
                        self.side_channel.host, self.side_channel.port)

    def _posted(self, data: bytes) -> None:  # a side channel thread
        try:
            fact = fact_from_bytes(data)
        except (ValueError, TypeError) as exc:
            logger.warning("kvplane %s: unreadable fact from a worker: %s", self.me.instance, exc)
            return
        try:
            self.on_fact(fact)
        except Exception as exc:  # noqa: BLE001 - the wall, on the side channel's thread
            self.fault(f"fact {fact.kind} not applied", exc, request=fact.xfer,
                       attempt=fact.attempt)

    # ---- lease control from the router (side channel) -----------------------------------------

    def _verify(self, handle: Any) -> None:
        """Raise `PeerError` unless `handle` carries a valid router signature (when a key is
        configured)."""
        if not self.key:
            return
        from kvplane.live.router_handles import HandleError, verify_wire

        try:
            verify_wire(self.key, handle)
        except HandleError as exc:
            raise PeerError(f"retained handle refused: {exc}") from exc

    def _verify_pull(self, handle: Any, xfer: str) -> None:
        """Raise `PeerError` unless a pull handle is prefill's own, unaltered, for this
        transfer and not expired (when a key is configured)."""
        if not self.key:
            return
        try:
            signing.verify(self.key, handle)
            signing.check_bound(handle, xfer=xfer, now=self.clock())
        except signing.SignatureError as exc:
            raise PeerError(f"pull handle refused: {exc}") from exc

    def _control_request(self, key: str) -> bytes | None:  # a side channel thread
        kind, _, rest = key.partition("/")
        if kind == "unhold":
            return self._unhold(rest)
        if kind in ("pin", "unpin"):
            return self._pin(kind, rest)
        if kind not in ("renew", "release"):
            return None
        try:
            handle = json.loads(rest)
            self._verify(handle)
            lease = str(handle["lease"])
            if Endpoint.from_dict(handle["source"]).instance != self.me.instance:
                raise PeerError("the handle names another instance")
        except (ValueError, KeyError, TypeError, PeerError) as exc:
            logger.warning("kvplane %s: refused %s request: %s", self.me.instance, kind, exc)
            return None
        return self._control(kind, lease)

    def _unhold(self, raw: str) -> bytes | None:
        """The router gives back a pull hold decode will never read (decode refused the leg):
        the handle must be one this instance signed."""
        try:
            handle = json.loads(raw)
            if self.key:
                signing.verify(self.key, handle)
            src = SourceHandle.from_dict(handle)
            if src.source.instance != self.me.instance:
                raise PeerError("the handle names another instance")
        except (ValueError, PeerError, signing.SignatureError) as exc:
            logger.warning("kvplane %s: refused unhold request: %s", self.me.instance, exc)
            return None
        return self._release_hold(src.xfer, src.lease)

    def _pin(self, kind: str, raw: str) -> bytes | None:
        """A reader's `pin/` before its READ of our blocks (the lease must be alive; it stays
        until `unpin/`), for a handle this instance (pull) or the router (reuse) signed."""
        try:
            body = json.loads(raw)
            handle, reader = body["handle"], str(body["reader"])
            if body.get("kind") == "pull":
                if self.key:
                    signing.verify(self.key, handle)
                src = SourceHandle.from_dict(handle)
                role, lease, owner = "prefill", src.lease, src.source.instance
            else:
                self._verify(handle)
                role, lease = "decode", str(handle["lease"])
                owner = Endpoint.from_dict(handle["source"]).instance
            if owner != self.me.instance:
                raise PeerError("the handle names another instance")
            duration = max(0.0, float(body.get("duration", 0.0)))
        except (ValueError, KeyError, TypeError, PeerError, signing.SignatureError) as exc:
            logger.warning("kvplane %s: refused %s request: %s", self.me.instance, kind, exc)
            return None
        return self._pin_lease(kind, role, lease, reader, duration)

    @_locked
    def _pin_lease(self, kind: str, role: str, lease: str, reader: str,
                   duration: float) -> bytes | None:
        cmd: Any = BeginRead(lease, reader, duration) if kind == "pin" else EndRead(lease, reader)
        events = self._handle(role, cmd, self.clock())
        want = LeasePinned if kind == "pin" else LeaseUnpinned
        if not any(isinstance(e, want) for e in events):
            return None
        return json.dumps({"lease": lease, kind: True}).encode()

    @_locked
    def _release_hold(self, xfer: str, lease: str) -> bytes:
        events = self._handle("prefill", Release(lease, "decode refused the leg"), self.clock())
        released = any(isinstance(e, LeaseReleased) for e in events)
        return json.dumps({"xfer": xfer, "released": released}).encode()

    @_locked
    def _control(self, kind: str, lease: str) -> bytes | None:
        now = self.clock()
        if kind == "renew":
            events = self._handle("decode", Heartbeat(lease, self.cfg.lease_extension), now)
            renewed = next((e for e in events if isinstance(e, LeaseRenewed)), None)
            if renewed is None:
                return None
            return json.dumps({"lease": lease, "expires_at": renewed.expires_at}).encode()
        events = self._handle("decode", Release(lease, "released by the router"), now)
        return json.dumps({"lease": lease, "released": bool(events)}).encode()

    # ---- the core, recording and reacting -----------------------------------------------------

    def _handle(self, role: str, cmd: Any, now: float) -> list[Event]:
        """Run one core command; a refusal (`PeerError` or `ProtocolError`, whatever its
        message) is recorded and comes back as no events: the caller falls back."""
        core = self.prefill if role == "prefill" else self.decode
        try:
            events = core.handle(cmd, now)
        except (PeerError, ProtocolError) as exc:
            self.fault(f"{role} core refused {type(cmd).__name__}", exc,
                       request=getattr(cmd, "request", None),
                       attempt=getattr(cmd, "attempt", 0), at=now)
            return []
        self.recorder.record_all(events)
        self._react(role, events, now)
        return events

    def _record(self, *events: Event) -> None:
        self.recorder.record_all(list(events))

    def fault(self, what: str, exc: BaseException, *, request: str | None = None,
              attempt: int = 0, at: float | None = None) -> None:
        """Record an error stopped at the wall (the request then computes locally)."""
        reason = f"connector: {what}: {type(exc).__name__}: {exc}"[:500]
        logger.warning("kvplane %s: %s%s", self.me.instance, reason,
                       f" (request {request})" if request else "")
        if request:
            try:
                self._record(KVLoadFailed(at=self.clock() if at is None else at,
                                          instance=self.me.instance, request=request,
                                          attempt=int(attempt), reason=reason))
            except Exception:
                logger.exception("kvplane: could not record a fault")

    def _react(self, role: str, events: Sequence[Event], now: float) -> None:
        for ev in events:
            attempt = getattr(ev, "attempt", 0)
            req = self.by_key.get((role, ev.request or "", attempt))
            if isinstance(ev, TransferPlanned):
                self._order_transfer(role, ev, now)
            elif isinstance(ev, RegistrationSent):
                self._order_registration(ev, req, now)
            elif (isinstance(ev, RegistrationDropped) and ev.final) or (
                    isinstance(ev, TransferFailed) and ev.direction == "P->D"
                    and role == "prefill"):
                # a non-final drop is a copy of a registration that still stands: decode's
                # wait goes on, and telling it "no KV" would free blocks a WRITE lands in
                self._tell_decode_failed(ev.request or "", ev.attempt, ev.reason)
            if role == "decode" and isinstance(ev, (LeaseExpired, LeaseReleased, LeaseRenewed)):
                self._republish(ev)
            if req is None:
                continue
            if isinstance(ev, (KVReceived, KVLoadFailed)) or (
                    isinstance(ev, (TransferCompleted, TransferFailed))
                    and ev.direction == "D->P" and role == "prefill"):
                failed = isinstance(ev, (KVLoadFailed, TransferFailed))
                if req.vllm == "waiting_kv":
                    self.pending.finished_recving.add(req.rid)
                    if failed:
                        self.pending.failed_recving.add(req.rid)
                    req.vllm = "running"
                    if failed and role == "decode" and isinstance(ev, KVLoadFailed):
                        self._restart_decode_attempt(req, now, "KV load failed")
            elif isinstance(ev, BlocksFreed):
                if req.vllm == "delay_send":
                    self.pending.finished_sending.add(req.rid)
                    self._forget(req)
                elif req.vllm == "finished_waiting_kv":
                    self.pending.finished_recving.add(req.rid)
                    self._forget(req)

    def _republish(self, ev: Event) -> None:
        lease = getattr(ev, "lease", "")
        handle = self.published.get(lease)
        if handle is None:
            return
        if isinstance(ev, LeaseRenewed):
            handle = dataclasses.replace(handle, expires_at=ev.expires_at)
            self.published[lease] = handle
            self.side_channel.set(f"retained/{handle.xfer}",
                                  json.dumps(handle.to_dict()).encode())
        else:
            del self.published[lease]
            self.side_channel.delete(f"retained/{handle.xfer}")

    def _forget(self, req: Req) -> None:
        req.vllm = "done"
        self.reqs.pop(req.rid, None)
        if self.by_key.get(req.key) is req:
            del self.by_key[req.key]

    def _restart_decode_attempt(self, req: Req, now: float, why: str) -> None:
        """vLLM frees a request's blocks after a failed load and computes the prompt itself:
        end this attempt's books (its blocks are freed) and count the local compute as the
        next attempt."""
        if self.decode.phase(req.leg.xfer, req.attempt) == "decoding":
            self._handle("decode", dcore.Finish(req.leg.xfer, req.attempt), now)
        self.by_key.pop(req.key, None)
        req.attempt = rules.next_attempt(req.attempt)
        req.blocks = []
        req.shared, req.local_hit = [], 0  # the re-schedule has a prefix hit of its own
        self.by_key[req.key] = req
        logger.info("kvplane %s: %s for %s; computing it locally (attempt %d)",
                    self.me.instance, why, req.leg.xfer, req.attempt)

    # ---- orders for the worker ---------------------------------------------------------------

    def _order_transfer(self, role: str, ev: TransferPlanned, now: float) -> None:
        """One order per (producer rank, consumer rank) stream of the plan, carried out by our
        rank of the stream; the transfer ends when its last stream does (`StreamTally`)."""
        xfer, attempt = ev.request or "", ev.attempt
        try:
            if role == "decode":  # pull: READ prefill's held blocks
                req = self.by_key.get(("decode", xfer, attempt))
                assert req is not None and req.leg.pull is not None
                src = req.leg.pull
                plan = plan_transfer(src.layout, self.layout, ev.src_blocks, ev.dst_blocks,
                                     ev.num_tokens)
                wire = (req.request.kv_transfer_params or {})["kvplane"]["pull"]
                notice = self._notif("READ", {"xfer": xfer, "attempt": attempt})
                one = len(plan.streams) == 1
                if not one:  # prefill frees its hold once every rank has read
                    self.read_notice[(xfer, attempt)] = (src.source, notice)
                self._stream_orders(
                    "read", "pull", xfer, attempt, src.source, plan, (src.layout, self.layout),
                    local="dst",
                    notify=notice if one else b"",
                    deadline=rules.read_deadline(now, self.cfg.transfer_timeout,
                                                 src.expires_at, margin=rules.PIN_MARGIN),
                    pin=self._pin_body("pull", wire, xfer, attempt))
            elif ev.direction == "D->P":  # reuse: READ decode's retained blocks
                handle = self.retained_of[(xfer, attempt)]
                plan = plan_transfer(handle.layout, self.layout, ev.src_blocks, ev.dst_blocks,
                                     ev.num_tokens)
                wire = (req_of.request.kv_transfer_params or {})["kvplane"]["reuse"] \
                    if (req_of := self.by_key.get(("prefill", xfer, attempt))) else None
                self._stream_orders(
                    "read", "reuse", xfer, attempt, handle.source, plan,
                    (handle.layout, self.layout), local="dst",
                    deadline=rules.read_deadline(now, self.cfg.transfer_timeout,
                                                 handle.expires_at, margin=rules.PIN_MARGIN),
                    pin=self._pin_body("reuse", wire, xfer, attempt) if wire else "")
            else:  # push: WRITE into decode's registered blocks
                peer = self.decode_of[(xfer, attempt)]
                reg = self.prefill.entries[(xfer, attempt)].registration
                assert reg is not None
                dst_layout = self.prefill.layout_of(reg)
                # decode already has its first `skip` blocks (its local prefix hit): those may
                # be shared with other requests there, so they are never written
                skip = self.skip_of.get((xfer, attempt), 0)
                window = rules.push_window(skip, ev.num_tokens, self.layout.block_size,
                                           dst_layout.block_size)
                plan = plan_transfer(self.layout, dst_layout, window.src(ev.src_blocks),
                                     window.dst(ev.dst_blocks), window.num_tokens)
                deadline = rules.read_deadline(now, self.cfg.transfer_timeout, reg.deadline)
                self._stream_orders("write", "push", xfer, attempt, peer, plan,
                                    (self.layout, dst_layout), local="src", deadline=deadline)
        except (PeerError, KeyError, AssertionError, ValueError) as exc:
            # The plan was recorded but cannot be carried out: end it as failed at once.
            logger.warning("kvplane %s: cannot carry out %s transfer of %s: %r",
                           self.me.instance, ev.direction, xfer, exc)
            self.tallies.pop((self._purpose(role, ev), xfer, attempt), None)
            self.read_notice.pop((xfer, attempt), None)
            self._transfer_ended(self._purpose(role, ev), xfer, attempt, now, False,
                                 f"cannot carry out: {exc}")

    @staticmethod
    def _purpose(role: str, ev: TransferPlanned) -> str:
        return "pull" if role == "decode" else ("reuse" if ev.direction == "D->P" else "push")

    def _stream_orders(self, kind: Any, purpose: str, xfer: str, attempt: int, peer: Endpoint,
                       plan: Any, layouts: tuple[KVLayout, KVLayout], *, local: str,
                       deadline: float, notify: bytes = b"", pin: str = "") -> None:
        """The plan's streams as orders: ours is the `local` ("src" or "dst") end of each."""
        runs = slot_runs(plan)
        self.tallies[(purpose, xfer, attempt)] = rules.StreamTally(plan.expected)
        for st in plan.streams:
            mine, theirs_ = ((st.src_rank, st.dst_rank) if local == "src"
                             else (st.dst_rank, st.src_rank))
            # heads named only when a stream moves part of a rank's heads
            whole = st.heads == len(layouts[0].heads_of(st.src_rank)) == len(
                layouts[1].heads_of(st.dst_rank))
            heads = () if whole else (st.src_head, st.dst_head, st.heads)
            body = notify
            if kind == "write":  # each stream's WRITE carries its own completion notice
                body = self._notif("DONE", {"xfer": xfer, "attempt": attempt,
                                            "src_rank": st.src_rank, "dst_rank": st.dst_rank})
            self.pending.orders.append(Order(
                kind, xfer, attempt, peer, runs, notify=body, deadline=deadline,
                purpose=purpose, pin=pin, rank=mine, peer_rank=theirs_, heads=heads))

    def _transfer_ended(self, purpose: str, xfer: str, attempt: int, at: float, ok: bool,
                        reason: str) -> None:
        """A whole transfer ended (every stream): the core hears of it once."""
        if purpose == "pull":
            if self.decode.phase(xfer, attempt) in ("awaiting_kv", "aborting"):
                self._handle("decode", dcore.PullDone(xfer, attempt, ok, reason), at)
            notice = self.read_notice.pop((xfer, attempt), None)
            if ok and notice is not None:
                self.pending.orders.append(Order(
                    "notify", xfer, attempt, notice[0], notify=notice[1],
                    deadline=at + self.cfg.transfer_timeout, purpose="read"))
        elif purpose == "reuse":
            e = self.prefill.entries.get((xfer, attempt))
            if e is not None and e.reading:
                self._handle("prefill", pcore.ReuseReadDone(xfer, attempt, ok, reason), at)
                self.retained_of.pop((xfer, attempt), None)
        elif purpose == "push" and self.prefill.phase(xfer, attempt) == "transferring":
            self._handle("prefill", pcore.TransferDone(xfer, attempt, ok, reason), at)
            self.decode_of.pop((xfer, attempt), None)
            self.skip_of.pop((xfer, attempt), None)

    def _stream_ended(self, fact: Fact) -> None:
        """One stream's READ or WRITE ended on one of our ranks."""
        key = (fact.purpose, fact.xfer, fact.attempt)
        tally = self.tallies.get(key)
        stream = ((fact.rank, fact.peer_rank) if fact.kind == "write_done"
                  else (fact.peer_rank, fact.rank))
        if tally is None:  # a transfer planned before this process knew of tallies: one stream
            tally = rules.StreamTally(frozenset({stream}))
        try:
            outcome = tally.end(stream, fact.ok, fact.reason)
        except PeerError as exc:
            self.fault("transfer end not counted", exc, request=fact.xfer, attempt=fact.attempt)
            return
        if outcome is None:
            self.tallies[key] = tally
            return
        self.tallies.pop(key, None)
        self._transfer_ended(fact.purpose, fact.xfer, fact.attempt, fact.at, *outcome)

    def _notif(self, kind: Any, body: dict[str, Any]) -> bytes:
        """A NIXL notification to a peer, signed with the handle key (when there is one): a
        peer only acts on notifications another instance of the deployment sent."""
        if self.key:
            body = signing.sign(self.key, {**body, "kind": kind})
        return encode_notif(kind, body)

    def _pin_body(self, kind: str, handle: Any, xfer: str, attempt: int) -> str:
        return json.dumps({"kind": kind, "handle": handle,
                           "reader": f"{self.me.instance}/{xfer}#{attempt}"})

    def _order_registration(self, ev: RegistrationSent, req: Req | None, now: float) -> None:
        if req is None or req.leg.source is None:
            return
        # the blocks of decode's local hit lead the list (prefill plans from token 0) and
        # `skip` says how many of them prefill must not write
        body = {"xfer": ev.request, "attempt": ev.attempt, "decode": self.me.to_dict(),
                "blocks": list(req.shared) + list(ev.dst_blocks), "skip": len(req.shared),
                "num_tokens": ev.num_tokens, "layout": layout_to_dict(self.layout),
                "src_layout": layout_to_dict(req.src_layout or self.layout),
                "deadline": ev.deadline}
        self.pending.orders.append(Order("notify", ev.request or "", ev.attempt, req.leg.source,
                                         notify=self._notif("REG", body),
                                         deadline=now + self.cfg.transfer_timeout,
                                         purpose="register"))

    def _tell_decode_failed(self, xfer: str, attempt: int, reason: str) -> None:
        peer = self.decode_of.get((xfer, attempt))
        if peer is None:
            return
        self.pending.orders.append(Order(
            "notify", xfer, attempt, peer,
            notify=self._notif("FAIL", {"xfer": xfer, "attempt": attempt, "reason": reason}),
            deadline=self.clock() + self.cfg.transfer_timeout, purpose="fail"))

    # ---- vLLM hooks -----------------------------------------------------------------------------

    def _leg(self, request: Any) -> Leg | None:
        params = request.kv_transfer_params
        try:
            leg = parse_leg(params, request.request_id)
        except PeerError as exc:
            logger.warning("kvplane %s: request %s: ignoring its kvplane params: %s",
                           self.me.instance, request.request_id, exc)
            return None
        if leg is not None and self.no_kv_in and (leg.reuse is not None or (
                leg.role == "decode" and leg.source is not None)):
            self.fault(f"{self.no_kv_in}; computing the prompt",
                       PeerError("KV from another instance is not taken here"),
                       request=leg.xfer, attempt=leg.attempt)
            return dataclasses.replace(leg, reuse=None, pull=None, source=None)
        if leg is not None and leg.reuse is not None:
            try:
                self._verify(params["kvplane"]["reuse"])
            except PeerError as exc:
                self.fault("reuse handle refused; computing the prompt", exc, request=leg.xfer,
                           attempt=leg.attempt)
                leg = dataclasses.replace(leg, reuse=None)
        if leg is not None and leg.pull is not None:
            try:
                self._verify_pull(params["kvplane"]["pull"], leg.xfer)
            except PeerError as exc:
                self.fault("pull handle refused; computing the prompt", exc, request=leg.xfer,
                           attempt=leg.attempt)
                leg = dataclasses.replace(leg, pull=None, source=None)
        return leg

    def _req(self, request: Any) -> Req | None:
        req = self.reqs.get(request.request_id)
        if req is not None:
            return req
        leg = self._leg(request)
        if leg is None:
            return None
        key = (leg.role, leg.xfer, leg.attempt)
        # only a leg that moves KV claims its exchange: a refused (forged) one must not take
        # the transfer id away from the real request
        moves = leg.role == "prefill" or leg.source is not None
        if moves and not self.claims.claim(key, request.request_id):
            # n > 1, a batch prompt or a replay: another request owns this exchange; this one
            # computes its prompt itself, with no transfer and no hold
            if request.request_id not in self._unclaimed:
                self._unclaimed.add(request.request_id)
                self.fault(f"{leg.role} leg {leg.xfer}#{leg.attempt} already belongs to "
                           f"request {self.claims.owner(key)}; request {request.request_id} "
                           "computes its prompt", PeerError("duplicate transfer id"),
                           request=f"{leg.xfer}~{request.request_id}")
            return None
        req = Req(request.request_id, leg, request, leg.attempt,
                  preemptions=getattr(request, "num_preemptions", 0))
        self.reqs[req.rid] = req
        self.by_key[req.key] = req
        return req

    @_locked
    def on_new_request(self, request: Any) -> None:
        req = self._req(request)
        if req is None:
            return
        sp = getattr(request, "sampling_params", None)
        self._record(RequestArrived(
            at=self.clock(), instance=self.me.instance, request=req.leg.xfer,
            prompt_tokens=int(request.num_prompt_tokens),
            output_tokens=int(getattr(sp, "max_tokens", 0) or 0),
            conversation=req.leg.conversation, tenant=req.leg.tenant))

    @_locked
    def get_num_new_matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        req = self._req(request)
        if req is None:
            return 0, False
        n_prompt = int(request.num_prompt_tokens)
        self._sync_preemption(req, self.clock())  # a preempted request starts a new attempt
        if req.role == "decode":
            if not req.blocks:
                req.local_hit = num_computed
            if req.expected or req.attempt != req.leg.attempt or req.leg.source is None:
                return 0, False  # no transfer, or the one transfer was tried already
            have = n_prompt if req.leg.pull is None else min(n_prompt, req.leg.pull.num_tokens)
            src_bs = req.leg.pull.layout.block_size if req.leg.pull else None
            window = rules.decode_load(n_prompt, have, num_computed, self.layout.block_size,
                                       src_bs)
            return (window.num_tokens, True) if window is not None else (0, False)
        if not req.blocks:
            req.local_hit = num_computed
        if req.leg.reuse is None or req.started:
            return 0, False
        if req.leg.reuse.layout.block_size != self.layout.block_size \
                or num_computed % self.layout.block_size:
            return 0, False  # whole blocks move: only between equal block sizes
        made = next((e for e in req.decision or () if isinstance(e, ReuseDecided)), None)
        if req.decision is None or (made is not None and made.local_hit_tokens != num_computed):
            # (decided again when vLLM asks again with another local hit: the read starts
            # right after it)
            handle = req.leg.reuse
            prompt = list(request.prompt_token_ids or [])
            cmd = pcore.DecideReuse(
                req.leg.xfer, req.attempt, handle.core_handle(),
                block_hashes(prompt, handle.block_size, self.salt_of(request)), n_prompt,
                num_computed, threshold=self.cfg.kv_recompute_threshold,
                estimated_read=self.cfg.reuse_read_estimate, margin=rules.READ_MARGIN)
            try:
                req.decision = self.prefill.decide(cmd, self.clock())
            except ProtocolError as exc:
                logger.warning("kvplane %s: no reuse for %s: %s", self.me.instance,
                               req.leg.xfer, exc)
                req.decision = []
        ev = next((e for e in req.decision if isinstance(e, ReuseDecided)), None)
        if ev is not None and ev.outcome == "read" and ev.remote_tokens > 0:
            return ev.remote_tokens, True
        return 0, False

    @_locked
    def update_state_after_alloc(self, request: Any, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        req = self._req(request)
        if req is None:
            return
        now = self.clock()
        self._sync_preemption(req, now)
        new = [b for b in block_ids if b not in set(req.blocks)]
        if req.role == "prefill":
            self._prefill_alloc(req, new, num_external_tokens, now)
        else:
            self._decode_alloc(req, list(block_ids), new, num_external_tokens, now)

    def _prefill_alloc(self, req: Req, new: list[int], external: int, now: float) -> None:
        xfer, attempt = req.leg.xfer, req.attempt
        if req.decision is not None:  # apply the reuse decision made while matching
            decision, req.decision = req.decision, None
            for e in decision:
                self.prefill.apply(e)
            self._record(*decision)
            ev = next((e for e in decision if isinstance(e, ReuseDecided)), None)
            handle = req.leg.reuse
            if ev is not None and ev.outcome == "read" and external > 0 and handle is not None:
                # the read fills the blocks right after prefill's own local hit (those are
                # prefill's, computed before; shared with other requests, never written)
                src_blocks, reuse_blocks = rules.reuse_read(
                    handle.blocks, new, req.local_hit, external, self.layout.block_size)
                hit = new[:req.local_hit // self.layout.block_size]
                if hit:
                    self._handle("prefill", pcore.Allocate(xfer, attempt, tuple(hit)), now)
                    req.blocks += hit
                new = new[len(hit) + len(reuse_blocks):]
                self._handle("prefill", pcore.Allocate(xfer, attempt, reuse_blocks, "reuse"),
                             now)
                req.blocks += reuse_blocks
                self.retained_of[(xfer, attempt)] = handle
                req.vllm = "waiting_kv"
                started = self._handle("prefill", pcore.StartReuseRead(
                    xfer, attempt, handle.core_handle(), src_blocks, handle.layout, external,
                    dst_blocks=reuse_blocks), now)
                if not started:  # refused: vLLM recomputes those tokens (same attempt)
                    self.pending.finished_recving.add(req.rid)
                    self.pending.failed_recving.add(req.rid)
                    req.vllm = "running"
        if new:
            self._handle("prefill", pcore.Allocate(xfer, attempt, tuple(new)), now)
            req.blocks += new
        if not req.started:
            req.started = True
            prompt, cached = int(req.request.num_prompt_tokens), external + req.local_hit
            self._record(PrefillStarted(at=now, instance=self.me.instance, request=xfer,
                                        computed_tokens=prompt - cached, cached_tokens=cached))

    def _decode_alloc(self, req: Req, blocks: list[int], new: list[int], external: int,
                      now: float) -> None:
        xfer, leg = req.leg.xfer, req.leg
        bs = self.layout.block_size
        if not req.blocks and not req.shared and req.local_hit:
            # the blocks of vLLM's local prefix hit may be shared with other requests: they
            # are neither loaded into nor counted as this request's own
            req.shared = list(blocks[:req.local_hit // bs])
            new = [b for b in new if b not in set(req.shared)]
        if external > 0 and not req.expected and leg.source is not None:
            req.expected = True
            req.vllm = "waiting_kv"
            src_bs = leg.pull.layout.block_size if leg.pull else bs
            window = rules.LoadWindow(len(req.shared), external,
                                      len(req.shared) * bs // src_bs)
            dst = window.dst(blocks)
            try:
                if req.request.kv_transfer_params is not None:
                    req.request.kv_transfer_params["do_remote_prefill"] = False
                # push: prefill's layout from the leg (the router adds it), else assumed ours;
                # the registration says which, and a prefill of another TP refuses it
                src_layout = leg.pull.layout if leg.pull else (leg.source_layout or self.layout)
                req.src_layout = src_layout
                cmd = dcore.ExpectKV(
                    xfer, req.attempt, leg.source.instance, dst, external, src_layout,
                    mode=leg.mode, src_blocks=window.src(leg.pull.blocks) if leg.pull else (),
                    timeout=self.cfg.kv_wait_timeout,
                    src_expires_at=leg.pull.expires_at if leg.pull else None,
                    read_margin=rules.READ_MARGIN)
                req.blocks = list(dst)
                events = self._handle("decode", cmd, now)
            except Exception as exc:  # noqa: BLE001 - the wall: compute the prompt instead
                self.fault("cannot expect KV", exc, request=xfer, attempt=req.attempt, at=now)
                events = []
            if not events:  # the core refused: let vLLM compute the prompt
                self.local_fallback(req)
            return
        if new:
            self._handle("decode", dcore.Allocate(xfer, req.attempt, tuple(new)), now)
            req.blocks += new

    def local_fallback(self, req: Req) -> None:
        """The request's KV will not come: vLLM computes the prompt itself (as attempt n+1)."""
        self.pending.finished_recving.add(req.rid)
        self.pending.failed_recving.add(req.rid)
        req.vllm = "running"
        self.by_key.pop(req.key, None)
        req.attempt = rules.next_attempt(req.attempt)
        req.blocks = []
        self.by_key[req.key] = req

    def _sync_preemption(self, req: Req, now: float) -> None:
        n = int(getattr(req.request, "num_preemptions", 0) or 0)
        if n <= req.preemptions:
            return
        req.preemptions = n
        if req.role == "prefill":
            self._handle("prefill", pcore.Preempt(req.leg.xfer, req.attempt), now)
            req.blocks = []
        else:
            self._restart_decode_attempt(req, now, "preempted")

    @_locked
    def build_connector_meta(self) -> KvplaneMeta:
        now = self.clock()
        try:
            if now - self._last_tick >= _TICK_EVERY:
                self._last_tick = now
                for req in list(self.reqs.values()):
                    if req.vllm in ("running", "waiting_kv"):
                        self._sync_preemption(req, now)
                self._handle("prefill", pcore.Tick(), now)
                self._handle("decode", dcore.Tick(), now)
        finally:  # what was decided so far still reaches the workers
            meta = self.take_pending()
        return meta

    def take_pending(self) -> KvplaneMeta:
        meta, self.pending = self.pending, KvplaneMeta()
        return meta

    # ---- the wall: what a hook that raised answers (see connector.py) -------------------------

    @_locked
    def hook_failed(self, hook: str, exc: BaseException, request: Any) -> None:
        rid = getattr(request, "request_id", None)
        req = self.reqs.get(rid) if isinstance(rid, str) else None
        self.fault(f"{hook} failed", exc, request=req.leg.xfer if req else rid,
                   attempt=req.attempt if req else 0)
        if req is not None and hook == "get_num_new_matched_tokens" and not req.blocks:
            self._forget(req)  # nothing ordered yet: the request goes on as a plain one

    @_locked
    def alloc_failed(self, request: Any, num_external_tokens: int) -> None:
        """update_state_after_alloc raised: if vLLM now waits for a load we never ordered,
        tell it the load failed (it recomputes); a load already ordered runs its course."""
        req = self.reqs.get(request.request_id)
        if num_external_tokens and (req is None or req.vllm != "waiting_kv"):
            self.pending.finished_recving.add(request.request_id)
            self.pending.failed_recving.add(request.request_id)
            if req is not None:
                req.expected = True  # no second try for this request

    @_locked
    def finish_failed(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """request_finished raised: keep the blocks while anything may still touch them."""
        req = self.reqs.get(request.request_id)
        if req is None:
            return False, None
        if req.vllm == "waiting_kv":
            req.vllm = "finished_waiting_kv"  # vLLM keeps them until finished_recving
            return False, None
        if req.vllm in ("delay_send", "finished_waiting_kv"):
            return True, None  # the core holds them: freed when it says so
        self._forget(req)
        return False, None

    @_locked
    def take_loaded(self) -> set[str]:
        """The requests whose load the core has decided finished well and that no step has
        reported to vLLM yet, taken out of the next step's report: the facade hands them to
        vLLM in the step output it is reading now (`KvplaneConnector.update_connector_output`),
        one engine step earlier than through the workers. Failed loads stay on the workers'
        path (vLLM reads those before it calls the connector)."""
        p = self.pending
        done = p.finished_recving - p.failed_recving
        p.finished_recving -= done
        return done

    @_locked
    def put_back_loaded(self, rids: set[str]) -> None:
        """`take_loaded`'s requests could not be handed over: the next step reports them."""
        self.pending.finished_recving |= rids

    @_locked
    def has_pending_work(self) -> bool:
        p = self.pending
        return bool(p.orders or p.finished_sending or p.finished_recving or p.failed_recving)

    @_locked
    def request_finished(self, request: Any, block_ids: Sequence[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        req = self.reqs.get(request.request_id)
        if req is None:
            self._unclaimed.discard(request.request_id)
            return False, None
        now = self.clock()
        ok = getattr(request.status, "name", str(request.status)) in _OK_FINISH
        xfer = req.leg.xfer
        if req.vllm == "waiting_kv":  # finished (aborted) while its KV was on the way
            req.vllm = "finished_waiting_kv"
            role = req.role
            cmd = (pcore.Abort(xfer, req.attempt) if role == "prefill"
                   else dcore.Abort(xfer, req.attempt))
            self._handle(role, cmd, now)
            return False, None  # vLLM keeps the blocks until we report finished_recving
        known = set(req.blocks) | set(req.shared)
        new = [b for b in block_ids if b not in known]
        if req.role == "prefill":
            return self._prefill_finished(req, list(block_ids), new, ok, now)
        return self._decode_finished(req, list(block_ids), new, ok, now)

    def _prefill_finished(self, req: Req, blocks: list[int], new: list[int], ok: bool,
                          now: float) -> tuple[bool, dict[str, Any] | None]:
        xfer, attempt = req.leg.xfer, req.attempt
        if not ok or not blocks:
            req.vllm = "done"
            self._handle("prefill", pcore.Abort(xfer, attempt), now)
            self._forget(req)
            return False, None
        if new:
            self._handle("prefill", pcore.Allocate(xfer, attempt, tuple(new)), now)
            req.blocks += new
        num_tokens = int(req.request.num_computed_tokens)
        req.vllm = "delay_send"
        events = self._handle("prefill", pcore.FinishPrefill(
            xfer, attempt, num_tokens, mode=req.leg.mode,
            hold_ttl=self.cfg.kv_lease_duration), now)
        if not events:
            self._forget(req)
            return False, None
        if req.leg.mode == "push":
            return True, None
        grant = next((e for e in events if isinstance(e, LeaseGranted)), None)
        if grant is None:
            return True, None
        handle = SourceHandle(self.me, xfer, attempt, tuple(blocks), num_tokens, grant.lease,
                              grant.expires_at, self.layout)
        params = prefill_response(handle, "pull")
        if self.key:  # signed by its issuer: decode reads only blocks prefill named
            params["kvplane"]["pull"] = signing.sign(self.key, params["kvplane"]["pull"])
        return True, params

    def _decode_finished(self, req: Req, blocks: list[int], new: list[int], ok: bool,
                         now: float) -> tuple[bool, dict[str, Any] | None]:
        xfer, attempt = req.leg.xfer, req.attempt
        phase = self.decode.phase(xfer, attempt)
        if not ok:
            self._handle("decode", dcore.Abort(xfer, attempt), now)
            self._forget(req)
            return False, None
        if new and phase in ("absent", "decoding"):
            self._handle("decode", dcore.Allocate(xfer, attempt, tuple(new)), now)
            req.blocks += new
        retain = rules.retain_decision(req.leg.retain, self.cfg.bidirectional_kv_xfer,
                                       bool(blocks))
        if self.decode.phase(xfer, attempt) != "decoding":
            self._forget(req)
            return False, None
        if not retain:
            self._handle("decode", dcore.Finish(xfer, attempt), now)
            self._forget(req)
            return False, None
        num_tokens = int(req.request.num_computed_tokens)
        tokens = list(req.request.all_token_ids)[:num_tokens]
        bs = self.layout.block_size
        salt = self.salt_of(req.request)
        hashes = block_hashes(tokens, bs, salt)
        ttl = rules.retain_ttl(self.cfg.decoder_kv_blocks_ttl, req.leg.retain_ttl)
        lease = f"{xfer}#{attempt}/retained"
        req.vllm = "delay_send"
        renewable = self.cfg.lease_renewable
        events = self._handle("decode", dcore.Finish(xfer, attempt, dcore.Retain(
            lease, ttl, renewable, num_tokens, hashes)), now)
        grant = next((e for e in events if isinstance(e, LeaseGranted)), None)
        if grant is None:
            self._forget(req)
            return False, None
        retained = Retained(self.me, xfer, attempt, lease, tuple(blocks), num_tokens, bs,
                            hashes, grant.expires_at, renewable, self.layout, salt)
        self.published[lease] = retained
        self.side_channel.set(f"retained/{xfer}", json.dumps(retained.to_dict()).encode())
        return True, decode_response(retained)

    def salt_of(self, request: Any) -> str:
        """The block-hash salt of a request: model, LoRA adapter, cache_salt, multimodal
        inputs (never the handle's word for it)."""
        lora = getattr(request, "lora_request", None)
        mm = [str(getattr(f, "identifier", "") or getattr(f, "mm_hash", "") or "")
              for f in (getattr(request, "mm_features", None) or [])]
        salt = getattr(request, "cache_salt", None)
        return rules.reuse_salt(self.cfg.hash_salt, model=self.model,
                                lora=getattr(lora, "lora_name", None) if lora else None,
                                cache_salt=salt if isinstance(salt, str) else None,
                                mm_hashes=mm)

    # ---- facts from the workers -----------------------------------------------------------------

    @_locked
    def on_fact(self, fact: Fact) -> None:
        xfer, attempt = fact.xfer, fact.attempt
        if fact.kind == "notif":
            self._on_notif(fact)
        elif (fact.kind == "read_done" and fact.purpose in ("pull", "reuse")) or (
                fact.kind == "write_done" and fact.purpose == "push"):
            self._stream_ended(fact)
        elif fact.kind == "notify_done" and not fact.ok:
            logger.warning("kvplane %s: %s notification for %s failed: %s", self.me.instance,
                           fact.purpose, xfer, fact.reason)
            if fact.purpose == "register" and self.decode.phase(xfer, attempt) in (
                    "awaiting_kv", "aborting"):
                self._handle("decode", dcore.KVFailed(xfer, attempt,
                                                      f"registration not sent: {fact.reason}"),
                             fact.at)

    def _on_notif(self, fact: Fact) -> None:
        body, now = fact.body, fact.at
        if self.key:
            try:
                signing.verify(self.key, body)
                if body.get("kind") != fact.notif:
                    raise signing.SignatureError("signed for another kind of notification")
            except signing.SignatureError as exc:
                self.fault(f"{fact.notif} notification refused", exc,
                           request=f"{fact.xfer}~notif", attempt=fact.attempt, at=now)
                return
        try:
            xfer, attempt = str(body["xfer"]), int(body["attempt"])
            if fact.notif == "REG":
                peer = Endpoint.from_dict(body["decode"])
                deadline = body.get("deadline")
                blocks = tuple(int(b) for b in body["blocks"])
                skip = int(body.get("skip", 0))
                if not 0 <= skip < len(blocks):
                    raise PeerError(f"skip {skip} does not fit {len(blocks)} blocks")
                self.decode_of.setdefault((xfer, attempt), peer)
                self.skip_of.setdefault((xfer, attempt), skip)
                assumed = body.get("src_layout")
                reason = None if assumed is None else rules.registration_mismatch(
                    layout_from_dict(assumed).tp, self.layout.tp)
                if reason is not None:
                    self.fault("registration refused", PeerError(reason), request=xfer,
                               attempt=attempt, at=now)
                    self._tell_decode_failed(xfer, attempt, reason)
                    return
                cmd = pcore.Register(xfer, attempt, peer.instance, blocks,
                                     layout_from_dict(body["layout"]),
                                     None if deadline is None else float(deadline))
                if not self._handle("prefill", cmd, now):
                    self._tell_decode_failed(xfer, attempt, "registration refused")
            elif fact.notif == "DONE":
                self._handle("decode", dcore.Notify(xfer, attempt, int(body["src_rank"]),
                                                    int(body["dst_rank"])), now)
            elif fact.notif == "FAIL":
                self._handle("decode", dcore.KVFailed(xfer, attempt, str(body.get("reason"))),
                             now)
            elif fact.notif == "READ":
                self._handle("prefill", pcore.PullReadDone(xfer, attempt), now)
        except (KeyError, TypeError, ValueError, PeerError) as exc:
            logger.warning("kvplane %s: bad %s notification %r: %s", self.me.instance,
                           fact.notif, body, exc)
        except ProtocolError as exc:
            logger.warning("kvplane %s: %s notification out of turn: %s", self.me.instance,
                           fact.notif, exc)

    @_locked
    def shutdown(self) -> None:
        self.side_channel.close()
        self.recorder.close()

