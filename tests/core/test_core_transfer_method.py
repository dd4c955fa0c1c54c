"""The direct / staged / IPC rule that the live transport and the simulator share."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvplane.core.transfer_method import (
    STAGING_MARGIN,
    MethodCosts,
    choose,
    direct_time,
    ipc_time,
    staged_time,
)

MiB = 1 << 20
# Figures of the kind `kvplane calibrate nixl --device cuda` gives on one H200.
GPU = MethodCosts(bandwidth=200e9, per_descriptor=6.4e-6, copy_bandwidth=1.5e12,
                  round_trip=100e-6, chunk_bytes=64 * MiB, overlap=True)
HOST = MethodCosts(bandwidth=5e9, per_descriptor=2e-6, copy_bandwidth=5e9, round_trip=200e-6,
                   chunk_bytes=16 * MiB, overlap=False)


def test_direct_pays_per_descriptor() -> None:
    assert direct_time(GPU, 2 << 30, 65536) == pytest.approx(65536 * 6.4e-6 + (2 << 30) / 200e9)


def test_staged_overlaps_copies_on_a_gpu_and_adds_them_on_the_host() -> None:
    n = 2 << 30
    wire = n / 200e9 + 32 * 6.4e-6
    assert staged_time(GPU, n) == pytest.approx(100e-6 + 2 * (64 * MiB) / 1.5e12 + wire)
    host_wire = n / 5e9 + 128 * 2e-6
    assert staged_time(HOST, n) == pytest.approx(200e-6 + host_wire + 2 * n / 5e9)


def test_fragmented_16k_tokens_on_a_gpu_are_staged() -> None:
    # 16k tokens of a Llama-3-8B-like rank: 2 GiB in 32 KiB pieces (block, layer, K/V)
    assert choose(GPU, 2 << 30, 65536, staging_available=True) == "staged"
    assert choose(GPU, 2 << 30, 65536, staging_available=False) == "direct"


def test_contiguous_transfers_stay_direct() -> None:
    assert choose(GPU, 2 << 30, 64, staging_available=True) == "direct"
    assert choose(GPU, 2 << 30, 1, staging_available=True) == "direct"


def test_host_memory_stages_only_small_pieces() -> None:
    # 4 KiB pieces: descriptors cost more than two extra copies; 64 KiB pieces: they do not
    assert choose(HOST, 256 * MiB, 65536, staging_available=True) == "staged"
    assert choose(HOST, 256 * MiB, 4096, staging_available=True) == "direct"


def test_software_costs_keep_small_transfers_direct() -> None:
    live = MethodCosts(bandwidth=200e9, per_descriptor=6.4e-6, copy_bandwidth=1.5e12,
                       round_trip=150e-6, chunk_bytes=64 * MiB, overlap=True,
                       staged_fixed=1e-3, plan_per_run=0.15e-6)
    assert staged_time(live, 2 << 30, 65536) == pytest.approx(
        staged_time(GPU, 2 << 30) + 50e-6 + 1e-3 + 2 * 65536 * 0.15e-6)
    assert choose(live, 2 << 30, 65536, staging_available=True) == "staged"
    assert choose(live, 32 * MiB, 128, staging_available=True) == "direct"  # 1k tokens, whole


def test_bad_costs_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        MethodCosts(0, 1e-6, 1e9, 0, 1, True)


@given(st.integers(1, 1 << 34), st.integers(2, 1 << 20))
def test_the_choice_is_the_cheaper_estimate(nbytes: int, descriptors: int) -> None:
    got = choose(GPU, nbytes, descriptors, staging_available=True)
    d, s = direct_time(GPU, nbytes, descriptors), staged_time(GPU, nbytes, descriptors)
    assert got == ("staged" if s < STAGING_MARGIN * d else "direct")


def test_block_level_planning_is_charged_per_block_not_per_descriptor() -> None:
    # planning per item dominates a mid-size transfer: charged per run list entry it keeps the
    # transfer direct, charged per block (what post_blocks plans from) it stages
    slow_plan = MethodCosts(bandwidth=200e9, per_descriptor=6.4e-6, copy_bandwidth=1.5e12,
                            round_trip=150e-6, chunk_bytes=256 * MiB, overlap=True,
                            staged_fixed=1e-3, plan_per_run=20e-6)
    nbytes, descriptors, blocks = 512 * MiB, 4096, 64
    assert choose(slow_plan, nbytes, descriptors, staging_available=True) == "direct"
    assert choose(slow_plan, nbytes, descriptors, staging_available=True,
                  runs=blocks) == "staged"
    assert staged_time(slow_plan, nbytes, blocks) < direct_time(slow_plan, nbytes, descriptors)


# ---- the IPC copy (both caches GPU memory on one host, the peer's cache mapped) -----------------

# One H200: a one-pass copy kernel moves about 1.7 TB/s of payload (read once, written once).
GPU_IPC = MethodCosts(bandwidth=200e9, per_descriptor=6.4e-6, copy_bandwidth=1.5e12,
                      round_trip=100e-6, chunk_bytes=256 * MiB, overlap=True,
                      ipc_bandwidth=1.7e12, ipc_fixed=200e-6)


def test_ipc_is_chosen_only_where_a_route_exists() -> None:
    assert choose(GPU_IPC, 2 << 30, 65536, staging_available=True) == "staged"
    assert choose(GPU_IPC, 2 << 30, 65536, staging_available=True,
                  ipc="same-device") == "ipc"
    # no IPC bandwidth in the costs (host memory, an uncalibrated path): never IPC
    assert choose(GPU, 2 << 30, 65536, staging_available=True, ipc="same-device") == "staged"
    assert choose(HOST, 256 * MiB, 65536, staging_available=True, ipc="same-device") == "staged"


def test_ipc_wins_contiguous_transfers_on_one_gpu_too() -> None:
    # 64 descriptors of 32 MiB: direct is cheap, but the copy kernel skips NIXL altogether
    assert choose(GPU_IPC, 2 << 30, 64, staging_available=True, ipc="same-device") == "ipc"
    assert choose(GPU_IPC, 2 << 30, 64, staging_available=True) == "direct"


def test_ipc_between_two_gpus_is_capped_by_the_link() -> None:
    n = 2 << 30
    assert ipc_time(GPU_IPC, n, "same-device") == pytest.approx(200e-6 + n / 1.7e12)
    assert ipc_time(GPU_IPC, n, "peer-device") == pytest.approx(200e-6 + n / 200e9)
    # a fixed cost above what a contiguous transfer's 64 descriptors cost: direct keeps it
    slow = MethodCosts(bandwidth=200e9, per_descriptor=6.4e-6, copy_bandwidth=1.5e12,
                       round_trip=100e-6, chunk_bytes=256 * MiB, overlap=True,
                       ipc_bandwidth=1.7e12, ipc_fixed=1e-3)
    assert choose(slow, n, 64, staging_available=True, ipc="peer-device") == "direct"
    assert choose(slow, n, 64, staging_available=True, ipc="same-device") == "ipc"
    # fragmented: IPC still skips the 65,536 descriptors and both staging copies
    assert choose(GPU_IPC, n, 65536, staging_available=True, ipc="peer-device") == "ipc"


def test_a_tiny_transfer_stays_direct_when_the_ipc_fixed_cost_exceeds_it() -> None:
    slow = MethodCosts(bandwidth=200e9, per_descriptor=6.4e-6, copy_bandwidth=1.5e12,
                       round_trip=100e-6, chunk_bytes=256 * MiB, overlap=True,
                       ipc_bandwidth=1.7e12, ipc_fixed=1e-3)
    assert choose(slow, 64 * 1024, 2, staging_available=True, ipc="same-device") == "direct"
    assert ipc_time(slow, 0, "same-device") == 0.0


def test_negative_ipc_costs_are_refused() -> None:
    with pytest.raises(ValueError, match="ipc"):
        MethodCosts(bandwidth=1.0, per_descriptor=0.0, copy_bandwidth=1.0, round_trip=0.0,
                    chunk_bytes=1, overlap=True, ipc_fixed=-1.0)


@given(nbytes=st.integers(1, 1 << 34), descriptors=st.integers(1, 1 << 18),
       staging=st.booleans(), route=st.sampled_from([None, "same-device", "peer-device"]))
def test_the_choice_is_the_cheapest_estimate(nbytes: int, descriptors: int, staging: bool,
                                            route: str | None) -> None:
    method = choose(GPU_IPC, nbytes, descriptors, staging_available=staging,
                    ipc=route)  # type: ignore[arg-type]
    if route is None:
        assert method != "ipc"
        return
    ipc_s = ipc_time(GPU_IPC, nbytes, route)  # type: ignore[arg-type]
    if method == "ipc":
        assert ipc_s <= direct_time(GPU_IPC, nbytes, descriptors)
    else:
        other = (staged_time(GPU_IPC, nbytes, descriptors) if method == "staged"
                 else direct_time(GPU_IPC, nbytes, descriptors))
        assert other <= ipc_s
