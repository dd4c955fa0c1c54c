"""Cost models: how long things take, built from a model profile and a hardware profile.

Rules kept here:
- Each concern is its own small object with small methods, so a what-if is a profile change and
  a test can check one formula at a time: `KVGeometry` (bytes, blocks, descriptors),
  `ComputeCost` (engine steps: prefill, decode, mixed), `TransferCost` (NIXL preparation,
  posting, the wire, handshake, notification).
- Costs are pure functions of their arguments: no clock, no randomness, no state. Units are
  seconds, bytes, tokens. Every constant comes from a profile (which cites its source) or is a
  physical identity (2 FLOPs per multiply-add, K and V per layer).
- Tensor parallelism: an instance of TP size `tp` splits weights, FLOPs and KV heads over `tp`
  ranks. A KV transfer moves one slice per rank pair and all ranks move in parallel, so a
  transfer costs what one rank's slice costs. Descriptors per rank pair = runs x layers x 2
  (K and V are separate regions of every layer), where runs is the number of contiguous block
  runs the transfer plan found (kvplane.core merges adjacent blocks).
- Where a cost is paid is the driver's business, but the timing record says where it would be
  paid in vLLM: pull mode prepares and posts descriptors inline in decode's engine loop (a stall
  of every running request); push mode does both on prefill's background transfer thread.
- Staging (`SimCosts(staging=True)`, the scenario's `connector.transfer_staging`): kvplane's
  own transport, which picks per transfer between one descriptor per run and a staged transfer
  (gather into slots, one descriptor per slot, scatter) by the rule in
  kvplane.core.transfer_method, the one the live transport uses. Its inputs come from the link
  (bandwidth, per-descriptor post and wire cost, latency) and the device (a copy reads and
  writes every byte: HBM bandwidth x utilization / 2). That transport posts from its own
  thread, so with staging on the post is priced with the transfer, never in an engine loop.
- IPC (`SimCosts(ipc="same-device" | "peer-device")`, the scenario's `connector.transfer_ipc`):
  prefill and decode on one host, so kvplane's transport may copy a transfer's blocks with one
  kernel from one cache into the other (CUDA IPC), chosen by the same rule when its estimate
  is cheapest: a fixed cost plus the bytes at the copy's bandwidth (one read and one write of
  each byte, as a gather), capped by the link between two GPUs. Also posted off the engine loop.

How a step is priced (roofline with fixed costs):
    step = step_overhead + all-reduce(tokens) + max(FLOPs / (peak * tp * mfu),
                                                   (weight + KV read bytes per rank) / (bw * u))
FLOPs per token = 2 * matmul parameters + 4 * layers * heads * head_dim * (context it attends to).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from kvplane.core.plan import KVLayout
from kvplane.core.transfer_method import (
    IPC_FIXED_S,
    IpcRoute,
    Method,
    MethodCosts,
    choose,
    ipc_time,
    staged_time,
)

from .profiles import DTYPE_BYTES, CalibrationProfile, HardwareProfile, ModelProfile

if TYPE_CHECKING:
    from .config import Scenario

__all__ = [
    "ComputeCost",
    "KVGeometry",
    "SimCosts",
    "TransferCost",
    "TransferTiming",
    "attention_pairs",
    "attention_pairs_capped",
    "kv_pool_blocks",
]

KV_PARTS = 2  # K and V are stored (and described) separately in every layer
STAGING_SLOT_BYTES = 256 << 20  # live/staging.py's GPU slot: the staged pipeline's chunk
# The live staged path's own software, as benchmarks/transfer_fragmented.py --trace measured it
# on one H200 (docs/measurements/transfer-fragmented-h200.md): a fixed part per transfer (post
# to the first gather, about 1 ms) and planning per block on each side (the connector posts
# block ids: `Transport.post_blocks` plans from them, whatever the layer count).
STAGED_FIXED_S = 1e-3
PLAN_PER_RUN_S = 0.15e-6


def attention_pairs(new_tokens: int, cached_tokens: int = 0) -> float:
    """Query-key pairs a causal prefill of `new_tokens` after `cached_tokens` computes."""
    return new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2.0


def attention_pairs_capped(new_tokens: int, cached_tokens: int, cap: int) -> float:
    """Pairs when each query attends to at most `cap` keys (query i sees cached + i + 1)."""
    if new_tokens <= 0:
        return 0.0
    first = cached_tokens + 1  # keys the first new query sees
    last = cached_tokens + new_tokens
    if last <= cap:
        return attention_pairs(new_tokens, cached_tokens)
    if first >= cap:
        return float(new_tokens) * cap
    below = cap - first  # queries that see fewer than cap keys: first .. cap - 1
    return attention_pairs(below, cached_tokens) + float(new_tokens - below) * cap


# --- KV geometry ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """The KV cache of one model on one instance: bytes per token and block, descriptors.

    GQA: K and V are separate regions of every layer (`kv_parts` 2), split over TP ranks by KV
    head (`kv_heads_per_rank` = num_kv_heads / tp, at least 1: heads are replicated when tp
    exceeds them, as vLLM does). MLA: one latent region per layer (`kv_parts` 1), the whole
    latent on every rank. Sparse attention adds the indexer's cache, one more region per layer.
    """

    num_layers: int
    kv_heads_per_rank: int
    head_dim: int
    kv_dtype_bytes: float
    block_size: int
    tp: int
    kv_parts: int = KV_PARTS
    indexer_bytes_per_token: float = 0.0  # per layer, on every rank

    @classmethod
    def of(cls, model: ModelProfile, tp: int, block_size: int = 16) -> KVGeometry:
        if tp < 1 or block_size < 1:
            raise ValueError(f"tp and block_size must be >= 1, got tp={tp}, block={block_size}")
        sparse = model.sparse_attention
        indexer = (sparse.index_head_dim.value * DTYPE_BYTES[sparse.index_dtype]
                   if sparse is not None else 0.0)
        if model.mla is not None:
            return cls(num_layers=model.num_layers.value, kv_heads_per_rank=1,
                       head_dim=model.mla.kv_lora_rank.value + model.mla.qk_rope_head_dim.value,
                       kv_dtype_bytes=DTYPE_BYTES[model.kv_dtype], block_size=block_size, tp=tp,
                       kv_parts=1, indexer_bytes_per_token=indexer)
        heads = model.num_kv_heads.value
        return cls(
            num_layers=model.num_layers.value,
            kv_heads_per_rank=max(1, heads // tp),
            head_dim=model.head_dim.value,
            kv_dtype_bytes=DTYPE_BYTES[model.kv_dtype],
            block_size=block_size,
            tp=tp,
            indexer_bytes_per_token=indexer,
        )

    @property
    def parts(self) -> int:
        """Regions per layer a block spans (K and V; or the latent; plus the indexer's)."""
        return self.kv_parts + (1 if self.indexer_bytes_per_token else 0)

    @property
    def bytes_per_token_per_rank(self) -> float:
        """Every region of every layer for one token, on one rank."""
        return self.num_layers * (
            self.kv_parts * self.kv_heads_per_rank * self.head_dim * self.kv_dtype_bytes
            + self.indexer_bytes_per_token
        )

    @property
    def bytes_per_token(self) -> float:
        """What one token's KV occupies over all ranks of the instance."""
        return self.bytes_per_token_per_rank * self.tp

    @property
    def region_bytes(self) -> float:
        """One (layer, K or V or latent, block) region on one rank: what a descriptor describes."""
        return self.block_size * self.kv_heads_per_rank * self.head_dim * self.kv_dtype_bytes

    @property
    def bytes_per_block_per_rank(self) -> float:
        return self.block_size * self.bytes_per_token_per_rank

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold `tokens` tokens (the last one may be partly filled)."""
        return -(-tokens // self.block_size) if tokens > 0 else 0

    def full_blocks(self, tokens: int) -> int:
        """Blocks entirely filled by `tokens` tokens (what prefix caching can share)."""
        return max(0, tokens) // self.block_size

    def descriptors(self, runs: int) -> int:
        """Descriptors per rank pair for `runs` contiguous block runs: runs x layers x parts."""
        return runs * self.num_layers * self.parts

    def transfer_bytes_per_rank(self, blocks: int) -> float:
        """Bytes one rank moves for `blocks` whole blocks."""
        return blocks * self.bytes_per_block_per_rank


def kv_pool_blocks(
    model: ModelProfile,
    hardware: HardwareProfile,
    tp: int,
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    reserve_bytes: float = 0.0,
) -> int:
    """KV blocks one instance can hold, the way vLLM sizes its pool.

    Per device: capacity x gpu_memory_utilization - weights per rank - `reserve_bytes`
    (activations, CUDA graphs, communication buffers), divided by one block's bytes on a rank.
    """
    geometry = KVGeometry.of(model, tp, block_size)
    capacity = hardware.device.hbm_capacity.value * gpu_memory_utilization
    weights = model.total_params.value * DTYPE_BYTES[model.weight_dtype] / tp
    free = capacity - weights - reserve_bytes
    if free <= 0:
        raise ValueError(
            f"{model.name} at tp={tp} does not fit {hardware.name}: weights {weights / 1e9:.1f} GB"
            f" + reserve {reserve_bytes / 1e9:.1f} GB per device exceed {capacity / 1e9:.1f} GB"
        )
    return int(free // geometry.bytes_per_block_per_rank)


# --- compute ----------------------------------------------------------------------------------------


class ComputeCost:
    """Engine-step times of one instance (prefill, decode or mixed batches)."""

    def __init__(self, model: ModelProfile, hardware: HardwareProfile, tp: int | None = None,
                 block_size: int = 16, calibration: CalibrationProfile | None = None,
                 expert_parallel: bool = False, graph_batch: int = 0) -> None:
        if calibration is None:
            from .calibration import bundled_calibration

            calibration = bundled_calibration(model, hardware)
        self.calibration = calibration
        self.model = model
        self.hardware = hardware
        self.tp = tp if tp is not None else hardware.node.tp_size.value
        if self.tp > hardware.node.devices_per_node.value:
            raise ValueError(f"tp={self.tp} exceeds devices_per_node of {hardware.name}")
        self.geometry = KVGeometry.of(model, self.tp, block_size)
        wbytes = DTYPE_BYTES[model.weight_dtype]
        matmul_params = model.active_params.value - model.embedding_params.value
        # 2 FLOPs per multiply-add; the input embedding is a lookup, the LM head runs once per
        # sequence that samples a token, so both stay out of the per-token matmul term.
        self.linear_flops_per_token = 2.0 * matmul_params
        self.lm_head_flops = 2.0 * model.vocab_size.value * model.hidden_size.value
        # QK^T and PV: 2 FLOPs x heads x (qk width + v width) per (query, key) pair per layer;
        # GQA: both widths are head_dim; MLA: nope + rope for QK, v_head_dim for PV.
        mla = model.mla
        qk = (mla.qk_nope_head_dim.value + mla.qk_rope_head_dim.value if mla
              else model.head_dim.value)
        v = mla.v_head_dim.value if mla else model.head_dim.value
        self.attention_flops_per_pair = (
            2.0 * model.num_layers.value * model.num_attention_heads.value * (qk + v)
        )
        sparse = model.sparse_attention
        # Sparse attention: a query attends to at most `topk` keys; the indexer scores all.
        self.attend_cap = sparse.index_topk.value if sparse is not None else None
        self.indexer_flops_per_pair = (
            2.0 * model.num_layers.value * sparse.index_n_heads.value
            * sparse.index_head_dim.value if sparse is not None else 0.0
        )
        self.indexer_bytes_per_token = self.geometry.num_layers * self.geometry.indexer_bytes_per_token
        peak = hardware.device.peak_flops_bf16
        if model.compute_dtype == "fp8":
            if hardware.device.peak_flops_fp8 is None:
                raise ValueError(f"{model.name} computes in fp8, but {hardware.name} gives no "
                                 "device.peak_flops_fp8")
            peak = hardware.device.peak_flops_fp8
        self.flops_per_second = peak.value * self.tp * calibration.compute_utilization.value
        self.bytes_per_second = (
            hardware.device.hbm_bandwidth.value
            * calibration.memory_bandwidth_utilization.value
        )
        self._dense_weight_bytes_per_rank = model.total_params.value * wbytes / self.tp
        moe = model.moe
        self._expert_bytes_per_rank = (
            moe.expert_params.value * wbytes / self.tp if moe is not None else 0.0
        )
        self._experts = moe.num_experts.value if moe is not None else 0
        self._top_k = moe.experts_per_token.value if moe is not None else 0
        self.kv_bytes_per_token_per_rank = self.geometry.bytes_per_token_per_rank
        self.step_overhead = calibration.step_overhead.value
        # decode-only batches up to graph_batch replay a CUDA graph: their own fixed part; any
        # other step launches its kernels from the host, which takes at least launch_floor
        graph = calibration.graph_step_overhead
        self.graph_batch = graph_batch if graph is not None else 0
        self.graph_overhead = graph.value if graph is not None else self.step_overhead
        floor = calibration.launch_floor
        self.launch_floor = (floor.value * model.num_layers.value if floor is not None
                             else 0.0)
        self.prefill_request_overhead = calibration.prefill_request_overhead.value
        self._ar_latency = hardware.tp_collective.allreduce_latency.value
        self._ar_bandwidth = hardware.tp_collective.allreduce_bandwidth.value
        self._ar_per_pass = 2 * model.num_layers.value  # after attention and after the MLP
        # Expert parallelism (vLLM --enable-expert-parallel): an MoE layer's experts are spread
        # over the ranks instead of sliced; its MLP all-reduce becomes an all-to-all that sends
        # each token to its top-k experts and back.
        self.expert_parallel = expert_parallel and moe is not None and self.tp > 1
        self._moe_layers = 0
        if self.expert_parallel and moe is not None:
            self._moe_layers = (moe.num_moe_layers.value if moe.num_moe_layers is not None
                                else model.num_layers.value)
            self._ar_per_pass -= self._moe_layers
        a2a = hardware.tp_collective.alltoall_bandwidth
        self._a2a_bandwidth = a2a.value if a2a is not None else self._ar_bandwidth
        # what an all-reduce moves: activations, in their own dtype (not the weights')
        self._activation_bytes_per_token = (model.hidden_size.value
                                            * DTYPE_BYTES[model.activation_dtype])

    # -- pieces ------------------------------------------------------------------------------------

    def weight_bytes_per_rank(self, tokens: int = 1) -> float:
        """Weight bytes one rank streams in a step of `tokens` tokens.

        Dense: all of them. MoE: non-expert weights plus the expected share of experts that at
        least one of the step's tokens routes to, 1 - (1 - k/E)^tokens.
        """
        if self._experts == 0:
            return self._dense_weight_bytes_per_rank
        touched = 1.0 - (1.0 - self._top_k / self._experts) ** max(tokens, 1)
        shared = self._dense_weight_bytes_per_rank - self._expert_bytes_per_rank
        return shared + self._expert_bytes_per_rank * touched

    def allreduce_time(self, tokens: int) -> float:
        """TP collectives of one pass: two all-reduces per layer of `tokens` x hidden
        activations; with expert parallelism an MoE layer's second one is a dispatch and a
        combine all-to-all of top-k copies of each token. Zero without TP."""
        if self.tp == 1 or tokens <= 0:
            return 0.0
        size = tokens * self._activation_bytes_per_token
        total = self._ar_per_pass * (self._ar_latency + size / self._ar_bandwidth)
        if self._moe_layers:
            moved = size * self._top_k * (self.tp - 1) / self.tp  # what leaves each rank
            total += self._moe_layers * 2 * (self._ar_latency + moved / self._a2a_bandwidth)
        return total

    def flops(self, tokens: int, attention_pairs_: float, sampled: int) -> float:
        """FLOPs of a step computing `tokens` tokens that attend over `attention_pairs_` pairs."""
        return (
            self.linear_flops_per_token * tokens
            + self.attention_flops_per_pair * attention_pairs_
            + self.lm_head_flops * sampled
        )

    # -- steps -------------------------------------------------------------------------------------

    def step_time(
        self,
        *,
        tokens: int,
        attention_pairs_: float,
        kv_read_tokens: float,
        sampled: int,
        graph: bool = False,
    ) -> float:
        """One engine step: overhead + all-reduce + max(compute, memory), all scalars; a step
        replayed from a CUDA graph (`graph`) has its own overhead, any other at least the
        host's launch floor.

        tokens: tokens computed this step (prefill chunk tokens + one per decoding sequence);
        attention_pairs_: (query, key) pairs attended over; kv_read_tokens: cached tokens whose
        KV is read from HBM; sampled: sequences that produce a token this step.
        """
        if tokens <= 0:
            return 0.0
        compute = self.flops(tokens, attention_pairs_, sampled) / self.flops_per_second
        memory = (
            self.weight_bytes_per_rank(tokens)
            + kv_read_tokens * self.kv_bytes_per_token_per_rank
        ) / self.bytes_per_second
        if graph:
            return self.graph_overhead + self.allreduce_time(tokens) + max(compute, memory)
        return max(self.step_overhead + self.allreduce_time(tokens) + max(compute, memory),
                   self.launch_floor)

    def _pairs(self, new_tokens: int, cached_tokens: int) -> float:
        """(query, key) pairs priced for a chunk: attention (capped by sparse attention's top-k)
        plus the indexer's scoring of every pair, in attention-pair units."""
        full = attention_pairs(new_tokens, cached_tokens)
        cap = self.attend_cap
        if cap is None:
            return full
        attended = attention_pairs_capped(new_tokens, cached_tokens, cap)
        return attended + full * self.indexer_flops_per_pair / self.attention_flops_per_pair

    def _kv_read(self, tokens: float, sequences: int = 1) -> float:
        """Cached tokens whose KV a step reads, in full-KV token units (sparse: the top-k of
        each sequence, plus the indexer's keys of every token)."""
        cap = self.attend_cap
        if cap is None or self.kv_bytes_per_token_per_rank == 0:
            return tokens
        attended = min(tokens, float(cap) * max(sequences, 1))
        index_share = self.indexer_bytes_per_token / self.kv_bytes_per_token_per_rank
        return attended * (1.0 - index_share) + tokens * index_share

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """One step that prefills `new_tokens` after `cached_tokens` already in the cache."""
        return self.step_time(
            tokens=new_tokens,
            attention_pairs_=self._pairs(new_tokens, cached_tokens),
            kv_read_tokens=self._kv_read(cached_tokens),
            sampled=1,
        )

    def chunked_prefill_time(self, new_tokens: int, cached_tokens: int = 0,
                             chunk: int | None = None) -> float:
        """Prefill of one request alone, in chunks of at most `chunk` tokens (one step each)."""
        if chunk is None or chunk >= new_tokens:
            return self.prefill_time(new_tokens, cached_tokens)
        total, done = 0.0, 0
        while done < new_tokens:
            size = min(chunk, new_tokens - done)
            total += self.prefill_time(size, cached_tokens + done)
            done += size
        return total

    def decode_step_time(self, batch_size: int, context_tokens: int) -> float:
        """A decode-only step: `batch_size` sequences holding `context_tokens` tokens in total."""
        pairs = float(context_tokens)
        if self.attend_cap is not None:
            pairs = (min(pairs, float(self.attend_cap) * batch_size)
                     + pairs * self.indexer_flops_per_pair / self.attention_flops_per_pair)
        return self.step_time(
            tokens=batch_size,
            attention_pairs_=pairs,
            kv_read_tokens=self._kv_read(float(context_tokens), batch_size),
            sampled=batch_size,
            graph=batch_size <= self.graph_batch,
        )

    def decode_step_times(self, batch_size: int, context_tokens: int, steps: int) -> list[float]:
        """`steps` consecutive decode steps of an unchanging batch, whose context grows by
        `batch_size` a step: `decode_step_time` of each, bit for bit (the same operations in
        the same order, on an array), without a Python call per step."""
        if self.attend_cap is not None or steps < 4 or batch_size <= 0:
            return [self.decode_step_time(batch_size, context_tokens + batch_size * i)
                    for i in range(steps)]
        ctx = (context_tokens + batch_size * np.arange(steps, dtype=np.int64)).astype(np.float64)
        compute = (self.linear_flops_per_token * batch_size + self.attention_flops_per_pair * ctx
                   + self.lm_head_flops * batch_size) / self.flops_per_second
        memory = (self.weight_bytes_per_rank(batch_size)
                  + ctx * self.kv_bytes_per_token_per_rank) / self.bytes_per_second
        graph = batch_size <= self.graph_batch
        fixed = ((self.graph_overhead if graph else self.step_overhead)
                 + self.allreduce_time(batch_size))
        steps_s = fixed + np.maximum(compute, memory)
        if not graph:
            steps_s = np.maximum(steps_s, self.launch_floor)
        out: list[float] = steps_s.tolist()
        return out

    def batch_step_time(
        self, prefills: Sequence[tuple[int, int]] = (), decode_contexts: Sequence[int] = ()
    ) -> float:
        """A mixed step: prefill chunks as (new, cached) pairs plus decoding sequences' contexts.

        Prefill chunks that do not finish their prompt sample nothing; for simplicity every
        chunk is counted as sampling once (the LM head is < 0.5 % of a chunk's FLOPs).
        """
        tokens = sum(n for n, _ in prefills) + len(decode_contexts)
        pairs = sum(self._pairs(n, c) for n, c in prefills) + sum(
            self._pairs(1, c - 1) if c > 0 else 0.0 for c in decode_contexts)
        kv_read = (sum(self._kv_read(float(c)) for _, c in prefills)
                   + sum(self._kv_read(float(c)) for c in decode_contexts))
        return self.step_time(
            tokens=tokens, attention_pairs_=pairs, kv_read_tokens=kv_read,
            sampled=len(prefills) + len(decode_contexts),
            graph=not prefills and len(decode_contexts) <= self.graph_batch,
        )


# --- transfer ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TransferTiming:
    """One KV transfer priced piece by piece (per rank; ranks run in parallel).

    engine_stall_s: time the *engine loop* that prepares the transfer is blocked (pull mode
        without a reader thread: decode's loop; zero when a background thread does it);
    thread_busy_s: time a background transfer thread is busy preparing and posting (push
        mode: prefill's thread; pull with a reader thread: decode's reader);
    wire_s: from the last post to the data landing (latency, bytes, per-descriptor execution);
    notify_s: the completion notification's trip to the consumer (push) or 0;
    total_s: from the decision to transfer to the consumer knowing the data is there.
    """

    descriptors: int
    bytes_per_rank: float
    prepare_s: float
    post_s: float
    wire_s: float
    notify_s: float
    engine_stall_s: float
    thread_busy_s: float
    total_s: float


class TransferCost:
    """NIXL transfer costs over one link kind ('network' between nodes, 'nvlink' inside one)."""

    def __init__(self, hardware: HardwareProfile,
                 link: Literal["network", "nvlink"] = "network",
                 calibration: CalibrationProfile | None = None) -> None:
        if link not in hardware.links:
            raise ValueError(f"{hardware.name} has no {link!r} link (has {sorted(hardware.links)})")
        spec = hardware.links[link]
        self.hardware = hardware
        self.link = link
        if spec.utilization is not None:  # measured for the link itself
            utilization = spec.utilization.value
        elif calibration is not None:
            utilization = calibration.network_utilization.value
        else:
            raise ValueError(f"{hardware.name}: link {link!r} has no measured utilization; "
                             "pass the (model kind, hardware) calibration")
        self.bandwidth_per_rank = (
            spec.bandwidth_per_rail.value * spec.rails_per_device.value * utilization
        )
        self.latency = spec.latency.value
        self.post_fixed = spec.post_fixed.value
        self.post_per_descriptor = spec.post_per_descriptor.value
        self.wire_per_descriptor = spec.wire_per_descriptor.value
        measured = calibration.transfer_per_descriptor if calibration is not None else None
        if measured is not None:  # measured live: the connector's post and the wire together
            self.post_per_descriptor, self.wire_per_descriptor = 0.0, measured.value
        nixl = hardware.nixl
        self.prep_fixed = nixl.prep_fixed.value
        self.prep_per_descriptor = nixl.prep_per_descriptor.value
        self.unprepped_per_descriptor = nixl.unprepped_per_descriptor.value
        self.dlist_prep_per_descriptor = nixl.dlist_prep_per_descriptor.value
        self.add_remote_agent = nixl.add_remote_agent.value
        self.reuse_read_setup = (calibration.reuse_read_setup.value
                                 if calibration is not None else 0.0)

    def prepare_time(self, descriptors: int, prepped: bool = True) -> float:
        """Building the request's descriptors: make_prepped_xfer, or lists + initialize_xfer."""
        per = self.prep_per_descriptor if prepped else self.unprepped_per_descriptor
        return self.prep_fixed + descriptors * per

    def post_time(self, descriptors: int) -> float:
        """Posting the transfer to the backend, on the thread that calls it."""
        return self.post_fixed + descriptors * self.post_per_descriptor

    def wire_time(self, bytes_per_rank: float, descriptors: int) -> float:
        """From posted to landed: latency + bytes / (rail bandwidth x rails x util) + per-desc."""
        return (
            self.latency
            + bytes_per_rank / self.bandwidth_per_rank
            + descriptors * self.wire_per_descriptor
        )

    def transfer_time(self, bytes_per_rank: float, descriptors: int) -> float:
        """Post plus wire for one rank's slice (all ranks in parallel, so the whole transfer)."""
        return self.post_time(descriptors) + self.wire_time(bytes_per_rank, descriptors)

    def notification_time(self) -> float:
        """One small completion message: a single-descriptor post and the link latency."""
        return self.post_fixed + self.post_per_descriptor + self.latency

    def handshake_time(self, peer_descriptors: int = 0) -> float:
        """First contact with a peer: metadata round trip, add_remote_agent, and preparing the
        peer's descriptor list (`peer_descriptors` regions, one-time)."""
        return (
            2.0 * self.latency
            + self.add_remote_agent
            + peer_descriptors * self.dlist_prep_per_descriptor
        )

    def timing(
        self,
        bytes_per_rank: float,
        descriptors: int,
        *,
        placement: Literal["engine_loop", "thread"],
        notify: bool,
        prepped: bool = True,
        setup_s: float = 0.0,
    ) -> TransferTiming:
        """Price one transfer and say which loop pays the preparation.

        placement: 'engine_loop' (pull without a reader thread: prepare + post block the
        engine) or 'thread' (push's background thread, or a pull reader thread).
        notify: add the completion notification's trip (push WRITE notifications).
        setup_s: fixed coordination before the transfer (e.g. `reuse_read_setup`).
        """
        prepare = self.prepare_time(descriptors, prepped)
        post = self.post_time(descriptors)
        wire = self.wire_time(bytes_per_rank, descriptors)
        notify_s = self.latency if notify else 0.0
        busy = prepare + post
        return TransferTiming(
            descriptors=descriptors,
            bytes_per_rank=bytes_per_rank,
            prepare_s=prepare,
            post_s=post,
            wire_s=wire,
            notify_s=notify_s,
            engine_stall_s=busy if placement == "engine_loop" else 0.0,
            thread_busy_s=busy if placement == "thread" else 0.0,
            total_s=setup_s + busy + wire + notify_s,
        )

    def method_costs(self, copy_bandwidth: float,
                     chunk_bytes: int = STAGING_SLOT_BYTES) -> MethodCosts:
        """The inputs of the direct / staged / IPC rule, for this link (the IPC copy moves
        each byte once each way, as a gather does)."""
        return MethodCosts(
            bandwidth=self.bandwidth_per_rank,
            per_descriptor=self.post_per_descriptor + self.wire_per_descriptor,
            copy_bandwidth=copy_bandwidth,
            round_trip=2.0 * self.latency,
            chunk_bytes=chunk_bytes,
            overlap=True,  # GPU copies run on a side stream beside the wire
            staged_fixed=STAGED_FIXED_S,
            plan_per_run=PLAN_PER_RUN_S,
            ipc_bandwidth=copy_bandwidth,
            ipc_fixed=IPC_FIXED_S,
        )

    def chosen_transfer(self, bytes_per_rank: float, descriptors: int,
                        costs: MethodCosts, blocks: int | None = None, *,
                        staging: bool = True,
                        ipc: IpcRoute | None = None) -> tuple[Method, float]:
        """Post plus wire by the method the live transport would choose, and that method.
        `blocks`: what the staged path plans per item (the live connector plans from block
        ids; None: per descriptor, as a run list would be)."""
        planned = descriptors if blocks is None else blocks
        method = choose(costs, int(bytes_per_rank), descriptors, staging_available=staging,
                        runs=planned, ipc=ipc)
        if method == "ipc":  # the copy, then the notification across
            return method, ipc_time(costs, int(bytes_per_rank), ipc or "same-device") + (
                self.latency)
        if method == "staged":
            return method, self.post_fixed + self.latency + staged_time(
                costs, int(bytes_per_rank), planned)
        return method, self.transfer_time(bytes_per_rank, descriptors)

    def kv_timing(
        self,
        geometry: KVGeometry,
        blocks: int,
        runs: int,
        *,
        placement: Literal["engine_loop", "thread"],
        notify: bool,
        setup_s: float = 0.0,
    ) -> TransferTiming:
        """`timing` for `blocks` KV blocks in `runs` contiguous runs of one model's cache."""
        if runs > blocks or (blocks > 0 and runs < 1):
            raise ValueError(f"runs must be in 1..blocks, got runs={runs}, blocks={blocks}")
        return self.timing(
            geometry.transfer_bytes_per_rank(blocks),
            geometry.descriptors(runs),
            placement=placement,
            notify=notify,
            setup_s=setup_s,
        )


# --- the bundle the SimPy engine uses ---------------------------------------------------------------


class SimCosts:
    """Every cost the engine needs, for one scenario (the `Costs` protocol of sim/engine.py).

    Conventions of the engine's calls, kept here:
    - `descriptor_prep_time(descriptors, inline)`: `descriptors` is a plan's total over all
      streams; each rank prepares and posts its own share in parallel, so the time is that of
      descriptors / tp of the preparing side (decode when inline, prefill otherwise). It
      includes the post, because vLLM posts on the thread that prepared (pull: decode's engine
      loop; push: prefill's background thread).
    - `transfer_time(nbytes, descriptors, streams)`: totals over `streams` parallel rank pairs;
      the wire time of one stream's share (the post was already paid above).
    - `request_overhead()` is a per-request delay on the prefill path that does *not* hold the
      engine (calibrated, docs/calibration.md section 3); `reuse_read_setup()` is the fixed
      coordination of a D->P reuse read (section 4). The engine adds both where they occur.
    - The serving stack around the engines (calibration, measured from a live run):
      `request_leg()` per request leg (router to prefill, router to decode), `response_leg()`
      per answer through the router (prefill's in pull mode, the first token to the client),
      `transfer_setup()` per connector transfer (P->D, and a reuse read's D->P).
      `host_slowdown_quantiles()` is the calibration's per-hop slowdown on a shared host; the
      engine draws from it (seeded), since costs here stay free of randomness;
      `host_state_bins()` the same factors split by the host's sampled run queue, drawn by
      the engine given the run queue recorded at a hop's time when the run has samples.
    """

    def __init__(
        self,
        model: ModelProfile,
        hardware: HardwareProfile,
        *,
        prefill_tp: int | None = None,
        decode_tp: int | None = None,
        expert_parallel: bool = False,
        link: Literal["network", "nvlink"] = "network",
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        reserve_bytes: float = 4.0e9,
        calibration: CalibrationProfile | None = None,
        staging: bool = False,
        ipc: IpcRoute | None = None,
        graph_batch: int = 0,
    ) -> None:
        self.model = model
        self.hardware = hardware
        self.prefill = ComputeCost(model, hardware, prefill_tp, block_size, calibration,
                                   expert_parallel, graph_batch)
        self.calibration = self.prefill.calibration
        self.decode = ComputeCost(model, hardware, decode_tp, block_size, self.calibration,
                                  expert_parallel, graph_batch)
        self.transfer = TransferCost(hardware, link, self.calibration)
        self.staging = staging
        self.ipc = ipc
        # the transport chooses per transfer (and posts off the engine loop) with either
        self.choosing = staging or ipc is not None
        # a staged transfer's gather and scatter stream the KV through HBM: read + write
        copy_bandwidth = (hardware.device.hbm_bandwidth.value
                          * self.calibration.memory_bandwidth_utilization.value / 2.0)
        self.method_costs = self.transfer.method_costs(copy_bandwidth)
        self.block_size = block_size
        self.pool_blocks = {
            side: kv_pool_blocks(model, hardware, cost.tp, block_size, gpu_memory_utilization,
                                 reserve_bytes)
            for side, cost in (("prefill", self.prefill), ("decode", self.decode))
        }

    @classmethod
    def from_scenario(cls, scenario: Scenario) -> SimCosts:
        from .calibration import calibration_for

        engine = scenario.engine
        return cls(
            scenario.model, scenario.hardware,
            prefill_tp=scenario.prefill_tp, decode_tp=scenario.decode_tp, link=scenario.link,
            expert_parallel=scenario.cluster.expert_parallel,
            block_size=engine.block_size,
            gpu_memory_utilization=engine.gpu_memory_utilization,
            reserve_bytes=engine.activation_reserve_bytes,
            calibration=calibration_for(scenario),
            graph_batch=engine.graph_batch,
            staging=scenario.connector.transfer_staging,
            ipc=(None if scenario.connector.transfer_ipc == "off"
                 else scenario.connector.transfer_ipc),
        )

    # -- the engine's protocol ---------------------------------------------------------------------

    def prefill_time(self, new_tokens: int, cached_tokens: int) -> float:
        """One prefill step (one chunk) of `new_tokens` after `cached_tokens`."""
        return self.prefill.prefill_time(new_tokens, cached_tokens)

    def prefill_batch_time(self, chunks: list[tuple[int, int]]) -> float:
        """One prefill engine step computing several requests' chunks, as (new, cached)."""
        return self.prefill.batch_step_time(prefills=chunks)

    def decode_step_time(self, batch: int, context_tokens: int) -> float:
        return self.decode.decode_step_time(batch, context_tokens)

    def decode_step_times(self, batch: int, context_tokens: int, steps: int) -> list[float]:
        return self.decode.decode_step_times(batch, context_tokens, steps)

    def mixed_step_time(self, chunks: list[tuple[int, int]], contexts: list[int]) -> float:
        """One decode engine step computing prefill chunks, as (new, cached), besides the
        decoding sequences of these contexts (a local prefill: failed load, preemption)."""
        return self.decode.batch_step_time(prefills=chunks, decode_contexts=contexts)

    def _regions(self, descriptors: int) -> int:
        """The core plans K and V regions per layer; a model with another number of regions
        per layer (MLA: one latent; sparse attention: plus the indexer's) scales its count."""
        parts = self.prefill.geometry.parts
        return descriptors if parts == KV_PARTS else -(-descriptors * parts // KV_PARTS)

    def descriptor_prep_time(self, descriptors: int, inline: bool) -> float:
        tp = self.decode.tp if inline else self.prefill.tp
        per_rank = -(-self._regions(descriptors) // tp)
        if self.choosing:  # the post belongs to the chosen method: see transfer_time
            return self.transfer.prepare_time(per_rank)
        return self.transfer.prepare_time(per_rank) + self.transfer.post_time(per_rank)

    def transfer_time(self, nbytes: int, descriptors: int, streams: int) -> float:
        streams = max(1, streams)
        per_stream = -(-self._regions(descriptors) // streams)
        if self.choosing:
            return self.transfer.chosen_transfer(nbytes / streams, per_stream,
                                                 self.method_costs,
                                                 self._blocks(per_stream),
                                                 staging=self.staging, ipc=self.ipc)[1]
        return self.transfer.wire_time(nbytes / streams, per_stream)

    def _blocks(self, descriptors: int) -> int:
        """Block runs behind `descriptors` (one descriptor per run, layer and region): what the
        live connector's staged path plans from."""
        g = self.prefill.geometry
        return max(1, -(-descriptors // (g.num_layers * g.parts)))

    def transfer_method(self, nbytes: int, descriptors: int, streams: int) -> Method:
        """"direct", "staged" or "ipc": what transfer_time priced (always "direct" without
        staging or IPC)."""
        if not self.choosing:
            return "direct"
        streams = max(1, streams)
        per_stream = -(-self._regions(descriptors) // streams)
        return self.transfer.chosen_transfer(nbytes / streams, per_stream, self.method_costs,
                                             self._blocks(per_stream), staging=self.staging,
                                             ipc=self.ipc)[0]

    def handshake_time(self) -> float:
        """First contact: metadata round trip, add_remote_agent, and preparing the peer's
        descriptor list for its whole pool (one region per block, layer and K/V, per rank)."""
        peer = max(self.pool_blocks.values()) * self.prefill.geometry.num_layers * 2
        return self.transfer.handshake_time(peer)

    def message_latency(self) -> float:
        return self.transfer.notification_time()

    # -- what the protocol above does not carry ------------------------------------------------------

    def request_overhead(self) -> float:
        return self.prefill.prefill_request_overhead

    def reuse_read_setup(self) -> float:
        return self.transfer.reuse_read_setup

    def request_leg(self) -> float:
        """Router to an engine's scheduler, per leg (calibration `request_leg`)."""
        return self.calibration.request_leg.value

    def response_leg(self) -> float:
        """An engine's output back through the router (calibration `response_leg`)."""
        return self.calibration.response_leg.value

    def transfer_setup(self) -> float:
        """Fixed part of one connector KV transfer (calibration `transfer_setup`)."""
        return self.calibration.transfer_setup.value

    def empty_step_time(self) -> float:
        """An engine step that schedules nothing (it still polls the connector): the
        calibration's measured `empty_step`, else a step's fixed part."""
        empty = self.calibration.empty_step
        return empty.value if empty is not None else self.decode.step_overhead

    def host_slowdown_quantiles(self) -> dict[str, tuple[float, ...]]:
        """The calibration's host slowdown per hop kind, as quantiles (none: a dedicated
        host)."""
        return {k: tuple(v.quantiles) for k, v in self.calibration.host_slowdown.items()}

    def host_hop_correlation(self) -> float:
        """How alike one request's hop slowdowns are (0: each hop draws on its own)."""
        rho = self.calibration.host_hop_correlation
        return 0.0 if rho is None else rho.value

    def host_state_bins(self) -> tuple[float, tuple[float, ...],
                                        dict[str, tuple[tuple[float, ...], ...]]] | None:
        """The calibration's slowdown conditioned on the host's state: (averaging window in
        s, bin edges of the run queue, per hop kind its factors per bin); None when the
        calibration has no `host_state` (every hop draws from all factors of its kind)."""
        state = self.calibration.host_state
        if state is None:
            return None
        return state.window, tuple(state.edges), {
            k: tuple(tuple(q) for q in v.by_state)
            for k, v in self.calibration.host_slowdown.items() if v.by_state}

    def layout(self, side: Literal["prefill", "decode"]) -> KVLayout:
        """The core's KVLayout of one side."""
        cost = self.prefill if side == "prefill" else self.decode
        g = cost.geometry
        if g.kv_parts == KV_PARTS and not g.indexer_bytes_per_token:
            heads = self.model.num_kv_heads.value
            head_bytes = int(self.model.head_dim.value * DTYPE_BYTES[self.model.kv_dtype])
        else:  # the core's layout knows K and V heads: state the same bytes per token that way
            heads = 1
            head_bytes = round(g.bytes_per_token_per_rank / (g.num_layers * KV_PARTS))
        return KVLayout(
            block_size=self.block_size,
            tp=cost.tp,
            num_layers=self.model.num_layers.value,
            num_kv_heads=heads,
            head_bytes=head_bytes,
        )
