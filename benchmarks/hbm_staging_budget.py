"""HBM budget of a staged transfer on one GPU: a gather, a plain copy and a scatter of the same
bytes, each alone, then all three at once on three CUDA streams (what a pipelined staged
transfer between two processes on one GPU asks of one HBM). Prints ms and GB/s; CUDA only.

    python benchmarks/hbm_staging_budget.py [--gib 2] [--piece-kib 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=int, default=2, help="bytes moved by each copy, GiB")
    ap.add_argument("--piece-kib", type=int, default=32, help="gather/scatter row, KiB")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    dev = "cuda"
    size, piece = args.gib << 30, args.piece_kib << 10
    n = size // piece
    g = torch.Generator(device=dev).manual_seed(0)
    src = torch.randint(0, 256, (2 * size,), dtype=torch.uint8, device=dev, generator=g)
    dst = torch.zeros_like(src)
    a, b, c, d = (torch.empty(size, dtype=torch.uint8, device=dev) for _ in range(4))

    def rows(t: Any) -> Any:
        return t.view(torch.int64).view(-1, piece // 8)

    idx = torch.randperm(2 * n, device=dev, generator=g)[:n]
    idx2 = torch.randperm(2 * n, device=dev, generator=g)[:n]
    copies: dict[str, Callable[[], Any]] = {
        "gather (index_select)": lambda: torch.index_select(rows(src), 0, idx, out=rows(a)),
        "copy (copy_)": lambda: c.copy_(b),
        "scatter (index_copy_)": lambda: rows(dst).index_copy_(0, idx2, rows(d)),
    }
    streams = [torch.cuda.Stream() for _ in copies]

    def timed(fns: list[Callable[[], Any]]) -> float:
        out = []
        for r in range(args.repeats + 1):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for fn, st in zip(fns, streams, strict=False):
                st.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(st):
                    fn()
            for st in streams[:len(fns)]:
                torch.cuda.current_stream().wait_stream(st)
            end.record()
            torch.cuda.synchronize()
            if r:  # the first is a warm-up
                out.append(start.elapsed_time(end))
        return statistics.median(out)

    alone = 0.0
    for name, fn in copies.items():
        ms = timed([fn])
        alone += ms
        print(f"{name:32} {args.gib} GiB {ms:7.3f} ms  {size / ms / 1e6:7.1f} GB/s moved  "
              f"{2 * size / ms / 1e6:7.1f} GB/s of HBM")
    ms = timed(list(copies.values()))
    print(f"{'all three at once':32} {args.gib} GiB {ms:7.3f} ms  {3 * size / ms / 1e6:7.1f} "
          f"GB/s moved  {6 * size / ms / 1e6:7.1f} GB/s of HBM")
    print(f"sum of the three alone {alone:.3f} ms; together / alone = {ms / alone:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
