"""The IPC copy's logic that runs without a GPU: where a route exists, and the index logic of the
copy (the piece table the Triton kernel follows, and the torch fallback) on host memory.

The kernel itself runs only on a GPU: benchmarks/transfer_fragmented.py (modes ipc and
ipc-contiguous) moves 2 GiB through it between two processes and checks every byte
(docs/measurements/transfer-fragmented-h200.md).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from kvplane.live import ipc

HOST = ipc.host_id()
ME = {"host": HOST, "gpu": "GPU-a", "pid": 1, "regions": [{}]}


def test_a_route_needs_both_exports_one_host_and_a_reachable_gpu() -> None:
    assert ipc.route(ME, {**ME, "pid": 2}) == "same-device"
    assert ipc.route(ME, {**ME, "gpu": "GPU-b"}, {"GPU-b": True}) == "peer-device"
    assert ipc.route(ME, {**ME, "gpu": "GPU-b"}, {"GPU-b": False}) is None  # no peer access
    assert ipc.route(ME, {**ME, "gpu": "GPU-c"}, {"GPU-b": True}) is None  # not visible here
    assert ipc.route(ME, {**ME, "host": "elsewhere/boot"}) is None
    assert ipc.route(ME, None) is None and ipc.route(None, ME) is None
    assert ipc.route(ME, {**ME, "regions": []}) is None


def test_the_setting_is_auto_or_off() -> None:
    assert ipc.enabled("auto") and ipc.enabled("on") and not ipc.enabled("off")
    with pytest.raises(ValueError, match="KVPLANE_IPC"):
        ipc.enabled("sometimes")


# Two "caches" of 3 piece groups (layers x K/V) x 40 blocks of 512 B, each group its own region
# of a side, regions laid end to end in the side's offset space.
PIECE, BLOCKS, GROUPS = 512, 40, 3


def caches(seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    src = [rng.integers(0, 256, PIECE * BLOCKS, dtype=np.uint8) for _ in range(GROUPS)]
    dst = [np.zeros(PIECE * BLOCKS, dtype=np.uint8) for _ in range(GROUPS)]
    return src, dst


def side(regions: list[np.ndarray], ids: np.ndarray) -> ipc.Side:
    starts = [i * PIECE * BLOCKS for i in range(GROUPS + 1)]
    bases = tuple(starts[:-1])
    groups = ipc.group_addresses(bases, (BLOCKS - 1) * PIECE + PIECE, starts,
                                 [int(r.ctypes.data) for r in regions])
    return ipc.Side(groups, PIECE, BLOCKS, ids)


def expect_copied(src: list[np.ndarray], dst: list[np.ndarray], sid: np.ndarray,
                  did: np.ndarray) -> None:
    for s, d in zip(src, dst, strict=True):
        rows_s, rows_d = s.reshape(BLOCKS, PIECE), d.reshape(BLOCKS, PIECE)
        assert (rows_d[did] == rows_s[sid]).all()
        untouched = np.setdiff1d(np.arange(BLOCKS), did)
        assert not rows_d[untouched].any()


def test_the_piece_table_names_every_piece_the_kernel_copies() -> None:
    src, dst = caches(1)
    rng = np.random.default_rng(2)
    sid = rng.choice(BLOCKS, 17, replace=False)
    did = rng.choice(BLOCKS, 17, replace=False)
    a, b = side(src, sid), side(dst, did)
    origin = min(a.groups + b.groups) // ipc.UNIT * ipc.UNIT
    ts = ipc.piece_table(a.groups, a.stride, a.ids, origin)
    td = ipc.piece_table(b.groups, b.stride, b.ids, origin)
    assert ts.shape == td.shape == (GROUPS * 17,)
    # what the kernel does with row i: PIECE bytes from origin + ts[i] x 16 to origin + td[i] x 16
    for s_unit, d_unit in zip(ts.tolist(), td.tolist(), strict=True):
        ctypes.memmove(origin + d_unit * ipc.UNIT, origin + s_unit * ipc.UNIT, PIECE)
    expect_copied(src, dst, sid, did)


def test_the_torch_fallback_copies_the_same_pieces_on_cpu_tensors() -> None:
    src, dst = caches(3)
    rng = np.random.default_rng(4)
    sid = rng.choice(BLOCKS, 25, replace=False)
    did = rng.choice(BLOCKS, 25, replace=False)
    copier = ipc.Copier(torch.from_numpy(dst[0]))
    event, how = copier.copy(side(src, sid), side(dst, did), PIECE)
    assert (event, how) == (None, "torch")
    expect_copied(src, dst, sid, did)


def test_pieces_outside_one_region_or_misaligned_are_refused() -> None:
    with pytest.raises(ipc.IpcUnavailable, match="not inside one"):
        ipc.group_addresses((100,), 200, [0, 250], [4096])
    with pytest.raises(ipc.IpcUnavailable, match="aligned"):
        ipc.piece_table([4096 + 8], 512, [0, 1], 0)
