"""How to move one transfer's bytes: as its own runs (one descriptor each), staged, or by a
direct copy between the two processes' memories (CUDA IPC).

Rules kept here (the live transport and the simulator both call `choose`, so a what-if prices
exactly what the live connector would do):
- "direct": every merged run is one descriptor. Time = descriptors x per-descriptor cost +
  bytes / link bandwidth. The per-descriptor cost dominates once runs are small and many (a
  fragmented block pool: one run per block, layer and K/V).
- "staged": the data owner gathers the runs into a registered staging slot, moves each slot
  with one descriptor, and the receiver scatters it into place before the transfer counts as
  done. It costs one control round trip, a fixed software cost (control messages, the first
  and last chunk's bookkeeping), planning per run on both sides (granule indices), the copies,
  and one descriptor per chunk. Where the
  copies run beside the wire (a GPU's side stream) they overlap with it, and only the first
  gather and the last scatter are exposed; on host memory they share the same cores and memory,
  so they add up.
- "ipc": both caches are GPU memory on one host and the mover has mapped the peer's cache
  (CUDA IPC): one kernel reads every byte from the source cache and writes it into the
  destination cache, no staging slot and no NIXL descriptor. Time = a fixed cost (building
  the piece table, the launch, the synchronisation, the notification) + bytes / the copy's
  bandwidth; on one GPU that is the HBM's (each byte read once and written once), between two
  GPUs at most the link's. Chosen whenever it is available and estimated cheapest: it has no
  per-descriptor or per-run cost, so it wins for contiguous transfers too.
- Staging must win by `STAGING_MARGIN` (what the estimate leaves out: the copies' pull on
  memory bandwidth, the pool's bookkeeping); staging is only a choice when both sides have a
  staging pool.
- Pure arithmetic on the arguments: no clock, no I/O. Units: seconds, bytes, bytes/second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Method = Literal["direct", "staged", "ipc"]
# Where an IPC copy runs: both caches on the same GPU, or on two GPUs with peer access.
IpcRoute = Literal["same-device", "peer-device"]
STAGING_MARGIN = 0.9  # staged must be estimated at most 90% of direct to be chosen
# The IPC copy's fixed cost (block ids to the GPU, the launch, the event, the notification):
# what benchmarks/transfer_fragmented.py showed on one H200 (docs/measurements).
IPC_FIXED_S = 0.2e-3


@dataclass(frozen=True, slots=True)
class MethodCosts:
    """What the estimate needs, from a calibrated profile (kvplane calibrate nixl)."""

    bandwidth: float  # bytes/s of one large transfer over the path
    per_descriptor: float  # s each descriptor adds beyond its bytes
    copy_bandwidth: float  # bytes/s of a gather (or a scatter) of the runs on one side
    round_trip: float  # s of one control message there and back (the staging handshake)
    chunk_bytes: int  # size of one staging slot: the unit of the pipeline
    overlap: bool  # copies run beside the wire (GPU side stream) rather than after it
    staged_fixed: float = 0.0  # s of software per staged transfer beyond the round trip
    plan_per_run: float = 0.0  # s to plan one run's copy, paid on each side
    ipc_bandwidth: float = 0.0  # bytes/s of a one-pass IPC copy on one GPU; 0: no IPC path
    ipc_fixed: float = 0.0  # s per IPC transfer: piece table, launch, sync, notification

    def __post_init__(self) -> None:
        if min(self.bandwidth, self.copy_bandwidth) <= 0 or self.chunk_bytes <= 0:
            raise ValueError("bandwidths and chunk_bytes must be positive")
        if min(self.per_descriptor, self.round_trip, self.staged_fixed, self.plan_per_run,
               self.ipc_bandwidth, self.ipc_fixed) < 0:
            raise ValueError("per_descriptor, round_trip, staged_fixed, plan_per_run, "
                             "ipc_bandwidth and ipc_fixed must not be negative")


def direct_time(costs: MethodCosts, nbytes: int, descriptors: int) -> float:
    """One descriptor per merged run."""
    return descriptors * costs.per_descriptor + nbytes / costs.bandwidth


def staged_time(costs: MethodCosts, nbytes: int, runs: int = 0) -> float:
    """Gather `runs` runs into slots, one descriptor per slot, scatter on arrival."""
    if nbytes <= 0:
        return 0.0
    chunks = math.ceil(nbytes / costs.chunk_bytes)
    wire = nbytes / costs.bandwidth + chunks * costs.per_descriptor
    copy = nbytes / costs.copy_bandwidth  # one side's gather (or scatter) of every byte
    fixed = costs.round_trip + costs.staged_fixed + 2 * runs * costs.plan_per_run
    if not costs.overlap:
        return fixed + wire + 2 * copy
    first = min(nbytes, costs.chunk_bytes) / costs.copy_bandwidth
    return fixed + 2 * first + max(wire, copy)


def ipc_time(costs: MethodCosts, nbytes: int, route: IpcRoute) -> float:
    """One copy kernel from the source cache into the destination cache (CUDA IPC). Between two
    GPUs the bytes cross the link, so the link's bandwidth caps the copy's."""
    if costs.ipc_bandwidth <= 0:
        return math.inf
    if nbytes <= 0:
        return 0.0
    bandwidth = costs.ipc_bandwidth
    if route == "peer-device":
        bandwidth = min(bandwidth, costs.bandwidth)
    return costs.ipc_fixed + nbytes / bandwidth


def choose(costs: MethodCosts, nbytes: int, descriptors: int, *,
           staging_available: bool, runs: int | None = None,
           ipc: IpcRoute | None = None) -> Method:
    """The cheapest method for this transfer. "ipc" when `ipc` names a route (the peer's cache
    is mapped) and its estimate beats both others; otherwise "direct" unless staging clearly
    wins. `runs`: what the staged path plans per item (the descriptors for a run list; the
    block count for a block-level transfer, planned from block ids whatever the layer
    count)."""
    best: Method = "direct"
    best_time = direct_time(costs, nbytes, descriptors)
    if staging_available and descriptors > 1:
        staged = staged_time(costs, nbytes, descriptors if runs is None else runs)
        if staged < STAGING_MARGIN * best_time:
            best, best_time = "staged", staged
    if ipc is not None and ipc_time(costs, nbytes, ipc) < best_time:
        return "ipc"
    return best
