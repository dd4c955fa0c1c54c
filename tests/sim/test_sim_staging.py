"""The simulator prices staged transfers by the rule the live transport uses (core.transfer_method)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvplane.core.transfer_method import choose, ipc_time
from kvplane.sim.config import scenario_from_data
from kvplane.sim.costs import KVGeometry, SimCosts
from kvplane.sim.profiles import HardwareProfile, ModelProfile, load_profile
from kvplane.sim.runner import simulate

QWEN = load_profile("qwen3-32b", "model")
H200 = load_profile("p5en-h200-tp8", "hardware")
assert isinstance(QWEN, ModelProfile) and isinstance(H200, HardwareProfile)


def costs(staging: bool, link: str = "nvlink") -> SimCosts:
    return SimCosts(QWEN, H200, prefill_tp=8, decode_tp=8, link=link,  # type: ignore[arg-type]
                    staging=staging)


def test_a_fragmented_16k_transfer_is_staged_and_far_cheaper() -> None:
    g = KVGeometry.of(QWEN, 8)
    blocks = g.blocks_for(16384)
    nbytes, desc = int(g.transfer_bytes_per_rank(blocks)) * 8, g.descriptors(blocks) * 8
    plain, staged = costs(False), costs(True)
    assert staged.transfer_method(nbytes, desc, 8) == "staged"
    direct_s = plain.descriptor_prep_time(desc, False) + plain.transfer_time(nbytes, desc, 8)
    staged_s = staged.descriptor_prep_time(desc, False) + staged.transfer_time(nbytes, desc, 8)
    assert staged_s < direct_s / 10
    # the same rule as the live transport, on the same inputs
    per_stream = -(-desc // 8)
    assert choose(staged.method_costs, nbytes // 8, per_stream, staging_available=True) == "staged"


def test_contiguous_transfers_stay_direct_at_the_same_cost() -> None:
    g = KVGeometry.of(QWEN, 8)
    blocks = g.blocks_for(16384)
    nbytes, desc = int(g.transfer_bytes_per_rank(blocks)) * 8, g.descriptors(1) * 8
    plain, staged = costs(False), costs(True)
    assert staged.transfer_method(nbytes, desc, 8) == "direct"
    assert plain.transfer_method(nbytes, desc, 8) == "direct"
    total = plain.descriptor_prep_time(desc, False) + plain.transfer_time(nbytes, desc, 8)
    moved = staged.descriptor_prep_time(desc, False) + staged.transfer_time(nbytes, desc, 8)
    assert moved == pytest.approx(total)  # the post moved from preparation into the transfer


def test_copy_bandwidth_comes_from_the_device() -> None:
    c = costs(True)
    util = c.calibration.memory_bandwidth_utilization.value  # the (model kind, hardware) fit
    hbm = H200.device.hbm_bandwidth.value * util
    assert c.method_costs.copy_bandwidth == pytest.approx(hbm / 2)


BASE: dict[str, Any] = {
    "name": "staging-what-if",
    "seed": 3,
    "requests": 30,
    "warmup_requests": 0,
    "profiles": {"model": "qwen3-32b", "hardware": "p5en-h200-tp8"},
    "engine": {"pool_run_blocks": 1.5},  # a churned pool: runs of 1-2 blocks
    "connector": {"mode": "push"},
    "workload": {"kind": "poisson", "qps": 2, "input_len": {"mean": 16384, "dist": "fixed"},
                 "output_len": {"mean": 32, "dist": "fixed"}},
}


def _run(staging: bool) -> dict[str, Any]:
    data = json.loads(json.dumps(BASE))
    data["connector"]["transfer_staging"] = staging
    point = scenario_from_data(data, file="<test>").points()[0]
    _, summary = simulate(point)
    assert summary["finished"] == summary["submitted"]
    return summary


def test_what_if_staging_shortens_ttft_on_a_fragmented_pool() -> None:
    direct, staged = _run(False), _run(True)
    assert staged["ttft_ms"]["mean"] < direct["ttft_ms"]["mean"]


def test_what_if_scenario_stages_at_the_pools_own_fragmentation() -> None:
    """scenarios/what_if_staging.yaml (benchmarks/sim_staging_what_if.py): no fragmentation
    knob; the pool's LIFO reuse fragments it, and staging then shortens pull's TTFT and its
    engine-loop stall (TPOT)."""
    from pathlib import Path

    from kvplane.sim.config import load_scenario

    base = load_scenario(Path(__file__).resolve().parents[2] / "scenarios/what_if_staging.yaml")
    assert base.engine.pool_run_blocks is None
    out = {}
    for staging in (False, True):
        sc = base.model_copy(update={
            "requests": 30, "warmup_requests": 0,
            "connector": base.connector.model_copy(update={"transfer_staging": staging,
                                                           "mode": "pull"})})
        point = next(p for p in sc.points() if p.mode == "pull" and not p.bidirectional)
        _, out[staging] = simulate(point)
        assert out[staging]["finished"] == out[staging]["submitted"]
    assert out[False]["mean_run_blocks"] < 4  # fragmented by its own history
    assert out[True]["ttft_ms"]["mean"] < out[False]["ttft_ms"]["mean"]
    assert out[True]["tpot_ms"]["mean"] < out[False]["tpot_ms"]["mean"]


# ---- the IPC copy: prefill and decode on one host (connector.transfer_ipc) ----------------------


def ipc_costs(route: str | None, staging: bool = True) -> SimCosts:
    return SimCosts(QWEN, H200, prefill_tp=8, decode_tp=8, link="nvlink",
                    staging=staging, ipc=route)  # type: ignore[arg-type]


def test_on_one_host_the_ipc_copy_prices_fragmented_and_contiguous_transfers() -> None:
    g = KVGeometry.of(QWEN, 8)
    blocks = g.blocks_for(16384)
    nbytes = int(g.transfer_bytes_per_rank(blocks)) * 8
    for desc in (g.descriptors(blocks) * 8, g.descriptors(1) * 8):  # fragmented, contiguous
        same, staged = ipc_costs("same-device"), costs(True)
        assert same.transfer_method(nbytes, desc, 8) == "ipc"
        per_rank = nbytes / 8
        expected = ipc_time(same.method_costs, int(per_rank), "same-device") + (
            same.transfer.latency)
        assert same.transfer_time(nbytes, desc, 8) == pytest.approx(expected)
        assert same.transfer_time(nbytes, desc, 8) < staged.transfer_time(nbytes, desc, 8)
    # IPC alone (no staging pool) is still chosen per transfer
    only = ipc_costs("same-device", staging=False)
    assert only.transfer_method(nbytes, g.descriptors(blocks) * 8, 8) == "ipc"
    assert ipc_costs(None, staging=False).transfer_method(nbytes, desc, 8) == "direct"


def test_between_two_gpus_the_copy_is_capped_by_the_link() -> None:
    g = KVGeometry.of(QWEN, 8)
    blocks = g.blocks_for(16384)
    nbytes, desc = int(g.transfer_bytes_per_rank(blocks)) * 8, g.descriptors(blocks) * 8
    same, peer = ipc_costs("same-device"), ipc_costs("peer-device")
    assert peer.method_costs.bandwidth < peer.method_costs.ipc_bandwidth
    assert peer.transfer_time(nbytes, desc, 8) > same.transfer_time(nbytes, desc, 8)
    assert peer.transfer_method(nbytes, desc, 8) == "ipc"  # still no descriptors to pay


def test_the_scenario_names_the_ipc_route() -> None:
    data = json.loads(json.dumps(BASE))
    data["connector"]["transfer_ipc"] = "same-device"
    point = scenario_from_data(data, file="<test>").points()[0]
    assert SimCosts.from_scenario(point.scenario).ipc == "same-device"
    data["connector"]["transfer_ipc"] = "elsewhere"
    with pytest.raises(Exception, match="transfer_ipc"):
        scenario_from_data(data, file="<test>")
