"""Staged transfers: a fragmented run list moved as a few large WRITEs through staging slots.

Why: NIXL (UCX) pays about 2 us (host memory) to 6 us (GPU memory) per descriptor whatever its
size, so a fragmented block pool (one run per block, layer and K/V) moves at a few GB/s while one
large WRITE of the same bytes moves at the link's speed. Staging trades the descriptors for two
local copies (a gather and a scatter), which a GPU does at HBM speed on a side stream.

How it works (`Stager`, owned by a `Transport` made with a `StagingConfig`):
- Each transport registers one staging buffer, once, when its layout freezes (first `info()` or
  `add_peer()`): `slots` send slots then `slots` receive slots of `slot_bytes` each (so sending
  and receiving never starve each other). Its handshake announces the slot size.
- A transfer's runs become one stream of granules in the initiator's run order; both sides cut
  the stream into chunks of one slot (min of the two slot sizes) and know the other side's runs
  from the first control message (offsets delta-coded and zlib-compressed).
- A block transfer (`Transport.post_blocks`, `BlockLayout`: piece p of block b at
  bases[p] + b x stride) streams its pieces piece group by piece group, blocks in the given
  order; its first message carries the peer's layout and block ids (4 bytes a block) instead
  of runs. Each side plans from its id array alone, and where every piece group lies on one
  row grid of its memory (the usual case: per-layer caches from cudaMalloc), copies a whole
  chunk with one `index_select` / `index_copy_` over a view spanning all layers (`_Span`);
  otherwise one per piece group.
- The data owner always WRITEs (also for a READ: "ask the holder to write"): a READ sends PULL
  with the holder's runs and the first grants; a WRITE sends OFFER with the receiver's runs and
  the caller's notification, and the receiver answers with grants. A grant names a free receive
  slot for chunk k. The holder gathers chunk k into a free send slot (torch `index_select` on a
  side CUDA stream, or numpy `take` on host memory), WRITEs the slot to the granted slot with a
  LANDED notification, and frees its slot when the WRITE completes. The receiver scatters the
  landed chunk into place (`index_copy_`), frees the slot and grants the next chunk.
- Done: the receiver when every chunk is scattered; it then answers DONE, and a staged WRITE
  is done for its caller only on that answer, so, as with a direct WRITE, "done" means the
  bytes are in place (a later WRITE to the same place cannot be overwritten by a late
  scatter). The caller's notification reaches the receiver's inbox after the last scatter, so
  "the notification counts as done" keeps holding. A holder serving a READ is done when its
  WRITEs are; the reader when it has scattered everything.
- A failure (a WRITE that fails, a control message that cannot be sent, the caller's time-out)
  ends the job on both sides with FAIL; slots in use by a copy or WRITE in flight are freed when
  that finishes. A receiving job that hears nothing for `stale_s` is dropped (its holder died).

Rules: everything here runs under the transport's lock, called from its polling paths (`poll`,
`progress`, `notifications`); nothing blocks on the GPU (events are queried, not waited on).
"""

from __future__ import annotations

import base64
import collections
import json
import logging
import math
import os
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kvplane.core.transfer_method import IPC_FIXED_S, Method, MethodCosts

if TYPE_CHECKING:
    from kvplane.live.transport import Transfer, Transport

logger = logging.getLogger(__name__)

MAGIC = b"\x00kvplane-stage/1 "

# Defaults until a calibrated profile is given (StagingConfig.costs / costs_from_profile):
# docs/measurements/nixl-h200-1gpu-vram.yaml and nixl-h200-host-dram.yaml.
# staged_fixed and plan_per_run: what benchmarks/transfer_fragmented.py --trace showed of this
# module's own software (docs/measurements/transfer-fragmented-h200.md).
STAGED_FIXED_S = 1e-3
PLAN_PER_RUN_S = 0.15e-6
# The IPC copy (live/ipc.py) on one H200: payload moved by one pass of `index_select` over
# 32 KiB rows (2 GiB in 1.21 ms, each byte read and written once); fixed: IPC_FIXED_S.
IPC_GBPS = 1700.0
DEFAULT_COSTS: dict[str, MethodCosts] = {
    "VRAM": MethodCosts(bandwidth=200e9, per_descriptor=6.4e-6, copy_bandwidth=1.0e12,
                        round_trip=150e-6, chunk_bytes=256 << 20, overlap=True,
                        staged_fixed=STAGED_FIXED_S, plan_per_run=PLAN_PER_RUN_S,
                        ipc_bandwidth=IPC_GBPS * 1e9, ipc_fixed=IPC_FIXED_S),
    "DRAM": MethodCosts(bandwidth=5.5e9, per_descriptor=1.9e-6, copy_bandwidth=5.0e9,
                        round_trip=200e-6, chunk_bytes=4 << 20, overlap=False,
                        staged_fixed=STAGED_FIXED_S, plan_per_run=PLAN_PER_RUN_S),
}


@dataclass(frozen=True, slots=True)
class StagingConfig:
    """Staging for one transport. slot_bytes: one chunk (rounded down to the granule);
    slots: send slots and, again, receive slots; costs: the estimate's inputs (None: defaults
    for the memory kind, chunk size set to slot_bytes); force: always use one method
    (benchmarks and tests); stale_s: drop a receiving job that hears nothing this long."""

    slot_bytes: int = 64 << 20
    slots: int = 4
    costs: MethodCosts | None = None
    force: Method | None = None
    stale_s: float = 120.0

    def __post_init__(self) -> None:
        if self.slot_bytes <= 0 or self.slots <= 0:
            raise ValueError("slot_bytes and slots must be positive")
        if self.force not in (None, "direct", "staged", "ipc"):
            raise ValueError(f"force must be 'direct', 'staged', 'ipc' or None, not "
                             f"{self.force!r}")


STAGING_ENV = "KVPLANE_STAGING"


def staging_for(buffer: Any, setting: str | None = None) -> StagingConfig | None:
    """The staging a worker's transport gets for KV caches like `buffer`, from `setting` (by
    default the environment variable KVPLANE_STAGING): "auto" (the default: on for GPU memory,
    where descriptors cost most and copies are cheap; off for host memory), "on" (both; the
    estimate decides per transfer), "staged" or "direct" (pool registered, one method always:
    tests and benchmarks; never IPC), "ipc" (the IPC copy wherever the peer's cache can be
    mapped, else the estimate), "off" (no staging; IPC copies stay possible unless
    KVPLANE_IPC=off, live/ipc.py). Host memory gets small slots (4 x 4 MiB), GPU memory
    4 x 256 MiB (2 GiB per worker, half to send, half to receive: on an H200 fewer, larger
    chunks cost less Python per byte; docs/measurements/transfer-fragmented-h200.md)."""
    value = (setting if setting is not None else os.environ.get(STAGING_ENV, "auto")).lower()
    if value not in ("auto", "on", "off", "staged", "direct", "ipc"):
        raise ValueError(f"{STAGING_ENV}={value!r}: expected auto, on, off, staged, direct "
                         "or ipc")
    gpu = _is_torch(buffer) and buffer.device.type == "cuda"
    if value == "off" or (value == "auto" and not gpu):
        return None
    force: Method | None = value if value in ("staged", "direct", "ipc") else None  # type: ignore[assignment]
    return StagingConfig(slot_bytes=(256 if gpu else 4) << 20, slots=4, force=force)


def costs_from_profile(path: str | Path, *, chunk_bytes: int, overlap: bool) -> MethodCosts:
    """MethodCosts from a `kvplane calibrate nixl` YAML block (docs/measurements/*.yaml)."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
        m = data["nixl_measured"]

        def val(key: str) -> float:
            return float(m[key]["value"])

        return MethodCosts(
            bandwidth=val("write_bandwidth_GBps") * 1e9,
            per_descriptor=val("per_descriptor_us") * 1e-6,
            copy_bandwidth=val("copy_GBps") * 1e9 if "copy_GBps" in m else (
                DEFAULT_COSTS["VRAM" if overlap else "DRAM"].copy_bandwidth),
            round_trip=2 * val("small_write_latency_us") * 1e-6,
            chunk_bytes=chunk_bytes,
            overlap=overlap,
            staged_fixed=STAGED_FIXED_S,
            plan_per_run=PLAN_PER_RUN_S,
            # GPU memory only: a host-memory profile has no IPC copy
            ipc_bandwidth=(val("ipc_copy_GBps") if "ipc_copy_GBps" in m else IPC_GBPS) * 1e9
            if overlap else 0.0,
            ipc_fixed=IPC_FIXED_S if overlap else 0.0,
        )
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: not a calibration profile with nixl_measured "
                         f"(write_bandwidth_GBps, per_descriptor_us, small_write_latency_us): "
                         f"{exc}") from exc


# ---- control messages ------------------------------------------------------------------------


def encode(kind: str, header: dict[str, Any], runs: Any = None, granule: int = 1) -> bytes:
    """A control message; `runs` ((offset, length) rows, multiples of `granule`) travel as
    granule counts, offsets delta-coded, column by column, int32 where they fit, zlib'd: a KV
    layout repeats its block pattern per layer, which zlib's window then finds (65,536 runs of
    a fragmented 16k-token transfer fit in a few KiB instead of 1 MiB)."""
    import numpy as np

    body = b""
    if runs is not None:
        arr = np.asarray(runs, dtype=np.int64).reshape(-1, 2) // granule
        cols = np.concatenate([np.diff(arr[:, 0], prepend=0), arr[:, 1]])
        wide = bool(len(cols)) and (int(cols.max()) >= 2**31 or int(cols.min()) < -2**31)
        body = zlib.compress(cols.astype(np.int64 if wide else np.int32).tobytes(), 1)
        header = {**header, "rg": granule, "rw": 8 if wide else 4}
    head = json.dumps({"k": kind, **header}, separators=(",", ":")).encode()
    return MAGIC + head + b"\n" + body


def decode(message: bytes) -> tuple[str, dict[str, Any], Any]:
    import numpy as np

    head, _, body = message[len(MAGIC):].partition(b"\n")
    header = json.loads(head)
    runs = None
    if "lay" in header:  # a block transfer: the body is the block ids, int32
        return str(header.pop("k")), header, np.frombuffer(body, dtype=np.int32).astype(
            np.int64)
    if body:
        dtype = np.int64 if int(header.get("rw", 8)) == 8 else np.int32
        cols = np.frombuffer(zlib.decompress(body), dtype=dtype).astype(np.int64)
        n = len(cols) // 2
        runs = np.stack([np.cumsum(cols[:n]), cols[n:]], axis=1) * int(header.get("rg", 1))
    return str(header.pop("k")), header, runs


def granules_of(runs: Any, granule: int) -> Any:
    """(offset, length) rows, granule-aligned, as granule indices in stream order."""
    import numpy as np

    off, n = runs[:, 0] // granule, runs[:, 1] // granule
    total = int(n.sum())
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
    return np.repeat(off, n) + within


# ---- block-level transfers ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """Where each KV block's bytes lie in one transport's offset space: piece p of block b is
    `piece` bytes at `bases[p] + b * stride`. A per-layer cache gives one base per layer (or per
    layer and K/V half, FlashAttention's (2, blocks, ...) tensors); a cross-layer-contiguous
    cache (vLLM's block-outermost BLHNC/BLNHC layouts) one base, with piece = stride = all
    layers of a block: one descriptor per block. A transfer of n blocks then moves
    len(bases) x n pieces, planned from the two block-id arrays alone (no per-run lists)."""

    bases: tuple[int, ...]
    stride: int
    piece: int
    num_blocks: int

    def __post_init__(self) -> None:
        if not self.bases or self.piece <= 0 or self.num_blocks <= 0 or self.stride < self.piece:
            raise ValueError(f"block layout needs bases, piece > 0, stride >= piece and "
                             f"blocks > 0 (bases {len(self.bases)}, piece {self.piece}, "
                             f"stride {self.stride}, blocks {self.num_blocks})")
        if min(self.bases) < 0:
            raise ValueError("block layout bases must not be negative")

    @property
    def span(self) -> int:
        """Bytes from a piece group's base to the end of its last block."""
        return (self.num_blocks - 1) * self.stride + self.piece

    def to_wire(self) -> dict[str, Any]:
        return {"b": list(self.bases), "s": self.stride, "p": self.piece, "n": self.num_blocks}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> BlockLayout:
        return cls(tuple(int(x) for x in d["b"]), int(d["s"]), int(d["p"]), int(d["n"]))


def _mergeable(local: BlockLayout, remote: BlockLayout) -> bool:
    """Consecutive blocks' pieces touch on both sides (each piece is its block's stride)."""
    return local.stride == local.piece and remote.stride == remote.piece


def block_descriptors(local: BlockLayout, local_ids: Any, remote: BlockLayout,
                      remote_ids: Any) -> int:
    """How many runs `block_runs_array` would give, from the id arrays alone (cheap: the staged
    path never builds the runs)."""
    import numpy as np

    n = len(local_ids)
    if n > 1 and _mergeable(local, remote):
        lid, rid = np.asarray(local_ids), np.asarray(remote_ids)
        n = 1 + int(np.count_nonzero((lid[1:] != lid[:-1] + 1) | (rid[1:] != rid[:-1] + 1)))
    return len(local.bases) * n


def block_runs_array(local: BlockLayout, local_ids: Any, remote: BlockLayout,
                     remote_ids: Any) -> Any:
    """(local, remote, length) runs of a block transfer, merged where consecutive blocks are
    consecutive on both sides and each piece is its block's whole stride: an (N, 3) int64
    array built with numpy from the id arrays (piece group outermost, token order inside)."""
    import numpy as np

    lid = np.asarray(local_ids, dtype=np.int64)
    rid = np.asarray(remote_ids, dtype=np.int64)
    if len(lid) == 0:
        return np.empty((0, 3), dtype=np.int64)
    if _mergeable(local, remote) and len(lid) > 1:
        brk = (lid[1:] != lid[:-1] + 1) | (rid[1:] != rid[:-1] + 1)
        starts = np.flatnonzero(np.concatenate(([True], brk)))
        counts = np.diff(np.append(starts, len(lid)))
        lid, rid = lid[starts], rid[starts]
    else:
        counts = np.ones(len(lid), dtype=np.int64)
    lb = np.asarray(local.bases, dtype=np.int64)[:, None]
    rb = np.asarray(remote.bases, dtype=np.int64)[:, None]
    p = len(local.bases)
    out = np.empty((p * len(lid), 3), dtype=np.int64)
    out[:, 0] = (lb + lid[None, :] * local.stride).ravel()
    out[:, 1] = (rb + rid[None, :] * remote.stride).ravel()
    out[:, 2] = np.tile(counts * local.piece, p)
    return out


@dataclass(slots=True)
class BlockPlan:
    """A block job's copies: per piece group a 2-D view (one block's piece per row) and the
    block ids (one index tensor for every group); stream row s = group s // n, block s % n."""

    views: list[Any]
    ids: Any
    n: int
    span: _Span | None = None  # when set: one copy per chunk through `flat`
    flat: Any = None  # span row of every stream row (piece group, block, row in piece)


@dataclass(frozen=True, slots=True)
class _Span:
    """One 2-D view over all of a layout's piece groups (from the lowest to the highest address
    they touch), rows of `unit` bytes, so one index op copies a chunk across every layer: the
    batched gather. Only rows of our pieces are ever indexed; the memory between regions (other
    allocations) is never touched. row0: per piece group, the row of its block 0."""

    rows: Any
    unit: int
    row0: Any  # (groups, 1, 1), on the copies' device
    stride_rows: int
    within: Any  # (1, 1, piece_rows): row offsets inside one piece, on the copies' device


# ---- copies --------------------------------------------------------------------------------------


class Copier:
    """Gathers granules of our registered regions into a staging slot and scatters them back,
    with torch (CUDA side stream, or CPU) or numpy, whichever the buffers are."""

    def __init__(self, buffers: list[Any], pool: Any) -> None:
        self.cuda = _is_torch(pool) and pool.device.type == "cuda"
        if not self.cuda:
            # Host memory, also CPU tensors: numpy views of the same bytes. torch's CPU index
            # ops start thread pools that stall for tens of ms when the cores are busy polling.
            buffers, pool = [_host_view(b) for b in buffers], _host_view(pool)
        self.buffers = buffers  # the registered regions' buffers, in offset order
        self.pool = pool
        self.torch = self.cuda
        self._stream: Any = None
        sizes = [_nbytes(b) for b in buffers]
        self.starts = [0]
        for s in sizes:
            self.starts.append(self.starts[-1] + s)
        self._views: dict[int, tuple[list[Any], Any]] = {}
        self._block_views: dict[BlockLayout, list[Any]] = {}
        self._spans: dict[BlockLayout, _Span | None] = {}

    def region_of(self, layout: BlockLayout) -> str:
        """Why this layout's piece groups do not each lie inside one of our regions ("" when
        they do)."""
        import bisect

        for base in layout.bases:
            r = bisect.bisect_right(self.starts, base) - 1
            if r < 0 or r >= len(self.buffers) or base + layout.span > self.starts[r + 1]:
                return (f"piece group at {base} (+{layout.span} B) is not inside one "
                        f"registered KV region")
        return ""

    def block_views(self, layout: BlockLayout) -> list[Any]:
        """Per piece group, a (blocks, piece) view of the region under it; built once per
        layout (the per-layer address table) and kept."""
        import bisect

        views = self._block_views.get(layout)
        if views is not None:
            return views
        problem = self.region_of(layout)
        if problem:
            raise ValueError(problem)
        views = []
        for base in layout.bases:
            r = bisect.bisect_right(self.starts, base) - 1
            off = base - self.starts[r]
            views.append(_strided_rows(self.buffers[r], off, layout))
        self._block_views[layout] = views
        return views

    def plan_blocks(self, layout: BlockLayout, ids: Any) -> BlockPlan:
        import numpy as np

        idx = np.ascontiguousarray(ids, dtype=np.int64)
        n = len(idx)
        if self.torch:
            import torch

            idx = torch.from_numpy(idx).to(self.pool.device, non_blocking=False)
            self._side().wait_stream(torch.cuda.current_stream(self.pool.device))
        views = self.block_views(layout)
        span = self.span_for(layout)
        if span is None:
            return BlockPlan(views, idx, n)
        flat = (span.row0 + idx[None, :, None] * span.stride_rows + span.within).reshape(-1)
        if self.torch:
            import torch

            self._side().wait_stream(torch.cuda.current_stream(self.pool.device))
        return BlockPlan(views, idx, n, span, flat)

    def span_for(self, layout: BlockLayout) -> _Span | None:
        """The layout's span view (cached), or None when the piece groups do not share a row
        grid of at least 512 bytes (then one copy per piece group) or KVPLANE_STAGING_SPAN=0."""
        import bisect

        if layout in self._spans:
            return self._spans[layout]
        span = None
        if os.environ.get("KVPLANE_STAGING_SPAN", "1") != "0":
            addrs = []
            for base in layout.bases:
                r = bisect.bisect_right(self.starts, base) - 1
                addrs.append(_address(self.buffers[r]) + base - self.starts[r])
            low = min(addrs)
            high = max(addrs) + layout.span
            unit = math.gcd(layout.piece, layout.stride, *(a - low for a in addrs))
            if unit >= 512 and unit % 8 == 0 and low % 8 == 0:
                import numpy as np

                rows = _raw_rows(low, high - low, unit, self.buffers[0])
                row0 = np.array([(a - low) // unit for a in addrs], dtype=np.int64)
                within = np.arange(layout.piece // unit, dtype=np.int64)
                if self.torch:
                    import torch

                    row0 = torch.as_tensor(row0, device=self.pool.device)
                    within = torch.as_tensor(within, device=self.pool.device)
                span = _Span(rows, unit, row0[:, None, None], layout.stride // unit,
                             within[None, None, :])
        self._spans[layout] = span
        return span

    def views(self, granule: int) -> tuple[list[Any], Any]:
        """Each region and the pool as a 2-D view of one granule per row."""
        if granule not in self._views:
            self._views[granule] = ([_rows(b, granule) for b in self.buffers],
                                    _rows(self.pool, granule))
        return self._views[granule]

    def plan(self, gidx: Any, granule: int) -> tuple[Any, Any, Any]:
        """Per granule of the stream: (region, row) plus where the region changes (segments)."""
        import numpy as np

        starts_g = np.array(self.starts[:-1], dtype=np.int64) // granule
        region = np.searchsorted(starts_g, gidx, side="right") - 1
        rows = gidx - starts_g[region]
        cuts = np.flatnonzero(np.diff(region)) + 1
        seg_starts = np.concatenate(([0], cuts)).astype(np.int64)
        if self.torch:
            import torch

            rows = torch.from_numpy(rows).to(self.pool.device)
            # Copies of this job run on the side stream after what the caller's stream has
            # queued so far (a model step writing the KV cache, say).
            self._side().wait_stream(torch.cuda.current_stream(self.pool.device))
        return region, rows, seg_starts

    def _side(self) -> Any:
        if self._stream is None:
            import torch

            self._stream = torch.cuda.Stream(device=self.pool.device)
        return self._stream

    def run(self, direction: Literal["gather", "scatter"], plan: tuple[Any, Any, Any],
            lo: int, hi: int, slot_offset: int, granule: int) -> Any:
        """Copy stream granules [lo, hi) to (gather) or from (scatter) the slot at
        `slot_offset` (bytes into the pool). Returns an event to query, or None when done."""
        import numpy as np

        if isinstance(plan, BlockPlan):
            return self._run_blocks(direction, plan, lo, hi, slot_offset, granule)
        region, rows, seg_starts = plan
        regions, pool_rows = self.views(granule)
        slot_row = slot_offset // granule
        first = int(np.searchsorted(seg_starts, lo, side="right")) - 1
        segs = []
        i = max(first, 0)
        while i < len(seg_starts) and seg_starts[i] < hi:
            s0 = max(int(seg_starts[i]), lo)
            s1 = min(int(seg_starts[i + 1]) if i + 1 < len(seg_starts) else len(region), hi)
            segs.append((int(region[s0]), s0, s1))
            i += 1
        if self.cuda:
            import torch

            with torch.cuda.stream(self._side()):
                self._copy(direction, segs, regions, pool_rows, rows, slot_row - lo)
                event = torch.cuda.Event()
                event.record(self._side())
            return event
        self._copy(direction, segs, regions, pool_rows, rows, slot_row - lo)
        return None

    def _run_blocks(self, direction: Literal["gather", "scatter"], plan: BlockPlan, lo: int,
                    hi: int, slot_offset: int, piece: int) -> Any:
        """Stream rows [lo, hi) of a block job: one index_select (gather) or index_copy_
        (scatter) over the span when there is one, else one per piece group the chunk
        touches, all with the job's one id tensor."""
        span = plan.span
        if span is not None and slot_offset % 8 == 0:
            k = int(span.within.shape[-1])
            slot = _slot_rows(self.pool, slot_offset, (hi - lo) * k, span.unit)
            idx = plan.flat[lo * k:hi * k]
            if not self.cuda:
                if direction == "gather":
                    span.rows.take(idx, axis=0, out=slot, mode="clip")
                else:
                    span.rows[idx] = slot
                return None
            import torch

            with torch.cuda.stream(self._side()):
                if direction == "gather":
                    torch.index_select(span.rows, 0, idx, out=slot)
                else:
                    span.rows.index_copy_(0, idx, slot)
                event = torch.cuda.Event()
                event.record(self._side())
            return event
        slot = _slot_rows(self.pool, slot_offset, hi - lo, piece)
        n = plan.n
        steps = []
        for p in range(lo // n, (hi - 1) // n + 1):
            i0, i1 = max(lo, p * n) - p * n, min(hi, (p + 1) * n) - p * n
            a = p * n + i0 - lo
            steps.append((plan.views[p], plan.ids[i0:i1], slot[a:a + i1 - i0]))
        if not self.cuda:
            for view, ids, rows in steps:
                if direction == "gather":
                    if self.torch:
                        import torch

                        torch.index_select(view, 0, ids, out=rows)
                    else:
                        view.take(ids, axis=0, out=rows, mode="clip")
                else:
                    view[ids] = rows
            return None
        import torch

        with torch.cuda.stream(self._side()):
            for view, ids, rows in steps:
                if direction == "gather":
                    torch.index_select(view, 0, ids, out=rows)
                else:
                    view.index_copy_(0, ids, rows)
            event = torch.cuda.Event()
            event.record(self._side())
        return event

    def _copy(self, direction: str, segs: list[tuple[int, int, int]], regions: list[Any],
              pool_rows: Any, rows: Any, shift: int) -> None:
        import numpy as np

        for reg, s0, s1 in segs:
            src_rows = rows[s0:s1]
            slot = pool_rows[s0 + shift:s1 + shift]
            if self.torch:
                import torch

                if direction == "gather":
                    torch.index_select(regions[reg], 0, src_rows, out=slot)
                else:
                    regions[reg].index_copy_(0, src_rows, slot)
            elif direction == "gather":
                np.take(regions[reg], src_rows, axis=0, out=slot, mode="clip")
            else:
                regions[reg][src_rows] = slot


def _is_torch(buf: Any) -> bool:
    return type(buf).__module__.startswith("torch")


def _host_view(buf: Any) -> Any:
    if _is_torch(buf):
        import torch

        return buf.reshape(-1).view(torch.uint8).numpy()
    return buf


def _nbytes(buf: Any) -> int:
    if _is_torch(buf):
        return int(buf.numel() * buf.element_size())
    return int(buf.nbytes)


def _rows(buf: Any, granule: int) -> Any:
    if _is_torch(buf):
        import torch

        flat = buf.reshape(-1).view(torch.uint8)
        if granule % 8 == 0:
            return flat.view(torch.int64).view(-1, granule // 8)
        return flat.view(-1, granule)
    import numpy as np

    flat = buf.reshape(-1).view(np.uint8)
    if granule % 8 == 0:
        return flat.view(np.int64).reshape(-1, granule // 8)
    return flat.reshape(-1, granule)


def _strided_rows(buf: Any, offset: int, layout: BlockLayout) -> Any:
    """A (blocks, piece) view of `buf`'s bytes from `offset`, rows `layout.stride` apart
    (int64 elements where everything is 8-byte aligned: faster copies)."""
    wide = layout.piece % 8 == 0 and layout.stride % 8 == 0 and offset % 8 == 0
    unit = 8 if wide else 1
    shape = (layout.num_blocks, layout.piece // unit)
    strides = (layout.stride // unit, 1)
    if _is_torch(buf):
        import torch

        flat = buf.reshape(-1).view(torch.uint8)
        if wide:
            flat = flat.view(torch.int64)
        return torch.as_strided(flat, shape, strides, offset // unit)
    import numpy as np

    flat = buf.reshape(-1).view(np.uint8)
    if wide:
        flat = flat.view(np.int64)
    start = flat[offset // unit:]
    return np.lib.stride_tricks.as_strided(
        start, shape, (strides[0] * flat.itemsize, flat.itemsize), writeable=True)


def _address(buf: Any) -> int:
    if _is_torch(buf):
        return int(buf.data_ptr())
    return int(buf.ctypes.data)


class _CudaMemory:
    """Raw device memory as __cuda_array_interface__, for torch.as_tensor."""

    def __init__(self, address: int, shape: tuple[int, int], typestr: str) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr,
                                         "data": (address, False), "version": 2}


def _raw_rows(address: int, nbytes: int, unit: int, like: Any) -> Any:
    """A (nbytes / unit, unit) view (int64 elements) of memory from `address`, on the device
    of `like`."""
    shape = (nbytes // unit, unit // 8)
    if _is_torch(like) and like.device.type == "cuda":
        import torch

        return torch.as_tensor(_CudaMemory(address, shape, "<i8"), device=like.device)
    import ctypes

    import numpy as np

    raw = (ctypes.c_char * nbytes).from_address(address)
    return np.frombuffer(raw, dtype=np.int64).reshape(shape)


def _slot_rows(pool: Any, offset: int, rows: int, piece: int) -> Any:
    """`rows` rows of `piece` bytes of the pool from `offset`, as a 2-D view."""
    if _is_torch(pool):
        import torch

        flat = pool[offset:offset + rows * piece]
        if piece % 8 == 0 and offset % 8 == 0:
            return flat.view(torch.int64).view(rows, piece // 8)
        return flat.view(rows, piece)
    flat = pool[offset:offset + rows * piece]
    if piece % 8 == 0 and offset % 8 == 0:
        return flat.view("<i8").reshape(rows, piece // 8)
    return flat.reshape(rows, piece)


def allocate_pool(like: Any, nbytes: int) -> Any:
    """A staging buffer of the same kind (and device) as a registered buffer."""
    if _is_torch(like):
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device=like.device)
    import numpy as np

    return np.empty(nbytes, dtype=np.uint8)


def _event_done(event: Any) -> bool:
    return event is None or bool(event.query())


# ---- jobs ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Job:
    key: tuple[str, str]  # (peer, job id); the id is unique for its initiator
    role: Literal["send", "recv"]
    granule: int
    chunk_bytes: int
    nbytes: int
    plan: Any
    user: Transfer | None = None  # the caller's transfer this job finishes, if it is ours
    notify: bytes = b""  # a staged WRITE's notification, delivered after the last scatter
    grants: collections.deque[tuple[int, int]] = field(default_factory=collections.deque)
    # send: [chunk, slot, remote offset, phase ("gather"/"write"), event or NIXL handle]
    active: list[list[Any]] = field(default_factory=list)
    next_grant: int = 0
    slot_of: dict[int, int] = field(default_factory=dict)
    landed: collections.deque[int] = field(default_factory=collections.deque)
    finished: int = 0
    acked: bool = False  # a staged WRITE's receiver said every chunk is in place
    completed: bool = False
    failed: str = ""
    touched: float = 0.0

    @property
    def chunks(self) -> int:
        return max(1, math.ceil(self.nbytes / self.chunk_bytes))

    def span(self, k: int) -> tuple[int, int]:
        """Stream granules of chunk k."""
        per = self.chunk_bytes // self.granule
        return k * per, min((k + 1) * per, self.nbytes // self.granule)


class Stager:
    """The staging half of a `Transport`; see the module docstring."""

    def __init__(self, transport: Transport, config: StagingConfig, buffers: list[Any],
                 pool: Any, pool_offset: int, slot_bytes: int) -> None:
        self.t = transport
        self.config = config
        self.slot_bytes = slot_bytes
        self.pool_offset = pool_offset  # where the pool starts in our offset space
        self.copier = Copier(buffers, pool)
        n = config.slots
        self.free_send = collections.deque(range(n))
        self.free_recv = collections.deque(range(n, 2 * n))
        self.jobs: dict[tuple[str, str], _Job] = {}
        self.resting: list[tuple[float, int]] = []  # (free again at, slot offset)
        self._seq = 0
        self._info_b64: str | None = None
        # KVPLANE_STAGING_TRACE=1: (perf_counter, job id, step) of every step, for benchmarks.
        self.trace: list[tuple[float, str, str]] | None = (
            [] if os.environ.get("KVPLANE_STAGING_TRACE") else None)

    def _tr(self, job: _Job, step: str) -> None:
        if self.trace is not None:
            self.trace.append((time.perf_counter(), job.key[1], step))

    # -- starting -------------------------------------------------------------------------------

    def post(self, peer: str, op: str, merged: Any, notify: bytes, transfer: Transfer,
             granule: int, chunk_bytes: int, started: float = 0.0) -> None:
        """Start a staged WRITE (we hold the data) or READ (the peer does)."""
        import numpy as np

        self._seq += 1
        job_id = f"{self.t.name}/{self._seq}"
        local = np.stack([merged[:, 0], merged[:, 2]], axis=1)
        remote = np.stack([merged[:, 1], merged[:, 2]], axis=1)
        role: Literal["send", "recv"] = "send" if op == "WRITE" else "recv"
        job = _Job((peer, job_id), role, granule, chunk_bytes, int(merged[:, 2].sum()),
                   self.copier.plan(granules_of(local, granule), granule), user=transfer,
                   notify=notify if op == "READ" else b"", touched=time.monotonic())
        transfer.handle = job
        self.jobs[job.key] = job
        if self.trace is not None and started:
            self.trace.append((started, job_id, "post"))
        self._tr(job, "planned")
        hdr = {"id": job_id, "g": granule, "c": chunk_bytes, "n": job.nbytes,
               "info": self._info()}
        if op == "WRITE":
            hdr["notify"] = base64.b64encode(notify).decode("ascii")
            msg = encode("offer", hdr, remote, granule)
        else:
            hdr["grants"] = self._grant(job)
            msg = encode("pull", hdr, remote, granule)
        self._tr(job, f"encoded {len(msg)} B")
        self._send(job, msg)
        self._tr(job, "sent")

    def post_blocks(self, peer: str, op: str, local: BlockLayout, local_ids: Any,
                    remote: BlockLayout, remote_ids: Any, notify: bytes, transfer: Transfer,
                    chunk_bytes: int, started: float = 0.0) -> None:
        """Start a staged block transfer: the plan is the id arrays (no run list); the first
        message carries the peer's layout and its block ids (4 bytes a block)."""
        import numpy as np

        self._seq += 1
        job_id = f"{self.t.name}/{self._seq}"
        piece = local.piece
        chunk = chunk_bytes // piece * piece
        nbytes = len(local.bases) * len(local_ids) * piece
        role: Literal["send", "recv"] = "send" if op == "WRITE" else "recv"
        job = _Job((peer, job_id), role, piece, chunk, nbytes,
                   self.copier.plan_blocks(local, local_ids), user=transfer,
                   notify=notify if op == "READ" else b"", touched=time.monotonic())
        transfer.handle = job
        self.jobs[job.key] = job
        if self.trace is not None and started:
            self.trace.append((started, job_id, "post"))
        self._tr(job, "planned")
        hdr: dict[str, Any] = {"id": job_id, "g": piece, "c": chunk, "n": nbytes,
                               "info": self._info(), "lay": remote.to_wire()}
        body = np.ascontiguousarray(remote_ids, dtype=np.int32).tobytes()
        if op == "WRITE":
            hdr["notify"] = base64.b64encode(notify).decode("ascii")
            msg = encode("offer", hdr) + body
        else:
            hdr["grants"] = self._grant(job)
            msg = encode("pull", hdr) + body
        self._tr(job, f"encoded {len(msg)} B")
        self._send(job, msg)
        self._tr(job, "sent")

    def _info(self) -> str:
        if self._info_b64 is None:  # fetching agent metadata is not free: once
            self._info_b64 = base64.b64encode(self.t.local_info()).decode("ascii")
        return self._info_b64

    def cancel(self, job: _Job, reason: str) -> None:
        """The caller gave up (time-out): stop, tell the peer, keep slots until ops end."""
        job.user = None
        self._fail(job, reason, tell=True)

    # -- messages --------------------------------------------------------------------------------

    def on_message(self, peer: str, message: bytes) -> None:
        try:
            kind, hdr, runs = decode(message)
            key = (peer, str(hdr["id"]))
        except (ValueError, KeyError, zlib.error) as exc:
            logger.warning("%s: unreadable staging message from %s: %s", self.t.name, peer, exc)
            return
        job = self.jobs.get(key)
        if kind in ("offer", "pull"):
            if job is not None:  # a repeat
                return
            if runs is None or not self._know(peer, hdr):
                logger.warning("%s: staged %s %s from %s dropped: %s", self.t.name, kind,
                               key[1], peer, "no runs" if runs is None else "unknown peer")
                return
            g, c, n = int(hdr["g"]), int(hdr["c"]), int(hdr["n"])
            layout = None
            try:
                if "lay" in hdr:
                    layout = BlockLayout.from_wire(hdr["lay"])
                    problem = self._bad_block_request(layout, runs, g, c, n)
                else:
                    problem = self._bad_request(runs, g, c, n)
            except (ValueError, KeyError, TypeError) as exc:
                problem = f"unreadable block layout: {exc}"
            if problem:  # refuse before any copy: a bad index on a GPU would kill the context
                logger.warning("%s: refusing staged %s from %s: %s", self.t.name, kind, peer,
                               problem)
                self.t._agent_notify(peer, encode("fail", {"id": key[1], "reason": problem}))
                return
            plan = (self.copier.plan_blocks(layout, runs) if layout is not None
                    else self.copier.plan(granules_of(runs, g), g))
            job = _Job(key, "recv" if kind == "offer" else "send", g, c, n, plan,
                       touched=time.monotonic())
            self.jobs[key] = job
            self._tr(job, f"got {kind}, planned")
            if kind == "offer":
                job.notify = base64.b64decode(hdr.get("notify", ""))
                grants = self._grant(job)
                if grants:
                    self._send(job, encode("grant", {"id": key[1], "grants": grants}))
            else:
                job.grants.extend((int(k), int(o)) for k, o in hdr.get("grants", [])
                                  if 0 <= int(k) < job.chunks)
        elif job is None:
            return
        elif kind == "grant":
            job.grants.extend((int(k), int(o)) for k, o in hdr["grants"]
                              if 0 <= int(k) < job.chunks)
            self._tr(job, f"grant {[k for k, _ in hdr['grants']]}")
        elif kind == "landed":
            if int(hdr["chunk"]) in job.slot_of:
                job.landed.append(int(hdr["chunk"]))
            self._tr(job, f"landed {hdr['chunk']}")
        elif kind == "done":
            job.acked = True
            if job.finished >= job.chunks and not job.failed:
                self._complete(job)
        elif kind == "fail":
            self._fail(job, f"peer: {hdr.get('reason', 'failed')}", tell=False)
        job.touched = time.monotonic()

    def _bad_request(self, runs: Any, g: int, chunk: int, nbytes: int) -> str:
        """Why a peer's run list cannot be served here ("" when it can)."""
        off, n = runs[:, 0], runs[:, 1]
        if g <= 0 or chunk <= 0 or chunk % g or chunk > self.slot_bytes:
            return f"granule {g} / chunk {chunk} does not fit our {self.slot_bytes}-byte slots"
        if int(n.sum()) != nbytes or nbytes % g:
            return "run lengths do not add up to the transfer's bytes"
        if len(off) and (int(off.min()) < 0 or int((off + n).max()) > self.pool_offset
                         or bool(((off | n) % g).any()) or int(n.min()) <= 0):
            return "a run is outside our KV memory or not granule-aligned"
        return ""

    def _bad_block_request(self, layout: BlockLayout, ids: Any, piece: int, chunk: int,
                           nbytes: int) -> str:
        """Why a peer's block request cannot be served here ("" when it can)."""
        if piece != layout.piece or chunk <= 0 or chunk % piece or chunk > self.slot_bytes:
            return (f"piece {piece} / chunk {chunk} does not fit our {self.slot_bytes}-byte "
                    f"slots or the layout's {layout.piece}-byte pieces")
        if nbytes != len(layout.bases) * len(ids) * piece:
            return "the block count and layout do not add up to the transfer's bytes"
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= layout.num_blocks):
            return f"a block id is outside 0..{layout.num_blocks - 1}"
        if max(layout.bases) + layout.span > self.pool_offset:
            return "the block layout reaches past our KV memory"
        return self.copier.region_of(layout)

    def _know(self, peer: str, hdr: dict[str, Any]) -> bool:
        """The initiator's handshake rides on its first message, so a holder that never
        added its reader as a peer (pull mode) can still WRITE to it."""
        if peer in self.t._peers:
            return True
        try:
            self.t.add_peer(base64.b64decode(hdr["info"]))
        except Exception as exc:  # noqa: BLE001 - PeerError or a NIXL error: drop the job
            logger.warning("%s: cannot add staging peer %s: %s", self.t.name, peer, exc)
            return False
        return peer in self.t._peers

    def parked(self) -> bool:
        """No receive slot is free and some rest after a failed job: a new staged receive
        would wait up to `stale_s` for them."""
        return not self.free_recv and bool(self.resting)

    # -- progress --------------------------------------------------------------------------------

    def advance(self) -> None:
        now = time.monotonic()
        if self.resting:
            back = [off for until, off in self.resting if until <= now]
            self.resting = [(u, off) for u, off in self.resting if u > now]
            self.free_recv.extend((off - self.pool_offset) // self.slot_bytes for off in back)
        for job in list(self.jobs.values()):
            if job.role == "send":
                self._advance_send(job)
            else:
                self._advance_recv(job)
            if not job.failed and not job.completed and now - job.touched > self.config.stale_s:
                self._fail(job, f"no progress for {self.config.stale_s:g} s", tell=True)
            if (job.failed or job.completed) and not job.active:
                self.jobs.pop(job.key, None)

    def _advance_send(self, job: _Job) -> None:
        # Each granted chunk: gather into a free send slot, WRITE it once the gather is done,
        # free the slot once the WRITE is. Checking between launches lets a WRITE start while
        # later chunks are still being gathered.
        self._send_step(job)
        while job.grants and self.free_send and not job.failed:
            k, remote_off = job.grants.popleft()
            slot = self.free_send.popleft()
            lo, hi = job.span(k)
            event = self.copier.run("gather", job.plan, lo, hi, slot * self.slot_bytes,
                                    job.granule)
            job.active.append([k, slot, remote_off, "gather", event])
            self._tr(job, f"gather {k}")
            self._send_step(job)

    def _send_step(self, job: _Job) -> None:
        for item in list(job.active):
            k, slot, remote_off, phase, what = item
            if phase == "gather" and _event_done(what):
                if job.failed:
                    self._end_item(job, item, send=True)
                    continue
                lo, hi = job.span(k)
                length = (hi - lo) * job.granule
                self._tr(job, f"gathered {k}")
                handle = self.t._post_raw(job.key[0], "WRITE",
                                          [(self.pool_offset + slot * self.slot_bytes,
                                            remote_off, length)],
                                          encode("landed", {"id": job.key[1], "chunk": k}))
                if handle is None:
                    self._end_item(job, item, send=True)
                    self._fail(job, "posting a staged WRITE failed", tell=True)
                    continue
                item[3], item[4] = "write", handle
                job.touched = time.monotonic()
                self._tr(job, f"write {k}")
            elif phase == "write":
                state = self.t._xfer_state(what)
                if state == "PROC":
                    continue
                self._end_item(job, item, send=True)
                if state != "DONE":
                    self._fail(job, "a staged WRITE failed (peer gone?)", tell=True)
                    continue
                job.finished += 1
                job.touched = time.monotonic()
                self._tr(job, f"written {k}")
                # Our own WRITE is done when the receiver has scattered it all (as a direct
                # WRITE is done when its bytes are in place); a holder serving a READ is done
                # when its WRITEs are.
                if job.finished >= job.chunks and not job.failed and (
                        job.acked or job.user is None):
                    self._complete(job)

    def _advance_recv(self, job: _Job) -> None:
        # Finished scatters first, so their slots are granted again in this same pass.
        self._recv_step(job)
        while job.landed and not job.failed:
            k = job.landed.popleft()
            lo, hi = job.span(k)
            event = self.copier.run("scatter", job.plan, lo, hi,
                                    job.slot_of[k] - self.pool_offset, job.granule)
            job.active.append([k, job.slot_of[k], 0, "scatter", event])
            self._tr(job, f"scatter {k}")
            self._recv_step(job)

    def _recv_step(self, job: _Job) -> None:
        for item in list(job.active):
            if not _event_done(item[4]):
                continue
            self._end_item(job, item, send=False)
            job.slot_of.pop(item[0], None)
            if job.failed:
                continue
            job.finished += 1
            job.touched = time.monotonic()
            self._tr(job, f"scattered {item[0]}")
            if job.finished >= job.chunks:
                self._complete(job)
        if not job.failed and job.next_grant < job.chunks and self.free_recv:
            grants = self._grant(job)
            if grants:
                self._send(job, encode("grant", {"id": job.key[1], "grants": grants}))
                self._tr(job, f"granted {[k for k, _ in grants]}")

    # -- helpers ---------------------------------------------------------------------------------

    def _grant(self, job: _Job) -> list[list[int]]:
        out = []
        while job.next_grant < job.chunks and self.free_recv:
            slot = self.free_recv.popleft()
            off = self.pool_offset + slot * self.slot_bytes
            job.slot_of[job.next_grant] = off
            out.append([job.next_grant, off])
            job.next_grant += 1
        return out

    def _end_item(self, job: _Job, item: list[Any], *, send: bool) -> None:
        job.active.remove(item)
        if send:
            self.free_send.append(item[1])
        else:
            self.free_recv.append((item[1] - self.pool_offset) // self.slot_bytes)

    def _complete(self, job: _Job) -> None:
        from kvplane.live.transport import Notification, Status

        if job.completed:
            return
        job.completed = True
        self._tr(job, "complete")
        if job.role == "recv":
            if job.user is None:  # a peer's staged WRITE: tell it, then deliver its message
                self.t._agent_notify(job.key[0], encode("done", {"id": job.key[1]}))
                if job.notify:
                    self.t._inbox.append(Notification(job.key[0], job.notify))
            elif job.user is not None and job.notify:  # a READ's notification to the holder
                self.t._agent_notify(job.key[0], job.notify)
        if job.user is not None:
            job.user.finish(Status.DONE)
            job.user.handle = None

    def _fail(self, job: _Job, reason: str, *, tell: bool) -> None:
        from kvplane.live.transport import Status

        if job.failed:
            return
        job.failed = reason
        logger.warning(
            "%s: staged %s job %s with %s failed: %s (chunks %d, done %d, granted %d, grants "
            "waiting %d, in flight %s; free send slots %d, receive %d, resting %d)%s",
            self.t.name, job.role, job.key[1], job.key[0], reason, job.chunks, job.finished,
            job.next_grant, len(job.grants), [(i[0], i[3]) for i in job.active],
            len(self.free_send), len(self.free_recv), len(self.resting),
            "" if self.trace is None else
            f"; its steps: {[(round(t, 4), step) for t, j, step in self.trace if j == job.key[1]]}")
        if job.role == "recv":
            # Granted slots not being scattered: the holder may still be writing into them, so
            # they rest for stale_s before another job may be granted them.
            busy = {item[1] for item in job.active}
            until = time.monotonic() + self.config.stale_s
            self.resting += [(until, off) for off in job.slot_of.values() if off not in busy]
            job.slot_of.clear()
            job.landed.clear()
        job.grants.clear()
        if tell:
            self.t._agent_notify(job.key[0], encode("fail", {"id": job.key[1],
                                                             "reason": reason}))
        if job.user is not None:
            job.user.finish(Status.FAILED, reason)
            job.user.handle = None
            job.user = None

    def _send(self, job: _Job, message: bytes) -> None:
        if not self.t._agent_notify(job.key[0], message):
            self._fail(job, "sending a staging control message failed", tell=False)
