"""CUDA IPC copies: one process copies KV blocks straight between its own GPU cache and a peer
process's, with no staging slot and no NIXL descriptor.

Why: on one GPU a staged transfer reads and writes every byte three times (gather, NIXL WRITE,
scatter), and per-run descriptors cost 6 us each. A kernel that reads each piece from the
source cache and writes it into the destination cache touches every byte once each way: about
what one `index_select` costs (docs/measurements/transfer-fragmented-h200.md).

How it works:
- Export: when a `Transport`'s layout freezes on GPU memory, `IpcSide` asks torch for a CUDA
  IPC handle of each registered KV region (`UntypedStorage._share_cuda_`, the mechanism
  torch.multiprocessing uses) and puts them, with where it runs (host and boot id, GPU UUID,
  process id), in the handshake the transport already exchanges (`PeerInfo.ipc`). The staging
  pool is never exported. Plain values only (no pickle): a handshake cannot run code here.
- Route (`route`): both sides exported, same host and boot, and the peer's GPU is ours
  ("same-device") or one of ours with peer access ("peer-device"); otherwise no IPC.
- Mapping (`IpcSide.mapping`): the side that moves the bytes opens the peer's handles once per
  peer (`UntypedStorage._new_shared_cuda`, on its own device) and keeps them until the peer is
  removed. A peer in the same process needs no handle: its addresses are ours already.
- Copy (`Copier.copy`): one Triton kernel copies every piece (one block's bytes of one layer
  and K/V) from the source cache to the destination cache: one pass, each byte read and
  written once. It gets each side's per-group base addresses and block ids (a few KiB, one
  upload) and computes a piece's address itself (`piece_table` is the same rule in numpy,
  tested on the CPU). Without Triton, or for pieces that are not multiples of 512 bytes:
  torch index ops per piece group (`index_select` into a temporary, `index_copy_` out: two
  passes). The copy runs on a side stream after what the caller's stream has queued, and
  returns an event to query.

Failures (no handle, a handle that does not open, a kernel that does not build) raise
`IpcUnavailable`; the transport then uses its other methods and records the fallback.

Grants: mapping exposes the peer's whole KV cache to this process, as NIXL's registration
already does; which blocks are copied is still decided by the control plane (only blocks of
granted requests, from the two block-id arrays the connector plans).
"""

from __future__ import annotations

import base64
import logging
import math
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from kvplane.core.transfer_method import IpcRoute

logger = logging.getLogger(__name__)

IPC_ENV = "KVPLANE_IPC"
UNIT = 16  # bytes: the Triton kernel's address unit (one 128-bit load)


class IpcUnavailable(RuntimeError):
    """No IPC copy for this peer (the reason says why); use another method."""


def enabled(setting: str | None = None) -> bool:
    """KVPLANE_IPC: "auto" (default, on where a route exists) or "off"."""
    value = (setting if setting is not None else os.environ.get(IPC_ENV, "auto")).lower()
    if value not in ("auto", "on", "off"):
        raise ValueError(f"{IPC_ENV}={value!r}: expected auto, on or off")
    return value != "off"


def host_id() -> str:
    """This host (and boot): two processes share CUDA IPC only within one."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def route(ours: dict[str, Any] | None, theirs: dict[str, Any] | None,
          peers_of_ours: dict[str, bool] | None = None) -> IpcRoute | None:
    """How our copies reach the peer's cache, or None. `peers_of_ours`: UUIDs of the other GPUs
    this process sees, and whether ours has peer access to each."""
    if not ours or not theirs:
        return None
    if ours.get("host") != theirs.get("host") or not theirs.get("regions"):
        return None
    if ours.get("gpu") == theirs.get("gpu"):
        return "same-device"
    if (peers_of_ours or {}).get(str(theirs.get("gpu"))):
        return "peer-device"
    return None


# ---- the piece table (numpy; the index logic, testable without a GPU) --------------------------


def group_addresses(bases: tuple[int, ...], span: int, region_starts: list[int],
                    region_addresses: list[int]) -> list[int]:
    """Address of block 0 of each piece group: `bases` are offsets in the side's offset space
    (regions end to end, `region_starts` with the end appended). Each group must lie inside one
    region (the address of memory between regions means nothing)."""
    import bisect

    out = []
    for base in bases:
        r = bisect.bisect_right(region_starts, base) - 1
        if r < 0 or r >= len(region_addresses) or base + span > region_starts[r + 1]:
            raise IpcUnavailable(f"piece group at {base} (+{span} B) is not inside one "
                                 "registered KV region")
        out.append(region_addresses[r] + base - region_starts[r])
    return out


def unit_table(groups: list[int], stride: int, origin: int,
               unit: int = UNIT) -> tuple[Any, int]:
    """A side's piece groups and block stride in `unit`s from `origin`: what the kernel reads.
    Piece (g, block b) starts at origin + (groups[g] + b x stride) x unit."""
    import numpy as np

    ga = np.asarray(groups, dtype=np.int64) - np.int64(origin)
    if (ga % unit).any() or stride % unit:
        raise IpcUnavailable(f"pieces are not {unit}-byte aligned")
    return ga // unit, stride // unit


def piece_table(groups: list[int], stride: int, ids: Any, origin: int,
                unit: int = UNIT) -> Any:
    """Row r of a copy in `unit`s from `origin`, exactly as the kernel computes it: group
    r // n, block ids[r % n] (n blocks; rows group-major). Row r of the source is copied to
    row r of the destination."""
    import numpy as np

    g, s = unit_table(groups, stride, origin, unit)
    ids = np.asarray(ids, dtype=np.int64)
    n = len(ids)
    r = np.arange(len(g) * n, dtype=np.int64)
    return g[r // n] + ids[r % n] * s


# ---- export and mapping --------------------------------------------------------------------------


def _gpu_uuid(device: Any) -> str:
    import torch

    return str(torch.cuda.get_device_properties(device).uuid)


def export(buffers: list[Any]) -> dict[str, Any]:
    """Our identity and one handle per KV region (CUDA torch tensors, in registration order)."""
    import torch

    device = buffers[0].device
    regions = []
    for buf in buffers:
        share = buf.untyped_storage()._share_cuda_()
        (_dev, handle, size, offset, ref_handle, ref_offset, event_handle, sync) = share
        regions.append({
            "h": _b64(handle), "size": int(size), "off": int(offset),
            "rh": _b64(ref_handle), "ro": int(ref_offset),
            "eh": _b64(event_handle) if event_handle else "", "sync": bool(sync),
            "toff": int(buf.storage_offset() * buf.element_size()),
            "len": int(buf.numel() * buf.element_size()),
            "addr": int(buf.data_ptr()),
        })
    return {"host": host_id(), "gpu": _gpu_uuid(device), "pid": os.getpid(),
            "regions": regions, "torch": torch.__version__}


def _b64(data: Any) -> str:
    return base64.b64encode(bytes(data)).decode("ascii")


@dataclass(slots=True)
class Mapping:
    """The peer's KV regions as seen from this process (tensors keep the mappings open)."""

    addresses: list[int]
    lengths: list[int]
    keep: list[Any] = field(default_factory=list)

    def close(self) -> None:
        self.keep.clear()  # torch closes a handle when its last storage goes


def open_peer(theirs: dict[str, Any], device: Any) -> Mapping:
    """Map the peer's regions on our `device`; raises IpcUnavailable."""
    regions = theirs.get("regions") or []
    if int(theirs.get("pid", -1)) == os.getpid():  # a peer in this process: same addresses
        return Mapping([int(r["addr"]) for r in regions], [int(r["len"]) for r in regions])
    try:
        import torch

        index = torch.device(device).index or 0
        keep, addrs = [], []
        with torch.cuda.device(index):
            for r in regions:
                storage = torch.UntypedStorage._new_shared_cuda(
                    index, base64.b64decode(r["h"]), int(r["size"]), int(r["off"]),
                    base64.b64decode(r["rh"]), int(r["ro"]),
                    base64.b64decode(r["eh"]) if r["eh"] else None, bool(r["sync"]))
                t = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
                t.set_(storage, int(r["toff"]), (int(r["len"]),))
                keep.append(t)
                addrs.append(int(t.data_ptr()))
    except Exception as exc:
        raise IpcUnavailable(f"opening the peer's CUDA IPC handles failed: "
                             f"{type(exc).__name__}: {exc}") from exc
    return Mapping(addrs, [int(t.numel()) for t in keep], keep)


# ---- copies ---------------------------------------------------------------------------------------

_KERNEL: Any = None
MAX_BLOCK = 4096  # int64 elements one program moves per step (32 KiB)


def _triton_kernel() -> Any:
    """The one-pass copy kernel (built on first use per piece size), or None without Triton."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL or None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        _KERNEL = False
        return None

    @triton.jit(do_not_specialize=["n", "rows", "s_stride", "d_stride"])
    def copy_pieces(origin, s_groups, s_ids, s_stride, d_groups, d_ids, d_stride, n, rows,
                    ELEMS: tl.constexpr, BLOCK: tl.constexpr, PER: tl.constexpr):
        # Program p copies rows p*PER .. p*PER+PER-1 (row r: group r // n, block ids[r % n];
        # piece_table is the same rule in numpy). A piece is ELEMS int64s at
        # origin + (groups[g] + ids[i] x stride) x 2 elements: 16-byte units, so every access
        # is 16-byte aligned, and the mask is constant along a piece: the loads vectorise.
        r = tl.program_id(0) * PER + tl.arange(0, PER)
        live = r < rows
        g = r // n
        i = r % n
        s = (tl.load(s_groups + g, mask=live, other=0)
             + tl.load(s_ids + i, mask=live, other=0) * s_stride) * 2
        d = (tl.load(d_groups + g, mask=live, other=0)
             + tl.load(d_ids + i, mask=live, other=0) * d_stride) * 2
        cols = tl.arange(0, BLOCK)
        m = live[:, None]
        for k in tl.static_range(0, ELEMS, BLOCK):
            x = tl.load(origin + s[:, None] + k + cols[None, :], mask=m)
            tl.store(origin + d[:, None] + k + cols[None, :], x, mask=m)

    _KERNEL = copy_pieces
    return _KERNEL


def kernel_shape(piece: int) -> tuple[int, int, int] | None:
    """(ELEMS, BLOCK, PER) for pieces of `piece` bytes: BLOCK, the largest power of two up to
    MAX_BLOCK dividing the piece's int64 count, PER pieces per program so that one step moves
    about 32 KiB; None when the piece is not a multiple of 512 bytes (then torch)."""
    if piece % 512:
        return None
    elems = piece // 8
    block = 1
    while block * 2 <= MAX_BLOCK and elems % (block * 2) == 0:
        block *= 2
    per = 1
    while elems * per * 2 <= MAX_BLOCK:
        per *= 2
    return elems, block, per


def _rows_at(address: int, rows: int, stride: int, piece: int, like: Any) -> Any:
    """A (rows, piece) view of memory at `address`, rows `stride` bytes apart (int64 elements
    where aligned), on the device of `like` (a torch tensor), for torch's index ops."""
    import torch

    wide = piece % 8 == 0 and stride % 8 == 0 and address % 8 == 0
    unit = 8 if wide else 1
    shape = (rows, piece // unit)
    if like.device.type == "cuda":
        from kvplane.live.staging import _CudaMemory

        mem = _CudaMemory(address, shape, "<i8" if wide else "|u1")
        mem.__cuda_array_interface__["strides"] = (stride, unit)
        return torch.as_tensor(mem, device=like.device)
    import ctypes

    import numpy as np

    nbytes = (rows - 1) * stride + piece
    raw = np.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=np.uint8)
    arr = np.lib.stride_tricks.as_strided(raw.view(np.int64 if wide else np.uint8)[:1], shape,
                                          (stride, unit), writeable=True)
    return torch.from_numpy(arr)


@dataclass(frozen=True, slots=True)
class Side:
    """One side of a copy: where block 0 of each piece group lies, the block stride and the
    block count (for bounds), and the block ids, in transfer order."""

    groups: list[int]
    stride: int
    num_blocks: int
    ids: Any


class Copier:
    """Copies pieces between two sides' memories on one device (ours), on a side stream."""

    def __init__(self, like: Any, *, use_triton: bool = True) -> None:
        self.like = like  # a tensor on our device: the kernel's origin pointer
        self.cuda = like.device.type == "cuda"
        self.use_triton = use_triton and self.cuda
        self._stream: Any = None
        self.kernel_error = ""
        self.last = ""  # how the latest copy ran: "triton" or "torch"
        self.warmed: set[int] = set()

    def _side(self) -> Any:
        if self._stream is None:
            import torch

            self._stream = torch.cuda.Stream(device=self.like.device)
        return self._stream

    def copy(self, src: Side, dst: Side, piece: int) -> tuple[Any, str]:
        """Copy piece (g, src.ids[i]) to piece (g, dst.ids[i]) for every group g and i.
        Returns (event or None when done, "triton" or "torch")."""
        if not self.cuda:
            self._torch_copy(src, dst, piece)
            self.last = "torch"
            return None, "torch"
        import torch

        stream = self._side()
        stream.wait_stream(torch.cuda.current_stream(self.like.device))
        # the device too: Triton launches on the calling thread's current device, and a
        # connector's transfer thread starts on device 0 whatever its rank's GPU
        with torch.cuda.device(self.like.device), torch.cuda.stream(stream):
            how = "torch"
            if self.use_triton and piece % UNIT == 0 and self._triton_copy(src, dst, piece):
                how = "triton"
            else:
                self._torch_copy(src, dst, piece)
            event = torch.cuda.Event()
            event.record(stream)
        self.last = how
        return event, how

    def _triton_copy(self, src: Side, dst: Side, piece: int) -> bool:
        import numpy as np
        import torch

        kernel = _triton_kernel()
        shape = kernel_shape(piece)
        if kernel is None or shape is None or self.kernel_error:
            return False
        elems, block, per = shape
        origin = self.like.data_ptr() // UNIT * UNIT
        try:
            sg, ss = unit_table(src.groups, src.stride, origin)
            dg, ds = unit_table(dst.groups, dst.stride, origin)
        except IpcUnavailable:
            return False
        n = len(src.ids)
        # one upload: both sides' groups and ids (a few KiB)
        host = np.concatenate([sg, dg, np.asarray(src.ids, dtype=np.int64),
                               np.asarray(dst.ids, dtype=np.int64)])
        dev = torch.from_numpy(host).to(self.like.device)
        gn = len(sg)
        from kvplane.live.staging import _CudaMemory

        base = torch.as_tensor(_CudaMemory(origin, (1, 1), "<i8"), device=self.like.device)
        rows = gn * n
        try:
            kernel[(math.ceil(rows / per),)](
                base.view(-1), dev[:gn], dev[2 * gn:2 * gn + n], ss, dev[gn:2 * gn],
                dev[2 * gn + n:], ds, n, rows, ELEMS=elems, BLOCK=block, PER=per,
                num_warps=8)
        except Exception as exc:  # noqa: BLE001 - a kernel that does not build: torch from now
            self.kernel_error = f"{type(exc).__name__}: {exc}"
            logger.warning("kvplane ipc: the Triton copy kernel failed (%s); using torch index "
                           "ops (two passes)", self.kernel_error)
            return False
        # `dev` was allocated on the side stream, so the caching allocator reuses its memory
        # only after the kernel (queued on that stream) has read it.
        return True

    def _torch_copy(self, src: Side, dst: Side, piece: int) -> None:
        """Two passes per piece group: gather the source rows, scatter them into place."""
        import torch

        device = self.like.device
        sid = torch.as_tensor(src.ids, dtype=torch.int64).to(device)
        did = torch.as_tensor(dst.ids, dtype=torch.int64).to(device)
        for ga, gb in zip(src.groups, dst.groups, strict=True):
            rows_s = _rows_at(ga, src.num_blocks, src.stride, piece, self.like)
            rows_d = _rows_at(gb, dst.num_blocks, dst.stride, piece, self.like)
            rows_d.index_copy_(0, did, rows_s.index_select(0, sid))

    def warm_up(self, piece: int) -> None:
        """Build the kernel for pieces of `piece` bytes now (its first launch compiles it), on
        a scratch buffer, so that the first transfer does not pay for it."""
        if not self.use_triton or piece in self.warmed:
            return
        self.warmed.add(piece)
        import torch

        scratch = torch.zeros(4 * piece, dtype=torch.uint8, device=self.like.device)
        a = scratch.data_ptr()
        one = Side([a], piece, 2, [0])
        two = Side([a + 2 * piece], piece, 2, [0])
        saved = self.like
        try:
            self.like = scratch
            event, _ = self.copy(one, two, piece)
            if event is not None:
                event.synchronize()
        finally:
            self.like = saved


# ---- a transport's IPC state ------------------------------------------------------------------------


def _visible_peers(device: Any) -> dict[str, bool]:
    """UUIDs of the other GPUs this process sees, and whether `device` can reach each."""
    import torch

    ours = torch.device(device).index or 0
    out = {}
    for i in range(torch.cuda.device_count()):
        if i != ours:
            out[_gpu_uuid(i)] = bool(torch.cuda.can_device_access_peer(ours, i))
    return out


class IpcSide:
    """What one `Transport` needs for IPC copies: its export (for its handshake), the peers'
    mappings (opened once per peer, closed when the peer is removed), and the copier. Made
    only for GPU memory; raises where the export fails."""

    def __init__(self, buffers: list[Any], *, warm_up: int = 0) -> None:
        self.device = buffers[0].device
        self.export = export(buffers)
        self.visible = _visible_peers(self.device)
        self.copier = Copier(buffers[0])
        self.maps: dict[str, Mapping] = {}
        self.broken: dict[str, str] = {}
        if warm_up:
            self.warm_up(warm_up)

    def warm_up(self, piece: int) -> None:
        """Build the copy kernel for `piece`-byte pieces now (a second or two, once per
        process and size; Triton caches it on disk)."""
        try:
            self.copier.warm_up(piece)
        except Exception as exc:  # noqa: BLE001 - torch index ops remain
            self.copier.kernel_error = f"{type(exc).__name__}: {exc}"
            logger.warning("kvplane ipc: the Triton copy kernel did not build (%s); IPC "
                           "copies use torch index ops", self.copier.kernel_error)

    def route(self, peer: str, theirs: dict[str, Any] | None) -> IpcRoute | None:
        if peer in self.broken:
            return None
        return route(self.export, theirs, self.visible)

    def mapping(self, peer: str, theirs: dict[str, Any]) -> Mapping:
        m = self.maps.get(peer)
        if m is None:
            try:
                m = open_peer(theirs, self.device)
            except IpcUnavailable as exc:
                self.broken[peer] = str(exc)
                raise
            self.maps[peer] = m
        return m

    def forget(self, peer: str) -> None:
        m = self.maps.pop(peer, None)
        if m is not None:
            m.close()
        self.broken.pop(peer, None)
