"""NIXL transport: the one small interface through which the live connector (and its tests) move
KV bytes between two processes.

How it works:
- One `Transport` per process (per worker): it owns one NIXL agent with one backend, UCX
  (default) or LIBFABRIC (EFA), never silently another. Making
  an agent costs 0.5-2 s, so make it once, at start-up.
- `register(buffer)` registers host memory ("DRAM": a numpy array or CPU torch tensor) or GPU
  memory ("VRAM": a CUDA torch tensor; exercised once on an H200, two processes, nixl-cu13).
  All regions of one transport are of one kind. Byte offsets address the regions laid end to
  end in registration order (`register` returns where the new region starts), so the connector
  can name any byte of any layer by one integer.
- Handshake, out of band (the caller carries the bytes: a side channel, a pipe): each side sends
  `local_info()` (NIXL agent metadata plus our region layout) and the other calls `add_peer`.
  Adding a known peer again with the same layout keeps its connection (`remove_peer` first to
  reconnect).
  Register everything before the first `local_info()`/`add_peer`: after that the layout is frozen.
- `add_peer` prepares both descriptor lists once per peer (`prep_xfer_dlist`), cut into granules
  of gcd(our granule, peer's granule) bytes. A transfer then only picks indices
  (`make_prepped_xfer`): cheap per request. Runs `(local_offset, remote_offset, length)` are
  merged first where they continue each other on both sides; NIXL merges adjacent granules again.
  Every offset and length must be a multiple of that granule.
- `post_blocks` does the same for whole KV blocks, from two block-id arrays and each side's
  `BlockLayout` (where piece p of block b lies): no run list is built for a staged transfer,
  which is how the connector's worker posts (live/staging.py has the block path).
- `post` starts a WRITE (local -> peer) or READ (peer -> local) and returns a `Transfer`;
  `wait`/`poll` finish it. A WRITE's notification message reaches the peer only after its data
  has landed: the target treats the notification as completion (`wait_notification`).

Rules:
- nixl (and numpy, torch) are imported inside functions, so `import kvplane.live.transport`
  works where nixl is not installed; making a `Transport` then raises `NixlUnavailable`.
- With the progress thread off (the default: on 2 cores it crowds out everything else), NIXL
  moves only while someone calls into it. BOTH sides must keep polling (`poll`, `wait`,
  `notifications`, `progress`): a target blocked elsewhere (say, on a socket read) stalls even
  the initiator's first WRITE.
- Failures and time-outs come back as values (`TransferResult` with status FAILED or TIMED_OUT
  and a reason), never as exceptions into an engine loop. Exceptions are kept for our own misuse
  (`TransportError`: bad runs, registering after the handshake) and for a peer whose handshake
  bytes cannot be loaded (`PeerError`), both at set-up time.
- A peer that died shows up as FAILED at once (UCX reports the disconnect); a live peer that
  stops polling shows up as TIMED_OUT.
- A timed-out transfer's handle is released (which asks NIXL to cancel it); a backend that still
  writes afterwards writes into memory the caller must keep registered until `close()`.
- One thread at a time per transport unless made with `thread_safe=True` (NIXL's strict sync
  mode); our own bookkeeping is always under a lock.

Staging (`staging=StagingConfig(...)`, live/staging.py): the transport then also registers one
pool of staging slots when its layout freezes, and `post` chooses per transfer between the
merged runs ("direct") and a staged transfer (gather, one WRITE per slot, scatter on arrival)
by the estimate of kvplane.core.transfer_method, when the peer has staging too. A staged
transfer needs the peer's transport to keep polling (as every transfer does); both its READ and
its WRITE are carried out as WRITEs by the side that holds the data, and either is done only
when the bytes are in place on the receiver (as a direct transfer). `TransferResult.method`
says which was used; `busy` is true while staged jobs (ours or a peer's) are under way, when a
polling loop should not back off (each step of a staged transfer waits for the next poll).

IPC copies (live/ipc.py): on GPU memory the transport also exports CUDA IPC handles of its KV
regions in its handshake (`PeerInfo.ipc`; off with KVPLANE_IPC=off). For a block transfer
(`post_blocks`) to a peer on the same host whose GPU we reach, the estimate may choose "ipc":
we map the peer's cache (once per peer, dropped by `remove_peer`) and one kernel copies the
blocks, for a WRITE from our cache into the peer's and for a READ the other way; when its
event is done the notification goes over NIXL as for any WRITE, so the peer's completion rules
do not change. Any failure falls back to the estimate's other methods for that peer, recorded
(`fallbacks()`, `TransferResult.fallback`); run lists (`post`) never go by IPC.
"""

from __future__ import annotations

import base64
import collections
import json
import logging
import math
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal, Self

from kvplane.core.errors import PeerError
from kvplane.core.transfer_method import choose
from kvplane.live import ipc as ipc_copy
from kvplane.live.nixl_env import import_nixl_api, nixl_errors
from kvplane.live.staging import (
    DEFAULT_COSTS,
    MAGIC,
    BlockLayout,
    Stager,
    StagingConfig,
    allocate_pool,
    block_descriptors,
    block_runs_array,
)

Op = Literal["WRITE", "READ"]
MemKind = Literal["DRAM", "VRAM"]
RunLike = tuple[int, int, int]
# A sequence of runs, or an (N, 3) integer numpy array of them (the fast path).
RunsLike = Any

logger = logging.getLogger(__name__)

INFO_VERSION = 1
DEFAULT_GRANULE = 4096


class TransportError(ValueError):
    """Our side misused the transport (bad runs, registration after the handshake, ...)."""


class Status(str, Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    TIMED_OUT = "timed_out"


@dataclass(frozen=True, slots=True)
class Run:
    """`length` bytes from our `local_offset` to the peer's `remote_offset` (or back, for READ)."""

    local_offset: int
    remote_offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Region:
    address: int
    length: int
    device: int


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """What one side tells the other at handshake: NIXL agent metadata plus the region layout."""

    agent_name: str
    agent_metadata: bytes
    mem_kind: MemKind
    granule: int
    regions: tuple[Region, ...]
    staging_slot: int = 0  # bytes of one staging slot; 0: no staging
    ipc: dict[str, Any] | None = None  # CUDA IPC export of the KV regions (live/ipc.py)

    @property
    def size(self) -> int:
        return sum(r.length for r in self.regions)

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "v": INFO_VERSION,
                "agent_name": self.agent_name,
                "agent_metadata": base64.b64encode(self.agent_metadata).decode("ascii"),
                "mem_kind": self.mem_kind,
                "granule": self.granule,
                "regions": [[r.address, r.length, r.device] for r in self.regions],
                "staging_slot": self.staging_slot,
                **({"ipc": self.ipc} if self.ipc else {}),
            }
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> PeerInfo:
        try:
            d = json.loads(data)
            if d["v"] != INFO_VERSION:
                raise ValueError(f"handshake version {d['v']}, expected {INFO_VERSION}")
            info = cls(
                agent_name=str(d["agent_name"]),
                agent_metadata=base64.b64decode(d["agent_metadata"]),
                mem_kind=d["mem_kind"],
                granule=int(d["granule"]),
                regions=tuple(Region(int(a), int(n), int(dev)) for a, n, dev in d["regions"]),
                staging_slot=int(d.get("staging_slot", 0)),
                ipc=d.get("ipc"),
            )
            if info.ipc is not None and not isinstance(info.ipc, dict):
                raise ValueError("ipc must be an object")
        except (ValueError, KeyError, TypeError) as exc:
            raise PeerError(f"unreadable handshake: {exc}") from exc
        if info.mem_kind not in ("DRAM", "VRAM") or info.granule <= 0:
            raise PeerError(f"bad handshake: kind {info.mem_kind!r}, granule {info.granule}")
        return info


@dataclass(frozen=True, slots=True)
class TransferResult:
    status: Status
    peer: str
    op: str  # "WRITE", "READ" or "NOTIFY"
    nbytes: int
    descriptors: int  # after merging runs and cutting them at region boundaries (staged: slots)
    reason: str = ""
    method: str = "direct"  # "direct" (one descriptor per run), "staged" or "ipc"
    fallback: str = ""  # why the estimate's first choice (ipc) was not used, if it was not

    @property
    def ok(self) -> bool:
        return self.status is Status.DONE


@dataclass(frozen=True, slots=True)
class Notification:
    peer: str
    message: bytes


@dataclass(slots=True)
class Transfer:
    """A posted transfer. Finish it with `Transport.wait` (or `poll` until not PENDING)."""

    peer: str
    op: Op
    nbytes: int
    descriptors: int
    handle: Any = None
    result: TransferResult | None = None
    method: str = "direct"
    fallback: str = ""

    def finish(self, status: Status, reason: str = "") -> TransferResult:
        if self.result is None:  # the first outcome stands
            self.result = TransferResult(status, self.peer, self.op, self.nbytes,
                                         self.descriptors, reason, self.method, self.fallback)
        return self.result


@dataclass(slots=True)
class _IpcJob:
    """An IPC copy in flight: its event, and the notification to send once it is done."""

    event: Any
    notify: bytes


@dataclass(frozen=True, slots=True)
class Fallback:
    """A transfer that could not use the method the estimate chose (ipc) and used another."""

    peer: str
    chosen: str
    used: str
    reason: str
    at: float


@dataclass(slots=True)
class _Peer:
    info: PeerInfo
    granule: int
    local_dlist: Any
    remote_dlist: Any


@dataclass(slots=True)
class _Registered:
    region: Region
    keepalive: object  # the buffer, so its memory outlives the registration
    reg_descs: Any = field(default=None)


def merge_runs(runs: RunsLike) -> list[Run]:
    """Sort runs by local offset and join those that continue each other on both sides."""
    return [Run(int(lo), int(ro), int(n)) for lo, ro, n in _merged_array(runs)]


def _merged_array(runs: RunsLike) -> Any:
    """`merge_runs` as an (N, 3) int64 array, vectorised: a request can carry thousands of runs
    and a Python loop over them would cost more than NIXL's own per-descriptor work. Works on
    the three columns apart (1-D gathers are several times faster than gathering rows)."""
    import numpy as np

    if isinstance(runs, np.ndarray):
        arr = runs.astype(np.int64, copy=False).reshape(-1, 3)
    else:
        arr = np.array([(r.local_offset, r.remote_offset, r.length) if isinstance(r, Run)
                        else tuple(r) for r in runs], dtype=np.int64).reshape(-1, 3)
    lo, ro, n = (np.ascontiguousarray(arr[:, i]) for i in range(3))
    if not (n > 0).all():
        keep = n > 0
        lo, ro, n = lo[keep], ro[keep], n[keep]
    if len(lo) > 1 and not (lo[1:] >= lo[:-1]).all():
        order = np.argsort(lo, kind="stable")
        lo, ro, n = lo.take(order), ro.take(order), n.take(order)
    out = np.empty((len(lo), 3), dtype=np.int64)
    if len(lo) < 2:
        out[:, 0], out[:, 1], out[:, 2] = lo, ro, n
        return out
    cont = (lo[1:] == lo[:-1] + n[:-1]) & (ro[1:] == ro[:-1] + n[:-1])
    if not cont.any():
        out[:, 0], out[:, 1], out[:, 2] = lo, ro, n
        return out
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    out = np.empty((len(starts), 3), dtype=np.int64)
    out[:, 0], out[:, 1] = lo.take(starts), ro.take(starts)
    out[:, 2] = np.add.reduceat(n, starts)
    return out


def count_descriptors(runs: RunsLike, local: Sequence[Region], remote: Sequence[Region]) -> int:
    """Pieces the (merged) runs fall into once cut at either side's region boundaries."""
    return _count_merged(_merged_array(runs), local, remote)


def _count_merged(arr: Any, local: Sequence[Region], remote: Sequence[Region]) -> int:
    import numpy as np

    cuts_l = np.array(_boundaries(local)[:-1], dtype=np.int64)
    cuts_r = np.array(_boundaries(remote)[:-1], dtype=np.int64)
    lo, ro, n = arr[:, 0], arr[:, 1], arr[:, 2]
    inner_l = np.searchsorted(cuts_l, lo + n, "left") - np.searchsorted(cuts_l, lo, "right")
    inner_r = np.searchsorted(cuts_r, ro + n, "left") - np.searchsorted(cuts_r, ro, "right")
    total = len(arr)
    # Few runs cross a region boundary; count those exactly (a cut may fall at the same place
    # on both sides).
    for i in np.flatnonzero((inner_l > 0) | (inner_r > 0)):
        a, b, m = int(lo[i]), int(ro[i]), int(n[i])
        cuts = {int(c) - a for c in cuts_l if a < c < a + m}
        cuts |= {int(c) - b for c in cuts_r if b < c < b + m}
        total += len(cuts)
    return total


def _boundaries(regions: Sequence[Region], *, start: bool = False) -> list[int]:
    """Where each region ends in the offset space (with `start`: 0 first, then the ends)."""
    out, pos = [0] if start else [], 0
    for reg in regions:
        pos += reg.length
        out.append(pos)
    return out


def _describe_buffer(buffer: object) -> tuple[Region, MemKind]:
    """Address, length, device and memory kind of a numpy array or torch tensor."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buffer, torch.Tensor):
        if not buffer.is_contiguous():
            raise TransportError("register a contiguous tensor")
        nbytes = buffer.numel() * buffer.element_size()
        if buffer.device.type == "cuda":
            return Region(buffer.data_ptr(), nbytes, buffer.device.index or 0), "VRAM"
        if buffer.device.type == "cpu":
            return Region(buffer.data_ptr(), nbytes, 0), "DRAM"
        raise TransportError(f"cannot register memory on device {buffer.device}")
    import numpy as np

    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise TransportError("register a C-contiguous array")
        return Region(int(buffer.ctypes.data), int(buffer.nbytes), 0), "DRAM"
    raise TransportError(f"cannot register a {type(buffer).__name__}: numpy array or tensor")


BACKENDS = ("UCX", "LIBFABRIC")
BACKEND_HINTS = {
    "UCX": "The UCX plugin ships in the nixl-cu12/nixl-cu13 wheel; see nixl_env.INSTALL_HINT.",
    "LIBFABRIC": "NIXL's LIBFABRIC plugin needs libfabric.so.1 and libhwloc.so.15 on the "
                 "library path (EFA: the AWS EFA installer; elsewhere Debian's libfabric1 and "
                 "libhwloc15) and a working provider (FI_PROVIDER: efa on EFA, tcp to try it "
                 "without one); `fi_info -p $FI_PROVIDER` shows whether the provider loads.",
}


def nixl_backend(value: object) -> str:
    """The NIXL backend a setting names: "UCX" or "LIBFABRIC" (case-insensitive), or a list of
    exactly one of them (deploy writes `backends: [..]`). Anything else is refused: a backend
    we would not make must never be silently replaced by another."""
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise TransportError(f"backends {list(value)!r}: name exactly one of {BACKENDS}")
        value = value[0]
    name = str(value).strip().upper()
    if name not in BACKENDS:
        raise TransportError(f"NIXL backend {value!r} is not supported; choose one of "
                             f"{', '.join(BACKENDS)}")
    return name


class Transport:
    """One NIXL agent (UCX or LIBFABRIC), its registered regions, its peers and its notification inbox."""

    def __init__(self, name: str, *, granule: int = DEFAULT_GRANULE,
                 progress_thread: bool = False, thread_safe: bool = False,
                 staging: StagingConfig | None = None, backend: str = "UCX",
                 ipc: bool | None = None) -> None:
        if granule <= 0:
            raise TransportError("granule must be positive")
        backend = nixl_backend(backend)
        api = import_nixl_api()
        sync = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if thread_safe else None
        config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=[backend],
                                       sync_mode=sync)
        self._errors = nixl_errors()
        try:
            self._agent = api.nixl_agent(name, config)
        except self._errors as exc:
            raise TransportError(f"NIXL could not create its {backend} backend here: "
                                 f"{_why(exc)}. {BACKEND_HINTS[backend]}") from exc
        if backend not in self._agent.backends:
            raise TransportError(f"NIXL could not create its {backend} backend here (plugins "
                                 f"made: {sorted(self._agent.backends) or 'none'}). "
                                 f"{BACKEND_HINTS[backend]}")
        self.backend = backend
        self.name = name
        self.granule = granule
        self._lock = threading.RLock()
        self._regions: list[_Registered] = []
        self._mem_kind: MemKind | None = None
        self._frozen = False
        self._local_dlists: dict[int, Any] = {}
        self._peers: dict[str, _Peer] = {}
        self._inbox: list[Notification] = []
        self._staging = staging
        self._stager: Stager | None = None
        self._slot_bytes = 0
        # IPC copies (live/ipc.py): wanted unless KVPLANE_IPC=off; made when the layout
        # freezes, for GPU memory only.
        self._ipc_wanted = ipc_copy.enabled() if ipc is None else ipc
        self._ipc: ipc_copy.IpcSide | None = None
        self._fallbacks: collections.deque[Fallback] = collections.deque(maxlen=256)
        self._ipc_pending = 0

    # ---- memory and handshake -------------------------------------------------------------

    @property
    def size(self) -> int:
        """Bytes registered: the local offset space is [0, size)."""
        return sum(r.region.length for r in self._regions)

    @property
    def busy(self) -> bool:
        """Staged jobs are under way (ours or a peer's): a polling loop should not back off
        now, since every step of a staged transfer waits for the next poll."""
        return (self._stager is not None and bool(self._stager.jobs)) or self._ipc_pending > 0

    @property
    def mem_kind(self) -> MemKind:
        return self._mem_kind or "DRAM"

    def register(self, buffer: object) -> int:
        """Register a contiguous buffer; returns the offset where it starts in our offset space."""
        region, kind = _describe_buffer(buffer)
        with self._lock:
            if self._frozen:
                raise TransportError("register all memory before the handshake")
            if self._mem_kind not in (None, kind):
                raise TransportError(f"cannot mix {self._mem_kind} and {kind} regions")
            if region.length % self.granule:
                raise TransportError(
                    f"region of {region.length} bytes is not a multiple of the granule "
                    f"({self.granule})")
            start = self.size
            reg = _Registered(region, buffer)
            reg.reg_descs = self._agent.register_memory(
                [(region.address, region.length, region.device, "")], kind)
            self._regions.append(reg)
            self._mem_kind = kind
            return start

    def info(self) -> PeerInfo:
        with self._lock:
            self._freeze()
            return PeerInfo(self.name, bytes(self._agent.get_agent_metadata()), self.mem_kind,
                            self.granule, tuple(r.region for r in self._regions),
                            self._slot_bytes,
                            self._ipc.export if self._ipc is not None else None)

    def _freeze(self) -> None:
        """The layout is final: add the staging pool (once) as the last region."""
        if self._frozen:
            return
        self._frozen = True
        buffers = [r.keepalive for r in self._regions]
        if self._ipc_wanted and self.mem_kind == "VRAM" and buffers:
            try:
                self._ipc = ipc_copy.IpcSide(buffers, warm_up=self.granule)
            except Exception as exc:  # noqa: BLE001 - no IPC then; every other method stays
                logger.info("%s: no CUDA IPC export (%s: %s); transfers use NIXL", self.name,
                            type(exc).__name__, exc)
        cfg = self._staging
        if cfg is None or not self._regions:
            return
        slot = max(self.granule, cfg.slot_bytes // self.granule * self.granule)
        pool = allocate_pool(buffers[0], 2 * cfg.slots * slot)
        region, kind = _describe_buffer(pool)
        start = self.size
        reg = _Registered(region, pool)
        reg.reg_descs = self._agent.register_memory(
            [(region.address, region.length, region.device, "")], kind)
        self._regions.append(reg)
        self._slot_bytes = slot
        self._stager = Stager(self, cfg, buffers, pool, start, slot)

    def local_info(self) -> bytes:
        """Our handshake bytes, for the peer's `add_peer`."""
        return self.info().to_bytes()

    def add_peer(self, info: bytes | PeerInfo) -> str:
        """Load a peer's handshake and prepare both descriptor lists; returns the peer's name."""
        peer_info = info if isinstance(info, PeerInfo) else PeerInfo.from_bytes(info)
        with self._lock:
            if not self._regions:
                raise TransportError("register memory before adding a peer")
            self._freeze()
            if peer_info.mem_kind != self.mem_kind:
                # UCX can move DRAM<->VRAM, but one prepared pair of lists keeps one kind each;
                # nothing here needs mixed kinds yet.
                raise PeerError(f"peer memory is {peer_info.mem_kind}, ours {self.mem_kind}")
            known = self._peers.get(peer_info.agent_name)
            if known is not None:
                k = known.info
                if (k.mem_kind, k.granule, k.regions, k.staging_slot) == (
                        peer_info.mem_kind, peer_info.granule, peer_info.regions,
                        peer_info.staging_slot):
                    # The same agent (its name is unique to its process) met again, say by the
                    # stager and then by the connector's handshake: keep the connection. Removing
                    # and re-adding it here drops the peer's next messages without an error (on
                    # one H200 over cuda_ipc, a staged READ's request never arrived).
                    return peer_info.agent_name
                self.remove_peer(peer_info.agent_name)
            try:
                loaded = self._agent.add_remote_agent(peer_info.agent_metadata)
            except self._errors as exc:
                raise PeerError(f"cannot load agent metadata of {peer_info.agent_name}: "
                                f"{_why(exc)}") from exc
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name != peer_info.agent_name:
                raise PeerError(f"metadata names agent {name}, handshake {peer_info.agent_name}")
            granule = math.gcd(self.granule, peer_info.granule)
            remote = self._agent.prep_xfer_dlist(
                name, self._granules(peer_info.regions, granule), peer_info.mem_kind)
            self._peers[name] = _Peer(peer_info, granule, self._local_dlist(granule), remote)
            return name

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            p = self._peers.pop(peer, None)
            if self._ipc is not None:
                self._ipc.forget(peer)
            if p is None:
                return
            self._quietly(p.remote_dlist.release)
            self._quietly(self._agent.remove_remote_agent, peer)

    def peers(self) -> list[str]:
        with self._lock:
            return list(self._peers)

    # ---- transfers -------------------------------------------------------------------------

    def post(self, peer: str, op: Op, runs: RunsLike, *,
             notify: bytes = b"") -> Transfer:
        """Start a WRITE or READ of the runs. Never raises for a peer or backend failure: the
        returned transfer is then already finished with status FAILED."""
        if op not in ("WRITE", "READ"):
            raise TransportError(f"op must be WRITE or READ, not {op!r}")
        started = time.perf_counter()
        merged = _merged_array(runs)
        nbytes = int(merged[:, 2].sum())
        with self._lock:
            p = self._peers.get(peer)
            if p is None:
                t = Transfer(peer, op, nbytes, 0)
                t.finish(Status.FAILED, f"unknown peer {peer!r}")
                return t
            self._check(merged, p)
            t = Transfer(peer, op, nbytes,
                         _count_merged(merged, [r.region for r in self._regions],
                                       p.info.regions))
            if not len(merged):
                t.finish(Status.DONE)
                return t
            if self.method_for(peer, nbytes, t.descriptors, op=op) == "staged":
                assert self._stager is not None
                chunk = min(self._slot_bytes, p.info.staging_slot)
                t.method, t.descriptors = "staged", -(-nbytes // chunk)
                self._stager.post(peer, op, merged, notify, t, p.granule, chunk, started)
                return t
            local_idx, remote_idx = self._indices(merged, p)
            try:
                t.handle = self._agent.make_prepped_xfer(op, p.local_dlist, local_idx,
                                                         p.remote_dlist, remote_idx, notify)
                state = self._agent.transfer(t.handle)
            except self._errors as exc:
                self._release(t)
                t.finish(Status.FAILED, f"post failed: {_why(exc)}")
                return t
            if state == "ERR":
                self._release(t)
                t.finish(Status.FAILED, "NIXL reported an error when posting")
            elif state == "DONE":
                self._release(t)
                t.finish(Status.DONE)
            return t

    def post_blocks(self, peer: str, op: Op, local: BlockLayout, local_blocks: Any,
                    remote: BlockLayout, remote_blocks: Any, *,
                    notify: bytes = b"") -> Transfer:
        """`post` for whole KV blocks: block `local_blocks[i]` of our `local` layout to (WRITE)
        or from (READ) block `remote_blocks[i]` of the peer's `remote` layout, every piece
        group. Planned from the two id arrays with numpy (no run list; the pairs are sorted by
        our block id): direct runs are merged at block level, a staged job carries only the
        peer's block ids. The same method choice, failures-as-values and completion rules as
        `post`; bad ids or a layout outside either side's KV memory raise TransportError."""
        import numpy as np

        if op not in ("WRITE", "READ"):
            raise TransportError(f"op must be WRITE or READ, not {op!r}")
        started = time.perf_counter()
        lid = np.asarray(local_blocks, dtype=np.int64).ravel()
        rid = np.asarray(remote_blocks, dtype=np.int64).ravel()
        self._check_blocks(local, lid, remote, rid)
        if len(lid) > 1 and not (lid[1:] >= lid[:-1]).all():
            # Our blocks in ascending order (as `post` sorts runs): our copies walk memory
            # forwards, and blocks handed out in descending order (vLLM's LIFO reuse) merge.
            order = np.argsort(lid, kind="stable")
            lid, rid = lid[order], rid[order]
        nbytes = len(local.bases) * len(lid) * local.piece
        with self._lock:
            p = self._peers.get(peer)
            if p is None:
                t = Transfer(peer, op, nbytes, 0)
                t.finish(Status.FAILED, f"unknown peer {peer!r}")
                return t
            self._check_layouts(local, remote, p)
            t = Transfer(peer, op, nbytes, block_descriptors(local, lid, remote, rid))
            if not len(lid):
                t.finish(Status.DONE)
                return t
            chunk = min(self._slot_bytes, p.info.staging_slot) // local.piece * local.piece
            method = self.method_for(peer, nbytes, t.descriptors, runs=len(lid), op=op,
                                     blocks=True)
            if method == "ipc":
                reason = self._post_ipc(t, p, op, local, lid, remote, rid, notify)
                if not reason:
                    return t
                # the peer is now off IPC: the estimate picks among the other methods
                method = self.method_for(peer, nbytes, t.descriptors, runs=len(lid), op=op,
                                         blocks=True)
                if method == "staged" and not chunk:
                    method = "direct"
                t.fallback = f"ipc -> {method}: {reason}"
                self._fallbacks.append(Fallback(peer, "ipc", method, reason, time.time()))
                logger.warning("%s: IPC copy to %s not possible, using %s from now on: %s",
                               self.name, peer, method, reason)
            if chunk and method == "staged":
                assert self._stager is not None
                t.method, t.descriptors = "staged", -(-nbytes // chunk)
                self._stager.post_blocks(peer, op, local, lid, remote, rid, notify, t, chunk,
                                         started)
                return t
            self._post_direct(t, p, block_runs_array(local, lid, remote, rid), notify)
            return t

    @staticmethod
    def _check_blocks(local: BlockLayout, lid: Any, remote: BlockLayout, rid: Any) -> None:
        if len(lid) != len(rid):
            raise TransportError(f"{len(lid)} local blocks but {len(rid)} remote ones")
        if (local.piece, len(local.bases)) != (remote.piece, len(remote.bases)):
            raise TransportError(
                f"block layouts differ: ours {len(local.bases)} pieces of {local.piece} B, "
                f"peer's {len(remote.bases)} of {remote.piece} B")
        for name, ids, lay in (("local", lid, local), ("remote", rid, remote)):
            if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= lay.num_blocks):
                raise TransportError(f"a {name} block id is outside 0..{lay.num_blocks - 1}")

    def _check_layouts(self, local: BlockLayout, remote: BlockLayout, p: _Peer) -> None:
        g = p.granule
        peer_kv = p.info.size - (p.info.regions[-1].length if p.info.staging_slot > 0 else 0)
        for name, lay, size in (("local", local, self._kv_size()), ("remote", remote, peer_kv)):
            if lay.piece % g or lay.stride % g or any(b % g for b in lay.bases):
                raise TransportError(f"{name} block layout is not aligned to the {g}-byte "
                                     "granule")
            if max(lay.bases) + lay.span > size:
                raise TransportError(f"{name} block layout reaches past the registered KV "
                                     f"memory ({size} bytes)")

    def _kv_size(self) -> int:
        """Bytes of our registered KV regions (the staging pool, last, not counted)."""
        if self._stager is not None:
            return self._stager.pool_offset
        return self.size

    def _post_direct(self, t: Transfer, p: _Peer, merged: Any, notify: bytes) -> None:
        local_idx, remote_idx = self._indices(merged, p)
        try:
            t.handle = self._agent.make_prepped_xfer(t.op, p.local_dlist, local_idx,
                                                     p.remote_dlist, remote_idx, notify)
            state = self._agent.transfer(t.handle)
        except self._errors as exc:
            self._release(t)
            t.finish(Status.FAILED, f"post failed: {_why(exc)}")
            return
        if state == "ERR":
            self._release(t)
            t.finish(Status.FAILED, "NIXL reported an error when posting")
        elif state == "DONE":
            self._release(t)
            t.finish(Status.DONE)

    def method_for(self, peer: str, nbytes: int, descriptors: int, *, runs: int = -1,
                   op: str = "WRITE", blocks: bool = False) -> str:
        """"direct", "staged" or "ipc": what `post` (`post_blocks` with `blocks`) would do for
        a transfer of this shape. "ipc" only for block transfers to a peer whose cache this
        process can map (`ipc_route`). A READ (we receive) finds no staging when every receive
        slot is parked after a failed job (they rest for `stale_s`): it then goes direct
        rather than waiting for them."""
        cfg, p = self._staging, self._peers.get(peer)
        available = (self._stager is not None and p is not None and p.info.staging_slot > 0)
        route = self.ipc_route(peer) if blocks else None
        force = cfg.force if cfg is not None else None
        if force == "ipc" and route is not None:
            return "ipc"
        if force in ("direct", "staged"):
            return force if available else "direct"
        if op == "READ" and self._stager is not None and self._stager.parked():
            available = False
        costs = (cfg.costs if cfg is not None else None) or DEFAULT_COSTS[self.mem_kind]
        return choose(costs, nbytes, descriptors, staging_available=available,
                      runs=descriptors if runs < 0 else runs, ipc=route)

    def ipc_route(self, peer: str) -> str | None:
        """How an IPC copy reaches the peer's cache ("same-device", "peer-device"), or None:
        not GPU memory, KVPLANE_IPC=off, another host or an unreachable GPU, no export on
        either side, or an earlier IPC failure with this peer."""
        p = self._peers.get(peer)
        if self._ipc is None or p is None:
            return None
        return self._ipc.route(peer, p.info.ipc)

    def warm_up_ipc(self, piece: int) -> None:
        """Build the IPC copy kernel for blocks of `piece`-byte pieces now (freezes the layout),
        so that the first IPC transfer does not wait for it. Nothing without IPC."""
        with self._lock:
            self._freeze()
            if self._ipc is not None:
                self._ipc.warm_up(piece)

    def fallbacks(self) -> list[Fallback]:
        """The latest transfers that could not use the method chosen first (ipc), oldest
        first (kept: the last 256)."""
        with self._lock:
            return list(self._fallbacks)

    def _post_ipc(self, t: Transfer, p: _Peer, op: str, local: BlockLayout, lid: Any,
                  remote: BlockLayout, rid: Any, notify: bytes) -> str:
        """Start the copy kernel; "" when started, else why not (the peer is then marked off
        IPC). Never raises: any failure falls back to NIXL."""
        assert self._ipc is not None
        try:
            m = self._ipc.mapping(t.peer, p.info.ipc or {})
            kv = self._regions[:-1] if self._stager is not None else self._regions
            peer_kv = p.info.regions[:-1] if p.info.staging_slot > 0 else p.info.regions
            if len(m.addresses) != len(peer_kv) or any(
                    n < r.length for n, r in zip(m.lengths, peer_kv, strict=True)):
                raise ipc_copy.IpcUnavailable(
                    f"the peer's IPC export ({len(m.addresses)} regions) does not cover its "
                    f"{len(peer_kv)} registered KV regions")
            ours = ipc_copy.Side(
                ipc_copy.group_addresses(local.bases, local.span,
                                         _boundaries([r.region for r in kv], start=True),
                                         [r.region.address for r in kv]),
                local.stride, local.num_blocks, lid)
            theirs = ipc_copy.Side(
                ipc_copy.group_addresses(remote.bases, remote.span,
                                         _boundaries(peer_kv, start=True), m.addresses),
                remote.stride, remote.num_blocks, rid)
            src, dst = (ours, theirs) if op == "WRITE" else (theirs, ours)
            event, _how = self._ipc.copier.copy(src, dst, local.piece)
        except Exception as exc:  # noqa: BLE001 - never into vLLM: NIXL moves it instead
            reason = (str(exc) if isinstance(exc, ipc_copy.IpcUnavailable)
                      else f"{type(exc).__name__}: {exc}")
            self._ipc.broken[t.peer] = reason
            return reason
        t.method, t.descriptors = "ipc", 1
        t.handle = _IpcJob(event, notify)
        self._ipc_pending += 1
        return ""

    def _poll_ipc(self, t: Transfer) -> Status:
        """The copy's event; once it is done, the notification (as a WRITE's arrives after its
        data), then DONE."""
        job = t.handle
        if not isinstance(job, _IpcJob):
            return t.result.status if t.result else Status.FAILED
        failure = ""
        try:
            done = job.event is None or bool(job.event.query())
        except Exception as exc:  # noqa: BLE001 - a CUDA error: the transfer failed
            done, failure = True, f"IPC copy failed: {_why(exc)}"
        if not done:
            return Status.PENDING
        t.handle = None
        self._ipc_pending -= 1
        if not failure and job.notify and not self._agent_notify(t.peer, job.notify):
            failure = "copied, but the notification could not be sent"
        return (t.finish(Status.FAILED, failure) if failure else t.finish(Status.DONE)).status

    def poll(self, transfer: Transfer) -> Status:
        """One non-blocking look at a transfer; also drains notifications into the inbox."""
        if transfer.result is not None:
            return transfer.result.status
        with self._lock:
            self._drain()
            if transfer.method == "staged":  # the stager finishes it
                return transfer.result.status if transfer.result else Status.PENDING
            if transfer.method == "ipc":
                return self._poll_ipc(transfer)
            try:
                state = self._agent.check_xfer_state(transfer.handle)
            except self._errors as exc:
                state, reason = "ERR", f"state check failed: {_why(exc)}"
            else:
                reason = "NIXL reported an error (peer gone or unreachable?)"
            if state == "PROC":
                return Status.PENDING
            self._release(transfer)
            if state == "DONE":
                transfer.finish(Status.DONE)
            else:
                transfer.finish(Status.FAILED, reason)
            return transfer.result.status if transfer.result else Status.FAILED

    def wait(self, transfer: Transfer, timeout: float) -> TransferResult:
        """Poll until the transfer finishes or `timeout` seconds pass (then TIMED_OUT)."""
        deadline = time.monotonic() + timeout
        for pause in _backoff():
            if self.poll(transfer) is not Status.PENDING:
                break
            if time.monotonic() >= deadline:
                with self._lock:
                    self._release(transfer)
                transfer.finish(Status.TIMED_OUT, f"not done after {timeout:g} s")
                break
            time.sleep(0 if self.busy else pause)
        assert transfer.result is not None
        return transfer.result

    def transfer(self, peer: str, op: Op, runs: RunsLike, *,
                 notify: bytes = b"", timeout: float = 30.0) -> TransferResult:
        """`post` then `wait`."""
        return self.wait(self.post(peer, op, runs, notify=notify), timeout)

    # ---- notifications ---------------------------------------------------------------------

    def send_notification(self, peer: str, message: bytes) -> TransferResult:
        """A message not tied to a transfer (e.g. push mode's registration record)."""
        with self._lock:
            if peer not in self._peers:
                return TransferResult(Status.FAILED, peer, "NOTIFY", len(message), 0,
                                      f"unknown peer {peer!r}")
            try:
                self._agent.send_notif(peer, message)
            except self._errors as exc:
                return TransferResult(Status.FAILED, peer, "NOTIFY", len(message), 0,
                                      f"send failed: {_why(exc)}")
        return TransferResult(Status.DONE, peer, "NOTIFY", len(message), 0)

    def progress(self) -> None:
        """Let NIXL move (when the progress thread is off) and collect notifications."""
        with self._lock:
            self._drain()

    def notifications(self) -> list[Notification]:
        """Every notification received since the last call, oldest first."""
        with self._lock:
            self._drain()
            out, self._inbox = self._inbox, []
            return out

    def wait_notification(self, message: bytes, timeout: float, *, peer: str | None = None,
                          prefix: bool = False) -> Notification | None:
        """Wait for one notification equal to (or starting with) `message`; None on time-out.
        Other notifications stay in the inbox."""
        deadline = time.monotonic() + timeout
        for pause in _backoff():
            with self._lock:
                self._drain()
                for i, n in enumerate(self._inbox):
                    if peer is not None and n.peer != peer:
                        continue
                    if n.message == message or (prefix and n.message.startswith(message)):
                        return self._inbox.pop(i)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0 if self.busy else pause)
        return None  # unreachable: _backoff never ends

    # ---- teardown --------------------------------------------------------------------------

    def close(self) -> None:
        """Forget peers, release descriptor lists and deregister memory. Idempotent."""
        with self._lock:
            if self._stager is not None:
                self._stager.jobs.clear()
            for name in list(self._peers):
                self.remove_peer(name)
            for dl in self._local_dlists.values():
                self._quietly(dl.release)
            self._local_dlists.clear()
            for reg in self._regions:
                if reg.reg_descs is not None:
                    self._quietly(self._agent.deregister_memory, reg.reg_descs)
                    reg.reg_descs = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals -------------------------------------------------------------------------

    def _drain(self) -> None:
        try:
            new = self._agent.get_new_notifs()
        except self._errors as exc:  # a broken peer connection must not break the caller's loop
            logger.debug("%s: reading notifications failed: %s", self.name, _why(exc))
            new = {}
        for name, messages in new.items():
            peer = name.decode() if isinstance(name, bytes) else str(name)
            for m in messages:
                message = bytes(m)
                if self._stager is not None and message.startswith(MAGIC):
                    self._stager.on_message(peer, message)
                else:
                    self._inbox.append(Notification(peer, message))
        if self._stager is not None:
            self._stager.advance()

    # ---- what the stager needs (under the lock) --------------------------------------------

    def _post_raw(self, peer: str, op: Op, runs: RunsLike, notify: bytes) -> Any:
        """Post without bookkeeping: a NIXL handle, "DONE", or None when it failed."""
        p = self._peers.get(peer)
        if p is None:
            return None
        merged = _merged_array(runs)
        try:
            self._check(merged, p)
        except TransportError as exc:  # a grant the peer should not have made
            logger.warning("%s: staged WRITE refused: %s", self.name, exc)
            return None
        local_idx, remote_idx = self._indices(merged, p)
        try:
            handle = self._agent.make_prepped_xfer(op, p.local_dlist, local_idx,
                                                   p.remote_dlist, remote_idx, notify)
            state = self._agent.transfer(handle)
        except self._errors as exc:
            logger.debug("%s: staged post failed: %s", self.name, _why(exc))
            return None
        if state in ("DONE", "ERR"):
            self._quietly(handle.release)
            return "DONE" if state == "DONE" else None
        return handle

    def _xfer_state(self, handle: Any) -> str:
        """"PROC", "DONE" or "ERR"; a finished handle is released."""
        if handle == "DONE":
            return "DONE"
        try:
            state = str(self._agent.check_xfer_state(handle))
        except self._errors:
            state = "ERR"
        if state != "PROC":
            self._quietly(handle.release)
        return state

    def _agent_notify(self, peer: str, message: bytes) -> bool:
        if peer not in self._peers:
            return False
        try:
            self._agent.send_notif(peer, message)
        except self._errors as exc:
            logger.debug("%s: notification to %s failed: %s", self.name, peer, _why(exc))
            return False
        return True

    def _local_dlist(self, granule: int) -> Any:
        if granule not in self._local_dlists:
            self._local_dlists[granule] = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", self._granules([r.region for r in self._regions], granule),
                self.mem_kind)
        return self._local_dlists[granule]

    @staticmethod
    def _granules(regions: Sequence[Region], granule: int) -> Any:
        """Nx3 (address, length, device) rows: every region cut into granules, in order."""
        import numpy as np

        parts = []
        for reg in regions:
            n = reg.length // granule
            rows = np.empty((n, 3), dtype=np.uint64)
            rows[:, 0] = reg.address + np.arange(n, dtype=np.uint64) * np.uint64(granule)
            rows[:, 1] = granule
            rows[:, 2] = reg.device
            parts.append(rows)
        return np.concatenate(parts) if parts else np.empty((0, 3), dtype=np.uint64)

    def _check(self, runs: Any, p: _Peer) -> None:
        """Every run aligned to the pair's granule and inside both sides' memory."""
        g = p.granule
        lo, ro, n = runs[:, 0], runs[:, 1], runs[:, 2]
        bad = ((lo % g) | (ro % g) | (n % g)).astype(bool) | (lo < 0) | (ro < 0)
        if bad.any():
            raise TransportError(f"{Run(*map(int, runs[bad][0]))} is not aligned to the "
                                 f"{g}-byte granule")
        if len(runs) and (int((lo + n).max()) > self.size or int((ro + n).max()) > p.info.size):
            raise TransportError(f"a run goes past the registered memory (local {self.size}, "
                                 f"remote {p.info.size})")

    def _indices(self, runs: Any, p: _Peer) -> tuple[Any, Any]:
        """Granule indices of merged runs, for both prepared lists (vectorised)."""
        import numpy as np

        g = p.granule
        lo, ro, n = runs[:, 0], runs[:, 1], runs[:, 2]
        counts = n // g
        total = int(counts.sum())
        within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        local = (np.repeat(lo // g, counts) + within).astype(np.int32)
        remote = (np.repeat(ro // g, counts) + within).astype(np.int32)
        return local, remote

    def _release(self, transfer: Transfer) -> None:
        h, transfer.handle = transfer.handle, None
        if h is None:
            return
        if transfer.method == "staged":
            if self._stager is not None:
                self._stager.cancel(h, "the caller gave up waiting")
            return
        if transfer.method == "ipc":  # a kernel cannot be cancelled; it ends on its own
            self._ipc_pending -= 1
            return
        self._quietly(h.release)

    def _quietly(self, fn: Any, *args: Any) -> None:
        """Clean-up that may fail (a peer already gone, a transfer NIXL cannot cancel)."""
        try:
            fn(*args)
        except self._errors as exc:
            logger.debug("%s: clean-up %s failed: %s", self.name,
                         getattr(fn, "__name__", fn), _why(exc))


def _backoff() -> Iterable[float]:
    """Sleep lengths for a polling loop: spin briefly, then yield the core (few cores here)."""
    pause = 0.0
    while True:
        yield pause
        pause = min(0.001, max(pause * 2, 0.00002))


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
