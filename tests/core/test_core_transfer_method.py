"""The direct-versus-staged rule that the live transport and the simulator share."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvplane.core.transfer_method import (
    STAGING_MARGIN,
    MethodCosts,
    choose,
    direct_time,
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
