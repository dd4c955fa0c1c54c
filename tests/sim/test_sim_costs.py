"""Cost models: units, hand-checkable formulas, monotonicity, where a transfer's cost is paid."""

from __future__ import annotations

from typing import Any

import pytest

from kvplane.sim.costs import (
    ComputeCost,
    KVGeometry,
    TransferCost,
    attention_pairs,
    kv_pool_blocks,
)
from kvplane.sim.profiles import CalibrationProfile, HardwareProfile, ModelProfile, load_profile


def model(name: str = "tiny-test") -> ModelProfile:
    m = load_profile(name, "model")
    assert isinstance(m, ModelProfile)
    return m


def hardware(name: str = "cpu-test") -> HardwareProfile:
    h = load_profile(name, "hardware")
    assert isinstance(h, HardwareProfile)
    return h


def calibration(name: str = "calib-dense-cpu-test") -> CalibrationProfile:
    c = load_profile(name, "calibration")
    assert isinstance(c, CalibrationProfile)
    return c


def src(value: float) -> dict[str, Any]:
    return {"value": value, "source": "synthetic: test"}


# --- geometry -----------------------------------------------------------------------------------


def test_geometry_by_hand() -> None:
    g = KVGeometry.of(model(), tp=1, block_size=16)
    # 2 (K,V) x 2 layers x 2 kv heads x 16 dims x 2 bytes
    assert g.bytes_per_token_per_rank == 256
    assert g.region_bytes == 16 * 2 * 16 * 2
    assert g.bytes_per_block_per_rank == 16 * 256
    assert g.blocks_for(0) == 0 and g.blocks_for(1) == 1 and g.blocks_for(33) == 3
    assert g.full_blocks(33) == 2
    assert g.descriptors(runs=3) == 3 * 2 * 2
    assert g.transfer_bytes_per_rank(3) == 3 * 16 * 256


def test_tp_splits_kv_heads_and_replicates_beyond_them() -> None:
    qwen = model("qwen3-32b")
    assert KVGeometry.of(qwen, 8).kv_heads_per_rank == 1
    assert KVGeometry.of(qwen, 4).bytes_per_token_per_rank == 2 * 64 * 2 * 128 * 2
    assert KVGeometry.of(model(), 4).kv_heads_per_rank == 1  # 2 heads, 4 ranks: replicated
    with pytest.raises(ValueError):
        KVGeometry.of(qwen, 0)


def test_kv_pool_is_sized_from_memory() -> None:
    qwen, hw = model("qwen3-32b"), hardware("p5en-h200-tp8")
    blocks = kv_pool_blocks(qwen, hw, tp=8, gpu_memory_utilization=0.9, reserve_bytes=4e9)
    per_block = 16 * 32768
    expected = (141e9 * 0.9 - 32762123264 * 2 / 8 - 4e9) // per_block
    assert blocks == expected
    assert blocks * 16 > 3_000_000  # millions of tokens per TP8 instance
    with pytest.raises(ValueError, match="does not fit"):
        kv_pool_blocks(model("llama-3.3-70b"), hardware(), tp=1)


# --- compute --------------------------------------------------------------------------------------


def test_attention_pairs_are_causal() -> None:
    assert attention_pairs(1) == 1
    assert attention_pairs(4) == 10
    assert attention_pairs(2, cached_tokens=3) == 2 * 3 + 3


def test_decode_step_is_memory_bound_at_batch_one() -> None:
    c = ComputeCost(model(), hardware())
    weights = 201728 * 2
    expected = 1e-3 + weights / (1e11 * 0.5)  # overhead + weights / (bw x util), tp=1
    assert c.decode_step_time(1, 0) == pytest.approx(expected, rel=1e-6)
    assert c.allreduce_time(1000) == 0.0


def test_prefill_is_compute_bound_when_long() -> None:
    c = ComputeCost(model(), hardware())
    n = 100_000
    flops = c.flops(n, attention_pairs(n), 1)
    assert c.prefill_time(n) == pytest.approx(1e-3 + flops / (1e12 * 0.5), rel=1e-6)
    # the attention term is quadratic: doubling the prompt more than doubles the FLOPs
    assert c.flops(2 * n, attention_pairs(2 * n), 1) > 2.1 * flops


@pytest.mark.parametrize("name", ["qwen3-32b", "llama-3.3-70b"])
def test_monotonic_in_every_argument(name: str) -> None:
    c = ComputeCost(model(name), hardware("p5en-h200-tp8"))
    lengths = [1, 16, 512, 2048, 8192, 32768]
    prefill = [c.prefill_time(n) for n in lengths]
    assert prefill == sorted(prefill) and len(set(prefill)) == len(prefill)
    cached = [c.prefill_time(1024, k) for k in (0, 1024, 8192, 30000)]
    assert cached == sorted(cached)
    batch = [c.decode_step_time(b, b * 4096) for b in (1, 2, 4, 8, 64)]
    assert batch == sorted(batch)
    context = [c.decode_step_time(8, t) for t in (0, 10_000, 100_000, 1_000_000)]
    assert context == sorted(context)


def test_units_are_seconds_on_h200() -> None:
    c = ComputeCost(model("qwen3-32b"), hardware("p5en-h200-tp8"))
    assert 4e-3 < c.decode_step_time(1, 1024) < 8e-3           # milliseconds per token
    assert 0.02 < c.prefill_time(2048) < 0.2                    # tens of ms for 2k
    assert 0.4 < c.chunked_prefill_time(24576, 0, 8192) < 1.0   # under a second for 24k
    assert c.weight_bytes_per_rank() == pytest.approx(32762123264 * 2 / 8)


def test_chunking_costs_extra_steps_but_same_work() -> None:
    c = ComputeCost(model("qwen3-32b"), hardware("p5en-h200-tp8"))
    whole = c.prefill_time(16384)
    chunked = c.chunked_prefill_time(16384, 0, 8192)
    assert chunked > whole
    assert chunked - whole < 2 * (c.step_overhead + c.allreduce_time(1))


def test_mixed_step_prices_prefill_and_decode_together() -> None:
    c = ComputeCost(model("qwen3-32b"), hardware("p5en-h200-tp8"))
    alone = c.batch_step_time(prefills=[(2048, 0)])
    mixed = c.batch_step_time(prefills=[(2048, 0)], decode_contexts=[4096] * 8)
    assert mixed > alone
    assert c.batch_step_time(decode_contexts=[4096] * 8) == pytest.approx(
        c.decode_step_time(8, 8 * 4096))
    assert c.batch_step_time() == 0.0


def test_tp_larger_than_the_node_is_refused() -> None:
    with pytest.raises(ValueError, match="devices_per_node"):
        ComputeCost(model(), hardware(), tp=4)


def test_moe_reads_only_the_experts_a_step_touches() -> None:
    base = model().model_dump()
    base.update(
        name="tiny-moe",
        total_params=src(1_000_000), active_params=src(300_000), embedding_params=src(128_000),
        moe={"num_experts": src(8), "experts_per_token": src(2), "expert_params": src(800_000)},
    )
    moe = ModelProfile.model_validate(base)
    c = ComputeCost(moe, hardware(), calibration=calibration())
    one = c.weight_bytes_per_rank(1)
    many = c.weight_bytes_per_rank(1000)
    assert one == pytest.approx((200_000 + 800_000 * 0.25) * 2)
    assert many == pytest.approx(1_000_000 * 2, rel=1e-6)
    assert c.linear_flops_per_token == 2 * (300_000 - 128_000)


# --- transfer -----------------------------------------------------------------------------------


def test_transfer_pieces_by_hand() -> None:
    t = TransferCost(hardware(), "network", calibration())
    assert t.bandwidth_per_rank == 1e9
    assert t.wire_time(1e9, 0) == pytest.approx(1.0 + 1e-4)
    assert t.post_time(1000) == pytest.approx(1e-4 + 1000 * 1e-6)
    assert t.prepare_time(1000) == pytest.approx(1e-4 + 1000 * 1e-7)
    assert t.prepare_time(1000, prepped=False) == pytest.approx(1e-4 + 1000 * 1e-6)
    assert t.transfer_time(1e9, 1000) == pytest.approx(t.post_time(1000) + t.wire_time(1e9, 1000))
    assert t.handshake_time(0) == pytest.approx(2e-4 + 1e-2)
    assert t.handshake_time(1000) > t.handshake_time(0)
    assert 0 < t.notification_time() < 1e-3


def test_descriptors_not_bytes_dominate_fragmented_transfers() -> None:
    qwen, hw = model("qwen3-32b"), hardware("p5en-h200-tp8")
    g, t = KVGeometry.of(qwen, 8), TransferCost(hw, "network", calibration("calib-dense-p5en-h200-tp8"))
    blocks = g.blocks_for(16384)
    merged = t.kv_timing(g, blocks, 1, placement="thread", notify=True)
    scattered = t.kv_timing(g, blocks, blocks, placement="thread", notify=True)
    assert merged.bytes_per_rank == scattered.bytes_per_rank == 512 * 2**20
    assert scattered.descriptors == 131072
    # the descriptors' posts, not the bytes, make up most of a scattered transfer
    assert scattered.post_s > scattered.total_s / 2 > scattered.wire_s
    assert scattered.total_s > 3 * merged.total_s


def test_pull_stalls_the_engine_loop_push_does_not() -> None:
    qwen, hw = model("qwen3-32b"), hardware("p5en-h200-tp8")
    g, t = KVGeometry.of(qwen, 8), TransferCost(hw, "network", calibration("calib-dense-p5en-h200-tp8"))
    pull = t.kv_timing(g, 1024, 128, placement="engine_loop", notify=False)
    push = t.kv_timing(g, 1024, 128, placement="thread", notify=True)
    assert pull.engine_stall_s == pytest.approx(pull.prepare_s + pull.post_s) and pull.engine_stall_s > 0
    assert pull.thread_busy_s == 0.0
    assert push.engine_stall_s == 0.0 and push.thread_busy_s == pull.engine_stall_s
    assert push.total_s == pytest.approx(pull.total_s + push.notify_s)
    setup = t.kv_timing(g, 1024, 128, placement="thread", notify=False, setup_s=0.02)
    assert setup.total_s == pytest.approx(pull.total_s + 0.02)
    with pytest.raises(ValueError):
        t.kv_timing(g, 10, 11, placement="thread", notify=False)


def test_a_link_the_machine_lacks() -> None:
    with pytest.raises(ValueError, match="nvlink"):
        TransferCost(hardware(), "nvlink")


# --- the engine's bundle --------------------------------------------------------------------------


def test_sim_costs_follow_the_engine_conventions() -> None:
    from kvplane.core.plan import plan_transfer
    from kvplane.sim.config import load_scenario
    from kvplane.sim.costs import SimCosts

    scenario = load_scenario("seed_push_vs_pull")
    costs = SimCosts.from_scenario(scenario)
    src, dst = costs.layout("prefill"), costs.layout("decode")
    assert (src.tp, src.num_layers, src.num_kv_heads, src.head_bytes) == (8, 64, 8, 256)
    contiguous = plan_transfer(src, dst, tuple(range(1024)), tuple(range(5000, 6024)), 16384)
    scattered = plan_transfer(src, dst, tuple(range(1024)), tuple(range(6023, 4999, -1)), 16384)
    assert contiguous.descriptors == 8 * 128 and scattered.descriptors == 8 * 131072
    t = costs.transfer
    # per rank: 128 descriptors, 512 MiB; ranks in parallel
    assert costs.descriptor_prep_time(contiguous.descriptors, inline=True) == pytest.approx(
        t.prepare_time(128) + t.post_time(128))
    assert costs.transfer_time(contiguous.bytes, contiguous.descriptors, 8) == pytest.approx(
        t.wire_time(512 * 2**20, 128))
    stall = costs.descriptor_prep_time(scattered.descriptors, inline=True)
    assert 0.3 < stall < 0.35  # a fully scattered 16k pull stalls decode for ~1/3 s
    assert costs.prefill_time(2048, 0) == costs.prefill.prefill_time(2048)
    assert costs.decode_step_time(8, 8 * 16384) == costs.decode.decode_step_time(8, 8 * 16384)
    cal = costs.calibration
    assert costs.request_overhead() == cal.prefill_request_overhead.value
    assert costs.reuse_read_setup() == cal.reuse_read_setup.value
    assert 0 < costs.message_latency() < 1e-3
    assert costs.handshake_time() > t.add_remote_agent
    assert costs.pool_blocks["decode"] > 200_000


# --- architectures: MLA, sparse attention, MoE, FP8, dtypes ------------------------------------


def test_mla_caches_one_latent_per_token_per_layer_on_every_rank() -> None:
    ds = model("deepseek-v3")
    assert ds.mla is not None
    g8, g1 = KVGeometry.of(ds, 8), KVGeometry.of(ds, 1)
    latent = ds.mla.kv_lora_rank.value + ds.mla.qk_rope_head_dim.value  # 576
    assert g8.bytes_per_token_per_rank == ds.num_layers.value * latent * 2  # bf16, no K/V split
    assert g8.bytes_per_token_per_rank == g1.bytes_per_token_per_rank  # replicated, not split
    assert g8.parts == 1 and g8.descriptors(3) == 3 * ds.num_layers.value
    # GQA for contrast: K and V, split over ranks by head
    q = KVGeometry.of(model("qwen3-32b"), 8)
    assert q.parts == 2 and q.bytes_per_token_per_rank * 8 == KVGeometry.of(
        model("qwen3-32b"), 1).bytes_per_token_per_rank


def test_the_core_layout_states_the_same_bytes_for_mla() -> None:
    from kvplane.sim.costs import SimCosts

    ds, hw = model("deepseek-v3.2-exp"), hardware("p5en-h200-tp8")
    c = SimCosts(ds, hw)
    lay = c.layout("decode")
    assert lay.num_layers * 2 * lay.num_kv_heads * lay.head_bytes == \
        c.decode.geometry.bytes_per_token_per_rank
    # the core plans K and V regions; MLA + indexer is two regions per layer too, MLA alone one
    assert c.descriptor_prep_time(128, inline=False) == pytest.approx(
        c.transfer.prepare_time(16) + c.transfer.post_time(16))
    v3 = SimCosts(model("deepseek-v3"), hw)
    assert v3.descriptor_prep_time(128, inline=False) == pytest.approx(
        v3.transfer.prepare_time(8) + v3.transfer.post_time(8))


def test_sparse_attention_caps_the_keys_a_query_attends_to() -> None:
    from kvplane.sim.costs import attention_pairs_capped

    assert attention_pairs_capped(10, 0, 100) == attention_pairs(10, 0)
    assert attention_pairs_capped(10, 1000, 100) == 10 * 100
    # queries 1..4 see 1..4 keys, queries 5..10 are capped at 4
    assert attention_pairs_capped(10, 0, 4) == (1 + 2 + 3) + 7 * 4
    dense, sparse = model("deepseek-v3"), model("deepseek-v3.2-exp")
    hw = hardware("p5en-h200-tp8")
    cd, cs = ComputeCost(dense, hw), ComputeCost(sparse, hw)
    # long context: attention grows with context for MLA, stays near flat for sparse
    grow_d = cd.prefill_time(4096, 120_000) - cd.prefill_time(4096, 8_000)
    grow_s = cs.prefill_time(4096, 120_000) - cs.prefill_time(4096, 8_000)
    assert 0 < grow_s < grow_d / 2
    assert cs.decode_step_time(8, 8 * 100_000) < cd.decode_step_time(8, 8 * 100_000)


def test_fp8_compute_runs_at_the_fp8_peak() -> None:
    hw = hardware("p5en-h200-tp8")
    ds = model("deepseek-v3")
    assert ds.compute_dtype == "fp8"
    c8 = ComputeCost(ds, hw)
    c16 = ComputeCost(ds.model_copy(update={"compute_dtype": "bf16"}), hw)
    assert c8.flops_per_second == pytest.approx(2 * c16.flops_per_second, rel=0.01)
    bare = hw.model_copy(update={"device": hw.device.model_copy(update={"peak_flops_fp8": None})})
    with pytest.raises(ValueError, match="peak_flops_fp8"):
        ComputeCost(ds, bare)


def test_allreduce_moves_activations_in_their_dtype_not_the_weights() -> None:
    hw = hardware("p5en-h200-tp8")
    ds = model("deepseek-v3")  # fp8 weights, bf16 activations
    a = ComputeCost(ds, hw).allreduce_time(8192)
    b = ComputeCost(ds.model_copy(update={"activation_dtype": "fp8"}), hw).allreduce_time(8192)
    assert ds.weight_dtype == "fp8" and a > 1.5 * b


def test_moe_profile_is_priced_as_moe() -> None:
    ds = model("deepseek-v3")
    assert ds.moe is not None and ds.active_params.value < ds.total_params.value / 10
    c = ComputeCost(ds, hardware("p5en-h200-tp8"))
    assert c.calibration.model_kind == "moe"
    assert c.weight_bytes_per_rank(1) < c.weight_bytes_per_rank(4096) <= \
        c.weight_bytes_per_rank(1_000_000)


def test_expert_parallelism_turns_moe_all_reduces_into_all_to_alls() -> None:
    hw = hardware("p5en-h200-tp8")
    ds = model("deepseek-v3")
    assert ds.moe is not None and ds.moe.num_moe_layers is not None
    tp_only = ComputeCost(ds, hw)
    ep = ComputeCost(ds, hw, expert_parallel=True)
    # each MoE layer swaps one all-reduce for two all-to-alls of top-k (8) copies per token
    assert ep.allreduce_time(4096) > tp_only.allreduce_time(4096)
    dense = model("qwen3-32b")
    assert ComputeCost(dense, hw, expert_parallel=True).allreduce_time(4096) == \
        ComputeCost(dense, hw).allreduce_time(4096)


@pytest.mark.parametrize("name", ["qwen3-32b", "llama-3.1-405b", "deepseek-v3", "deepseek-v3.2-exp",
                                  "tiny-test"])
def test_a_macro_step_s_step_times_equal_one_call_per_step_bit_for_bit(name: str) -> None:
    """The decode loop prices a macro-step's steps at once; each is the single-step price."""
    hw = hardware("p5en-h200-tp8") if name != "tiny-test" else hardware()
    for c in (ComputeCost(model(name), hw), ComputeCost(model(name), hw, calibration=calibration())):
        for batch, ctx, steps in ((1, 16384, 128), (8, 131000, 50), (64, 250_000, 256),
                                  (3, 7, 5), (2, 100, 2)):
            want = [c.decode_step_time(batch, ctx + batch * i) for i in range(steps)]
            assert c.decode_step_times(batch, ctx, steps) == want


def test_kv_dtype_is_apart_from_the_weights() -> None:
    """An fp8 KV cache with bf16 weights: half the bytes per token (twice the pool, half a
    transfer), the weights' bytes unchanged."""
    hw = hardware("p5en-h200-tp8")
    q = model("qwen3-32b")
    q8 = q.model_copy(update={"kv_dtype": "fp8"})
    assert q.weight_dtype == q8.weight_dtype == "bf16"
    g, g8 = KVGeometry.of(q, 8), KVGeometry.of(q8, 8)
    assert g8.bytes_per_token_per_rank == pytest.approx(g.bytes_per_token_per_rank / 2)
    assert ComputeCost(q8, hw).weight_bytes_per_rank() == ComputeCost(q, hw).weight_bytes_per_rank()
    assert kv_pool_blocks(q8, hw, 8) == pytest.approx(2 * kv_pool_blocks(q, hw, 8), rel=1e-3)


# --- steps in and out of CUDA graphs --------------------------------------------------------------


def _graphed(graph: float = 1e-4, floor_per_layer: float = 0.0,
             empty: float | None = None) -> CalibrationProfile:
    upd: dict[str, Any] = {
        "graph_step_overhead": {"value": graph, "unit": "s", "source": "synthetic: test"},
        "launch_floor": ({"value": floor_per_layer, "unit": "s/layer", "source": "synthetic: test"}
                         if floor_per_layer else None)}
    if empty is not None:
        upd["empty_step"] = {"value": empty, "unit": "s", "source": "synthetic: test"}
    return CalibrationProfile.model_validate({**calibration().model_dump(), **upd})


def test_graph_replayed_decode_steps_have_their_own_fixed_part() -> None:
    plain = ComputeCost(model(), hardware(), None, 16, calibration(), graph_batch=4)
    cal = _graphed(graph=1e-4)
    graphed = ComputeCost(model(), hardware(), None, 16, cal, graph_batch=4)
    step = calibration().step_overhead.value
    assert step > 1e-4
    # up to the graph batch: the graph's fixed part replaces the step's
    for b in (1, 4):
        assert graphed.decode_step_time(b, 100 * b) == pytest.approx(
            plain.decode_step_time(b, 100 * b) - step + 1e-4)
    # beyond it, and any step with a prefill chunk: launched from the host, as before
    assert graphed.decode_step_time(5, 500) == plain.decode_step_time(5, 500)
    assert graphed.prefill_time(64) == plain.prefill_time(64)
    assert graphed.batch_step_time([(8, 0)], [100]) == plain.batch_step_time([(8, 0)], [100])
    assert graphed.batch_step_time((), [100, 100]) == graphed.decode_step_time(2, 200)
    # without a measured graph step the graph batch changes nothing
    assert plain.decode_step_time(1, 100) == ComputeCost(
        model(), hardware(), None, 16, calibration()).decode_step_time(1, 100)


def test_a_step_launched_from_the_host_takes_at_least_the_launch_floor() -> None:
    m = model()
    plain = ComputeCost(m, hardware(), None, 16, calibration())
    floor = (plain.prefill_time(16) + plain.prefill_time(4096)) / 2  # between the two
    per_layer = floor / m.num_layers.value
    cost = ComputeCost(m, hardware(), None, 16, _graphed(floor_per_layer=per_layer),
                       graph_batch=2)
    short, long = cost.prefill_time(16), cost.prefill_time(4096)
    assert plain.decode_step_time(3, 96) < floor  # the test's premise: decode under the floor
    assert short == pytest.approx(floor)  # held at the floor
    assert long == plain.prefill_time(4096)  # the GPU's work covers the launch
    assert cost.decode_step_time(2, 64) < floor  # a graph's replay is not floored
    assert cost.decode_step_time(3, 96) == pytest.approx(floor)  # beyond the graph batch
    # the macro-step's array path agrees with one call per step, floor included
    for b in (2, 3):
        assert cost.decode_step_times(b, 64, 8) == [cost.decode_step_time(b, 64 + b * i)
                                                   for i in range(8)]


def test_an_empty_step_is_the_measured_one_when_there_is_one() -> None:
    from kvplane.sim.costs import SimCosts

    m, h = model(), hardware()
    kw: dict[str, Any] = {"reserve_bytes": 0.0}
    assert SimCosts(m, h, calibration=calibration(), **kw).empty_step_time() == \
        calibration().step_overhead.value
    assert SimCosts(m, h, calibration=_graphed(empty=7e-3), **kw).empty_step_time() == 7e-3
