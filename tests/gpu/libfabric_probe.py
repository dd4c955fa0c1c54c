"""Try NIXL's LIBFABRIC backend for real: two agents in one process, one READ, bytes compared.

    FI_PROVIDER=tcp LD_LIBRARY_PATH=<libfabric libs> python tests/gpu/libfabric_probe.py

Prints one JSON line: whether the backend was made (or the connector's error, verbatim), and
if so whether a READ of GPU memory (host memory without a GPU) moved the right bytes. Run by
scripts/gpu_live.sh on the GPU machine, where the plugin finds the CUDA driver it links.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    out: dict[str, object] = {"FI_PROVIDER": os.environ.get("FI_PROVIDER", ""),
                              "backend": "LIBFABRIC"}
    from kvplane.live.transport import Status, Transport, TransportError

    try:
        a = Transport(f"lf-a-{time.time_ns() % 10**9}", backend="LIBFABRIC", granule=4096)
        b = Transport(f"lf-b-{time.time_ns() % 10**9}", backend="LIBFABRIC", granule=4096)
    except TransportError as exc:
        out.update(made=False, error=str(exc))
        print(json.dumps(out))
        return 0
    out["made"] = True
    try:
        import torch

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        src = torch.arange(1 << 20, dtype=torch.int32, device=dev)
        dst = torch.zeros(1 << 20, dtype=torch.int32, device=dev)
        a.register(src)
        b.register(dst)
        out["memory"] = a.mem_kind
        peer = b.add_peer(a.local_info())
        a.add_peer(b.local_info())
        n = src.numel() * src.element_size()
        t0 = time.perf_counter()
        t = b.post(peer, "READ", [(0, 0, n)])
        deadline = time.monotonic() + 20
        while b.poll(t) is Status.PENDING and time.monotonic() < deadline:
            a.progress()
        res = t.result
        out.update(ok=bool(res and res.ok), status=str(res.status if res else "pending"),
                   reason=res.reason if res else "", bytes=n,
                   ms=round((time.perf_counter() - t0) * 1000, 3),
                   equal=bool(torch.equal(src, dst)))
    except Exception as exc:  # noqa: BLE001 - the probe reports whatever happened
        out.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    finally:
        a.close()
        b.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
