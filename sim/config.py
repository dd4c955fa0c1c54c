"""Scenarios: the typed, validated description of one simulated experiment and its sweep.

Rules kept here:
- A scenario is YAML validated into frozen pydantic models (`extra="forbid"`, help text on every
  field). Building a model does no I/O; `load_scenario` and `scenario_from_data` read files,
  resolve profile names and turn every mistake into a `ScenarioError` that names the file, the
  dotted field path (with its line) and what was expected. YAML syntax errors carry their line.
- Profiles are given by name (a bundled profile, or a path relative to the scenario file) or
  inline; after loading, `Scenario.profiles` always holds validated profile objects, so a
  scenario dumped with `model_dump()` is self-contained and can be recorded next to a run.
- Policies are picked by an explicit `kind` field (workload, lease), never by registration.
- `Scenario.points()` expands the sweep into concrete points, outermost axis first: mode,
  bidirectional, qps, input length, output length, iteration. Each point carries a concrete
  scenario (sweep emptied) and a seed that depends on the workload axes and the iteration but
  not on mode or bidirectional, so push and pull see the same requests (common random numbers).
- Every assumption the published articles leave open is written down in `assumptions:`; the
  figures a run should be compared with live in `published:`.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .profiles import (
    CalibrationProfile,
    HardwareProfile,
    ModelProfile,
    ScenarioError,
    _Positions,
    _short,
    load_profile,
    profile_from_data,
    read_yaml,
    scenario_error_from_validation,
)

__all__ = [
    "Assumption",
    "Cluster",
    "ConnectorSettings",
    "EngineSettings",
    "FixedLease",
    "LengthSpec",
    "MultiTurnWorkload",
    "Point",
    "PoissonWorkload",
    "PrefixCaching",
    "Profiles",
    "Published",
    "PublishedFigure",
    "RenewableLease",
    "Scenario",
    "ScenarioError",
    "Sweep",
    "TraceWorkload",
    "Workload",
    "bundled_scenario_names",
    "load_published",
    "load_scenario",
    "scenario_from_data",
    "where_matches",
]

Mode = Literal["push", "pull"]


class _Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# --- cluster and engine -----------------------------------------------------------------------------


class Cluster(_Config):
    """How many prefill and decode instances (xPyD) and how each is parallelised."""

    prefill_instances: int = Field(default=1, ge=1, description="number of prefill instances (x)")
    decode_instances: int = Field(default=1, ge=1, description="number of decode instances (y)")
    prefill_tp: int | None = Field(
        default=None, ge=1, description="TP size of a prefill instance (default: hardware tp_size)"
    )
    decode_tp: int | None = Field(
        default=None, ge=1, description="TP size of a decode instance (default: hardware tp_size)"
    )
    colocated: bool = Field(
        default=False,
        description="prefill and decode share a node: KV moves over NVLink, not the network",
    )
    expert_parallel: bool = Field(
        default=False,
        description="MoE models: spread each MoE layer's experts over an instance's ranks "
        "(vLLM --enable-expert-parallel) instead of slicing every expert",
    )
    routing: Literal["round_robin", "least_loaded"] = Field(
        default="round_robin", description="how the router picks instances among several"
    )


class EngineSettings(_Config):
    """vLLM engine settings, the same on prefill and decode (as in the published runs)."""

    max_num_seqs: int = Field(default=8, ge=1, description="running requests per engine step")
    max_num_batched_tokens: int = Field(
        default=8192, ge=1, description="token budget of one engine step"
    )
    chunked_prefill: bool = Field(
        default=True, description="split long prompts into chunks of at most the token budget"
    )
    block_size: int = Field(default=16, ge=1, description="tokens per KV block")
    max_model_len: int = Field(default=32768, ge=1, description="longest prompt + output allowed")
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0.0, le=1.0, description="share of device memory vLLM may use"
    )
    pool_run_blocks: float | None = Field(
        default=None, gt=1.0,
        description="what-if only (no bundled scenario sets it): a synthetic history of a "
        "decode server's block pool, the mean length, in blocks, of the contiguous runs it "
        "hands out. Null (the default): the runs are what the simulated allocator hands out "
        "under the workload. Descriptors per transfer = runs x layers x 2, so this sets what "
        "a transfer costs to prepare and post",
    )
    pool_history: Literal["none", "sweep"] = Field(
        default="none",
        description="what the instances served before a sweep point's own requests. none: a "
        "fresh server per point. sweep: the same servers ran the sweep's earlier points of the "
        "same mode first (ascending input length, then output length, then rate, as a "
        "`vllm bench serve` sweep is run), each to completion, as unmeasured warm-up, so the "
        "block pools start the point in the state that history left them",
    )
    block_reuse: Literal["lifo", "fifo"] = Field(
        default="lifo",
        description="where vLLM's block pool puts a freed block that has no prefix-cache hash: "
        "lifo = the front (vLLM 0.32: the next request reuses the last one's blocks, in reverse "
        "order), fifo = the back (earlier V1 releases). Sets how contiguous transfers are",
    )
    cuda_graph_max_batch: int | None = Field(
        default=None, ge=0,
        description="largest decode-only batch vLLM replays from a captured CUDA graph. Null "
        "(the default): vLLM's own choice, min(2 x max_num_seqs, 512) (vLLM 0.25); 0: eager "
        "(--enforce-eager). Only a calibration with graph_step_overhead prices graph steps "
        "apart, and `kvplane calibrate live` fits one only when this is stated",
    )
    activation_reserve_bytes: float = Field(
        default=4.0e9, ge=0.0,
        description="per-device memory kept for activations, CUDA graphs and communication "
        "buffers (vLLM measures it in its profiling run) [B]",
    )

    @property
    def graph_batch(self) -> int:
        """Largest decode-only batch replayed from a CUDA graph (0: eager)."""
        if self.cuda_graph_max_batch is not None:
            return self.cuda_graph_max_batch
        return min(2 * self.max_num_seqs, 512)

    @model_validator(mode="after")
    def _budget(self) -> EngineSettings:
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked_prefill, max_num_batched_tokens must be >= max_model_len "
                f"({self.max_num_batched_tokens} < {self.max_model_len}), as vLLM requires"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        return self


# --- connector ----------------------------------------------------------------------------------


class PrefixCaching(_Config):
    """Automatic prefix caching, per side."""

    prefill: bool = Field(default=True, description="prefix caching on prefill instances")
    decode: bool = Field(default=False, description="prefix caching on decode instances")


class FixedLease(_Config):
    """Retained decode blocks live `decoder_kv_blocks_ttl` seconds, never renewed (published)."""

    kind: Literal["fixed"] = Field(default="fixed", description="lease policy tag")


class RenewableLease(_Config):
    """Retained decode blocks stay while heartbeats arrive (the authors' named next step)."""

    kind: Literal["renewable"] = Field(description="lease policy tag")
    heartbeat_interval_s: float = Field(
        default=5.0, gt=0.0, description="how often the holder renews the lease [s]"
    )
    extension_s: float = Field(
        default=20.0, gt=0.0, description="how far one heartbeat pushes the expiry [s]"
    )
    heartbeat_from: Literal["router", "device"] = Field(
        default="router", description="who sends heartbeats while the conversation is active"
    )
    idle_after_s: float = Field(
        default=60.0, gt=0.0,
        description="the heartbeat stops once a conversation has been idle this long [s]",
    )

    @model_validator(mode="after")
    def _renews_in_time(self) -> RenewableLease:
        if self.extension_s <= self.heartbeat_interval_s:
            raise ValueError("extension_s must exceed heartbeat_interval_s, or leases lapse")
        return self


Lease = Annotated[FixedLease | RenewableLease, Field(discriminator="kind")]


class ConnectorSettings(_Config):
    """The KV connector: transfer mode, bidirectional reuse, leases, prefix caching."""

    mode: Mode = Field(default="push", description="push (NixlPushConnector) or pull (stock)")
    bidirectional: bool = Field(
        default=False, description="bidirectional_kv_xfer: decode retains KV for prefill reuse"
    )
    decoder_kv_blocks_ttl: float = Field(
        default=480.0, gt=0.0, description="how long decode retains a finished request's KV [s]"
    )
    lease: Lease = Field(default_factory=FixedLease, description="retention lease policy")
    kv_recompute_threshold: int = Field(
        default=64, ge=0,
        description="prefill reads retained KV only if it supplies at least this many tokens",
    )
    prefix_caching: PrefixCaching = Field(
        default_factory=PrefixCaching, description="automatic prefix caching per side"
    )
    pull_reader_thread: bool = Field(
        default=False,
        description="pull mode prepares and posts reads on a reader thread (vLLM PR #45211) "
        "instead of inline in decode's engine loop",
    )
    handshake_at_start: bool = Field(
        default=True,
        description="instances have already met when the run starts (the published sweeps ran "
        "many points on long-lived servers), so the one-time NIXL handshake, seconds for a "
        "large pool, is not paid by the first request",
    )
    reuse_read_run_blocks: float | None = Field(
        default=None, ge=1.0,
        description="mean contiguous run, in blocks, of the retained blocks a D->P reuse read "
        "covers (null: the runs the core plans from the actual block ids). Retained KV is read "
        "long after it was written, from a pool that has churned since",
    )
    pull_hold_lease_s: float = Field(
        default=30.0, gt=0.0,
        description="kv_lease_duration: how long prefill holds blocks for a pulling decode [s]",
    )
    pull_hold_heartbeat_s: float = Field(
        default=5.0, gt=0.0, description="decode's heartbeat that extends the prefill hold [s]"
    )
    pull_hold_extension_s: float = Field(
        default=20.0, gt=0.0, description="how far one hold heartbeat extends the hold [s]"
    )
    transfer_staging: bool = Field(
        default=False,
        description="kvplane's transport: each transfer moves as its runs or staged (gathered "
        "into slots, one descriptor per slot, scattered), whichever the estimate of "
        "kvplane.core.transfer_method finds cheaper; posts are priced with the transfer",
    )
    transfer_ipc: Literal["off", "same-device", "peer-device"] = Field(
        default="off",
        description="prefill and decode on one host: kvplane's transport may copy a transfer's "
        "blocks with one kernel over CUDA IPC (same-device: one GPU; peer-device: two GPUs "
        "with peer access, capped by the link), when the same estimate finds it cheapest",
    )


# --- workloads ------------------------------------------------------------------------------------


class LengthSpec(_Config):
    """A token-count distribution. A bare integer in YAML means a fixed length."""

    mean: float = Field(ge=0.0, description="mean length [tokens]")
    dist: Literal["fixed", "uniform", "exponential", "lognormal"] = Field(
        default="fixed", description="distribution shape"
    )
    range_ratio: float = Field(
        default=0.0, ge=0.0, lt=1.0,
        description="uniform: lengths in [mean(1-r), mean(1+r)] (vllm bench --random-range-ratio)",
    )
    sigma: float = Field(default=0.5, gt=0.0, description="lognormal: sigma of the log")
    min: int = Field(default=0, ge=0, description="lower clip [tokens]")
    max: int | None = Field(default=None, ge=0, description="upper clip [tokens]")

    @model_validator(mode="before")
    @classmethod
    def _bare_int(cls, data: Any) -> Any:
        if isinstance(data, bool):
            return data
        if isinstance(data, (int, float)):
            return {"mean": data}
        return data

    @model_validator(mode="after")
    def _bounds(self) -> LengthSpec:
        if self.max is not None and self.max < self.min:
            raise ValueError("max must be >= min")
        return self

    def upper_bound(self) -> float:
        """The largest length this spec can produce (inf when unbounded)."""
        if self.max is not None:
            return float(self.max)
        if self.dist == "fixed":
            return max(self.mean, float(self.min))
        if self.dist == "uniform":
            return max(self.mean * (1.0 + self.range_ratio), float(self.min))
        return float("inf")

    def with_mean(self, mean: float) -> LengthSpec:
        return self.model_copy(update={"mean": float(mean)})


class PoissonWorkload(_Config):
    """Open-loop arrivals at a rate, like `vllm bench serve` (random dataset)."""

    kind: Literal["poisson"] = Field(description="workload tag")
    qps: float = Field(default=1.0, gt=0.0, description="request rate [1/s] (sweep.qps overrides)")
    input_len: LengthSpec = Field(
        default_factory=lambda: LengthSpec(mean=1024), description="prompt tokens (sweep overrides)"
    )
    output_len: LengthSpec = Field(
        default_factory=lambda: LengthSpec(mean=128), description="output tokens (sweep overrides)"
    )
    burstiness: float = Field(
        default=1.0, gt=0.0,
        description="gamma shape of inter-arrival times (1 = Poisson), as vllm bench --burstiness",
    )
    shared_prefix_fraction: float = Field(
        default=0.0, ge=0.0, lt=1.0,
        description="leading share of every prompt that is identical across requests (what "
        "prefix caching on prefill can hit)",
    )


class MultiTurnWorkload(_Config):
    """Conversations whose every turn resends the growing history (agentic multi-turn chat).

    Turn k's prompt = turn k-1's prompt + its output + the new user message + tool output,
    where tool output = tool_output_tokens + tool_output_fraction x (history so far).
    """

    kind: Literal["multi_turn"] = Field(description="workload tag")
    conversation_rate: float = Field(
        default=0.1, gt=0.0, description="new conversations per second (sweep.qps overrides)"
    )
    turns: LengthSpec = Field(
        default_factory=lambda: LengthSpec(mean=5), description="turns per conversation"
    )
    first_prompt: LengthSpec = Field(
        default_factory=lambda: LengthSpec(mean=1024),
        description="prompt tokens of the first turn (sweep.input_lens overrides the mean)",
    )
    user_tokens: LengthSpec = Field(
        default_factory=lambda: LengthSpec(mean=128), description="new user tokens per later turn"
    )
    tool_output_tokens: LengthSpec = Field(
        default_factory=lambda: LengthSpec(mean=0), description="tool output tokens per later turn"
    )
    tool_output_fraction: float = Field(
        default=0.0, ge=0.0,
        description="extra tool output per turn as a share of the history so far (file reads, "
        "search results that grow with the task)",
    )
    output_len: LengthSpec = Field(
        default_factory=lambda: LengthSpec(mean=256),
        description="output tokens per turn (sweep.output_lens overrides the mean)",
    )
    think_time_s: float = Field(
        default=5.0, ge=0.0, description="mean pause between a turn's end and the next turn [s]"
    )
    think_time_dist: Literal["fixed", "exponential"] = Field(
        default="exponential", description="shape of the think-time distribution"
    )
    shared_prefix_tokens: int = Field(
        default=0, ge=0, description="system prompt shared by every conversation [tokens]"
    )
    max_prompt_tokens: int | None = Field(
        default=None, ge=1,
        description="end a conversation before a prompt would exceed this (default: "
        "engine.max_model_len minus the turn's output)",
    )


class TraceWorkload(_Config):
    """Replay of a Mooncake-style JSONL trace: timestamp [ms], input_length, output_length,
    hash_ids (one per `hash_block_tokens` prompt tokens)."""

    kind: Literal["trace"] = Field(description="workload tag")
    path: str = Field(description="trace file; relative paths are relative to the scenario file")
    time_scale: float = Field(
        default=1.0, gt=0.0, description="multiply every timestamp (0.5 = twice as fast)"
    )
    hash_block_tokens: int = Field(
        default=512, ge=1, description="prompt tokens covered by one hash id (Mooncake: 512)"
    )


Workload = Annotated[
    PoissonWorkload | MultiTurnWorkload | TraceWorkload, Field(discriminator="kind")
]

# Which sweep axes mean something for which workload kind.
_AXES_FOR: dict[str, frozenset[str]] = {
    "poisson": frozenset({"qps", "input_lens", "output_lens"}),
    "multi_turn": frozenset({"qps", "input_lens", "output_lens"}),
    "trace": frozenset(),
}


# --- sweep, assumptions, published figures -------------------------------------------------------


class Sweep(_Config):
    """Axes to sweep; an axis left out keeps the scenario's own value."""

    qps: list[Annotated[float, Field(gt=0.0)]] | None = Field(
        default=None, description="request rates (multi_turn: new conversations per second)"
    )
    input_lens: list[Annotated[int, Field(ge=1)]] | None = Field(
        default=None, description="prompt lengths (multi_turn: first-turn prompt)"
    )
    output_lens: list[Annotated[int, Field(ge=1)]] | None = Field(
        default=None, description="output lengths"
    )
    modes: list[Mode] | None = Field(default=None, description="connector modes")
    bidirectional: list[bool] | None = Field(default=None, description="reuse off / on")
    iterations: int = Field(default=1, ge=1, description="repeats of every point (new seed each)")

    @model_validator(mode="after")
    def _no_empty_or_duplicate(self) -> Sweep:
        for name in ("qps", "input_lens", "output_lens", "modes", "bidirectional"):
            values = getattr(self, name)
            if values is None:
                continue
            if not values:
                raise ValueError(f"{name}: an axis needs at least one value (or leave it out)")
            if len(set(values)) != len(values):
                raise ValueError(f"{name}: values repeat: {values}")
        return self


class Assumption(_Config):
    """One choice the published articles leave open, and why this scenario makes it."""

    topic: str = Field(description="what is unknown, e.g. 'output length'")
    choice: str = Field(description="what this scenario assumes")
    why: str = Field(description="the reason, or the evidence behind the choice")


_WHERE_KEYS = frozenset({
    "mode", "qps", "input_len", "output_len", "bidirectional", "prompt_tokens", "load",
    "descriptors", "model",
})
WhereValue = str | int | float | bool
PUBLISHED_FILE = "published.yaml"


def where_matches(where: dict[str, Any], **point: Any) -> bool:
    """Whether a point's axes satisfy a figure's `where` (a list: any of its values); axes the
    point does not have are not checked."""
    for key, want in where.items():
        if key not in point:
            continue
        have = point[key]
        if isinstance(want, list):
            if have not in want:
                return False
        elif have != want:
            return False
    return True


class PublishedFigure(_Config):
    """One published number (or range, or ratio of two others) and the points it belongs to.

    Figures live in `scenarios/published.yaml` (described in docs/published.md), never in code.
    """

    id: str = Field(description="stable name; calibration records cite figures by it")
    metric: Literal[
        "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "prefill_ms", "kv_transfer_ms",
        "throughput_rps", "ttft_speedup", "tpot_speedup", "post_ms",
    ] = Field(description="what was measured (speedups: baseline / improved)")
    value: float | None = Field(default=None, description="the figure, when a single number")
    low: float | None = Field(default=None, description="lower end, when a range")
    high: float | None = Field(default=None, description="upper end, when a range")
    ratio_of: tuple[str, str] | None = Field(
        default=None,
        description="a speedup read off two other figures of the study: [baseline, improved] "
        "ids; `value`, unless stated, is filled in from them when the file is loaded",
    )
    stat: Literal["mean", "median", "p90", "p99"] = Field(
        default="mean", description="statistic (the articles report means unless stated)"
    )
    where: dict[str, WhereValue | list[WhereValue]] = Field(
        default_factory=dict,
        description="which points it applies to: mode, qps, input_len, output_len, "
        "bidirectional, prompt_tokens (bucket of turns by prompt length), load, descriptors, "
        "model; a list means each of its values",
    )
    tolerance: float | None = Field(
        default=None, gt=0.0,
        description="relative distance a prediction may have and still pass (the project's "
        "choice); none: shown with its error, never a verdict",
    )
    source: str = Field(description="the article, PR or section it comes from")
    note: str = Field(default="", description="how to read it")

    @model_validator(mode="after")
    def _value_or_range(self) -> PublishedFigure:
        given = sum((self.value is not None or self.ratio_of is not None,
                     self.low is not None or self.high is not None))
        if self.ratio_of is not None and self.value is None:
            raise ValueError("a ratio figure is resolved by its study (load_published)")
        if self.ratio_of is not None and (self.low is not None or self.high is not None):
            raise ValueError("a ratio figure has a value, not a range")
        if given != 1:
            raise ValueError("give exactly one of: value, low and high, or ratio_of")
        if (self.low is None) != (self.high is None):
            raise ValueError("a range needs both low and high")
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError("low must be <= high")
        unknown = set(self.where) - _WHERE_KEYS
        if unknown:
            raise ValueError(f"where: unknown keys {sorted(unknown)}; allowed {sorted(_WHERE_KEYS)}")
        return self

    def matches(self, **point: Any) -> bool:
        """Whether a point with these axes is one the figure applies to."""
        return where_matches(self.where, **point)


class Published(_Config):
    """One published study: where its figures come from and the figures themselves."""

    study: str = Field(default="", description="key of the study in scenarios/published.yaml")
    title: str = Field(default="", description="what the study measured")
    source: str = Field(description="where the figures come from (docs/published.md section)")
    scenario: str | None = Field(
        default=None, description="the bundled scenario that reproduces the study, if any"
    )
    baseline: dict[str, WhereValue] = Field(
        default_factory=dict, description="the axes of a speedup's baseline, e.g. {mode: pull}"
    )
    improved: dict[str, WhereValue] = Field(
        default_factory=dict, description="the axes of a speedup's improved side"
    )
    prompt_bucket: float = Field(
        default=0.25, gt=0.0, lt=1.0,
        description="a `prompt_tokens` selector matches turns within this relative distance",
    )
    figures: list[PublishedFigure] = Field(description="the figures")
    claims: list[str] = Field(default_factory=list, description="qualitative published claims")

    @model_validator(mode="before")
    @classmethod
    def _ratios_resolve(cls, data: Any) -> Any:
        """Fill a ratio figure's `value` from the two figures it names (baseline / improved)."""
        if not isinstance(data, dict) or not isinstance(data.get("figures"), list):
            return data
        figs = [dict(f) if isinstance(f, dict) else f for f in data["figures"]]
        by = {f.get("id"): f for f in figs if isinstance(f, dict)}
        for f in figs:
            if not isinstance(f, dict) or f.get("ratio_of") is None:
                continue
            pair = f["ratio_of"]
            got = [by.get(i) for i in pair] if isinstance(pair, (list, tuple)) else []
            values = [g.get("value") for g in got if isinstance(g, dict)]
            if len(values) != 2 or not all(isinstance(v, (int, float)) for v in values):
                raise ValueError(f"{f.get('id')}: ratio_of needs two single-valued figures of "
                                 f"the study, got {pair!r}")
            if f.get("value") is None:  # a stated ratio (e.g. "1.6x") is kept as stated
                f["value"] = float(values[0]) / float(values[1])
        return {**data, "figures": figs}

    @model_validator(mode="after")
    def _unique_ids(self) -> Published:
        ids = [f.id for f in self.figures]
        if len(set(ids)) != len(ids):
            raise ValueError(f"figure ids repeat: {sorted(i for i in set(ids) if ids.count(i) > 1)}")
        return self

    def figure(self, figure_id: str) -> PublishedFigure:
        for f in self.figures:
            if f.id == figure_id:
                return f
        raise LookupError(f"study {self.study!r} has no figure {figure_id!r}")


def load_published() -> dict[str, Published]:
    """Every published study, from `kvplane.scenarios/published.yaml` (docs/published.md)."""
    file = f"scenarios/{PUBLISHED_FILE}"
    text = resources.files(_SCENARIOS_PACKAGE).joinpath(PUBLISHED_FILE).read_text(
        encoding="utf-8")
    data, positions = read_yaml(text, file)
    studies = data.get("studies") if isinstance(data, dict) else None
    if not isinstance(studies, dict):
        raise ScenarioError(file, [("studies", "a mapping of study name to study", None, 1)])
    out: dict[str, Published] = {}
    for name, body in studies.items():
        try:
            out[name] = Published.model_validate({**body, "study": name})
        except ValidationError as exc:
            raise scenario_error_from_validation(exc, file, positions, ("studies", name),
                                                 Published) from None
    return out


def _resolve_published(value: Any, file: str, positions: _Positions | None) -> Any:
    """A scenario names its study (`published: {study: NAME}` or `published: NAME`); the
    figures come from scenarios/published.yaml, so no scenario types a published number."""
    if isinstance(value, dict) and "figures" in value:
        return value  # a study already resolved, e.g. a scenario recorded with a run
    name = value.get("study") if isinstance(value, dict) else value
    if not isinstance(name, str):
        return value
    if isinstance(value, dict) and set(value) - {"study"}:
        line = positions.line_of(("published",)) if positions else None
        expected = ("only `study: NAME` (the figures live in scenarios/published.yaml, see "
                    "docs/published.md)")
        raise ScenarioError(file, [("published", expected, _short(sorted(value)), line)])
    studies = load_published()
    if name not in studies:
        line = positions.line_of(("published",)) if positions else None
        raise ScenarioError(file, [("published.study", f"one of {sorted(studies)}",
                                    repr(name), line)])
    return studies[name]


# --- the scenario ---------------------------------------------------------------------------------


class Profiles(_Config):
    """The model and hardware profiles (names are resolved by `load_scenario`)."""

    model: ModelProfile = Field(description="model profile: a bundled name, a path, or inline")
    hardware: HardwareProfile = Field(
        description="hardware profile: a bundled name, a path, or inline"
    )
    calibration: CalibrationProfile | None = Field(
        default=None,
        description="efficiencies of this (model kind, hardware) pair: a bundled name, a path, "
        "or inline (default: the bundled calibration made for them, see `kvplane calibrate fit`)",
    )

    @model_validator(mode="before")
    @classmethod
    def _names_need_loading(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in ("model", "hardware"):
                if isinstance(data.get(key), str):
                    raise ValueError(  # noqa: TRY004 - pydantic reports ValueError only
                        f"{key}: profile names are resolved by load_scenario / scenario_from_data;"
                        " building Profiles directly needs profile objects"
                    )
        return data


@dataclass(frozen=True, slots=True)
class Point:
    """One concrete point of a sweep."""

    index: int
    mode: Mode
    bidirectional: bool
    qps: float | None
    input_len: int | None
    output_len: int | None
    iteration: int
    seed: int
    scenario: Scenario
    # engine.pool_history "sweep": the points the same servers ran before this one, in order
    history: tuple[Point, ...] = ()

    @property
    def label(self) -> str:
        """`<mode>_qps<q>_in<in>_out<out>_iter<i>` like the published result files."""
        parts: list[str] = [self.mode]
        if self.bidirectional:
            parts.append("bidi")
        if self.qps is not None:
            parts.append(f"qps{self.qps:g}")
        if self.input_len is not None:
            parts.append(f"in{self.input_len}")
        if self.output_len is not None:
            parts.append(f"out{self.output_len}")
        parts.append(f"iter{self.iteration}")
        return "_".join(parts)


class Scenario(_Config):
    """One experiment: cluster, profiles, engine, connector, workload, sweep, assumptions."""

    name: str = Field(description="short name of the scenario")
    description: str = Field(default="", description="what it is for")
    seed: int = Field(default=0, ge=0, description="base seed of every random draw")
    requests: int = Field(gt=0, description="requests per sweep point")
    warmup_requests: int = Field(
        default=0, ge=0, description="requests run first and left out of the statistics"
    )
    cluster: Cluster = Field(default_factory=Cluster, description="xPyD shape and TP sizes")
    profiles: Profiles = Field(description="model and hardware profiles")
    engine: EngineSettings = Field(default_factory=EngineSettings, description="vLLM settings")
    connector: ConnectorSettings = Field(
        default_factory=ConnectorSettings, description="KV connector settings"
    )
    workload: Workload = Field(description="request generator (kind: poisson|multi_turn|trace)")
    sweep: Sweep = Field(default_factory=Sweep, description="axes to sweep")
    assumptions: list[Assumption] = Field(
        default_factory=list, description="every choice the published articles leave open"
    )
    published: Published | None = Field(default=None, description="figures to compare against")

    @property
    def model(self) -> ModelProfile:
        return self.profiles.model

    @property
    def hardware(self) -> HardwareProfile:
        return self.profiles.hardware

    @property
    def prefill_tp(self) -> int:
        return self.cluster.prefill_tp or self.hardware.node.tp_size.value

    @property
    def decode_tp(self) -> int:
        return self.cluster.decode_tp or self.hardware.node.tp_size.value

    @property
    def link(self) -> Literal["network", "nvlink"]:
        """The KV path between prefill and decode."""
        return "nvlink" if self.cluster.colocated else "network"

    @model_validator(mode="after")
    def _coherent(self) -> Scenario:
        devices = self.hardware.node.devices_per_node.value
        for side, tp in (("prefill_tp", self.prefill_tp), ("decode_tp", self.decode_tp)):
            if tp > devices:
                raise ValueError(
                    f"cluster.{side}={tp} exceeds {self.hardware.name}'s {devices} devices per node"
                )
        if self.cluster.colocated:
            if "nvlink" not in self.hardware.links:
                raise ValueError(f"cluster.colocated needs an 'nvlink' link in {self.hardware.name}")
            if self.prefill_tp + self.decode_tp > devices:
                raise ValueError("cluster.colocated: prefill_tp + decode_tp exceed one node")
        kind = self.workload.kind
        allowed = _AXES_FOR[kind]
        for axis in ("qps", "input_lens", "output_lens"):
            if getattr(self.sweep, axis) is not None and axis not in allowed:
                raise ValueError(f"sweep.{axis} does not apply to a {kind!r} workload")
        longest_in = max(self.sweep.input_lens or [0])
        longest_out = max(self.sweep.output_lens or [0])
        if isinstance(self.workload, PoissonWorkload):
            longest_in = max(longest_in, int(self.workload.input_len.upper_bound())
                             if not self.sweep.input_lens else 0)
            longest_out = max(longest_out, int(self.workload.output_len.upper_bound())
                              if not self.sweep.output_lens else 0)
        if longest_in + longest_out > self.engine.max_model_len:
            raise ValueError(
                f"input {longest_in} + output {longest_out} tokens exceed engine.max_model_len "
                f"{self.engine.max_model_len}"
            )
        return self

    # -- sweep ---------------------------------------------------------------------------------

    def points(self) -> list[Point]:
        """Expand the sweep into concrete points (mode outermost, iteration innermost)."""
        sweep = self.sweep
        modes: list[Mode] = list(sweep.modes) if sweep.modes else [self.connector.mode]
        bidis = list(sweep.bidirectional) if sweep.bidirectional else [self.connector.bidirectional]
        qpss: list[float | None] = list(sweep.qps) if sweep.qps else [None]
        ins: list[int | None] = list(sweep.input_lens) if sweep.input_lens else [None]
        outs: list[int | None] = list(sweep.output_lens) if sweep.output_lens else [None]
        points: list[Point] = []
        grid = itertools.product(modes, bidis, qpss, ins, outs, range(sweep.iterations))
        for index, (mode, bidi, qps, inp, out, it) in enumerate(grid):
            scenario = self._concrete(mode, bidi, qps, inp, out)
            points.append(Point(
                index=index, mode=mode, bidirectional=bidi,
                qps=qps if qps is not None else _base_qps(self.workload),
                input_len=inp, output_len=out, iteration=it,
                seed=_point_seed(self.seed, qps, inp, out, it),
                scenario=scenario,
            ))
        if self.engine.pool_history == "sweep":
            points = _with_history(points)
        return points

    def _concrete(self, mode: Mode, bidi: bool, qps: float | None, inp: int | None,
                  out: int | None) -> Scenario:
        connector = self.connector.model_copy(update={"mode": mode, "bidirectional": bidi})
        workload: PoissonWorkload | MultiTurnWorkload | TraceWorkload = self.workload
        if isinstance(workload, PoissonWorkload):
            update: dict[str, Any] = {}
            if qps is not None:
                update["qps"] = qps
            if inp is not None:
                update["input_len"] = workload.input_len.with_mean(inp)
            if out is not None:
                update["output_len"] = workload.output_len.with_mean(out)
            workload = workload.model_copy(update=update)
        elif isinstance(workload, MultiTurnWorkload):
            update = {}
            if qps is not None:
                update["conversation_rate"] = qps
            if inp is not None:
                update["first_prompt"] = workload.first_prompt.with_mean(inp)
            if out is not None:
                update["output_len"] = workload.output_len.with_mean(out)
            workload = workload.model_copy(update=update)
        return self.model_copy(
            update={"connector": connector, "workload": workload, "sweep": Sweep()}
        )


def _sweep_order(p: Point) -> tuple[int, int, int, float]:
    """The order a `vllm bench serve` sweep runs its points on one deployment: per iteration,
    ascending input length, then output length, then request rate."""
    return (p.iteration, p.input_len or 0, p.output_len or 0, p.qps or 0.0)


def _with_history(points: list[Point]) -> list[Point]:
    """Each point with the points of the same deployment (mode, bidirectional) run before it."""
    out: list[Point] = []
    for p in points:
        same = sorted((q for q in points if (q.mode, q.bidirectional) == (p.mode, p.bidirectional)),
                      key=_sweep_order)
        at = [q.index for q in same].index(p.index)
        out.append(replace(p, history=tuple(same[:at])))
    return out


def _base_qps(workload: PoissonWorkload | MultiTurnWorkload | TraceWorkload) -> float | None:
    if isinstance(workload, PoissonWorkload):
        return workload.qps
    if isinstance(workload, MultiTurnWorkload):
        return workload.conversation_rate
    return None


def _point_seed(seed: int, qps: float | None, inp: int | None, out: int | None, it: int) -> int:
    key = f"{seed}|{qps!r}|{inp!r}|{out!r}|{it}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


# --- loading --------------------------------------------------------------------------------------

_SCENARIOS_PACKAGE = "kvplane.scenarios"


def bundled_scenario_names() -> list[str]:
    """Names of the scenarios shipped in kvplane.scenarios (the *.yaml next to its __init__)."""
    folder = resources.files(_SCENARIOS_PACKAGE)
    return sorted(e.name[:-5] for e in folder.iterdir()
                  if e.name.endswith(".yaml") and e.name != PUBLISHED_FILE)


def _is_path(path_or_name: str | Path) -> bool:
    text = str(path_or_name)
    return isinstance(path_or_name, Path) or "/" in text or text.endswith((".yaml", ".yml"))


def load_scenario(path_or_name: str | Path) -> Scenario:
    """Read and validate a scenario file, or a bundled scenario given by name.

    Raises ScenarioError naming the file, the dotted field (with its line) and what was expected,
    for YAML syntax errors, unknown profile names, wrong types, unknown fields and incoherent
    settings.
    """
    if _is_path(path_or_name):
        path = Path(path_or_name)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ScenarioError(str(path), [("", "a readable scenario file", str(exc), None)]) \
                from None
        file, base_dir = str(path), path.parent
    else:
        name = str(path_or_name)
        entry = resources.files(_SCENARIOS_PACKAGE).joinpath(f"{name}.yaml")
        if not entry.is_file():
            names = ", ".join(bundled_scenario_names()) or "(none)"
            raise ScenarioError(name, [("", f"a scenario file path or a bundled name ({names})",
                                        None, None)])
        text, file = entry.read_text(encoding="utf-8"), f"scenarios/{name}.yaml"
        base_dir = Path(str(resources.files(_SCENARIOS_PACKAGE)))
    data, positions = read_yaml(text, file)
    return scenario_from_data(data, file=file, base_dir=base_dir, positions=positions)


def scenario_from_data(
    data: Any,
    file: str = "<scenario>",
    base_dir: Path | None = None,
    positions: _Positions | None = None,
) -> Scenario:
    """Validate parsed scenario data: resolve profile names and relative paths, then check."""
    if not isinstance(data, dict):
        raise ScenarioError(file, [("", "a mapping at the top of the scenario", _short(data), 1)])
    data = dict(data)
    if data.get("published") is not None:
        data["published"] = _resolve_published(data["published"], file, positions)
    profiles = data.get("profiles")
    if isinstance(profiles, dict):
        data["profiles"] = _resolve_profiles(profiles, file, base_dir, positions)
    workload = data.get("workload")
    if (
        isinstance(workload, dict)
        and workload.get("kind") == "trace"
        and isinstance(workload.get("path"), str)
        and base_dir is not None
        and not Path(workload["path"]).is_absolute()
    ):
        data["workload"] = {**workload, "path": str(base_dir / workload["path"])}
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise scenario_error_from_validation(exc, file, positions, root=Scenario) from None


def _resolve_profiles(
    profiles: dict[str, Any], file: str, base_dir: Path | None, positions: _Positions | None
) -> dict[str, Any]:
    out = dict(profiles)
    for key in ("model", "hardware", "calibration"):
        if key not in profiles:
            continue  # pydantic reports the missing field
        value = profiles[key]
        where = ("profiles", key)
        line = positions.line_of(where) if positions else None
        if isinstance(value, str):
            target: str | Path = value
            if _is_path(value) and base_dir is not None and not Path(value).is_absolute():
                target = base_dir / value
            try:
                out[key] = load_profile(target, kind=key)
            except ScenarioError as exc:
                if exc.problems and exc.problems[0][0] == "" and not _is_path(value):
                    from .profiles import bundled_profile_names

                    names = ", ".join(bundled_profile_names(key))
                    raise ScenarioError(file, [(
                        f"profiles.{key}",
                        (f"the name of a bundled {key} profile ({names}), "
                         "a path to a profile file, or an inline profile"),
                        repr(value), line,
                    )]) from None
                raise
        elif isinstance(value, dict):
            out[key] = profile_from_data(value, file, positions, key, where)
        elif value is None and key == "calibration":
            continue
        else:
            raise ScenarioError(file, [(
                f"profiles.{key}", "a profile name, a path, or an inline profile mapping",
                _short(value), line,
            )])
    return out
