"""The IPC copy (live/ipc.py) alone, without NIXL: two processes on one GPU, a Llama-3-8B-like
rank's cache each (32 layers x K/V x 2,048 blocks of 32 KiB); the parent maps the child's
cache and copies 1,024 blocks (2 GiB) both ways, fragmented and contiguous, with the Triton
kernel and with the torch fallback; both sides checksum what moved.

    python benchmarks/ipc_copy_probe.py        # GPU only

Output of one H200: docs/measurements/transfer-fragmented-h200-ipc-probe.txt (its last line
came from a version that gathered from one 128 MiB region, partly cache-resident: not a floor;
the HBM floor is in transfer-fragmented-h200-hbm-budget.txt).
"""
import multiprocessing as mp
import statistics
import sys
import time

import torch

from kvplane.live import ipc

LAYERS, POOL, PIECE = 32, 2048, 32 << 10  # Llama-3-8B-like rank; 16k tokens = 1024 blocks
N = 1024


def make(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randint(0, 256, (2 * POOL * PIECE,), dtype=torch.uint8, device="cuda",
                          generator=g) for _ in range(LAYERS)]


def groups(regs):
    return [r.data_ptr() + kv * POOL * PIECE for r in regs for kv in range(2)]


def checksum(regs, ids):
    idx = torch.as_tensor(ids, device="cuda")
    w = torch.arange(1, len(ids) + 1, device="cuda", dtype=torch.int64)
    total = 0
    for p, a in enumerate(groups(regs)):
        rows = ipc._rows_at(a, POOL, PIECE, PIECE, regs[0])
        s = rows.index_select(0, idx).sum(dim=1)
        total += int(((s * w).sum() * (p + 1)).item())
    return total & (2**64 - 1)


def child(conn):
    regs = make(2)
    torch.cuda.synchronize()
    conn.send(ipc.export(regs))
    while True:
        cmd, arg = conn.recv()
        if cmd == "sum":
            torch.cuda.synchronize()
            conn.send(checksum(regs, arg))
        else:
            conn.send("bye")
            return


def main():
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=child, args=(there,), daemon=True)
    proc.start()
    regs = make(1)
    t0 = time.perf_counter()
    side = ipc.IpcSide(regs, warm_up=PIECE)
    print(f"IpcSide (export + kernel warm-up) {time.perf_counter() - t0:.2f} s, "
          f"kernel_error={side.copier.kernel_error!r}", flush=True)
    theirs = here.recv()
    print("route", ipc.route(side.export, theirs, side.visible), flush=True)
    t0 = time.perf_counter()
    m = side.mapping("child", theirs)
    print(f"mapped {len(m.addresses)} regions in {(time.perf_counter() - t0) * 1e3:.1f} ms",
          flush=True)
    rng = torch.Generator().manual_seed(0)
    frag = (torch.randperm(POOL, generator=rng)[:N].numpy(),
            torch.randperm(POOL, generator=rng)[:N].numpy())
    contig = (torch.arange(N).numpy(), torch.arange(N).numpy())
    theirs_groups = [a + kv * POOL * PIECE for a in m.addresses for kv in range(2)]
    nbytes = 2 * LAYERS * N * PIECE
    ok = True
    for use_triton in (True, False):
        side.copier.use_triton = use_triton
        for name, (a, b) in (("fragmented", frag), ("contiguous", contig)):
            for op in ("WRITE", "READ"):
                ours = ipc.Side(groups(regs), PIECE, POOL, a)
                peer = ipc.Side(theirs_groups, PIECE, POOL, b)
                src, dst = (ours, peer) if op == "WRITE" else (peer, ours)
                times = []
                for _ in range(5):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    event, how = side.copier.copy(src, dst, PIECE)
                    event.synchronize()
                    times.append(time.perf_counter() - t0)
                here.send(("sum", b))
                got = here.recv()
                mine = checksum(regs, a)
                ok &= got == mine
                med = statistics.median(times)
                print(f"{how:6} {name:10} {op:5} {med * 1e3:7.3f} ms  {nbytes / med / 1e9:7.1f} GB/s"
                      f"  min {min(times) * 1e3:.3f}  {'ok' if got == mine else 'DIFFER'}",
                      flush=True)
    side.forget("child")
    here.send(("stop", None))
    here.recv()
    proc.join(10)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
