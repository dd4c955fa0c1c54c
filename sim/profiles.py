"""Model and hardware profiles: the physical constants the cost models are built from.

Rules kept here:
- Every numeric constant is a `Sourced` value, written in YAML as `{value: ..., source: "..."}`
  (optionally with `unit:`). A bare number is an error, and so is a source that does not say
  what kind of evidence it is: `datasheet:`, `config:` (a model's published config.json),
  `published:` (a published measurement), `measured:` (a measurement made here, docs/published.md section 4
  or `kvplane calibrate`), `calibrated:` (fitted to published figures in docs/calibration.md),
  `derived:` (computed from other sourced constants) or `synthetic:` (test-only profiles).
- Units are SI base units: seconds, bytes, bytes per second, FLOP per second. A field that has a
  unit declares it; a `unit:` written in the file must match it, so a GB/s-vs-Gb/s slip is caught.
- Profiles are frozen pydantic models with `extra="forbid"`. Building one does no I/O; reading a
  file is `load_profile`, which raises `ScenarioError` naming the file, the dotted field and what
  was expected. Bundled profiles live in `kvplane.scenarios/profiles/<name>.yaml`.
- A profile describes a thing (a model, a machine); how a scenario uses it (how many instances,
  which connector mode) is the scenario's business (sim/config.py).
"""

from __future__ import annotations

import itertools
import re
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "DTYPE_BYTES",
    "SOURCE_KINDS",
    "CalibrationProfile",
    "Fitted",
    "HardwareProfile",
    "HostSlowdown",
    "HostState",
    "LinkProfile",
    "MLASpec",
    "MoESpec",
    "ModelProfile",
    "ScenarioChoice",
    "ScenarioError",
    "Sourced",
    "SourcedInt",
    "SparseAttentionSpec",
    "bundled_profile_names",
    "load_profile",
    "read_yaml",
    "scenario_error_from_validation",
]

SOURCE_KINDS: tuple[str, ...] = (
    "datasheet", "config", "published", "measured", "calibrated", "derived", "synthetic",
)
_SOURCE_RE = re.compile(rf"^({'|'.join(SOURCE_KINDS)}):\s*\S")

DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5, "fp4": 0.5,
}
Dtype = Literal["fp32", "bf16", "fp16", "fp8", "int8", "int4", "fp4"]


# --- errors ---------------------------------------------------------------------------------------


class ScenarioError(ValueError):
    """A scenario or profile file is wrong: names the file, the field and what was expected.

    `problems` holds one `(field, expected, got, line)` tuple per mistake; `str()` lists them all,
    one per line, as `file:line: field: expected ..., got ...`.
    """

    def __init__(
        self, file: str, problems: list[tuple[str, str, str | None, int | None]]
    ) -> None:
        self.file = file
        self.problems = problems
        lines = []
        for field, expected, got, line in problems:
            where = f"{file}:{line}" if line else file
            what = f"{field}: " if field else ""
            tail = f", got {got}" if got is not None else ""
            lines.append(f"{where}: {what}expected {expected}{tail}")
        super().__init__("\n".join(lines))

    @property
    def field(self) -> str:
        """The dotted path of the first problem (the one most callers want to show)."""
        return self.problems[0][0] if self.problems else ""


# --- YAML with positions --------------------------------------------------------------------------


class _Positions:
    """Line numbers of the nodes of one YAML document, keyed by path tuple."""

    def __init__(self) -> None:
        self.lines: dict[tuple[str | int, ...], int] = {}

    def walk(self, node: yaml.Node, path: tuple[str | int, ...]) -> None:
        self.lines[path] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                name = key.value if isinstance(key, yaml.ScalarNode) else str(key)
                self.walk(value, (*path, name))
                # point at the key, which is where a reader looks for the field
                self.lines[(*path, name)] = key.start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self.walk(item, (*path, i))

    def line_of(self, path: tuple[str | int, ...]) -> int | None:
        """The line of `path`, or of its deepest ancestor present in the file."""
        for end in range(len(path), -1, -1):
            line = self.lines.get(path[:end])
            if line is not None:
                return line
        return None


# libyaml's parser where PyYAML was built with it (about ten times faster: the bundled
# profiles are read at every simulation's start), the pure-Python one otherwise; both safe
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_yaml(text: str, file: str) -> tuple[Any, _Positions]:
    """Parse one YAML document; a syntax error becomes a ScenarioError with its line number."""
    try:
        data = yaml.load(text, Loader=_Loader)
        node = yaml.compose(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        col = f", column {mark.column + 1}" if mark is not None else ""
        problem = exc.problem or exc.context or "malformed YAML"
        raise ScenarioError(file, [("", f"valid YAML ({problem}{col})", None, line)]) from None
    except yaml.YAMLError as exc:
        raise ScenarioError(file, [("", f"valid YAML ({exc})", None, None)]) from None
    positions = _Positions()
    if node is not None:
        positions.walk(node, ())
    return data, positions


# --- pydantic errors to ScenarioError -------------------------------------------------------------

# Union members that pydantic puts into `loc`; they are not fields the user wrote.
_TAG_SEGMENTS = frozenset({
    "poisson", "multi_turn", "trace", "fixed", "renewable",
    "function-after", "function-before", "function-wrap", "function-plain",
})


def _clean_loc(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    out: list[int | str] = []
    for seg in loc:
        if isinstance(seg, str) and (
            seg in _TAG_SEGMENTS or seg.startswith(("function-", "tagged-union["))
        ):
            continue
        out.append(seg)
    return tuple(out)


def _dotted(prefix: tuple[int | str, ...], loc: tuple[int | str, ...]) -> str:
    text = ""
    for seg in (*prefix, *loc):
        if isinstance(seg, int):
            text += f"[{seg}]"
        else:
            text += f".{seg}" if text else str(seg)
    return text


def _expected(err: Any, allowed: list[str] | None) -> str:
    kind = err["type"]
    if kind == "missing":
        return "a value (this field is required)"
    if kind == "extra_forbidden":
        if allowed:
            return "no such field; allowed fields here: " + ", ".join(allowed)
        return "no such field"
    msg: str = err["msg"]
    for lead in ("Input should be ", "Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(lead)
    return msg


def _allowed_fields(root: type[BaseModel], loc: tuple[int | str, ...]) -> list[str] | None:
    """Best effort: the field names of the model at `loc[:-1]` (for 'no such field' hints)."""
    import typing

    model: Any = root
    for seg in loc[:-1]:
        if isinstance(seg, int):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        info = model.model_fields.get(seg)
        if info is None:
            # a tagged union member name sits in loc: pick that member
            return None
        model = _model_of(info.annotation, typing)
    if isinstance(model, type) and issubclass(model, BaseModel):
        return sorted(model.model_fields)
    return None


def _model_of(annotation: Any, typing: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _model_of(typing.get_args(annotation)[0], typing)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    models = [_model_of(a, typing) for a in args]
    models = [m for m in models if isinstance(m, type) and issubclass(m, BaseModel)]
    return models[0] if len(models) == 1 else None


def scenario_error_from_validation(
    exc: ValidationError,
    file: str,
    positions: _Positions | None = None,
    prefix: tuple[int | str, ...] = (),
    root: type[BaseModel] | None = None,
) -> ScenarioError:
    """Turn a pydantic ValidationError into a ScenarioError with dotted paths and line numbers."""
    problems: list[tuple[str, str, str | None, int | None]] = []
    seen: set[tuple[str, str]] = set()
    for err in exc.errors(include_url=False):
        loc = _clean_loc(tuple(err["loc"]))
        allowed = _allowed_fields(root, loc) if root is not None else None
        expected = _expected(err, allowed)
        got = None if err["type"] == "missing" else _short(err.get("input"))
        if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
            ctx = err.get("ctx") or {}
            loc = (*loc, str(ctx.get("discriminator", "kind")).strip("'"))
            expected = f"one of {ctx.get('expected_tags', '')}"
            got = _short(ctx.get("tag")) if err["type"] == "union_tag_invalid" else None
        field = _dotted(prefix, loc)
        if (field, expected) in seen:
            continue
        seen.add((field, expected))
        line = positions.line_of((*prefix, *loc)) if positions is not None else None
        problems.append((field, expected, got, line))
    return ScenarioError(file, problems)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --- sourced constants ----------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _check_sourced(data: Any) -> Any:
    if not isinstance(data, dict):
        raise ValueError(  # noqa: TRY004 - pydantic reports ValueError only
            f"a constant with its source, e.g. {{value: {data!r}, source: \"datasheet: ...\"}}"
            " (every constant cites a datasheet, a published or local measurement, or a fit)"
        )
    source = data.get("source")
    if not isinstance(source, str) or not source.strip():
        raise ValueError(
            "a `source:` next to the value (every constant cites its source: one of "
            + ", ".join(f"'{k}: ...'" for k in SOURCE_KINDS) + ")"
        )
    if not _SOURCE_RE.match(source.strip()):
        raise ValueError(
            f"a source starting with its kind, one of {', '.join(SOURCE_KINDS)} "
            f"(e.g. 'datasheet: NVIDIA H200 ...'), not {source!r}"
        )
    return data


class Sourced(_Strict):
    """A real-valued constant and the evidence for it."""

    value: float = Field(description="the number, in the SI unit of the field")
    source: str = Field(description="kind of evidence and where: 'datasheet: ...', 'measured: ...'")
    unit: str | None = Field(default=None, description="optional; must match the field's unit")

    @model_validator(mode="before")
    @classmethod
    def _need_source(cls, data: Any) -> Any:
        return _check_sourced(data)


class SourcedInt(_Strict):
    """An integer constant and the evidence for it."""

    value: int = Field(description="the integer")
    source: str = Field(description="kind of evidence and where")
    unit: str | None = Field(default=None, description="optional; must match the field's unit")

    @model_validator(mode="before")
    @classmethod
    def _need_source(cls, data: Any) -> Any:
        return _check_sourced(data)


class _Profile(_Strict):
    """Checks the optional `unit:` of every sourced field against the unit the field declares."""

    @model_validator(mode="after")
    def _units_match(self) -> _Profile:
        for name, info in type(self).model_fields.items():
            value = getattr(self, name)
            if not isinstance(value, (Sourced, SourcedInt, Fitted)) or value.unit is None:
                continue
            extra = info.json_schema_extra
            expected = extra.get("unit") if isinstance(extra, dict) else None
            if expected is not None and value.unit != expected:
                raise ValueError(f"{name}: unit {value.unit!r} where {expected!r} is expected")
        return self


def _u(unit: str, description: str, **kw: Any) -> Any:
    return Field(description=f"{description} [{unit}]", json_schema_extra={"unit": unit}, **kw)


# --- model profile --------------------------------------------------------------------------------


class MoESpec(_Profile):
    """Mixture-of-experts shape: which share of the weights one token touches."""

    num_experts: SourcedInt = Field(description="routed experts per MoE layer")
    experts_per_token: SourcedInt = Field(description="routed experts each token uses (top-k)")
    expert_params: Sourced = _u("params", "parameters in all routed experts of all layers")
    num_moe_layers: SourcedInt | None = _u(
        "layers", "layers whose MLP is an MoE (default: every layer)", default=None)


class MLASpec(_Profile):
    """Multi-head latent attention: one compressed latent (plus a shared rotary key) per token
    per layer is cached, the same on every TP rank, in one region per layer."""

    kv_lora_rank: SourcedInt = _u("elements", "width of the cached latent")
    qk_rope_head_dim: SourcedInt = _u("elements", "rotary key part, cached next to the latent")
    qk_nope_head_dim: SourcedInt = _u("elements", "per-head query/key width without rotary part")
    v_head_dim: SourcedInt = _u("elements", "per-head value width")


class SparseAttentionSpec(_Profile):
    """Sparse attention with a lightweight indexer (DeepSeek-V3.2 class): each query attends to
    at most `index_topk` keys that an indexer picks by scoring every key, with a cache of its own."""

    index_topk: SourcedInt = _u("tokens", "keys each query attends to at most")
    index_n_heads: SourcedInt = _u("heads", "indexer heads (scoring every key)")
    index_head_dim: SourcedInt = _u("elements", "indexer head width (also its cache per token)")
    index_dtype: Dtype = Field(default="fp8", description="dtype of the indexer's keys and cache")


class ModelProfile(_Profile):
    """A transformer's shape: what sets its FLOPs, weight bytes and KV bytes."""

    kind: Literal["model"] = Field(default="model", description="profile kind tag")
    name: str = Field(description="profile name, e.g. 'qwen3-32b'")
    description: str = Field(default="", description="what this is, in words")
    num_layers: SourcedInt = _u("layers", "decoder layers (each keeps its own K and V)")
    num_attention_heads: SourcedInt = _u("heads", "query heads")
    num_kv_heads: SourcedInt = _u("heads", "key/value heads (GQA groups)")
    head_dim: SourcedInt = _u("elements", "size of one attention head")
    hidden_size: SourcedInt = _u("elements", "residual stream width")
    intermediate_size: SourcedInt | None = _u("elements", "MLP width (documentation)", default=None)
    vocab_size: SourcedInt = _u("tokens", "vocabulary size (LM head cost)")
    total_params: Sourced = _u("params", "all parameters, embeddings included")
    active_params: Sourced = _u(
        "params", "parameters one token uses (dense: = total_params; MoE: fewer)"
    )
    embedding_params: Sourced = _u(
        "params", "input embedding + LM head parameters (not matmuls per prompt token)"
    )
    moe: MoESpec | None = Field(default=None, description="set for mixture-of-experts models")
    mla: MLASpec | None = Field(default=None, description="set for multi-head latent attention")
    sparse_attention: SparseAttentionSpec | None = Field(
        default=None, description="set for indexer-based sparse attention")
    weight_dtype: Dtype = Field(default="bf16", description="dtype of the weights")
    kv_dtype: Dtype = Field(default="bf16", description="dtype of the KV cache (apart from weights)")
    compute_dtype: Literal["bf16", "fp16", "fp8"] = Field(
        default="bf16", description="dtype of the matmuls: fp8 runs at the device's peak_flops_fp8")
    activation_dtype: Dtype = Field(
        default="bf16", description="dtype of activations (what TP all-reduces move)")

    @model_validator(mode="after")
    def _consistent(self) -> ModelProfile:
        if self.num_attention_heads.value % self.num_kv_heads.value:
            raise ValueError("num_attention_heads must be a multiple of num_kv_heads")
        if self.active_params.value > self.total_params.value:
            raise ValueError("active_params cannot exceed total_params")
        if self.embedding_params.value >= self.active_params.value:
            raise ValueError("embedding_params must be smaller than active_params")
        return self


# --- hardware profile -----------------------------------------------------------------------------


class DeviceSpec(_Profile):
    """One accelerator, from its datasheet."""

    name: str = Field(description="marketing name of the device")
    peak_flops_bf16: Sourced = _u("FLOP/s", "dense bf16/fp16 tensor throughput (no sparsity)")
    peak_flops_fp8: Sourced | None = _u("FLOP/s", "dense fp8 tensor throughput", default=None)
    hbm_bandwidth: Sourced = _u("B/s", "device memory bandwidth")
    hbm_capacity: Sourced = _u("B", "device memory capacity")


class NodeSpec(_Profile):
    devices_per_node: SourcedInt = _u("devices", "accelerators in one node")
    tp_size: SourcedInt = _u("devices", "tensor-parallel size an instance uses by default")


class TPCollective(_Profile):
    """All-reduce inside a tensor-parallel group (two per layer per forward pass)."""

    allreduce_latency: Sourced = _u("s", "fixed time of one small all-reduce")
    allreduce_bandwidth: Sourced = _u("B/s", "algorithm bandwidth of a large all-reduce")
    alltoall_bandwidth: Sourced | None = _u(
        "B/s", "per-device bandwidth of an expert-parallel all-to-all (default: the "
        "all-reduce's)", default=None)


class LinkProfile(_Profile):
    """One path KV can take between instances (network rails, or NVLink inside a node)."""

    name: str = Field(description="e.g. 'efa' or 'nvlink'")
    bandwidth_per_rail: Sourced = _u("B/s", "line rate of one rail")
    rails_per_device: SourcedInt = _u("rails", "rails one device's KV is registered on")
    utilization: Sourced | None = _u(
        "fraction", "share of the line rate a NIXL transfer reaches, when measured for the "
        "link itself (else the calibration's network_utilization)", default=None)
    latency: Sourced = _u("s", "one-way latency of a small message")
    post_fixed: Sourced = _u("s", "fixed cost of posting one transfer (on the posting thread)")
    post_per_descriptor: Sourced = _u("s", "posting cost per descriptor (on the posting thread)")
    wire_per_descriptor: Sourced = _u(
        "s", "per-descriptor execution cost on the transport once posted (message-rate bound)"
    )


class NixlCosts(_Profile):
    """NIXL agent costs: preparation, handshake, one-time set-up (docs/published.md section 4)."""

    prep_fixed: Sourced = _u("s", "make_prepped_xfer fixed cost per request")
    prep_per_descriptor: Sourced = _u("s", "make_prepped_xfer cost per descriptor")
    unprepped_per_descriptor: Sourced = _u(
        "s", "building descriptor lists + initialize_xfer per descriptor (no prepped handles)"
    )
    dlist_prep_per_descriptor: Sourced = _u(
        "s", "one-time preparation of a peer's descriptor list, per descriptor (at handshake)"
    )
    add_remote_agent: Sourced = _u("s", "loading a peer's agent metadata (first contact)")
    agent_init: Sourced = _u("s", "creating the NIXL agent (start-up, off the request path)")
    register_per_byte: Sourced = _u("s/B", "memory registration per byte (start-up)")


class HardwareProfile(_Profile):
    """A machine type as the simulator needs it: compute, memory, collectives, links, NIXL."""

    kind: Literal["hardware"] = Field(default="hardware", description="profile kind tag")
    name: str = Field(description="profile name, e.g. 'p5en-h200-tp8'")
    description: str = Field(default="", description="what this is, in words")
    device: DeviceSpec = Field(description="the accelerator")
    node: NodeSpec = Field(description="devices per node and default TP size")
    tp_collective: TPCollective = Field(description="all-reduce cost inside a TP group")
    links: dict[str, LinkProfile] = Field(
        description="KV paths by role: 'network' (between nodes) and optionally 'nvlink'"
    )
    nixl: NixlCosts = Field(description="NIXL preparation, handshake and set-up costs")

    @field_validator("links")
    @classmethod
    def _need_network(cls, links: dict[str, LinkProfile]) -> dict[str, LinkProfile]:
        unknown = set(links) - {"network", "nvlink"}
        if unknown:
            raise ValueError(f"links may be 'network' and 'nvlink', not {sorted(unknown)}")
        if "network" not in links:
            raise ValueError("links needs a 'network' entry (the path between nodes)")
        return links

    @model_validator(mode="after")
    def _tp_fits(self) -> HardwareProfile:
        if self.node.tp_size.value > self.node.devices_per_node.value:
            raise ValueError("node.tp_size cannot exceed node.devices_per_node")
        return self


# --- calibration profile ----------------------------------------------------------------------


class Fitted(_Strict):
    """A constant no datasheet gives, fitted to named published or measured figures."""

    value: float = Field(description="the number, in the SI unit of the field")
    source: str = Field(description="'calibrated: ...' (how it was fitted) or 'measured: ...'")
    unit: str | None = Field(default=None, description="optional; must match the field's unit")
    fitted_to: list[str] = Field(
        default_factory=list,
        description="ids of the figures (scenarios/published.yaml) this value was solved from; "
        "`kvplane validate` counts none of them as a prediction",
    )

    @model_validator(mode="before")
    @classmethod
    def _need_source(cls, data: Any) -> Any:
        return _check_sourced(data)


class ScenarioChoice(_Strict):
    """A scenario input the publications leave open, chosen with their figures in view."""

    scenario: str = Field(description="bundled scenario name")
    field: str = Field(description="dotted field of the scenario, e.g. 'workload.tool_output_fraction'")
    value: float | str | None = Field(default=None, description="the value chosen")
    why: str = Field(description="how it was chosen")
    fitted_to: list[str] = Field(default_factory=list, description="figure ids it was chosen from")


HopKind = Literal["request_leg", "response_leg", "prefill_step", "transfer", "first_token",
                  "decode_step"]


class HostSlowdown(_Strict):
    """How much a shared host slows one kind of hop of a request (a leg through the router, an
    engine step, a transfer, the first token's return): the distribution of (recorded hop
    duration / the hop's priced cost) over a recorded live run's hops of that kind: every
    recorded factor, ascending. The simulator draws one factor per hop, seeded, from the
    inverse CDF that puts the i-th of n at probability (i + 1/2) / n and interpolates between
    them, so every recorded factor weighs 1/n, the extremes too, and the draws keep the
    recorded mean. On a CPU shared with other work, every process gets a varying share of the
    cores, so a hop's wall time is its cost divided by that share.
    """

    quantiles: list[float] = Field(min_length=2, description="factors, ascending [1]")
    by_state: list[list[float]] = Field(
        default_factory=list, description="the same factors split by the host's state when "
        "the hop began (the calibration's `host_state` bins, lowest first), each ascending "
        "[1]; empty: not conditioned")
    source: str = Field(description="'calibrated: ...', how it was measured")
    fitted_to: list[str] = Field(default_factory=list, description="what it was measured from")

    @model_validator(mode="after")
    def _ascending(self) -> HostSlowdown:
        for q in (self.quantiles, *self.by_state):
            if len(q) < 2 or any(b < a for a, b in itertools.pairwise(q)) or q[0] < 0:
                raise ValueError("quantiles must be ascending and not negative (two at least)")
        return self


class HostState(_Strict):
    """What a shared host's state is, for a slowdown conditioned on it: the host's run queue
    (`procs_running` of /proc/stat: threads running or ready to run), sampled during a run
    and averaged over `window` seconds either side of a hop's start, cut into bins at `edges`.
    A hop's slowdown is then drawn from the factors recorded in its bin (`HostSlowdown.
    by_state`), given the run queue sampled while the simulated run is the recorded one; a run
    without samples draws from all of them (`quantiles`)."""

    signal: Literal["run_queue"] = Field(default="run_queue", description="what was sampled")
    window: float = Field(gt=0, description="half-width of the averaging window [s]")
    edges: list[float] = Field(min_length=1, description="bin edges of the averaged run "
                               "queue, ascending (n edges: n + 1 bins)")
    source: str = Field(description="'calibrated: ...', how the bins were chosen")
    fitted_to: list[str] = Field(default_factory=list, description="what it was measured from")

    @model_validator(mode="after")
    def _strictly_ascending(self) -> HostState:
        if any(b <= a for a, b in itertools.pairwise(self.edges)):
            raise ValueError("host_state edges must be strictly ascending")
        return self


def _not_fitted(name: str) -> Fitted:
    return Fitted(value=0.0, unit="s", source=f"derived: {name} not part of this calibration "
                  "(zero; its time is inside the fitted overheads)")


class CalibrationProfile(_Profile):
    """Efficiencies and engine costs of one (model kind, hardware) pair: what a serving engine
    gets out of the datasheet numbers, which depends on the model's kernels as much as on the
    machine. Written by `kvplane calibrate fit`; each value names the figures it was fitted to.
    """

    kind: Literal["calibration"] = Field(default="calibration", description="profile kind tag")
    name: str = Field(description="profile name, e.g. 'dense@p5en-h200-tp8'")
    description: str = Field(default="", description="what this is, in words")
    model_kind: Literal["dense", "moe"] = Field(
        description="which models it applies to: dense, or moe (mixture of experts)")
    hardware: str = Field(description="name of the hardware profile it applies to")
    compute_utilization: Fitted = _u("fraction", "share of peak FLOP/s prefill matmuls reach")
    memory_bandwidth_utilization: Fitted = _u(
        "fraction", "share of HBM bandwidth streaming reads (weights, KV) reach")
    step_overhead: Fitted = _u("s", "fixed time of one engine step (schedule, launch, sample)")
    prefill_request_overhead: Fitted = _u(
        "s", "per-request delay on the prefill path outside model steps (not holding the engine)")
    network_utilization: Fitted = _u(
        "fraction", "share of the network link's line rate a NIXL transfer reaches")
    reuse_read_setup: Fitted = _u(
        "s", "fixed coordination time of a D->P reuse read (async receive, pin, completion)")
    # The serving stack around the engines, measured from a recorded live run (`kvplane
    # calibrate live`); zero where a calibration's figures do not see them (they then sit
    # inside prefill_request_overhead and step_overhead).
    request_leg: Fitted = _u(
        "s", "a request's trip from the router into an engine's scheduler: HTTP, the API "
        "server's input processing, the hand-off to the engine process (paid per leg)",
        default_factory=lambda: _not_fitted("request_leg"))
    response_leg: Fitted = _u(
        "s", "an engine's output back through the router: output processing, the HTTP "
        "response or stream, the router's relay (prefill's answer in pull mode, and the first "
        "token to the client)", default_factory=lambda: _not_fitted("response_leg"))
    transfer_setup: Fitted = _u(
        "s", "fixed cost of one connector KV read or write besides the bytes: the side "
        "channel's pin round trip, NIXL's preparation and post, completion polling",
        default_factory=lambda: _not_fitted("transfer_setup"))
    transfer_per_descriptor: Fitted | None = Field(
        default=None, description="seconds one descriptor adds to a connector KV transfer "
        "(its post and its wire time together), measured from a live run; when set it replaces "
        "the link's post_per_descriptor + wire_per_descriptor (the hardware profile's figure "
        "comes from another path: a copy inside one GPU costs less per descriptor than one "
        "between two)")
    graph_step_overhead: Fitted | None = Field(
        default=None, description="fixed time of a decode-only step that vLLM replays from a "
        "captured CUDA graph (batches up to the engine's `cuda_graph_max_batch`), measured from "
        "a live run; unset, every step costs step_overhead. A step with a prefill chunk runs "
        "outside the graphs and launches its kernels one by one from the host, so its fixed "
        "part (step_overhead) can be many times larger")
    launch_floor: Fitted | None = Field(
        default=None, description="least time per layer of an engine step that runs outside "
        "CUDA graphs (any step with a prefill chunk): the host launching the forward's kernels "
        "one by one, which the GPU's work overlaps, so such a step takes the larger of this "
        "times the model's layers and its priced time. Per layer, so that it carries to "
        "another model of the same kind. Measured from a live run; unset, no floor")
    empty_step: Fitted | None = Field(
        default=None, description="an engine step that computes nothing (the scheduler and the "
        "connector's poll): what a request waits between its KV transfer's end and the step "
        "that schedules it, measured from a live run; unset, a decode-only step's fixed part")
    host_slowdown: dict[HopKind, HostSlowdown] = Field(
        default_factory=dict, description="per-hop slowdown of a shared host, by hop kind "
        "(empty: a dedicated host)")
    host_state: HostState | None = Field(
        default=None, description="the host's state the slowdown is conditioned on (none: "
        "drawn from all recorded factors of the hop kind)")
    host_hop_correlation: Fitted | None = Field(
        default=None, json_schema_extra={"unit": "fraction"},
        description="how alike the host's slowdowns of one request's hops are (its legs, "
        "prefill step, answer, transfers, first token: the same few hundred ms, mostly the "
        "same processes): the correlation of their normal scores, one factor shared by a "
        "request's hops (a Gaussian copula). Measured from a live run; unset or zero, every "
        "hop draws on its own [fraction]")
    scenario_choices: list[ScenarioChoice] = Field(
        default_factory=list,
        description="scenario inputs chosen with published figures in view (their figures "
        "count as fitted too)",
    )

    @model_validator(mode="after")
    def _bins_match(self) -> CalibrationProfile:
        rho = self.host_hop_correlation
        if rho is not None and not 0.0 <= rho.value < 1.0:
            raise ValueError("host_hop_correlation must be at least 0 and less than 1")
        bins = len(self.host_state.edges) + 1 if self.host_state is not None else 0
        for kind, hs in self.host_slowdown.items():
            if hs.by_state and len(hs.by_state) != bins:
                raise ValueError(f"host_slowdown.{kind}.by_state has {len(hs.by_state)} "
                                 f"tables; host_state has {bins} bins")
        return self

    def constants(self) -> dict[str, Fitted]:
        return {name: getattr(self, name) for name, info in type(self).model_fields.items()
                if info.annotation in (Fitted, Fitted | None) and getattr(self, name) is not None}

    def fitted_figures(self, scenario: str | None = None) -> dict[str, list[str]]:
        """Figure id -> what was fitted to it (constant names, scenario fields)."""
        out: dict[str, list[str]] = {}
        for name, c in self.constants().items():
            for fid in c.fitted_to:
                out.setdefault(fid, []).append(name)
        for choice in self.scenario_choices:
            if scenario is None or choice.scenario == scenario:
                for fid in choice.fitted_to:
                    out.setdefault(fid, []).append(f"{choice.scenario}:{choice.field}")
        return out


PROFILE_TYPES: dict[str, type[ModelProfile | HardwareProfile | CalibrationProfile]] = {
    "model": ModelProfile,
    "hardware": HardwareProfile,
    "calibration": CalibrationProfile,
}
Profile = ModelProfile | HardwareProfile | CalibrationProfile
ProfileKind = Literal["model", "hardware", "calibration"]
_PROFILES_PACKAGE = "kvplane.scenarios"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def bundled_profile_names(kind: ProfileKind | None = None) -> list[str]:
    """Names of the profiles shipped in kvplane.scenarios/profiles (of one kind, if given)."""
    folder = resources.files(_PROFILES_PACKAGE).joinpath("profiles")
    names = []
    for entry in folder.iterdir():
        if not entry.name.endswith(".yaml"):
            continue
        if kind is not None:
            head = yaml.load(entry.read_text(encoding="utf-8"), Loader=_Loader) or {}
            if not isinstance(head, dict) or head.get("kind") != kind:
                continue
        names.append(entry.name[: -len(".yaml")])
    return sorted(names)


def _profile_text(path_or_name: str | Path) -> tuple[str, str]:
    text_name = str(path_or_name)
    if isinstance(path_or_name, Path) or "/" in text_name or text_name.endswith(".yaml"):
        path = Path(path_or_name)
        try:
            return path.read_text(encoding="utf-8"), str(path)
        except OSError as exc:
            raise ScenarioError(str(path), [("", "a readable profile file", str(exc), None)]) from None
    if not _NAME_RE.match(text_name):
        raise ScenarioError(text_name, [("", "a profile name or path", repr(text_name), None)])
    entry = resources.files(_PROFILES_PACKAGE).joinpath("profiles", f"{text_name}.yaml")
    if not entry.is_file():
        names = ", ".join(bundled_profile_names()) or "(none)"
        raise ScenarioError(
            text_name, [("", f"the name of a bundled profile ({names}) or a path", None, None)]
        )
    return entry.read_text(encoding="utf-8"), f"profiles/{text_name}.yaml"


def load_profile(
    path_or_name: str | Path, kind: ProfileKind | None = None
) -> Profile:
    """Read a profile file (or a bundled profile by name) and validate it.

    Raises ScenarioError naming the file, the field and what was expected: for YAML syntax, a
    missing `source:`, a wrong unit, a wrong type, or a profile of the other kind.
    """
    text, file = _profile_text(path_or_name)
    data, positions = read_yaml(text, file)
    return profile_from_data(data, file, positions, kind)


def profile_from_data(
    data: Any,
    file: str,
    positions: _Positions | None = None,
    kind: ProfileKind | None = None,
    prefix: tuple[int | str, ...] = (),
) -> Profile:
    """Validate already-parsed profile data (used for inline profiles in a scenario too)."""
    where = _dotted(prefix, ("kind",))
    line = positions.line_of((*prefix, "kind")) if positions else None
    if not isinstance(data, dict):
        raise ScenarioError(file, [(_dotted(prefix, ()), "a mapping (a profile)", _short(data),
                                    line)])
    found = data.get("kind", kind)
    if found not in PROFILE_TYPES:
        raise ScenarioError(file, [(where, "'model', 'hardware' or 'calibration'", _short(found),
                                    line)])
    if kind is not None and found != kind:
        raise ScenarioError(file, [(where, f"a {kind} profile", repr(found), line)])
    cls = PROFILE_TYPES[found]
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise scenario_error_from_validation(exc, file, positions, prefix, cls) from None

