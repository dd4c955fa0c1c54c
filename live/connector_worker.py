"""KvplaneConnector's worker half: the KV cache registered with NIXL, and a transfer thread that
carries out the scheduler half's orders.

How it works:
- `register_kv_caches` registers every layer's cache tensor with one `Transport` (NIXL, UCX,
  host memory on CPU). Layers are laid end to end in layer order, so "block b of layer l" is
  the byte offset `region_start[l] + b * block_stride`. Both sides run the same model, so the
  same order on both sides.
- The handshake (`KvplaneHandshake`: the transport's `local_info()` plus the block geometry)
  goes to the scheduler process through vLLM (`get_handshake_metadata`), which serves it on the
  side channel.
- One daemon thread, `kvplane-xfer`, owns the transport: it turns block runs into byte runs,
  posts READs and WRITEs, polls them, sends notifications, and drains incoming notifications.
  A peer's handshake is fetched from the peer's side channel by a separate small pool
  (`kvplane-handshake`) the first time an order needs that peer; the order waits (with its
  deadline) while other peers' transfers go on, so an unreachable peer delays only the orders
  addressed to it, never another tenant's transfer.
- A READ of a peer's leased blocks (pull hold, retained KV) first pins the lease on the peer's
  side channel (`pin/`, on the same pool): a lease that is gone or would expire before the READ
  ends refuses, and the READ fails instead of reading freed blocks; `unpin/` follows the READ. The engine
  thread only hands it orders and takes back facts through queues, so preparing descriptors,
  handshakes and waiting never happen on the engine loop (decode's loop in push mode only
  queues a registration order).
- Failures (peer unreachable, transfer failed or too slow) come back as facts with ok=False and
  a reason; the scheduler half's core decides what follows. A peer whose transfer failed is
  forgotten, so the next order handshakes again (a restarted peer has a new agent).
"""

from __future__ import annotations

import base64
import collections
import concurrent.futures as cf
import json
import logging
import math
import queue
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvplane.live.connector_wire import (
    Endpoint,
    Fact,
    KvplaneHandshake,
    KvplaneMeta,
    KvplaneWorkerMeta,
    Order,
    decode_notif,
    fact_to_bytes,
)
from kvplane.live.sidechannel import FactSender, fetch, rank_key

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Geometry:
    """How block ids map to bytes on one rank: region i is layer i's cache."""

    region_sizes: tuple[int, ...]
    block_stride: int
    block_bytes: int
    num_blocks: int

    def starts(self) -> list[int]:
        out, pos = [], 0
        for n in self.region_sizes:
            out.append(pos)
            pos += n
        return out

    def layout(self) -> Any:
        """The transport's block layout of this rank: one piece per layer and block."""
        from kvplane.live.staging import BlockLayout

        return BlockLayout(tuple(self.starts()), self.block_stride, self.block_bytes,
                           self.num_blocks)

    def to_dict(self) -> dict[str, Any]:
        return {"region_sizes": list(self.region_sizes), "block_stride": self.block_stride,
                "block_bytes": self.block_bytes, "num_blocks": self.num_blocks}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Geometry:
        return cls(tuple(int(x) for x in d["region_sizes"]), int(d["block_stride"]),
                   int(d["block_bytes"]), int(d["num_blocks"]))


def encode_rank_payload(info: bytes, geometry: Geometry) -> bytes:
    return json.dumps({"info": base64.b64encode(info).decode("ascii"),
                       "geometry": geometry.to_dict()}).encode()


def decode_rank_payload(data: bytes) -> tuple[bytes, Geometry]:
    d = json.loads(data)
    return base64.b64decode(d["info"]), Geometry.from_dict(d["geometry"])


def byte_runs(runs: Iterable[tuple[int, int, int]], local: Geometry, remote: Geometry,
              local_is_src: bool) -> list[tuple[int, int, int]]:
    """Block runs `(src, dst, count)` as byte runs `(local, remote, length)`, layer by layer."""
    if len(local.region_sizes) != len(remote.region_sizes):
        raise ValueError(f"layer count differs: ours {len(local.region_sizes)}, peer's "
                         f"{len(remote.region_sizes)}")
    if local.block_bytes != remote.block_bytes:
        raise ValueError(f"block bytes differ: ours {local.block_bytes}, peer's "
                         f"{remote.block_bytes}")
    out = []
    ls, rs = local.starts(), remote.starts()
    runs = list(runs)
    for layer in range(len(ls)):
        for src, dst, count in runs:
            lb, rb = (src, dst) if local_is_src else (dst, src)
            if lb + count > local.num_blocks or rb + count > remote.num_blocks:
                raise ValueError(f"block run {(src, dst, count)} is past the cache")
            if local.block_stride == local.block_bytes and remote.block_stride == \
                    remote.block_bytes:
                out.append((ls[layer] + lb * local.block_stride,
                            rs[layer] + rb * remote.block_stride, count * local.block_bytes))
            else:
                out += [(ls[layer] + (lb + i) * local.block_stride,
                         rs[layer] + (rb + i) * remote.block_stride, local.block_bytes)
                        for i in range(count)]
    return out


def block_ids(runs: Iterable[tuple[int, int, int]], local: Geometry, remote: Geometry,
              local_is_src: bool) -> tuple[Any, Any]:
    """Block runs `(src, dst, count)` as two block-id arrays (ours, the peer's), one entry per
    block in run order: what `Transport.post_blocks` plans from (numpy, no per-run loop)."""
    import numpy as np

    if len(local.region_sizes) != len(remote.region_sizes):
        raise ValueError(f"layer count differs: ours {len(local.region_sizes)}, peer's "
                         f"{len(remote.region_sizes)}")
    if local.block_bytes != remote.block_bytes:
        raise ValueError(f"block bytes differ: ours {local.block_bytes}, peer's "
                         f"{remote.block_bytes}")
    arr = np.asarray(list(runs), dtype=np.int64).reshape(-1, 3)
    src, dst, count = arr[:, 0], arr[:, 1], arr[:, 2]
    lb, rb = (src, dst) if local_is_src else (dst, src)
    bad = (count <= 0) | (lb < 0) | (rb < 0) | (lb + count > local.num_blocks) | (
        rb + count > remote.num_blocks)
    if bad.any():
        raise ValueError(f"block run {tuple(int(x) for x in arr[bad][0])} is past the cache")
    within = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count,
                                                                   count)
    return np.repeat(lb, count) + within, np.repeat(rb, count) + within


@dataclass(frozen=True, slots=True)
class CacheRegion:
    """One layer's KV cache as NIXL sees it: a flat view of its memory, blocks outermost."""

    name: str
    flat: Any  # a contiguous 1-D tensor over the layer's whole cache
    num_blocks: int
    block_stride: int  # bytes from one block to the next
    block_bytes: int  # bytes of one block (all its K/V, heads and tokens)
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(self.flat.numel()) * int(self.flat.element_size())


def _dense_inner(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True when dims 1.. (in any order, as a layout permutation leaves them) pack one block
    densely: sorted by stride, each stride is the product of the sizes inside it."""
    inner = sorted(((st, sz) for st, sz in zip(strides[1:], shape[1:]) if sz != 1))
    expected = 1
    for st, sz in inner:
        if st != expected:
            return False
        expected *= sz
    return True


def cache_region(name: str, t: Any) -> CacheRegion:
    """One layer's cache tensor as a region: blocks must be the outermost dimension and each
    block one dense run of bytes (any order inside it: vLLM's NHD or HND, K and V together or
    MLA's single latent, any dtype including FP8). vLLM hands permuted views for HND; the
    region is the memory under the view, so it is registered as a flat alias of it."""
    import torch

    shape, strides = tuple(int(x) for x in t.shape), tuple(int(x) for x in t.stride())
    if len(shape) < 2:
        raise ValueError(f"KV cache of {name} has shape {shape}: no block dimension")
    num_blocks, elt = shape[0], t.element_size()
    block_elems = math.prod(shape[1:])
    if not _dense_inner(shape, strides) or strides[0] < block_elems:
        raise ValueError(
            f"KV cache of {name} is not block-major (shape {shape}, strides {strides}): "
            "kvplane needs blocks outermost and each block dense; vLLM's layout for this "
            "attention backend does not give that (see docs/deploy.md, KV cache layout)")
    span = strides[0] * (num_blocks - 1) + block_elems
    flat = torch.as_strided(t, (span,), (1,))
    return CacheRegion(name, flat, num_blocks, strides[0] * elt, block_elems * elt,
                       str(t.dtype).replace("torch.", ""))


def cache_regions(kv_caches: dict[str, Any]) -> list[CacheRegion]:
    """Every layer's region in layer order, a layer sharing another's cache counted once; all
    layers must agree on block count and geometry (one KV cache group)."""
    seen: set[int] = set()
    out: list[CacheRegion] = []
    for name in sorted(kv_caches, key=_layer_index):
        t = kv_caches[name]
        if isinstance(t, (list, tuple)):
            raise ValueError(  # noqa: TRY004 - a layout we refuse, like the others
                f"KV cache of {name} is split in {len(t)} tensors (separate K and V); "
                "kvplane needs one tensor per layer")
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out.append(cache_region(name, t))
    if not out:
        raise ValueError("vLLM registered no KV cache tensors")
    first = out[0]
    for r in out[1:]:
        if (r.num_blocks, r.block_stride, r.block_bytes) != (
                first.num_blocks, first.block_stride, first.block_bytes):
            raise ValueError(
                f"KV cache of {r.name} ({r.num_blocks} blocks of {r.block_bytes} bytes, "
                f"stride {r.block_stride}) differs from {first.name}'s ({first.num_blocks}, "
                f"{first.block_bytes}, {first.block_stride}): layers of several KV cache "
                "groups or sizes are not supported")
    return out


def _layer_index(name: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", name))


@dataclass(slots=True)
class _InFlight:
    order: Order
    peer: str
    transfer: Any
    started: float


@dataclass(slots=True)
class Stats:
    """What moved since the last report (worker -> vLLM's metrics)."""

    bytes: list[int] = field(default_factory=list)
    descriptors: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    failed: int = 0

    def empty(self) -> bool:
        return not self.bytes and not self.failed

    def to_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "descriptors": self.descriptors, "seconds": self.seconds,
                "ops": self.ops, "failed": self.failed}


class TransferThread:
    """Owns the transport once started; see the module docstring."""

    def __init__(self, transport: Any, geometry: Geometry, rank: int, name: str,
                 sender: FactSender | None = None) -> None:
        self.transport = transport
        self.sender = sender
        self.geometry = geometry
        self.rank = rank
        self.orders: queue.SimpleQueue[Order] = queue.SimpleQueue()
        self.facts: collections.deque[Fact] = collections.deque()
        self.stats: collections.deque[tuple[str, bool, int, int, float]] = collections.deque()
        self._peers: dict[tuple[str, int], tuple[str, Geometry]] = {}
        # handshakes being fetched off this thread, and the orders waiting for them
        self._fetching: dict[tuple[str, int], cf.Future[bytes]] = {}
        self._waiting: dict[tuple[str, int], list[Order]] = {}
        self._pool = cf.ThreadPoolExecutor(4, thread_name_prefix="kvplane-handshake")
        self._pinning: list[tuple[cf.Future[bytes], Order]] = []
        self._inflight: list[_InFlight] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvplane-xfer-{name}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.sender is not None:
            self.sender.close()

    # ---- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        idle = 0.0
        while not self._stop.is_set():
            busy = False
            try:
                while True:
                    order = self.orders.get_nowait()
                    busy = True
                    self._start(order)
            except queue.Empty:
                pass
            except Exception:
                logger.exception("kvplane: transfer thread failed to start an order")
            try:
                busy |= self._handshakes()
                busy |= self._pins()
                busy |= self._poll()
                busy |= self._drain()
            except Exception:
                logger.exception("kvplane: transfer thread failed while polling")
            if busy or self._inflight or getattr(self.transport, "busy", False):  # staging
                idle = 0.0
                time.sleep(0)
            elif self._waiting or self._pinning:
                idle = 0.0
                self._stop.wait(0.001)
            else:
                idle = min(0.002, max(idle * 2, 0.0001))
                self._stop.wait(idle)

    def emit(self, fact: Fact) -> None:
        """Straight to our scheduler process when we can; else with the next step's metadata."""
        if self.sender is None or not self.sender.send(fact_to_bytes(fact)):
            self.facts.append(fact)

    def _fact(self, order: Order, kind: str, ok: bool, reason: str = "", **kw: Any) -> None:
        self.emit(Fact(kind, order.xfer, order.attempt, time.time(), ok=ok,  # type: ignore[arg-type]
                       reason=reason, purpose=order.purpose, rank=self.rank, **kw))

    def _handshakes(self) -> bool:
        """Orders waiting for a handshake: failed past their deadline, started once it came."""
        if not self._waiting:
            return False
        busy, now = False, time.time()
        for key in list(self._waiting):
            orders = self._waiting[key]
            late = [o for o in orders if o.deadline and now > o.deadline]
            for o in late:
                busy = True
                self._fact(o, "notify_done" if o.kind == "notify" else f"{o.kind}_done", False,
                           "deadline passed waiting for the peer's handshake")
            orders = [o for o in orders if o not in late]
            fut = self._fetching.get(key)
            if fut is None or not fut.done():
                if orders:
                    self._waiting[key] = orders
                else:
                    self._waiting.pop(key, None)
                continue
            busy = True
            del self._fetching[key]
            self._waiting.pop(key, None)
            try:
                info, geom = decode_rank_payload(fut.result())
                name = self.transport.add_peer(info)
            except Exception as exc:  # noqa: BLE001 - unreachable, nonsense or a NIXL error
                for o in orders:
                    self._fact(o, "notify_done" if o.kind == "notify" else f"{o.kind}_done",
                               False, f"handshake with {o.peer.instance} failed: {exc}")
                continue
            self._peers[key] = (name, geom)
            logger.info("kvplane: connected to %s:%d as NIXL peer %s", key[0], key[1], name)
            for o in orders:
                self._start(o)
        return busy

    def _forget_peer(self, ep: Endpoint) -> None:
        self._peers.pop((ep.host, ep.port), None)

    def _pins(self) -> bool:
        """READs waiting for their pin: posted once pinned, failed if refused."""
        if not self._pinning:
            return False
        busy, still = False, []
        for fut, order in self._pinning:
            if not fut.done():
                still.append((fut, order))
                continue
            busy = True
            try:
                fut.result()
            except Exception as exc:  # noqa: BLE001 - refused, unreachable or nonsense
                self._fact(order, "read_done", False,
                           f"the source's lease is not alive (pin refused): {exc}")
                continue
            self._start(order, pinned=True)
        self._pinning = still
        return busy

    def _ask_pin(self, order: Order) -> bytes:
        body = json.loads(order.pin)
        body["duration"] = max(0.0, order.deadline - time.time()) if order.deadline else 1.0
        return fetch(order.peer.host, order.peer.port, "pin/" + json.dumps(body))

    def _unpin(self, order: Order) -> None:
        def go() -> None:
            try:
                fetch(order.peer.host, order.peer.port, "unpin/" + order.pin)
            except Exception as exc:  # noqa: BLE001 - the pin then ends with the lease
                logger.warning("kvplane: unpin after the READ of %s failed: %s", order.xfer, exc)

        self._pool.submit(go)

    def _start(self, order: Order, pinned: bool = False) -> None:
        done = "notify_done" if order.kind == "notify" else f"{order.kind}_done"
        if order.deadline and time.time() > order.deadline:
            self._fact(order, done, False, "deadline passed before the transfer started")
            return
        key = (order.peer.host, order.peer.port)
        if key not in self._peers:
            # fetched off this thread; the order waits for it (see _handshakes)
            self._waiting.setdefault(key, []).append(order)
            if key not in self._fetching:
                self._fetching[key] = self._pool.submit(fetch, key[0], key[1],
                                                        rank_key(self.rank))
            return
        peer, geom = self._peers[key]
        if order.kind == "read" and order.pin and not pinned:
            self._pinning.append((self._pool.submit(self._ask_pin, order), order))
            return
        if order.kind == "notify":
            res = self.transport.send_notification(peer, order.notify)
            if not res.ok:
                self._forget_peer(order.peer)
            self._fact(order, done, res.ok, res.reason)
            return
        op = "WRITE" if order.kind == "write" else "READ"
        notify = order.notify if order.kind == "write" else b""
        try:
            ours, theirs = block_ids(order.runs, self.geometry, geom,
                                     local_is_src=order.kind == "write")
            # Planned at block level (block-id arrays, per-layer address table): the staged
            # path then sends block ids, not a run list (live/staging.py).
            t = self.transport.post_blocks(peer, op, self.geometry.layout(), ours,
                                           geom.layout(), theirs, notify=notify)
        except ValueError as exc:  # TransportError is one: a layout that does not fit
            self._fact(order, done, False, f"cannot map blocks: {exc}")
            return
        self._inflight.append(_InFlight(order, peer, t, time.perf_counter()))

    def _poll(self) -> bool:
        if not self._inflight:
            return False
        from kvplane.live.transport import Status

        still, changed = [], False
        now = time.time()
        for f in self._inflight:
            status = self.transport.poll(f.transfer)
            if status is Status.PENDING and f.order.deadline and now > f.order.deadline:
                self.transport.wait(f.transfer, 0.0)  # releases the handle: TIMED_OUT
                status = f.transfer.result.status if f.transfer.result else Status.TIMED_OUT
            if status is Status.PENDING:
                still.append(f)
                continue
            changed = True
            self._finish(f)
        self._inflight = still
        return changed

    def _finish(self, f: _InFlight) -> None:
        res = f.transfer.result
        ok = res is not None and res.ok
        seconds = time.perf_counter() - f.started
        order = f.order
        reason = "" if ok else (res.reason if res is not None else "no result")
        if order.kind == "read" and order.pin:
            self._unpin(order)
        if ok and order.kind == "read" and order.notify:
            sent = self.transport.send_notification(f.peer, order.notify)
            if not sent.ok:
                logger.warning("kvplane: read of %s done but telling %s failed: %s",
                               order.xfer, order.peer.instance, sent.reason)
        if not ok:
            self._forget_peer(order.peer)
            logger.warning("kvplane: %s of %s %s %s: %s", order.kind.upper(), order.xfer,
                           "to" if order.kind == "write" else "from", order.peer.instance,
                           reason)
        nbytes = res.nbytes if res is not None else 0
        descs = res.descriptors if res is not None else 0
        self.stats.append((order.kind, ok, nbytes, descs, seconds))
        self._fact(order, f"{order.kind}_done", ok, reason, nbytes=nbytes if ok else 0,
                   descriptors=descs, seconds=seconds)

    def _drain(self) -> bool:
        got = False
        for n in self.transport.notifications():
            parsed = decode_notif(n.message)
            if parsed is None:
                continue
            kind, body = parsed
            got = True
            try:
                xfer, attempt = str(body["xfer"]), int(body["attempt"])
            except (KeyError, TypeError, ValueError):
                logger.warning("kvplane: notification without a transfer id: %r", n.message)
                continue
            self.emit(Fact("notif", xfer, attempt, time.time(), notif=kind, body=body,
                           rank=self.rank))
        return got


class WorkerHalf:
    """The worker-side logic, driven by the facade; vLLM-free apart from the tensors it gets."""

    def __init__(self, instance: str, rank: int, *, progress_thread: bool = False,
                 post_to: tuple[str, int] | None = None, backend: str = "UCX") -> None:
        self.instance = instance
        self.backend = backend
        self.post_to = post_to
        self.rank = rank
        self.progress_thread = progress_thread
        self.transport: Any = None
        self.geometry: Geometry | None = None
        self.thread: TransferThread | None = None
        self._reports = KvplaneMeta()
        self._load_errors: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from kvplane.live.staging import staging_for
        from kvplane.live.transport import Transport

        regions = cache_regions(kv_caches)
        first = regions[0]
        self.transport = Transport(f"{self.instance}-rank{self.rank}-{time.time_ns() % 10**9}",
                                   granule=math.gcd(first.block_stride, first.block_bytes),
                                   progress_thread=self.progress_thread, backend=self.backend,
                                   staging=staging_for(first.flat))
        for r in regions:
            self.transport.register(r.flat)
        self.geometry = Geometry(tuple(r.nbytes for r in regions), first.block_stride,
                                 first.block_bytes, first.num_blocks)
        logger.info("kvplane %s rank %d: registered %d layers x %d blocks of %d bytes "
                    "(stride %d, %s) with NIXL %s", self.instance, self.rank, len(regions),
                    first.num_blocks, first.block_bytes, first.block_stride, first.dtype,
                    self.backend)
        sender = FactSender(*self.post_to) if self.post_to else None
        self.thread = TransferThread(self.transport, self.geometry, self.rank, self.instance,
                                     sender)
        self.thread.start()

    def handshake(self) -> KvplaneHandshake | None:
        if self.transport is None or self.geometry is None:
            return None
        payload = encode_rank_payload(self.transport.local_info(), self.geometry)
        return KvplaneHandshake(self.rank, payload, self.geometry.block_bytes,
                                self.geometry.num_blocks, len(self.geometry.region_sizes))

    def start_step(self, meta: Any) -> None:
        """This step's orders go to the transfer thread; its reports are repeated to vLLM."""
        if not isinstance(meta, KvplaneMeta):
            return
        if self.thread is not None:
            for order in meta.orders:
                self.thread.orders.put(order)
        r = self._reports
        r.finished_sending |= meta.finished_sending
        r.finished_recving |= meta.finished_recving
        r.failed_recving |= meta.failed_recving
        r.load_error_blocks |= meta.load_error_blocks

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        r, self._reports = self._reports, KvplaneMeta()
        self._load_errors = r.load_error_blocks
        return r.finished_sending, r.finished_recving, r.failed_recving

    def load_error_blocks(self) -> set[int]:
        """Blocks of the loads that failed among the last `transfer_results()` (vLLM 0.25.1
        recomputes a failed load only when its blocks are named; see vllm_compat)."""
        out, self._load_errors = self._load_errors, set()
        return out

    def worker_meta(self) -> KvplaneWorkerMeta | None:
        if self.thread is None or not self.thread.facts:
            return None
        facts = []
        while self.thread.facts:
            facts.append(self.thread.facts.popleft())
        return KvplaneWorkerMeta(facts)

    def take_stats(self) -> Stats | None:
        if self.thread is None or not self.thread.stats:
            return None
        s = Stats()
        while self.thread.stats:
            kind, ok, nbytes, descs, seconds = self.thread.stats.popleft()
            if not ok:
                s.failed += 1
                continue
            s.bytes.append(nbytes)
            s.descriptors.append(descs)
            s.seconds.append(seconds)
            s.ops.append(kind)
        return s

    def shutdown(self) -> None:
        if self.thread is not None:
            self.thread.stop()
            self.thread = None
        if self.transport is not None:
            self.transport.close()
            self.transport = None
