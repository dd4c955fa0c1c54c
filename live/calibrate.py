"""`kvplane calibrate nixl`: measure what NIXL costs on this machine, for the simulator's
hardware profiles.

How it works: two processes, each with one `Transport` (UCX), one registered buffer (host
memory, or GPU memory with `device="cuda"`, one GPU per process when two are present). The
initiator times, each as the median of several repeats:
- a contiguous WRITE and READ of the whole buffer (bandwidth; NIXL merges the granules);
- a scattered WRITE of every other 4 KiB granule (nothing merges): its excess over the same
  bytes at full bandwidth, divided by the descriptor count, is the cost per descriptor;
- a 4 KiB WRITE (latency);
- a local gather of every other 4 KiB granule into a contiguous buffer (copy bandwidth: what a
  staged transfer pays to gather, and again to scatter; torch `index_select` on the GPU, numpy
  `take` on the host);
- one-time costs: agent creation, registration, add_peer (preparing both descriptor lists).
The target checks a checksum of what landed, so the figures come from real bytes moved.
Figures print as a YAML block whose every value carries a `measured:` source naming this
command, the machine and the date, ready to paste into a hardware profile.

Rules: both processes keep polling NIXL while the other works (the progress thread is off);
nothing here is imported by the connector.
"""

from __future__ import annotations

import multiprocessing as mp
import platform
import statistics
import time
from datetime import date
from typing import Any

GRANULE = 4096


def _buffer(nbytes: int, device: str, rank: int) -> Any:
    if device == "cuda":
        import torch

        gpu = rank % max(torch.cuda.device_count(), 1)
        return torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{gpu}")
    import numpy as np

    return np.zeros(nbytes, dtype=np.uint8)


def _checksum(buf: Any, device: str) -> int:
    if device == "cuda":
        return int(buf.to(dtype=__import__("torch").int64).sum().item())
    return int(buf.astype("int64").sum())


def _target(conn: Any, nbytes: int, device: str) -> None:
    from kvplane.live.transport import Transport

    t = Transport("calib-target")
    buf = _buffer(nbytes, device, 1)
    t.register(buf)
    conn.send(t.local_info())
    t.add_peer(conn.recv())
    while True:
        t.progress()
        t.notifications()
        if conn.poll(0.0005):
            msg = conn.recv()
            if msg == "stop":
                break
            if msg == "checksum":
                conn.send(_checksum(buf, device))
    t.close()


def _gather(buf: Any, device: str) -> Any:
    """A function that gathers every other granule of `buf` (half its bytes) once."""
    if device == "cuda":
        import torch

        rows = buf.view(torch.int64).view(-1, GRANULE // 8)
        idx = torch.arange(0, rows.shape[0], 2, device=buf.device)
        out = torch.empty((len(idx), GRANULE // 8), dtype=torch.int64, device=buf.device)

        def run() -> None:
            torch.index_select(rows, 0, idx, out=out)
            torch.cuda.synchronize(buf.device)

        return run
    import numpy as np

    rows_np = buf.view(np.int64).reshape(-1, GRANULE // 8)
    idx_np = np.arange(0, rows_np.shape[0], 2)
    out_np = np.empty((len(idx_np), GRANULE // 8), dtype=np.int64)
    return lambda: np.take(rows_np, idx_np, axis=0, out=out_np, mode="clip")


def _median(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(device: str = "cpu", nbytes: int = 256 << 20, repeats: int = 5) -> dict[str, float]:
    import numpy as np

    from kvplane.live.transport import Transport

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(there, nbytes, device), daemon=True)
    proc.start()
    try:
        start = time.perf_counter()
        t = Transport("calib-initiator")
        agent_s = time.perf_counter() - start
        buf = _buffer(nbytes, device, 0)
        if device == "cuda":
            buf.copy_(__import__("torch").arange(nbytes, device=buf.device, dtype=__import__(
                "torch").int64).remainder(251).to(__import__("torch").uint8))
        else:
            buf[:] = np.arange(nbytes, dtype=np.int64) % 251
        start = time.perf_counter()
        t.register(buf)
        register_s = time.perf_counter() - start
        here.send(t.local_info())
        info = here.recv()
        start = time.perf_counter()
        peer = t.add_peer(info)
        add_peer_s = time.perf_counter() - start

        def go(op: str, runs: Any) -> None:
            res = t.transfer(peer, op, runs, timeout=120.0)  # type: ignore[arg-type]
            if not res.ok:
                raise RuntimeError(f"{op} failed: {res.reason}")

        whole = [(0, 0, nbytes)]
        go("WRITE", whole)
        here.send("checksum")
        if here.recv() != _checksum(buf, device):
            raise RuntimeError("the bytes that landed differ from the bytes sent")
        write_s = _median(lambda: go("WRITE", whole), repeats)
        read_s = _median(lambda: go("READ", whole), repeats)
        offs = np.arange(0, nbytes, 2 * GRANULE, dtype=np.int64)
        scattered = np.stack([offs, offs, np.full_like(offs, GRANULE)], axis=1)
        scat_s = _median(lambda: go("WRITE", scattered), max(3, repeats // 2))
        small_s = _median(lambda: go("WRITE", [(0, 0, GRANULE)]), repeats * 10)
        copy_s = _median(_gather(buf, device), repeats)
        here.send("stop")
        t.close()
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    bw = nbytes / write_s
    n_desc = len(offs)
    per_desc = max(scat_s - (n_desc * GRANULE) / bw, 0.0) / n_desc
    return {
        "write_bandwidth_GBps": bw / 1e9,
        "read_bandwidth_GBps": nbytes / read_s / 1e9,
        "per_descriptor_us": per_desc * 1e6,
        "scattered_descriptors": float(n_desc),
        "scattered_write_ms": scat_s * 1e3,
        "small_write_latency_us": small_s * 1e6,
        "copy_GBps": nbytes / 2 / copy_s / 1e9,
        "agent_create_s": agent_s,
        "register_ms_per_GiB": register_s * 1e3 / (nbytes / 2**30),
        "add_peer_ms": add_peer_s * 1e3,
        "buffer_MiB": nbytes / 2**20,
    }


def as_profile_yaml(figures: dict[str, float], device: str) -> str:
    source = (f"measured: kvplane calibrate nixl --device {device} on {platform.node()} "
              f"({platform.machine()}), {date.today().isoformat()}")
    lines = ["nixl_measured:"]
    units = {"write_bandwidth_GBps": "GB/s", "read_bandwidth_GBps": "GB/s",
             "per_descriptor_us": "us", "scattered_descriptors": "count",
             "scattered_write_ms": "ms", "small_write_latency_us": "us", "copy_GBps": "GB/s",
             "agent_create_s": "s",
             "register_ms_per_GiB": "ms/GiB", "add_peer_ms": "ms", "buffer_MiB": "MiB"}
    for key, value in figures.items():
        unit = units.get(key, "")
        lines.append(f"  {key}: {{value: {value:.4g}, unit: \"{unit}\", source: \"{source}\"}}")
    return "\n".join(lines)
