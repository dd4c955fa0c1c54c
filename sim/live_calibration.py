"""Calibration from a recorded live run: `kvplane calibrate live RUN`.

A live run through `kvplane router` and KvplaneConnector records, per request, when each hop
happened: the router's `RequestArrived`, the prefill and decode schedulers' `RequestArrived`,
`PrefillStarted` / `PrefillFinished`, the router's `MetadataRelayed`, decode's P->D
`TransferPlanned` / `TransferCompleted` / `KVReceived`, the router's `FirstTokenEmitted` and
`RequestFinished` (with its TPOT). Those intervals measure the mechanisms the simulator prices,
each as its uncontended cost: the lower quintile (20th percentile) over the run, since a
shared host only ever slows a hop:

| constant | measured as |
|---|---|
| `request_leg` | router's arrival -> prefill scheduler's arrival, and router's relay -> decode scheduler's arrival (one leg each, pooled) |
| `response_leg` | prefill's `PrefillFinished` -> the router's `MetadataRelayed` (prefill's answer through the router) |
| `transfer_setup` | decode's P->D `TransferPlanned` -> `TransferCompleted`, less the bytes' time on the scenario's link: the intercept of a line through those (lower quintile per prompt length) against the transfers' descriptors |
| `transfer_per_descriptor` | the slope of that line: what one descriptor adds (post and wire), which depends on the path (a copy inside one GPU, NVLink, EFA, UCX over TCP) more than any datasheet says |
| `step_overhead` | an engine step's fixed part: the intercept of a line through prefill's one-step durations (lower quintile per prompt length) against their FLOPs (else the router's time per output token less a batch-1 step's arithmetic) |
| `compute_utilization` | the slope of that line |
| `host_slowdown` | per hop kind (request leg, response leg, prefill step, transfer, the first token's: KV received -> the router's first token, i.e. an empty step to notice the KV, one to compute, the response leg; and a decode step: the time per output token after the first), recorded duration over priced cost: how much the host slowed that kind of hop, as all of them (drawn with each weighing 1/n: the i-th at probability (i + 1/2)/n) |

| `host_hop_correlation` | how alike one request's hop slowdowns are: each hop's normal score (its rank among the hops of its kind, in its run-queue bin), the mean product over pairs of hops of the same request, over the mean square. A twin's request draws its hops through one shared normal factor with this weight (a Gaussian copula), so a request that meets a slow host meets it on several hops, as recorded, instead of every hop drawing on its own |

Only pull-mode requests without a reuse read are used (the shape of every leg is then known).
What a run cannot show stays as it was in the prior calibration (memory and network
efficiency, `prefill_request_overhead`, `reuse_read_setup`): the fit says so. Every fitted value
names the run and the intervals it came from (`fitted_to`: `live:<run>:<interval>`).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from kvplane.store import EventStore

from .costs import ComputeCost, TransferCost
from .host_state import HostTimeline, state_bin
from .profiles import (
    CalibrationProfile,
    Fitted,
    HardwareProfile,
    HostSlowdown,
    HostState,
    ModelProfile,
)

__all__ = ["LiveFit", "Prediction", "describe", "fit_live", "intervals", "percentile", "predict"]


@dataclass
class _Trace:
    """One request's recorded hops (seconds since the epoch; None where not recorded)."""

    arrived: dict[str, float] = field(default_factory=dict)  # instance -> RequestArrived
    prompt: int = 0
    max_tokens: int = 0  # output tokens asked for (the workloads ignore EOS: all are made)
    prefill_started: float | None = None
    computed: int = 0
    cached: int = 0
    prefill_finished: float | None = None
    relayed: float | None = None
    p2d_planned: float | None = None
    p2d_done: float | None = None
    p2d_bytes: int = 0
    p2d_runs: int = 0
    p2d_descriptors: float = 0.0  # per stream (rank pair): what one post carries
    d2p: bool = False
    kv_received: float | None = None
    first_token: float | None = None
    tpot: float | None = None
    finished: float | None = None  # the router's RequestFinished
    mode: str = ""


def _traces(store: EventStore, run_id: str) -> dict[str, _Trace]:
    out: dict[str, _Trace] = defaultdict(_Trace)
    for e in sorted(store.events(run_id), key=lambda e: e.at):
        if e.request is None:
            continue
        t = out[e.request]
        name = type(e).__name__
        inst = e.instance
        if name == "RequestArrived":
            t.arrived.setdefault(inst, e.at)
            if inst == "router":
                t.prompt = e.prompt_tokens  # type: ignore[attr-defined]
                t.max_tokens = e.output_tokens  # type: ignore[attr-defined]
        elif name == "RequestRouted":
            t.mode = e.mode  # type: ignore[attr-defined]
        elif name == "PrefillStarted" and t.prefill_started is None:
            t.prefill_started = e.at
            t.computed = e.computed_tokens  # type: ignore[attr-defined]
            t.cached = e.cached_tokens  # type: ignore[attr-defined]
        elif name == "PrefillFinished":
            t.prefill_finished = e.at
        elif name == "MetadataRelayed":
            t.relayed = e.at
        elif name == "TransferPlanned":
            if e.direction == "D->P":  # type: ignore[attr-defined]
                t.d2p = True
            elif inst != "router" and t.p2d_planned is None:
                t.p2d_planned = e.at
                t.p2d_bytes = e.bytes  # type: ignore[attr-defined]
                t.p2d_runs = e.runs  # type: ignore[attr-defined]
                t.p2d_descriptors = e.descriptors / max(  # type: ignore[attr-defined]
                    1, e.expected_notifications)  # type: ignore[attr-defined]
        elif name == "TransferCompleted" and e.direction == "P->D":  # type: ignore[attr-defined]
            t.p2d_done = e.at
        elif name == "KVReceived":
            t.kv_received = e.at
        elif name == "FirstTokenEmitted" and inst == "router":
            t.first_token = e.at
        elif name == "RequestFinished" and inst == "router":
            t.tpot = e.tpot  # type: ignore[attr-defined]
            t.finished = e.at
    return out


def intervals(store: EventStore, run_id: str) -> dict[str, list[float]]:
    """The run's measured intervals (seconds), one list per kind, over the pull-mode requests
    without a reuse read; also `ttft` and `tpot` as the router recorded them, and
    `decode_token`: the router's time from the first token to the last over the tokens made
    after the first. `at:<kind>` holds, in the same order, when each hop of `<kind>` began
    (seconds since the epoch), and `who:<kind>` which request it was (its place in the run)."""
    out: dict[str, list[float]] = defaultdict(list)

    def hop(kind: str, start: float, end: float) -> None:
        out[kind].append(end - start)
        out[f"at:{kind}"].append(start)  # when it began (the host's state then)
        out[f"who:{kind}"].append(float(who))  # whose: one request's hops, drawn alike

    for who, t in enumerate(_traces(store, run_id).values()):
        router = t.arrived.get("router")
        if router is None or t.mode != "pull" or t.d2p or t.first_token is None:
            continue
        pf, dec = t.arrived.get("prefill"), t.arrived.get("decode")
        out["ttft"].append(t.first_token - router)
        if t.tpot is not None and t.tpot > 0:
            out["tpot"].append(t.tpot)
        if pf is not None:
            hop("request_leg", router, pf)
        if dec is not None and t.relayed is not None:
            hop("request_leg", t.relayed, dec)
        if t.prefill_finished is not None and t.relayed is not None:
            hop("response_leg", t.prefill_finished, t.relayed)
        if t.prefill_started is not None and t.prefill_finished is not None and not t.cached:
            hop("prefill_step", t.prefill_started, t.prefill_finished)
            out["prefill_tokens"].append(float(t.computed))
        if t.p2d_planned is not None and t.p2d_done is not None:
            hop("p2d_transfer", t.p2d_planned, t.p2d_done)
            out["p2d_bytes"].append(float(t.p2d_bytes))
            out["p2d_descriptors"].append(t.p2d_descriptors)
            out["p2d_tokens"].append(float(t.prompt))
        if t.kv_received is not None:
            hop("kv_to_first_token", t.kv_received, t.first_token)
            out["kv_context"].append(float(t.prompt))
        if t.finished is not None and t.max_tokens > 1:  # after the first token, per token
            out["decode_token"].append((t.finished - t.first_token) / (t.max_tokens - 1))
            out["at:decode_token"].append(t.first_token)
            out["who:decode_token"].append(float(who))
            out["decode_context"].append(float(t.prompt + t.max_tokens / 2))
    return dict(out)


def prefill_steps_by_decode(store: EventStore, run_id: str
                            ) -> dict[str, dict[int, list[float]]]:
    """One-step prefills of the run (seconds, by computed tokens), split by what the decode
    engine did meanwhile: `idle` (no request between its `KVReceived` and its end decoding for
    most of the step) or `busy`. On one GPU shared by both engines a busy decode slows
    prefill (CUDA time-slices the two processes); the simulator gives each engine a device of
    its own, so a workload whose prefills overlap decoding is then not predicted."""
    traces = _traces(store, run_id).values()
    decoding = sorted((t.kv_received, t.finished) for t in traces
                      if t.kv_received is not None and t.finished is not None)
    out: dict[str, dict[int, list[float]]] = {"idle": defaultdict(list),
                                              "busy": defaultdict(list)}
    for t in traces:
        a, b = t.prefill_started, t.prefill_finished
        if a is None or b is None or t.cached or b <= a:
            continue
        covered, upto = 0.0, a  # the part of [a, b] some request was decoding
        for lo, hi in decoding:  # by start: none after one starting at b or later overlaps
            if lo >= b:
                break
            lo, hi = max(lo, upto), min(hi, b)
            if hi > lo:
                covered, upto = covered + hi - lo, hi
        out["busy" if covered > (b - a) / 2 else "idle"][t.computed].append(b - a)
    return {k: dict(v) for k, v in out.items()}


def decode_interference(store: EventStore, run_id: str) -> tuple[float, float] | None:
    """(idle, busy): the median one-step prefill (seconds) of the prompt lengths the run saw
    both with decode idle and with decode busy (`prefill_steps_by_decode`); None without such
    a length. Busy well above idle means the engines share a device (or a host) the twin
    gives each its own."""
    by = prefill_steps_by_decode(store, run_id)
    both = sorted(set(by["idle"]) & set(by["busy"]))
    if not both:
        return None
    return (statistics.median(x for n in both for x in by["idle"][n]),
            statistics.median(x for n in both for x in by["busy"][n]))


def prefill_slowdown(store: EventStore, run_id: str, reference: str) -> float | None:
    """The median, over `run_id`'s one-step prefills, of each one's duration over the
    `reference` run's median one-step prefill of that length (interpolated between the
    reference's lengths, held at its shortest and longest): how much slower the same work ran
    in this run. The reference is the calibration run, whose decode was mostly idle; a ratio
    well above 1 means this run's prefills met something the twin does not price (a decode
    sharing their GPU). None without prefills in either run."""
    ref = sorted((n, statistics.median(ds)) for n, ds in
                 _by_length(intervals(store, reference)).items())
    got = intervals(store, run_id)
    if not ref or not got.get("prefill_step"):
        return None
    expected = np.interp(got["prefill_tokens"], [n for n, _ in ref], [d for _, d in ref])
    return float(np.median(np.asarray(got["prefill_step"]) / expected))


def _by_length(iv: Mapping[str, list[float]]) -> dict[int, list[float]]:
    """A run's one-step prefill durations by computed tokens."""
    by: dict[int, list[float]] = defaultdict(list)
    for n, d in zip(iv.get("prefill_tokens", []), iv.get("prefill_step", []), strict=True):
        by[int(n)].append(d)
    return dict(by)


def interference_note(store: EventStore, run_id: str, ratio: float = 1.5) -> str | None:
    """A line for the user when the run's prefills were slowed by decoding (busy at least
    `ratio` x idle), else None."""
    got = decode_interference(store, run_id)
    if got is None or got[1] < ratio * got[0]:
        return None
    idle, busy = got
    return (f"note: run {run_id}'s one-step prefills took {busy * 1e3:.1f} ms (median) while "
            f"decode was running and {idle * 1e3:.1f} ms while it was idle, same prompt "
            "lengths: if prefill and decode share a GPU (CUDA time-slices two processes), the "
            "twin, which gives each engine a device of its own, does not price that")


@dataclass
class LiveFit:
    calibration: CalibrationProfile
    measured: dict[str, float]  # interval kind -> lower quintile (s); host delay percentiles
    samples: int  # requests used
    kept: list[str]  # constants the run does not show (prior value kept)


def _q(xs: list[float], p: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * p
    i = int(k)
    j = min(i + 1, len(s) - 1)
    return s[i] + (s[j] - s[i]) * (k - i)


def _fitted(value: float, unit: str, run_id: str, used: list[str], how: str) -> Fitted:
    return Fitted(value=float(value), unit=unit, fitted_to=[f"live:{run_id}:{u}" for u in used],
                  source=f"calibrated: kvplane calibrate live {run_id}, {how}")


QUIET = 0.2  # the quantile taken as a hop's uncontended cost


def _line(pts: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through `pts`; a flat line where x does
    not vary."""
    mx, my = statistics.fmean(x for x, _ in pts), statistics.fmean(y for _, y in pts)
    var = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / var if var > 0 else 0.0
    return my - slope * mx, slope


FLOOR_ABOVE = 1.1  # a floor sits this far above the line at the shortest length, or is none


FLAT = 0.1  # a line rising less than this share of its mean level over A's lengths is flat


def _floor_line(pts: list[tuple[float, float]]) -> tuple[float | None, float, float]:
    """(floor, intercept, slope): the least-squares fit of max(floor, line) to `pts` (x
    ascending) where the shortest lengths sit level above the line through the rest (a step
    outside CUDA graphs cannot be shorter than the host's launch of its kernels); floor None
    and the plain line where no split fits better. Where the steps do not grow with their
    work at all (the line rises less than FLAT of their level), every length is on the
    floor: (their mean, 0, 0), no line."""
    a, b = _line(pts)
    level = statistics.fmean(y for _, y in pts)
    if b * (pts[-1][0] - pts[0][0]) < FLAT * level:
        return level, 0.0, 0.0
    best = (sum((y - a - b * x) ** 2 for x, y in pts), None, a, b)
    for k in range(1, len(pts) - 1):
        floor = statistics.fmean(y for _, y in pts[:k])
        a, b = _line(pts[k:])
        if b <= 0 or floor < FLOOR_ABOVE * (a + b * pts[0][0]):  # clear of the line
            continue
        sse = sum((y - max(floor, a + b * x)) ** 2 for x, y in pts)
        if sse < best[0]:
            best = (sse, floor, a, b)
    return best[1], best[2], best[3]


# the host's state a hop's slowdown is conditioned on (chosen on the sessions of 15:59-17:24,
# reported on those of 17:52-20:55 unchanged: docs/validation.md)
HOST_WINDOW = 1.0  # s either side of a hop's start: the run queue averaged over it
HOST_BINS = 3  # equally populated by the calibration run's hops
MIN_PER_BIN = 8  # fewer hops of a kind in a bin: it borrows its neighbours'
MIN_HOST_SAMPLES = 20  # fewer samples: no conditioning


def _host_state(run_id: str, factors: dict[str, list[tuple[float, float, float]]],
                samples: Sequence[Sequence[float]] | None
                ) -> tuple[HostState | None, HostTimeline | None]:
    """Bins of the host's run queue, cut so the run's hops fill them equally (None without
    enough samples)."""
    if not samples or len(samples) < MIN_HOST_SAMPLES:
        return None, None
    timeline = HostTimeline.from_samples(samples, HOST_WINDOW)
    xs = sorted(timeline.at(at) for fs in factors.values() for _, at, _ in fs)
    edges = sorted({_q(xs, i / HOST_BINS) for i in range(1, HOST_BINS)}) if xs else []
    if not edges:
        return None, None
    return HostState(
        window=HOST_WINDOW, edges=edges, fitted_to=[f"live:{run_id}:host_samples"],
        source=f"calibrated: kvplane calibrate live {run_id}, {len(samples)} run-queue samples "
               f"averaged over {HOST_WINDOW:g} s either side of each hop's start, cut into "
               f"{len(edges) + 1} bins holding equal shares of the run's hops"), timeline


def _by_state(xf: list[tuple[float, float]], edges: list[float]) -> list[list[float]]:
    """The factors (run queue, factor) split by bin, ascending; a bin with fewer than
    MIN_PER_BIN hops takes its nearest neighbours' too."""
    bins: list[list[float]] = [[] for _ in range(len(edges) + 1)]
    for x, f in xf:
        bins[state_bin(edges, x)].append(f)
    whole = sorted(f for _, f in xf)
    out = []
    for i in range(len(bins)):
        got, k = list(bins[i]), 1
        while len(got) < MIN_PER_BIN and k < len(bins):
            got += [f for j in (i - k, i + k) if 0 <= j < len(bins) for f in bins[j]]
            k += 1
        got = sorted(got) if len(got) >= 2 else whole
        out.append(got if len(got) > 1 else got * 2)
    return out


MIN_HOP_PAIRS = 30  # fewer pairs of one request's hops: no correlation fitted


def _hop_correlation(hops: Mapping[str, list[tuple[float, float, float]]],
                     timeline: HostTimeline | None, edges: list[float] | None
                     ) -> tuple[float, int] | None:
    """(rho, pairs): how alike the host's slowdowns of one request's hops are, from
    (factor, began, request) per hop kind. Each hop's slowdown becomes a normal score (its
    rank among the hops of its kind, in its run-queue bin when the host was sampled, through
    the normal quantile function), so neither the kinds' scales nor the host's state, which
    the bins already condition on, counts; rho is the mean product of two hops of the same
    request over the mean square, at least 0. None with fewer than MIN_HOP_PAIRS pairs."""
    normal = statistics.NormalDist()
    by_request: dict[float, list[float]] = defaultdict(list)
    for fs in hops.values():
        groups: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for f, at, who in fs:
            cell = (state_bin(edges, timeline.at(at))
                    if edges is not None and timeline is not None else 0)
            groups[cell].append((f, who))
        for group in groups.values():
            if len(group) < 2:
                continue
            for rank, (_, who) in enumerate(sorted(group)):
                by_request[who].append(normal.inv_cdf((rank + 0.5) / len(group)))
    cross = square = 0.0
    pairs = count = 0
    for zs in by_request.values():
        total = sum(zs)
        cross += (total * total - sum(z * z for z in zs)) / 2.0
        pairs += len(zs) * (len(zs) - 1) // 2
        square += sum(z * z for z in zs)
        count += len(zs)
    if pairs < MIN_HOP_PAIRS or square <= 0:
        return None
    return min(max((cross / pairs) / (square / count), 0.0), 0.95), pairs


def fit_live(store: EventStore, run_id: str, model: ModelProfile, hardware: HardwareProfile,
             prior: CalibrationProfile, name: str | None = None, block_size: int = 16,
             link: Literal["network", "nvlink"] = "network",
             host_samples: Sequence[Sequence[float]] | None = None,
             graph_batch: int = 0) -> LiveFit:
    """Fit the stack's constants of (model kind, hardware) from a recorded live run.

    `host_samples` (`[time, run queue, ...]`; default: the run's `meta.host_samples`) is the
    host's state during the run: with enough of them the slowdown is also split by the run
    queue when each hop began (`host_state`, `HostSlowdown.by_state`).
    `graph_batch` > 0 (the scenario's `engine.cuda_graph_max_batch` when the scenario states
    it; 0, the default: eager, or not stated, as CPU runs): the engine replayed decode-only
    steps from CUDA graphs, so their fixed part (`graph_step_overhead`), the host's launch
    floor of the other steps (`launch_floor`) and the step that reports a finished receive
    (`empty_step`) are fitted apart from the prefill line.
    Raises ValueError naming what the run lacks (no pull-mode request, no transfer, ...).
    """
    iv = intervals(store, run_id)
    for need in ("request_leg", "response_leg", "prefill_step", "p2d_transfer", "tpot",
                 "kv_to_first_token"):
        if not iv.get(need):
            raise ValueError(f"run {run_id} has no {need} to measure: record a pull-mode run "
                             "through kvplane router (RequestArrived at router, prefill and "
                             "decode; MetadataRelayed; a P->D TransferPlanned/Completed)")
    # the arithmetic, priced with the prior's efficiencies and no step overhead
    bare = prior.model_copy(update={"step_overhead": prior.step_overhead.model_copy(
        update={"value": 0.0}), "graph_step_overhead": None, "launch_floor": None,
        "empty_step": None})
    compute = ComputeCost(model, hardware, None, block_size, bare)
    ctx = statistics.median(iv["kv_context"])
    # prefill step = overhead + FLOPs / (peak x mfu): the lower quintile of each prompt
    # length's one-step prefills, one line (least squares); its intercept is an engine step's
    # fixed part. (A loaded API server coalesces the stream, so the router's time per output
    # token can fall below a step: it only serves when the line has no positive intercept.)
    pts = [(compute.flops(n, n * (n + 1) / 2.0, 1), _q(ds, QUIET))
           for n, ds in sorted(_by_length(iv).items())]
    per_token = iv.get("decode_token") or iv["tpot"]
    # what A's time per output token (batch 1, lower quintile) leaves over the step's priced
    # arithmetic: a decode step's fixed part
    token_rest = max(_q(per_token, QUIET) - compute.decode_step_time(1, int(ctx)), 0.0)
    # with CUDA graphs the shortest prefills can sit on a floor: the host launching a forward
    # outside the graphs, which short chunks' GPU work does not cover
    floor, overhead, slope = _floor_line(pts) if graph_batch > 0 else (None, *_line(pts))
    flat = floor is not None and slope == 0.0  # every length on the floor: no line to read
    overhead_from = "prefill_step"
    if slope <= 0 or overhead <= 0:  # no line: the decode time per token, one slope through it
        overhead = token_rest
        overhead_from = "decode_token"
        slope = (sum(f * max(y - overhead, 0.0) for f, y in pts) / sum(f * f for f, _ in pts))
    peak = compute.flops_per_second / prior.compute_utilization.value
    mfu = min(max(1.0 / (slope * peak), 1e-6), 1.0) if slope > 0 else 1.0
    if flat:  # the prefills measured the host, not the GPU's arithmetic: the prior's stays
        mfu = prior.compute_utilization.value
    # a transfer = set-up + the bytes' time on the scenario's link + a cost per descriptor: a
    # line through the lower quintiles (per prompt length) of what the bytes leave, against
    # the descriptors; the bytes' rate is the link's (profile), the rest is this path's own
    wire = TransferCost(hardware, link, prior)
    rest: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for d, b, n, k in zip(iv["p2d_transfer"], iv["p2d_bytes"], iv["p2d_descriptors"],
                          iv["p2d_tokens"], strict=True):
        rest[int(k)].append((n, d - wire.wire_time(b, 0)))
    tpts = [(statistics.median(n for n, _ in xs), _q([r for _, r in xs], QUIET))
            for xs in rest.values()]
    setup, per_desc = _line(tpts)
    if per_desc < 0:  # no slope: the set-up alone
        setup, per_desc = max(_q([r for _, r in tpts], QUIET), 0.0), 0.0
    elif setup < 0:  # no intercept: the slope alone, through the origin
        setup = 0.0
        per_desc = max(sum(n * r for n, r in tpts) / max(sum(n * n for n, _ in tpts), 1e-30),
                       0.0)
    leg, resp = max(_q(iv["request_leg"], QUIET), 0.0), max(_q(iv["response_leg"], QUIET), 0.0)
    # a decode-only step replayed from a CUDA graph launches no kernel from the host: its fixed
    # part is token_rest, not the prefill line's intercept
    graph = token_rest if graph_batch > 0 else None
    graph_fit = empty_fit = None
    if graph is not None:
        graph_fit = _fitted(
            graph, "s", run_id, ["decode_token"],
            f"lower quintile of {len(per_token)} requests' time per output token after the "
            "first less a batch-1 decode step's priced arithmetic (decode steps replayed from "
            f"CUDA graphs, batches up to {graph_batch})")
        # from a P->D transfer's end to the first token: the step that reports the finished
        # receive (nothing to compute), the request's first step, the response leg
        empty = max(_q(iv["kv_to_first_token"], QUIET) - _q(per_token, QUIET) - resp, 0.0)
        empty_fit = _fitted(
            empty, "s", run_id, ["kv_to_first_token", "decode_token", "response_leg"],
            f"lower quintile of {len(iv['kv_to_first_token'])} P->D transfers' end to first "
            "token, less the lower quintiles of a decode step and of the response leg")
    floor_fit = None if floor is None else _fitted(
        floor / model.num_layers.value, "s/layer", run_id, ["prefill_step"],
        f"mean of the lower quintiles of {len(pts)} prompt lengths' one-step prefills, which "
        "do not grow with their work, over the model's layers" if flat else
        "mean of the lower quintiles of the shortest prompt lengths' one-step prefills, which "
        f"sit level, at least {FLOOR_ABOVE - 1:.0%} above the line through the longer ones, "
        "over the model's layers")
    # what the twin counts before a received request's first step: an empty step
    decode_fixed = overhead if graph is None else empty
    # ... and the fixed part a decode step itself holds once more (eager: the line's)
    step_fixed = overhead if graph is None else 0.0
    # how much the host slowed every hop: measured over priced, pooled
    fitted_compute = prior.model_copy(update={
        "step_overhead": prior.step_overhead.model_copy(update={"value": overhead}),
        "compute_utilization": prior.compute_utilization.model_copy(update={"value": mfu}),
        "graph_step_overhead": graph_fit, "empty_step": empty_fit,
        "launch_floor": floor_fit})
    priced = ComputeCost(model, hardware, None, block_size, fitted_compute,
                         graph_batch=graph_batch)
    pairs: dict[str, list[tuple[float, float]]] = {
        "request_leg": [(x, leg) for x in iv["request_leg"]],
        "response_leg": [(x, resp) for x in iv["response_leg"]],
        "transfer": [(d, setup + wire.wire_time(b, 0) + n * per_desc)
                     for d, b, n in zip(iv["p2d_transfer"], iv["p2d_bytes"],
                                        iv["p2d_descriptors"], strict=True)],
        "prefill_step": [(d, priced.prefill_time(int(n)))
                         for n, d in zip(iv["prefill_tokens"], iv["prefill_step"], strict=True)],
        "first_token": [(d, decode_fixed + priced.decode_step_time(1, int(c)) + resp)
                        for d, c in zip(iv["kv_to_first_token"], iv["kv_context"], strict=True)],
        "decode_step": [(d, step_fixed + priced.decode_step_time(1, int(c)))
                        for d, c in zip(iv.get("decode_token", []), iv.get("decode_context", []),
                                        strict=True)],
    }
    # each hop kind's intervals: when each hop began (the host's state then) and whose it was
    interval_of = {"request_leg": "request_leg", "response_leg": "response_leg",
                   "transfer": "p2d_transfer", "prefill_step": "prefill_step",
                   "first_token": "kv_to_first_token", "decode_step": "decode_token"}
    factors = {kind: [(max(x, 0.0) / cost, at, who) for (x, cost), at, who in zip(
        pairs[kind], iv.get(f"at:{key}", []), iv.get(f"who:{key}", []), strict=True) if cost > 0]
        for kind, key in interval_of.items()}
    if host_samples is None:
        host_samples = store.run(run_id).meta.get("host_samples") or None
    state, timeline = _host_state(run_id, factors, host_samples)
    # one request's hops, alike; decode steps are the batch's, not one request's
    whose = {kind: fs for kind, fs in factors.items() if kind != "decode_step"}
    alike = _hop_correlation(whose, timeline, None if state is None else state.edges)
    # every recorded factor is kept, ascending (a twin draws each with weight 1/n): a
    # coarse table (21 quantiles) interpolates its top 5 % of draws between the 95th percentile
    # and the run's one worst stall, so one 20 s stall among 192 hops weighed as 5 % of draws
    slowdown: dict[str, HostSlowdown] = {}
    for kind, fs in factors.items():
        slow = sorted(f for f, _, _ in fs)
        if slow:
            by_state = ([] if state is None or timeline is None else
                        _by_state([(timeline.at(at), f) for f, at, _ in fs], state.edges))
            slowdown[kind] = HostSlowdown(
                quantiles=slow if len(slow) > 1 else slow * 2, by_state=by_state,
                fitted_to=[f"live:{run_id}:{kind}"],
                source=f"calibrated: kvplane calibrate live {run_id}, {len(slow)} {kind} hops' "
                       "recorded duration over their priced cost, every one" + (
                           ", and split by the host's run queue when each began"
                           if by_state else ""))
    n = len(iv["ttft"])
    upd: dict[str, object] = {
        "request_leg": _fitted(leg, "s", run_id, ["request_leg"],
                               f"lower quintile of {len(iv['request_leg'])} legs (router -> "
                               "prefill and router -> decode scheduler)"),
        "response_leg": _fitted(resp, "s", run_id, ["response_leg"],
                                f"lower quintile of {len(iv['response_leg'])} prefill answers "
                                "(PrefillFinished -> MetadataRelayed)"),
        "transfer_setup": _fitted(setup, "s", run_id, ["p2d_transfer"],
                                  f"intercept of a line (least squares) through the lower "
                                  f"quintiles of {len(tpts)} prompt lengths' P->D transfers "
                                  f"less their bytes' time on the {link} link, against their "
                                  "descriptors"),
        "transfer_per_descriptor": _fitted(per_desc, "s", run_id, ["p2d_transfer"],
                                           f"slope of that line ({len(iv['p2d_transfer'])} "
                                           "transfers)"),
        "step_overhead": _fitted(overhead, "s", run_id, [overhead_from], (
            f"intercept of a line (least squares) through the lower quintiles of {len(pts)} "
            "prompt lengths' one-step prefills against their FLOPs"
            if overhead_from == "prefill_step" else
            f"lower quintile of {len(per_token)} requests' time per output token after the "
            "first less a batch-1 step's priced arithmetic")),
        "compute_utilization": prior.compute_utilization if flat else _fitted(
            mfu, "fraction", run_id, ["prefill_step"],
            f"slope of a line (least squares) through the lower quintiles of {len(pts)} prompt "
            "lengths' one-step prefills against their FLOPs"),
        "graph_step_overhead": graph_fit,
        "empty_step": empty_fit,
        "launch_floor": floor_fit,
        # the recorded legs are this run's whole per-request delay
        "prefill_request_overhead": Fitted(value=0.0, unit="s", source=(
            f"derived: kvplane calibrate live {run_id}: the recorded legs replace it")),
        "host_slowdown": slowdown,
        "host_state": state,
        "host_hop_correlation": None if alike is None else _fitted(
            alike[0], "fraction", run_id, [interval_of[kind] for kind in whose],
            f"mean product of the normal scores of one request's hop slowdowns over "
            f"{alike[1]} pairs of hops of the same request (each hop's score: its rank among "
            "the run's hops of its kind" + (" in its run-queue bin" if state else "") + "), "
            "over their mean square"),
    }
    kept = ["memory_bandwidth_utilization", "network_utilization", "reuse_read_setup",
            *(["compute_utilization"] if flat else [])]
    cal = prior.model_copy(update={
        **upd, "name": name or f"{prior.name}-live",
        "description": f"fitted by kvplane calibrate live to run {run_id} ({n} requests)"})
    measured = {"request_leg": leg, "response_leg": resp, "transfer_setup": setup,
                "tpot": _q(iv["tpot"], QUIET), "ttft_p50": _q(iv["ttft"], 0.5),
                "ttft_p90": _q(iv["ttft"], 0.9)}
    return LiveFit(cal, measured, n, kept)


def describe(fit: LiveFit) -> list[str]:
    """Lines saying what the fit used and what it gave."""
    lines = [f"{fit.samples} pull-mode requests; measured (ms):"]
    for k, v in fit.measured.items():
        lines.append(f"  {k:<20} {v * 1e3:9.2f}")
    lines.append("constants:")
    for k in ("request_leg", "response_leg", "transfer_setup", "transfer_per_descriptor",
              "step_overhead", "compute_utilization", "graph_step_overhead", "launch_floor",
              "empty_step", "host_hop_correlation"):
        c = getattr(fit.calibration, k)
        if c is None:
            continue
        lines.append(f"  {k:<20} {c.value:.6g} {c.unit or ''}  ({c.source})")
    for kind, hs in fit.calibration.host_slowdown.items():
        q = hs.quantiles
        lines.append(f"  host_slowdown {kind:<13} p10 {_q(q, 0.1):.2f}x p50 {_q(q, 0.5):.2f}x "
                     f"p90 {_q(q, 0.9):.2f}x max {q[-1]:.2f}x")
    state = fit.calibration.host_state
    if state is not None:
        lines.append(f"  host_state: run queue over +-{state.window:g} s, bins cut at "
                     + ", ".join(f"{e:.1f}" for e in state.edges) + f" ({state.source})")
        for kind, hs in fit.calibration.host_slowdown.items():
            lines.append(f"  by run queue  {kind:<13} p50 " + " / ".join(
                f"{_q(q, 0.5):.2f}x" for q in hs.by_state) + "  p90 " + " / ".join(
                f"{_q(q, 0.9):.2f}x" for q in hs.by_state))
    lines.append(f"kept from the prior: {', '.join(fit.kept)}")
    return lines


def percentile(xs: list[float], p: float) -> float:
    """Linear-interpolated percentile, p in 0..1."""
    return _q(xs, p)


@dataclass
class Prediction:
    """A recorded run's TTFTs against its twins' (the simulator's prediction)."""

    run: str
    live: list[float]  # the router's recorded TTFT per request, seconds
    predicted: list[float]  # the twins' TTFTs, pooled over seeds
    twins: list[str]
    reads_live: int  # reuse reads recorded
    reads_twin: float  # reuse reads in the twins, per seed on average

    def error(self, p: float) -> float:
        live = _q(self.live, p)
        return (_q(self.predicted, p) - live) / live

    def live_interval(self, p: float, level: float = 0.9) -> tuple[float, float]:
        """Distribution-free interval of the live percentile (binomial order statistics): how
        far the recorded percentile itself could be from the host's with this many requests."""
        from math import comb

        s, n = sorted(self.live), len(self.live)
        cdf, acc = [], 0.0
        for k in range(n + 1):
            acc += comb(n, k) * p ** k * (1 - p) ** (n - k)
            cdf.append(acc)
        tail = (1 - level) / 2
        lo = max(next((k for k in range(n + 1) if cdf[k] >= tail), 0) - 1, 0)
        hi = min(next((k for k in range(n + 1) if cdf[k] >= 1 - tail), n), n - 1)
        return s[lo], s[hi]

    def lines(self) -> list[str]:
        out = [(f"run {self.run}: {len(self.live)} requests live ({self.reads_live} reuse "
                f"reads), {len(self.twins)} twins ({self.reads_twin:.0f} reuse reads each)")]
        for p in (0.5, 0.9):
            lo, hi = self.live_interval(p)
            out.append(f"  TTFT p{int(p * 100)}: live {_q(self.live, p) * 1e3:.1f} ms (90 % "
                       f"interval {lo * 1e3:.1f}-{hi * 1e3:.1f}), predicted "
                       f"{_q(self.predicted, p) * 1e3:.1f} ms, error {self.error(p):+.1%}")
        return out


def predict(store: EventStore, run_id: str, scenario: Any, seeds: int = 10,
            host_samples: Sequence[Sequence[float]] | None = None) -> Prediction:
    """Twin a recorded run `seeds` times under `scenario` (its calibration included) and pool
    the twins' TTFTs; the recorded TTFTs are the router's. `host_samples` (default: the run's
    own) is the host's state during the recorded run, an input like its arrivals."""
    return predict_groups(store, run_id, scenario, seeds, host_samples)[run_id]


def requests_of(store: EventStore, run_id: str) -> set[str]:
    """The requests a recorded run holds (a group for `predict_groups`)."""
    return {e.request for e in store.events(run_id, ["RequestArrived"]) if e.request is not None}


def predict_groups(store: EventStore, run_id: str, scenario: Any, seeds: int = 10,
                   host_samples: Sequence[Sequence[float]] | None = None,
                   groups: Mapping[str, Collection[str]] | None = None) -> dict[str, Prediction]:
    """`predict`, compared group by group: each of `groups` (name -> request ids) gets its own
    Prediction of those requests' TTFTs, live and in the same twins (default: one group, the
    whole run, named after it). For workloads recorded together (both in flight at the same
    moments, so both met the same host): the twin simulates all of them, as they shared the
    engines, and each workload is compared on its own requests."""
    from .replay_sim import replay_into_sim

    sets = {run_id: None} if groups is None else {g: set(ids) for g, ids in groups.items()}

    def of(group: set[str] | None, request: str | None) -> bool:
        return group is None or request in group

    answered = [e for e in store.events(run_id, ["RequestFinished"]) if e.instance == "router"]
    read = [e for e in store.events(run_id, ["ReuseDecided"])
            if e.outcome == "read"]  # type: ignore[attr-defined]
    live = {g: [e.ttft for e in answered if of(want, e.request)]  # type: ignore[attr-defined]
            for g, want in sets.items()}
    reads = {g: sum(1 for e in read if of(want, e.request)) for g, want in sets.items()}
    pred: dict[str, list[float]] = {g: [] for g in sets}
    twin_reads = dict.fromkeys(sets, 0)
    twins: list[str] = []
    for seed in range(seeds):
        twin = replay_into_sim(store, run_id, scenario.model_copy(update={"seed": seed}),
                               host_samples=host_samples)
        twins.append(twin)
        finished = list(store.events(twin, ["RequestFinished"]))
        decided = [e for e in store.events(twin, ["ReuseDecided"])
                   if e.outcome == "read"]  # type: ignore[attr-defined]
        for g, want in sets.items():
            pred[g] += [e.ttft for e in finished if of(want, e.request)]
            twin_reads[g] += sum(1 for e in decided if of(want, e.request))
    out: dict[str, Prediction] = {}
    for g in sets:
        if not live[g] or not pred[g]:
            raise ValueError(f"run {run_id}: no finished request to compare"
                             + ("" if groups is None else f" in {g}"))
        out[g] = Prediction(g if groups is not None else run_id, live[g], pred[g], twins,
                            reads[g], twin_reads[g] / max(seeds, 1))
    return out
