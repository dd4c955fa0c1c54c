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
  its cost estimate), all posted as byte-run lists (`Transport.post`);
- the same fragmented blocks posted at block level (`Transport.post_blocks`: planned from the
  two block-id arrays, a staged job carries only block ids): "bstaged" (forced staging),
  "bauto" (the estimate's choice among NIXL's methods), "bdirect" (forced per-block
  descriptors);
- CUDA IPC copies (live/ipc.py, GPU memory only): the initiator maps the other process's cache
  and one kernel copies every piece, no NIXL descriptor and no staging: "ipc" (the fragmented
  blocks), "ipc-contiguous" (blocks 0..n-1), "iauto" (the estimate's choice with IPC
  available).
--layout cross-layer keeps all layers of a block together (vLLM's block-outermost BLHNC
layout): one piece of layers x 2 x block bytes per block, so one descriptor per block.
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
    """Per layer one flat (2, blocks, ...) cache, or (cross-layer) one flat cache of
    (blocks, layers, 2, ...)."""
    per_layer = 2 * args.pool_blocks * _piece(args)
    sizes = ([per_layer] * args.layers if args.layout == "per-layer"
             else [per_layer * args.layers])
    if args.device != "cpu":
        import torch

        dev = _torch_device(args)
        g = torch.Generator(device=dev).manual_seed(seed)
        return [torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev, generator=g)
                for n in sizes]
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]


def block_layout(args: argparse.Namespace) -> Any:
    """Where a block's pieces lie in the transport's offset space (same on both sides)."""
    from kvplane.live.staging import BlockLayout

    piece = _piece(args)
    if args.layout == "cross-layer":
        whole = 2 * args.layers * piece
        return BlockLayout((0,), whole, whole, args.pool_blocks)
    layer_bytes = 2 * args.pool_blocks * piece
    bases = tuple(layer * layer_bytes + kv * args.pool_blocks * piece
                  for layer in range(args.layers) for kv in range(2))
    return BlockLayout(bases, piece, piece, args.pool_blocks)


def _views(args: argparse.Namespace, cache: list[Any]) -> list[Any]:
    """Per piece group, a (blocks, piece) int64 view of the cache."""
    from kvplane.live.staging import _strided_rows

    lay = block_layout(args)
    region = len(cache[0]) if hasattr(cache[0], "__len__") else 0
    return [_strided_rows(cache[b // region], b % region, lay) for b in lay.bases]


def _torch_device(args: argparse.Namespace) -> str:
    return "cuda" if args.device == "cuda" else "cpu"


def _piece(args: argparse.Namespace) -> int:
    return args.block * args.kv_heads * args.head_dim * args.dtype_bytes


def byte_runs(args: argparse.Namespace, local_blocks: Any, remote_blocks: Any) -> Any:
    """(local, remote, length) per piece (layer x K/V x block, or block for a cross-layer
    cache), unmerged: `Transport.post` merges them."""
    lay = block_layout(args)
    base = np.asarray(lay.bases, dtype=np.int64)[:, None]
    lo = (base + np.asarray(local_blocks, dtype=np.int64)[None, :] * lay.stride).ravel()
    ro = (base + np.asarray(remote_blocks, dtype=np.int64)[None, :] * lay.stride).ravel()
    return np.stack([lo, ro, np.full_like(lo, lay.piece)], axis=1)


def checksum(args: argparse.Namespace, cache: list[Any], blocks: Any) -> int:
    """Position-weighted sum of the pieces of `blocks` in token order (int64, wrapping)."""
    total = 0
    views = _views(args, cache)
    if args.device != "cpu":
        import torch

        idx = torch.as_tensor(np.asarray(blocks), device=_torch_device(args))
        w = torch.arange(1, len(blocks) + 1, device=_torch_device(args), dtype=torch.int64)
        for p, rows in enumerate(views):
            s = rows.index_select(0, idx).sum(dim=1)
            total += int(((s * w).sum() * (p + 1)).item())
        return total & (2**64 - 1)
    w = np.arange(1, len(blocks) + 1, dtype=np.int64)
    with np.errstate(over="ignore"):
        for p, rows in enumerate(views):
            s = rows[np.asarray(blocks)].sum(axis=1)
            total += int((s * w).sum()) * (p + 1)
    return total & (2**64 - 1)


def _zero(args: argparse.Namespace, cache: list[Any], blocks: Any) -> None:
    for rows in _views(args, cache):
        if args.device != "cpu":
            import torch

            idx = torch.as_tensor(np.asarray(blocks), device=_torch_device(args))
            rows.index_fill_(0, idx, 0)
        else:
            rows[np.asarray(blocks)] = 0
    if args.device == "cuda":
        import torch

        torch.cuda.synchronize()


def _transport(args: argparse.Namespace, name: str, cache: list[Any]) -> Any:
    from kvplane.live.staging import StagingConfig, costs_from_profile
    from kvplane.live.transport import Transport

    costs = None
    if args.profile:
        costs = costs_from_profile(args.profile, chunk_bytes=args.slot_mib << 20,
                                   overlap=args.device == "cuda")
    t = Transport(name, granule=block_layout(args).piece,
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
    ap.add_argument("--slot-mib", type=int, default=None, help="staging slot (256 cuda, 4 cpu)")
    ap.add_argument("--slots", type=int, default=None, help="send (and receive) slots "
                    "(4 cuda, 8 cpu)")
    ap.add_argument("--ops", default="WRITE,READ")
    ap.add_argument("--modes", default=None,
                    help="comma-separated: contiguous, direct, staged, auto (run lists), "
                         "bdirect, bstaged, bauto (block level), ipc, ipc-contiguous, iauto "
                         "(CUDA IPC, cuda only); default: all that apply to the device")
    ap.add_argument("--layout", choices=["per-layer", "cross-layer"], default="per-layer",
                    help="per-layer: one (2, blocks, ...) tensor per layer (FlashAttention); "
                         "cross-layer: one (blocks, layers, 2, ...) tensor")
    ap.add_argument("--profile", default="", help="calibration YAML for the auto choice")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="also write the figures here")
    ap.add_argument("--trace", action="store_true",
                    help="print the steps of the last staged transfer on both sides")
    args = ap.parse_args(argv)
    args.tokens = args.tokens or (16384 if args.device == "cuda" else 2048)
    args.slot_mib = args.slot_mib or (256 if args.device == "cuda" else 4)
    args.slots = args.slots or (4 if args.device == "cuda" else 8)
    args.modes = args.modes or ("contiguous,direct,staged,auto,bstaged,bauto"
                                + (",ipc,ipc-contiguous,iauto" if args.device == "cuda" else ""))
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

    layout = block_layout(args)
    rng = np.random.default_rng(args.seed)
    contiguous = (np.arange(n), np.arange(n))
    fragmented = (rng.permutation(args.pool_blocks)[:n], rng.permutation(args.pool_blocks)[:n])
    rows: list[dict[str, Any]] = []
    ok_all = True
    seq = 0
    print(f"{args.tokens} tokens, {args.layers} layers x K/V x {n} blocks of {_piece(args)} B "
          f"= {nbytes / 2**20:.0f} MiB per transfer in {len(layout.bases) * n} pieces of "
          f"{layout.piece} B ({args.layout} cache), device {args.device}", flush=True)
    ipc_side = t._ipc  # the IPC copier, present on GPU memory; off for NIXL's modes
    for op in args.ops.split(","):
        base_s = direct_s = None
        for mode in args.modes.split(","):
            flat = mode in ("contiguous", "ipc-contiguous")
            ours, theirs = contiguous if flat else fragmented
            # WRITE: our blocks are the source; READ: our blocks are the destination.
            blocks = mode.startswith(("b", "i"))
            runs = None if blocks else byte_runs(args, ours, theirs)
            t._ipc = ipc_side if mode.startswith("i") else None
            t._staging = t._staging.__class__(
                slot_bytes=args.slot_mib << 20, slots=args.slots, costs=t._staging.costs,
                force={"contiguous": "direct", "direct": "direct", "staged": "staged",
                       "bdirect": "direct", "bstaged": "staged", "ipc": "ipc",
                       "ipc-contiguous": "ipc"}.get(mode))
            if op == "WRITE":
                _ask(here, t, "zero", theirs)
            else:
                _zero(args, cache, ours)
            times, method, descs = [], "", 0
            for _ in range(args.repeats):
                seq += 1
                tag = f"bench-{seq}".encode()
                start = time.perf_counter()
                note = tag if op == "WRITE" else b""
                if blocks:
                    res = t.wait(t.post_blocks(peer, op, layout, ours, layout, theirs,
                                               notify=note), 300)
                else:
                    res = t.transfer(peer, op, runs, notify=note, timeout=300)
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
            direct_s = med if mode == "direct" else direct_s
            kernel = ipc_side.copier.last if ipc_side is not None and method == "ipc" else ""
            row = {"op": op, "layout": "contiguous" if flat else "fragmented",
                   "cache": args.layout, "mode": mode, "method": method,
                   "descriptors": descs, "median_ms": med * 1e3, "GBps": nbytes / med / 1e9,
                   "vs_contiguous": med / base_s if base_s else None,
                   "speedup_vs_direct": direct_s / med if direct_s else None,
                   "verified": verified, "bytes": nbytes, "ipc_kernel": kernel}
            rows.append(row)
            ratio = f"{row['vs_contiguous']:.2f}x" if base_s else "-"
            gain = f"{row['speedup_vs_direct']:.1f}x" if direct_s else "-"
            print(f"{op:5} {mode:14} {method:6} {descs:7d} desc  {med * 1e3:9.2f} ms  "
                  f"{row['GBps']:8.2f} GB/s  {ratio:>7} of contiguous time  {gain:>6} "
                  f"faster than per-run  bytes {'ok' if verified else 'DIFFER'}"
                  f"{'  kernel ' + kernel if kernel else ''}", flush=True)
    t._ipc = ipc_side
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
