"""Fragmented KV transfers: contiguous vs fragmented-as-is vs fragmented-staged, in one run.

Two processes, each with one `Transport` (NIXL, UCX) over a KV cache shaped like one TP rank of
a real model: per layer one tensor (2, blocks, block_size, kv_heads, head_dim), K and V halves
as vLLM's FlashAttention layout has them, so one (layer, K/V, block) piece is
block_size x kv_heads x head_dim x dtype bytes (32 KiB for Llama-3-8B at TP 1). The cache holds
twice the blocks a transfer needs.

Layouts moved (the same bytes each time):
- contiguous: blocks 0..n-1 to blocks 0..n-1 (NIXL merges them: one descriptor per layer and
  K/V);
- fragmented: n blocks drawn at random from each side's pool, paired in token order (what a
  long-running block pool hands out), once "direct" (one descriptor per merged run) and once
  "staged" (gather, one WRITE per slot, scatter), plus "auto" (the transport's own choice from
  its cost estimate).
Each is timed as the median of --repeats from post to the receiver having the bytes in place
(a WRITE: the receiver's notification, acknowledged back; a READ: the reader's completion),
and verified: the receiver's bytes, read in token order, are checksummed against the sender's.

    python benchmarks/transfer_fragmented.py --device cpu
    python benchmarks/transfer_fragmented.py --device cuda --tokens 16384 --json out.json

Prints GB/s per layout and the ratio to contiguous; exits non-zero if any bytes differ.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import numpy as np


def _cache(args: argparse.Namespace, seed: int) -> list[Any]:
    shape = (2, args.pool_blocks, args.block, args.kv_heads, args.head_dim)
    n = int(np.prod(shape)) * args.dtype_bytes
    if args.device != "cpu":
        import torch

        dev = _torch_device(args)
        g = torch.Generator(device=dev).manual_seed(seed)
        return [torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev, generator=g)
                for _ in range(args.layers)]
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(args.layers)]


def _torch_device(args: argparse.Namespace) -> str:
    return "cuda" if args.device == "cuda" else "cpu"


def _piece(args: argparse.Namespace) -> int:
    return args.block * args.kv_heads * args.head_dim * args.dtype_bytes


def byte_runs(args: argparse.Namespace, local_blocks: Any, remote_blocks: Any) -> Any:
    """(local, remote, length) per (layer, K/V, block) piece; the transport merges them."""
    piece = _piece(args)
    layer_bytes = 2 * args.pool_blocks * piece
    lk = np.arange(args.layers * 2, dtype=np.int64)
    base = (lk // 2) * layer_bytes + (lk % 2) * args.pool_blocks * piece
    lo = (base[:, None] + np.asarray(local_blocks, dtype=np.int64)[None, :] * piece).ravel()
    ro = (base[:, None] + np.asarray(remote_blocks, dtype=np.int64)[None, :] * piece).ravel()
    return np.stack([lo, ro, np.full_like(lo, piece)], axis=1)


def checksum(args: argparse.Namespace, cache: list[Any], blocks: Any) -> int:
    """Position-weighted sum of the pieces of `blocks` in token order (int64, wrapping)."""
    piece = _piece(args)
    total = 0
    if args.device != "cpu":
        import torch

        idx = torch.as_tensor(np.asarray(blocks), device=_torch_device(args))
        w = torch.arange(1, len(blocks) + 1, device=_torch_device(args), dtype=torch.int64)
        for li, layer in enumerate(cache):
            rows = layer.view(torch.int64).view(2, args.pool_blocks, piece // 8)
            for kv in range(2):
                s = rows[kv].index_select(0, idx).sum(dim=1)
                total += int(((s * w).sum() * (2 * li + kv + 1)).item())
        return total & (2**64 - 1)
    w = np.arange(1, len(blocks) + 1, dtype=np.int64)
    with np.errstate(over="ignore"):
        for li, layer in enumerate(cache):
            rows = layer.view(np.int64).reshape(2, args.pool_blocks, piece // 8)
            for kv in range(2):
                s = rows[kv][np.asarray(blocks)].sum(axis=1)
                total += int((s * w).sum()) * (2 * li + kv + 1)
    return total & (2**64 - 1)


def _zero(args: argparse.Namespace, cache: list[Any], blocks: Any) -> None:
    piece = _piece(args)
    for layer in cache:
        if args.device != "cpu":
            import torch

            rows = layer.view(2, args.pool_blocks, piece)
            idx = torch.as_tensor(np.asarray(blocks), device=_torch_device(args))
            rows.index_fill_(1, idx, 0)
            if args.device == "cuda":
                torch.cuda.synchronize()
        else:
            layer.reshape(2, args.pool_blocks, piece)[:, np.asarray(blocks)] = 0


def _transport(args: argparse.Namespace, name: str, cache: list[Any]) -> Any:
    from kvplane.live.staging import StagingConfig, costs_from_profile
    from kvplane.live.transport import Transport

    costs = None
    if args.profile:
        costs = costs_from_profile(args.profile, chunk_bytes=args.slot_mib << 20,
                                   overlap=args.device == "cuda")
    t = Transport(name, granule=_piece(args),
                  staging=StagingConfig(slot_bytes=args.slot_mib << 20, slots=args.slots,
                                        costs=costs))
    for layer in cache:
        t.register(layer)
    return t


def _target(conn: Any, args: argparse.Namespace) -> None:
    cache = _cache(args, seed=2)
    t = _transport(args, "bench-target", cache)
    conn.send(t.local_info())
    parent = t.add_peer(conn.recv())
    while True:
        for n in t.notifications():
            if n.message.startswith(b"bench-"):
                t.send_notification(parent, b"ack-" + n.message)
        if not conn.poll(0):
            continue
        cmd, *rest = conn.recv()
        if cmd == "zero":
            _zero(args, cache, rest[0])
            conn.send("ok")
        elif cmd == "checksum":
            conn.send(checksum(args, cache, rest[0]))
        elif cmd == "trace":
            conn.send(t._stager.trace if t._stager is not None else None)
        elif cmd == "stop":
            t.close()
            conn.send("bye")
            return


def _ask(conn: Any, t: Any, *cmd: Any) -> Any:
    conn.send(cmd)
    while not conn.poll(0):
        t.progress()
    return conn.recv()


def _print_trace(ours: list[Any], theirs: list[Any]) -> None:
    """The last staged job's steps, both processes on one clock (perf_counter is system-wide
    monotonic on Linux)."""
    if not ours:
        return
    last = ours[-1][1]
    steps = sorted([(t, "initiator", s) for t, j, s in ours if j == last]
                   + [(t, "target", s) for t, j, s in theirs if j == last])
    t0 = steps[0][0]
    print(f"-- trace of {last}")
    for t, side, s in steps:
        print(f"  {(t - t0) * 1e3:8.3f} ms  {side:9} {s}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "torch-cpu", "cuda"], default="cpu",
                    help="cpu: numpy host memory; torch-cpu: torch CPU tensors (vLLM's CPU "
                         "cache); cuda: GPU memory")
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens per transfer (default 16384 on cuda, 2048 on cpu)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype-bytes", type=int, default=2)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--slot-mib", type=int, default=None, help="staging slot (64 cuda, 4 cpu)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--ops", default="WRITE,READ")
    ap.add_argument("--modes", default="contiguous,direct,staged,auto")
    ap.add_argument("--profile", default="", help="calibration YAML for the auto choice")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="also write the figures here")
    ap.add_argument("--trace", action="store_true",
                    help="print the steps of the last staged transfer on both sides")
    args = ap.parse_args(argv)
    args.tokens = args.tokens or (16384 if args.device == "cuda" else 2048)
    args.slot_mib = args.slot_mib or (64 if args.device == "cuda" else 4)
    if args.trace:
        os.environ["KVPLANE_STAGING_TRACE"] = "1"
    n = -(-args.tokens // args.block)
    args.pool_blocks = 2 * n
    nbytes = n * _piece(args) * 2 * args.layers

    from kvplane.live.transport import Status

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(there, args), daemon=True)
    proc.start()
    cache = _cache(args, seed=1)
    t = _transport(args, "bench-initiator", cache)
    here.send(t.local_info())
    peer = t.add_peer(here.recv())

    rng = np.random.default_rng(args.seed)
    contiguous = (np.arange(n), np.arange(n))
    fragmented = (rng.permutation(args.pool_blocks)[:n], rng.permutation(args.pool_blocks)[:n])
    rows: list[dict[str, Any]] = []
    ok_all = True
    seq = 0
    print(f"{args.tokens} tokens, {args.layers} layers x K/V x {n} blocks of {_piece(args)} B "
          f"= {nbytes / 2**20:.0f} MiB per transfer, device {args.device}", flush=True)
    for op in args.ops.split(","):
        base_s = None
        for mode in args.modes.split(","):
            ours, theirs = contiguous if mode == "contiguous" else fragmented
            # WRITE: our blocks are the source; READ: our blocks are the destination.
            runs = byte_runs(args, ours, theirs)
            t._staging = t._staging.__class__(
                slot_bytes=args.slot_mib << 20, slots=args.slots, costs=t._staging.costs,
                force={"contiguous": "direct", "direct": "direct", "staged": "staged"}.get(mode))
            if op == "WRITE":
                _ask(here, t, "zero", theirs)
            else:
                _zero(args, cache, ours)
            times, method, descs = [], "", 0
            for _ in range(args.repeats):
                seq += 1
                tag = f"bench-{seq}".encode()
                start = time.perf_counter()
                res = t.transfer(peer, op, runs, notify=tag if op == "WRITE" else b"",
                                 timeout=300)
                if res.ok and op == "WRITE":
                    got = t.wait_notification(b"ack-" + tag, 300)
                    if got is None:
                        res = res.__class__(Status.TIMED_OUT, peer, op, 0, 0, "no ack")
                elapsed = time.perf_counter() - start
                if not res.ok:
                    print(f"{op} {mode}: {res.status.value} {res.reason}", flush=True)
                    ok_all = False
                    break
                times.append(elapsed)
                method, descs = res.method, res.descriptors
            if not times:
                continue
            if op == "WRITE":
                verified = _ask(here, t, "checksum", theirs) == checksum(args, cache, ours)
            else:
                verified = checksum(args, cache, ours) == _ask(here, t, "checksum", theirs)
            ok_all &= verified
            med = statistics.median(times)
            base_s = med if mode == "contiguous" else base_s
            row = {"op": op, "layout": "contiguous" if mode == "contiguous" else "fragmented",
                   "mode": mode, "method": method, "descriptors": descs,
                   "median_ms": med * 1e3, "GBps": nbytes / med / 1e9,
                   "vs_contiguous": med / base_s if base_s else None,
                   "verified": verified, "bytes": nbytes}
            rows.append(row)
            ratio = f"{row['vs_contiguous']:.2f}x" if base_s else "-"
            print(f"{op:5} {mode:10} {method:6} {descs:7d} desc  {med * 1e3:9.2f} ms  "
                  f"{row['GBps']:8.2f} GB/s  {ratio:>7} of contiguous time  "
                  f"bytes {'ok' if verified else 'DIFFER'}", flush=True)
    if args.trace and t._stager is not None:
        _print_trace(t._stager.trace or [], _ask(here, t, "trace") or [])
    _ask(here, t, "stop")
    t.close()
    proc.join(30)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "rows": rows,
                       "host": os.uname().nodename, "python": sys.version.split()[0]},
                      fh, indent=1)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
