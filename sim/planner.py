"""Capacity planning: the cheapest xPyD and connector settings that meet an SLO.

Rules kept here:
- The workload planned for is explicit: request rate (multi-turn: new conversations per
  second), input and output length, requests per run and seeds. Each defaults to the
  scenario's most demanding sweep value (highest rate, longest input, longest output), and
  every answer states the workload it was computed for.
- Cost is GPUs: prefill instances x prefill TP + decode instances x decode TP; with a GPU-hour
  price, also dollars per hour. Candidates are tried cheapest first; every candidate of one
  cost is simulated with every seed, and the search stops at the first cost where one meets
  the SLO. So the answer is the cheapest, and among equally cheap ones the one with the most
  margin.
- A candidate meets the SLO when p90 TTFT and p90 TPOT are within it at *every* seed (one
  lucky seed is not a plan). Figures are reported as the mean over seeds with a 95 %
  Student-t interval.
- Margin is the smaller of (SLO - p90) / SLO over TTFT and TPOT, at the worst seed: how much
  load growth or model error the configuration absorbs before it breaks the SLO.
- SLO attainment of a run is the share of its requests whose own TTFT and TPOT both meet the
  SLO (DistServe's measure); goodput is the rate of such requests, per GPU.
- After the search, the chosen connector setting is also run at fractions and multiples of
  the rate on every instance shape tried, one seed each: attainment against instances and
  rate, what the dashboard's Plan page draws.
- Modes tried: push and pull; with a multi-turn workload also bidirectional reuse on and off.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from . import stats
from .config import MultiTurnWorkload, Point, PoissonWorkload, Scenario, Sweep, load_scenario
from .engines import check_engine, map_ordered
from .runner import simulate

#: progress(done, total) as simulations finish.
Progress = Callable[[int, int], None]

#: the rates of the attainment curve, as multiples of the planned rate
CURVE_RATES = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)


@dataclass(frozen=True)
class Candidate:
    prefill: int
    decode: int
    mode: str
    bidirectional: bool

    def label(self) -> str:
        reuse = "+reuse" if self.bidirectional else ""
        return f"{self.prefill}P{self.decode}D {self.mode}{reuse}"


@dataclass(frozen=True)
class PlanWorkload:
    """What is planned for; `rate` is requests/s, or new conversations/s when multi-turn."""

    kind: str
    rate: float
    input_len: int
    output_len: int
    requests: int
    seeds: tuple[int, ...]

    @property
    def rate_unit(self) -> str:
        return "conversations/s" if self.kind == "multi_turn" else "requests/s"

    def describe(self) -> str:
        what = "first-turn prompt" if self.kind == "multi_turn" else "input"
        return (f"{self.rate:g} {self.rate_unit}, {what} {self.input_len} tokens, output "
                f"{self.output_len} tokens, {self.requests} requests per run, seeds "
                f"{', '.join(str(s) for s in self.seeds)}")


@dataclass
class Trial:
    """One simulation: a candidate at a rate and seed."""

    candidate: Candidate
    gpus: int
    rate: float
    seed: int
    ttft_p90: float
    tpot_p90: float
    attainment: float
    goodput: float  # requests meeting the SLO per second


@dataclass
class Verdict:
    candidate: Candidate
    gpus: int
    dollars_per_hour: float | None
    ttft_p90: tuple[float, float]  # mean, 95 % half-width over seeds
    tpot_p90: tuple[float, float]
    attainment: tuple[float, float]
    goodput_per_gpu: float
    margin: float  # at the worst seed
    meets: bool


@dataclass
class PlanResult:
    scenario: str
    workload: PlanWorkload
    slo: dict[str, float]
    gpu_hour_price: float | None
    verdicts: list[Verdict] = field(default_factory=list)
    curve: list[Trial] = field(default_factory=list)
    chosen: Verdict | None = None
    max_instances: int = 8
    prefill_tp: int = 1
    decode_tp: int = 1

    @property
    def found(self) -> bool:
        return self.chosen is not None

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON (no NaN) for the store's run meta and `--json`."""
        def verdict(v: Verdict) -> dict[str, Any]:
            return {**asdict(v), "label": v.candidate.label(), "candidate": asdict(v.candidate)}

        return _finite({
            "scenario": self.scenario, "workload": {**asdict(self.workload),
                                                    "rate_unit": self.workload.rate_unit},
            "slo": self.slo, "gpu_hour_price": self.gpu_hour_price,
            "prefill_tp": self.prefill_tp, "decode_tp": self.decode_tp,
            "max_instances": self.max_instances,
            "verdicts": [verdict(v) for v in self.verdicts],
            "chosen": verdict(self.chosen) if self.chosen else None,
            "curve": [{**asdict(t), "label": t.candidate.label(),
                       "candidate": asdict(t.candidate)} for t in self.curve],
        })

    def text(self) -> str:
        w, slo = self.workload, self.slo
        lines = [f"planning {self.scenario} for {w.describe()}",
                 f"SLO: p90 TTFT <= {slo['ttft_p90_ms']:g} ms and p90 TPOT <= "
                 f"{slo['tpot_p90_ms']:g} ms at every seed"
                 + (f"; ${self.gpu_hour_price:g} per GPU-hour" if self.gpu_hour_price else ""),
                 (f"{'GPUs':>4} {'$/h':>7}  {'candidate':<18} {'TTFT p90 (ms)':>17} "
                  f"{'TPOT p90 (ms)':>15} {'attain':>11} {'margin':>7}")]
        for v in self.verdicts:
            cost = f"{v.dollars_per_hour:7.2f}" if v.dollars_per_hour is not None else f"{'-':>7}"
            lines.append(
                f"{v.gpus:>4} {cost}  {v.candidate.label():<18} {_pm(v.ttft_p90, 1):>17} "
                f"{_pm(v.tpot_p90, 2):>15} {_pm((v.attainment[0] * 100, v.attainment[1] * 100), 0) + '%':>11} "
                f"{v.margin * 100:>6.1f}%{'  meets SLO' if v.meets else ''}")
        lines.append("(p90 as mean +- 95 % interval over seeds; attain: share of requests "
                     "meeting both SLOs; margin at the worst seed)")
        if self.chosen is None:
            lines.append(f"no configuration of up to {self.max_instances} instances meets the "
                         "SLO")
        else:
            c = self.chosen
            price = f" (${c.dollars_per_hour:.2f}/h)" if c.dollars_per_hour is not None else ""
            lines.append(f"cheapest: {c.candidate.label()} on {c.gpus} GPUs{price}, margin "
                         f"{c.margin * 100:.1f}% (the tighter of TTFT and TPOT), goodput "
                         f"{c.goodput_per_gpu:.3g} requests/s per GPU")
        return "\n".join(lines)


def _pm(x: tuple[float, float], digits: int) -> str:
    return f"{x[0]:.{digits}f} +- {x[1]:.{digits}f}"


def _finite(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def mean_interval(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % Student-t interval (0 for one value)."""
    iv = stats.mean_interval(values)
    return iv.mean, iv.high - iv.mean


# --- the workload ---------------------------------------------------------------------------


def plan_workload(sc: Scenario, *, rate: float | None = None, input_len: int | None = None,
                  output_len: int | None = None, requests: int | None = None,
                  seeds: int = 3) -> PlanWorkload:
    """The workload to plan for: the options given, else the scenario's most demanding sweep
    values, else its workload's own."""
    wl = sc.workload
    if isinstance(wl, PoissonWorkload):
        base = (wl.qps, wl.input_len.mean, wl.output_len.mean)
    elif isinstance(wl, MultiTurnWorkload):
        base = (wl.conversation_rate, wl.first_prompt.mean, wl.output_len.mean)
    else:  # a trace: its arrivals and lengths are fixed, so there is nothing to plan over
        raise ValueError(  # noqa: TRY004 - the user's scenario, reported as a plain error
            "plan needs a poisson or multi_turn workload (a trace fixes its arrivals and "
            "lengths: use `kvplane sim run` on it)")
    sw = sc.sweep
    rate = rate if rate is not None else max(sw.qps) if sw.qps else base[0]
    inp = input_len if input_len is not None else max(sw.input_lens) if sw.input_lens \
        else int(base[1])
    out = output_len if output_len is not None else max(sw.output_lens) if sw.output_lens \
        else int(base[2])
    n = requests if requests is not None else sc.requests
    return PlanWorkload(kind=wl.kind, rate=float(rate), input_len=int(inp),
                        output_len=int(out), requests=int(n),
                        seeds=tuple(sc.seed + i for i in range(max(seeds, 1))))


# --- candidates and trials ------------------------------------------------------------------


def _candidates(sc: Scenario, max_instances: int) -> dict[int, list[Candidate]]:
    ptp, dtp = sc.prefill_tp, sc.decode_tp
    bidis = [False, True] if sc.workload.kind == "multi_turn" else [False]
    by_cost: dict[int, list[Candidate]] = {}
    for x in range(1, max_instances):
        for y in range(1, max_instances - x + 1):
            for mode in ("push", "pull"):
                for bidi in bidis:
                    by_cost.setdefault(x * ptp + y * dtp, []).append(
                        Candidate(x, y, mode, bidi))
    return dict(sorted(by_cost.items()))


def _point(sc: Scenario, c: Candidate, w: PlanWorkload, rate: float, seed: int) -> Point:
    cluster = sc.cluster.model_copy(update={"prefill_instances": c.prefill,
                                            "decode_instances": c.decode})
    base = sc.model_copy(update={
        "cluster": cluster, "seed": seed, "requests": w.requests,
        "warmup_requests": min(sc.warmup_requests, w.requests // 5),
        "sweep": Sweep(modes=[c.mode], bidirectional=[c.bidirectional],  # type: ignore[list-item]
                       qps=[rate], input_lens=[w.input_len], output_lens=[w.output_len])})
    return base.points()[0]


def _trial(args: tuple[Point, Candidate, int, float, dict[str, float]]) -> Trial:
    point, cand, gpus, rate, slo = args
    sim, s = simulate(point, drain=False)
    ttft_slo, tpot_slo = slo["ttft_p90_ms"] / 1e3, slo["tpot_p90_ms"] / 1e3
    done = sorted(sim.done, key=lambda r: r.arrival)
    done = done[int(len(done) * point.scenario.warmup_requests / max(len(done), 1)):]
    good = 0
    for r in done:
        tpot = (r.finish - r.first_token) / (r.output - 1) if r.output > 1 else 0.0
        good += (r.first_token - r.arrival) <= ttft_slo and tpot <= tpot_slo
    span = (max(r.finish for r in done) - min(r.arrival for r in done)) if done else 0.0
    return Trial(candidate=cand, gpus=gpus, rate=rate, seed=point.seed,
                 ttft_p90=s["ttft_ms"]["p90"], tpot_p90=s["tpot_ms"]["p90"],
                 attainment=good / len(done) if done else 0.0,
                 goodput=good / span if span > 0 else 0.0)


class _Pool:
    """Runs trials on an engine (`engines.py`: local processes, inline for one job, or Ray
    tasks), reporting progress. The local process pool lives for the whole search."""

    def __init__(self, jobs: int, progress: Progress | None, engine: str = "local",
                 address: str | None = None) -> None:
        check_engine(engine, address)
        self.jobs = jobs or (os.cpu_count() or 1)
        self.engine, self.address = engine, address
        self.progress = progress
        self.done = 0
        self.total = 0
        self._pool = (ProcessPoolExecutor(max_workers=self.jobs)
                      if engine == "local" and self.jobs > 1 else None)

    def run(self, work: list[Any]) -> list[Trial]:
        out = []
        if self.engine != "local":
            it = map_ordered(_trial, work, engine=self.engine, address=self.address)
        elif self._pool and len(work) > 1:
            it = self._pool.map(_trial, work)
        else:
            it = map(_trial, work)
        for t in it:
            out.append(t)
            self.done += 1
            if self.progress:
                self.progress(self.done, self.total)
        return out

    def close(self) -> None:
        if self._pool:
            self._pool.shutdown()


def plan(scenario: str | Scenario, *, ttft_p90_ms: float, tpot_p90_ms: float,
         rate: float | None = None, input_len: int | None = None,
         output_len: int | None = None, requests: int | None = None, seeds: int = 3,
         max_instances: int = 8, gpu_hour_price: float | None = None, jobs: int = 0,
         curve: bool = True, progress: Progress | None = None, engine: str = "local",
         address: str | None = None) -> PlanResult:
    """Search xPyD and connector settings for the cheapest one meeting the SLO (module doc)."""
    sc = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    w = plan_workload(sc, rate=rate, input_len=input_len, output_len=output_len,
                      requests=requests, seeds=seeds)
    slo = {"ttft_p90_ms": ttft_p90_ms, "tpot_p90_ms": tpot_p90_ms}
    result = PlanResult(scenario=sc.name, workload=w, slo=slo, gpu_hour_price=gpu_hour_price,
                        max_instances=max_instances, prefill_tp=sc.prefill_tp,
                        decode_tp=sc.decode_tp)
    levels = _candidates(sc, max_instances)
    pool = _Pool(jobs, progress, engine, address)
    # the progress total is an upper bound that shrinks when the search stops early
    pool.total = sum(len(c) for c in levels.values()) * len(w.seeds)
    try:
        tried: list[Candidate] = []
        for gpus, cands in levels.items():
            work = [(_point(sc, c, w, w.rate, seed), c, gpus, w.rate, slo)
                    for c in cands for seed in w.seeds]
            trials = pool.run(work)
            tried += cands
            for c in cands:
                mine = [t for t in trials if t.candidate == c]
                result.verdicts.append(_verdict(c, gpus, mine, slo, gpu_hour_price))
            passing = [v for v in result.verdicts if v.gpus == gpus and v.meets]
            if passing:
                result.chosen = max(passing, key=lambda v: v.margin)
                break
        if curve and result.chosen is not None:
            ch = result.chosen.candidate
            shapes = sorted({(c.prefill, c.decode) for c in tried})
            work = [(_point(sc, cand, w, w.rate * f, w.seeds[0]), cand,
                     cand.prefill * sc.prefill_tp + cand.decode * sc.decode_tp, w.rate * f, slo)
                    for x, y in shapes
                    for cand in [Candidate(x, y, ch.mode, ch.bidirectional)]
                    for f in CURVE_RATES]
            pool.total = pool.done + len(work)
            result.curve = pool.run(work)
        else:
            pool.total = pool.done
            if progress:
                progress(pool.done, pool.total)
    finally:
        pool.close()
    return result


def _verdict(c: Candidate, gpus: int, trials: list[Trial], slo: dict[str, float],
             price: float | None) -> Verdict:
    margins = [min((slo["ttft_p90_ms"] - t.ttft_p90) / slo["ttft_p90_ms"],
                   (slo["tpot_p90_ms"] - t.tpot_p90) / slo["tpot_p90_ms"]) for t in trials]
    worst = min(margins)
    return Verdict(
        candidate=c, gpus=gpus, dollars_per_hour=gpus * price if price is not None else None,
        ttft_p90=mean_interval([t.ttft_p90 for t in trials]),
        tpot_p90=mean_interval([t.tpot_p90 for t in trials]),
        attainment=mean_interval([t.attainment for t in trials]),
        goodput_per_gpu=sum(t.goodput for t in trials) / len(trials) / gpus,
        margin=worst, meets=worst >= 0)


def search(scenario: str | Scenario, *, ttft_p90_ms: float, tpot_p90_ms: float,
           qps: float | None = None, max_instances: int = 8, jobs: int = 0,
           seeds: int = 1, engine: str = "local",
           address: str | None = None) -> tuple[str, bool]:
    """`plan` as text and whether a configuration was found (no attainment curve)."""
    res = plan(scenario, ttft_p90_ms=ttft_p90_ms, tpot_p90_ms=tpot_p90_ms, rate=qps,
               max_instances=max_instances, jobs=jobs, seeds=seeds, curve=False,
               engine=engine, address=address)
    return res.text(), res.found
