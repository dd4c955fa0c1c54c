"""Does the simulator predict the published results? (docs/published.md)

Rules kept here:
- Published figures and their tolerances are read from scenarios/published.yaml (through the
  seed scenarios' `published: {study: ...}`); nothing published is typed in here.
- Every check runs over several seeds and reports the mean with a 95 % t-interval
  (sim/stats.py). A check passes when its interval overlaps the tolerance band around the
  published figure; the table also says how many single seeds fell inside the band.
- A figure that a constant of the calibration in use (or a scenario choice it lists) was fitted
  to is *fitted*: shown with its error, never counted. The verdict counts *predicted* figures
  only. A figure without a tolerance is context: shown, never counted.
- Figures against prompt length (bidirectional) are read off the simulated curve: the mean of
  each prompt length, interpolated linearly at the published length. A prefill duration there
  is the study's harness window (`prefill_window`: from the router handing the request to
  prefill to the router having its answer), which the calibration fit prices too.
- A published anchor that contradicts another published anchor (a TTFT below the prefill
  duration it contains) is shown, marked and explained; it does not fail the command, because
  no causal model can meet it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .config import Point, Published, PublishedFigure, Scenario, load_scenario, where_matches
from .engine import SimRequest
from .profiles import CalibrationProfile
from .runner import simulate
from .stats import Interval, mean_interval

DEFAULT_SEEDS = 10
_SPEEDUPS = ("ttft_speedup", "tpot_speedup")


@dataclass
class Check:
    figure: PublishedFigure
    name: str
    samples: list[float]
    fitted_by: list[str] = field(default_factory=list)
    unit: str = "ms"
    anchor_note: str = ""

    @property
    def published(self) -> float | tuple[float, float]:
        f = self.figure
        if f.low is not None and f.high is not None:
            return (f.low, f.high)
        assert f.value is not None
        return f.value

    @property
    def interval(self) -> Interval:
        return mean_interval(self.samples)

    @property
    def band(self) -> tuple[float, float]:
        pub = self.published
        lo, hi = pub if isinstance(pub, tuple) else (pub, pub)
        tol = self.figure.tolerance or 0.0
        return lo * (1 - tol), hi * (1 + tol)

    @property
    def error(self) -> float:
        """Relative error of the mean against the published value (0 inside a range)."""
        pub, sim = self.published, self.interval.mean
        if isinstance(pub, tuple):
            lo, hi = pub
            if lo <= sim <= hi:
                return 0.0
            edge = lo if sim < lo else hi
            return (sim - edge) / edge
        return (sim - pub) / pub

    @property
    def within(self) -> bool:
        return self.interval.overlaps(*self.band)

    @property
    def kind(self) -> str:
        if self.figure.tolerance is None:
            return "context"
        return "fitted" if self.fitted_by else "predicted"

    @property
    def counted(self) -> bool:
        return self.kind == "predicted"

    @property
    def ok(self) -> bool:
        return not self.counted or self.within or bool(self.anchor_note)

    @property
    def verdict(self) -> str:
        if self.kind == "context":
            return "context (no verdict)"
        if self.kind == "fitted":
            return f"fitted ({'inside' if self.within else 'outside'} band, not counted)"
        if self.within:
            return "pass"
        return "MISS (inconsistent anchor)" if self.anchor_note else "FAIL"

    def row(self) -> str:
        pub = self.published
        pub_s = f"{pub[0]:g}-{pub[1]:g}" if isinstance(pub, tuple) else f"{pub:.3g}"
        iv = self.interval
        tol = f"±{self.figure.tolerance * 100:.0f} %" if self.figure.tolerance else "-"
        inside = f"{iv.within(*self.band)}/{iv.n}" if self.figure.tolerance else "-"
        return (f"| {self.name} | `{self.figure.id}` | {pub_s} {self.unit} | "
                f"{iv.text('.2f' if self.unit == 'x' else '.1f')} {self.unit} | "
                f"{self.error * 100:+.1f} % | {tol} | {inside} | {self.verdict} |")


HEADER = [("| check | figure | published | simulated: mean [95 % CI] | error of mean | "
           "tolerance | seeds inside | verdict |"), "|---|---|---|---|---|---|---|---|"]


# --- running the scenarios over seeds ---------------------------------------------------------


def _axes(p: Point) -> dict[str, Any]:
    return {"mode": p.mode, "bidirectional": p.bidirectional, "qps": p.qps,
            "input_len": p.input_len, "output_len": p.output_len}


def _needed(study: Published, p: Point) -> bool:
    """A point some figure of the study (speedups: either side) is read from."""
    ax = _axes(p)
    for f in study.figures:
        where = {k: v for k, v in f.where.items() if k in ax}
        if f.metric in _SPEEDUPS:
            where = {k: v for k, v in where.items() if k not in study.baseline}
        if where_matches(where, **ax):
            return True
    return False


def _seeded(sc: Scenario, k: int) -> Scenario:
    return sc.model_copy(update={"seed": sc.seed + k})


def _run_points(points: Sequence[Point], jobs: int) -> list[tuple[Any, dict[str, Any]]]:
    """(done requests, summary) of each point, in order."""
    if jobs <= 1 or len(points) <= 1:
        return [_one(p) for p in points]
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(_one, points))


def _one(p: Point) -> tuple[list[SimRequest], dict[str, Any]]:
    sim, summary = simulate(p, drain=False)
    for r in sim.done:  # callbacks do not pickle; the statistics need none
        r.on_done = None
    return sim.done, summary


# --- push vs pull -------------------------------------------------------------------------------


def push_pull_checks(sc: Scenario, per_seed: Sequence[dict[tuple[Any, ...], dict[str, Any]]],
                     fitted: dict[str, list[str]]) -> list[Check]:
    """`per_seed`: one dict per seed, (mode, qps, input_len) -> the point's summary."""
    study = sc.published
    assert study is not None
    base_mode = str(study.baseline.get("mode", "pull"))
    new_mode = str(study.improved.get("mode", "push"))
    keys = sorted({k for d in per_seed for k in d}, key=lambda k: (k[1], k[2], k[0]))
    checks: list[Check] = []

    def fitted_by(f: PublishedFigure) -> list[str]:
        ids = [f.id, *(f.ratio_of or ())]
        return sorted({what for i in ids for what in fitted.get(i, [])})

    for f in study.figures:
        metric = f.metric
        if metric in ("ttft_ms", "tpot_ms"):
            for mode, qps, inp in keys:
                if not f.matches(mode=mode, qps=qps, input_len=inp):
                    continue
                samples = [d[(mode, qps, inp)][metric]["mean"] for d in per_seed]
                name = f"{'TTFT' if metric == 'ttft_ms' else 'TPOT'}, {mode}, {qps:g} QPS, {inp} in"
                checks.append(Check(f, name, samples, fitted_by(f)))
        elif metric in _SPEEDUPS:
            base = "ttft_ms" if metric == "ttft_speedup" else "tpot_ms"
            for qps, inp in sorted({(k[1], k[2]) for k in keys}):
                if not f.matches(qps=qps, input_len=inp):
                    continue
                samples = [d[(base_mode, qps, inp)][base]["mean"]
                           / d[(new_mode, qps, inp)][base]["mean"] for d in per_seed]
                what = "TTFT" if base == "ttft_ms" else "TPOT"
                checks.append(Check(f, f"{what} {base_mode}/{new_mode}, {qps:g} QPS, {inp} in",
                                    samples, fitted_by(f), unit="x"))
    return checks


def run_push_pull(sc: Scenario, seeds: int, jobs: int
                  ) -> list[dict[tuple[Any, ...], dict[str, Any]]]:
    assert sc.published is not None
    out: list[dict[tuple[Any, ...], dict[str, Any]]] = []
    points = [p for k in range(seeds) for p in _seeded(sc, k).points()
              if _needed(sc.published, p)]
    results = _run_points(points, jobs)
    per = len(points) // seeds
    for k in range(seeds):
        chunk = zip(points[k * per:(k + 1) * per], results[k * per:(k + 1) * per], strict=True)
        out.append({(p.mode, p.qps, p.input_len): s for p, (_, s) in chunk})
    return out


# --- bidirectional ----------------------------------------------------------------------------


def prefill_window(r: SimRequest) -> float:
    """A prefill duration as the bidirectional study's harness times it: the multi-turn proxy of
    vLLM PR #32553 clocks its whole call to prefill, from sending the request to having the
    answer (docs/published.md section 2). Without an answer to the router (push) it ends with
    prefill's last step."""
    end = r.prefill_answered if r.prefill_answered >= 0 else r.prefill_end
    return end - r.prefill_received


def curve(done: Sequence[SimRequest], metric: str) -> tuple[np.ndarray, np.ndarray]:
    """Mean of a per-request metric at each prompt length (ms)."""
    values: dict[int, list[float]] = {}
    for r in done:
        if metric == "ttft_ms":
            v = r.first_token - r.arrival
        elif metric == "prefill_ms":
            v = prefill_window(r)
        else:  # kv_transfer_ms: the D->P read that reuse adds
            if r.reuse_read_s <= 0:
                continue
            v = r.reuse_read_s
        values.setdefault(r.prompt, []).append(v * 1e3)
    xs = np.array(sorted(values), dtype=float)
    ys = np.array([np.mean(values[int(x)]) for x in xs])
    return xs, ys


_LABEL = {"ttft_ms": "TTFT", "prefill_ms": "prefill duration", "kv_transfer_ms": "D->P transfer"}


def bidirectional_checks(sc: Scenario, per_seed: Sequence[dict[bool, Sequence[SimRequest]]],
                         fitted: dict[str, list[str]]) -> list[Check]:
    study = sc.published
    assert study is not None
    checks: list[Check] = []
    for f in study.figures:
        at = float(f.where["prompt_tokens"])  # type: ignore[arg-type]
        by = sorted({w for i in (f.id, *(f.ratio_of or ())) for w in fitted.get(i, [])})
        if f.metric == "ttft_speedup":
            samples = [float(np.interp(at, *curve(runs[False], "ttft_ms")))
                       / float(np.interp(at, *curve(runs[True], "ttft_ms"))) for runs in per_seed]
            checks.append(Check(f, f"TTFT off/on at {at / 1024:g}k", samples, by, unit="x"))
            continue
        bidi = bool(f.where["bidirectional"])
        samples = [float(np.interp(at, *curve(runs[bidi], f.metric))) for runs in per_seed]
        checks.append(Check(f, f"{_LABEL[f.metric]}, reuse {'on' if bidi else 'off'}, "
                            f"{at / 1024:g}k", samples, by, anchor_note=_inconsistent(study, f)))
    return checks


def run_bidirectional(sc: Scenario, seeds: int, jobs: int
                      ) -> list[dict[bool, Sequence[SimRequest]]]:
    points = [p for k in range(seeds) for p in _seeded(sc, k).points()]
    results = _run_points(points, jobs)
    out: list[dict[bool, Sequence[SimRequest]]] = [{} for _ in range(seeds)]
    per = len(points) // seeds
    for i, (p, (done, _)) in enumerate(zip(points, results, strict=True)):
        out[i // per][p.bidirectional] = done
    return out


def _inconsistent(study: Published, f: PublishedFigure) -> str:
    """A published TTFT below the published prefill duration of the same point."""
    if f.metric not in ("ttft_ms", "prefill_ms") or f.value is None:
        return ""
    other = "prefill_ms" if f.metric == "ttft_ms" else "ttft_ms"
    g = next((x for x in study.figures if x.metric == other and x.where == f.where), None)
    if g is None or g.value is None:
        return ""
    ttft, prefill = (f.value, g.value) if f.metric == "ttft_ms" else (g.value, f.value)
    if ttft < prefill:
        return (f"published TTFT {ttft:g} ms is below the published prefill duration "
                f"{prefill:g} ms of the same point; TTFT contains the prefill")
    return ""


# --- figures of vLLM pull requests that a seed scenario can stand in for ---------------------


def reader_thread_checks(sc: Scenario, prs: Published, seeds: int, jobs: int) -> list[Check]:
    """PR #45211: pull with a reader thread against inline preparation, on the push/pull seed's
    platform (the PR's output length, request count and pool state are not stated)."""
    checks: list[Check] = []
    for f in prs.figures:
        if f.id != "pr45211-reader-thread":
            continue
        pts = [p for k in range(seeds) for p in _seeded(sc, k).points()
               if f.matches(mode=p.mode, qps=p.qps, input_len=p.input_len)]
        threaded = [replace_point(p, pull_reader_thread=True) for p in pts]
        base = _run_points(pts, jobs)
        with_thread = _run_points(threaded, jobs)
        samples = [a["ttft_ms"]["mean"] / b["ttft_ms"]["mean"]
                   for (_, a), (_, b) in zip(base, with_thread, strict=True)]
        checks.append(Check(f, "TTFT pull inline / pull reader thread, 8 QPS, 2048 in",
                            samples, unit="x"))
    return checks


def replace_point(p: Point, **connector: Any) -> Point:
    from dataclasses import replace

    sc = p.scenario.model_copy(update={"connector": p.scenario.connector.model_copy(
        update=connector)})
    return replace(p, scenario=sc)


# --- sensitivity and the whole report -------------------------------------------------------------


def sensitivity(sc: Scenario, seeds: int, jobs: int,
                runs: Iterable[float | None] = (None, 9.0, 6.2, 4.0),
                seed_results: Sequence[dict[tuple[Any, ...], dict[str, Any]]] | None = None,
                ) -> list[str]:
    """The high-load push/pull figures against decode-pool fragmentation (not published).
    A synthetic history replaces the seed's `engine.pool_history`; `seed_results` (from
    `run_push_pull`) gives the first row without running it again."""
    seed_run = sc.engine.pool_run_blocks
    history = sc.engine.pool_history
    assumed = (f"the seed assumes {seed_run}" if seed_run is not None else
               "the seed assumes none: its figures above are the first row")
    own = ("the run's own requests" if history == "none" else
           f"the history the seed names (`engine.pool_history: {history}`) and the run's own "
           "requests; a synthetic history replaces it")
    lines = [("What-if: the high-load figures (8 QPS, 16k in; mean over "
              f"{seeds} seeds) under a synthetic history of decode's pool (`engine.pool_run_blocks`: "
              f"mean contiguous run it hands out, blocks; {assumed}; 'none' is what "
              f"the allocator gives from {own}; the second column is the mean run the "
              "transfers got):"), "",
             ("| synthetic run | mean run handed out (blocks) | TTFT push | TTFT pull | pull/push |"
              " TPOT push | TPOT pull | pull/push |"),
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        by: dict[str, list[dict[str, Any]]] = {}
        if r is None and seed_results is not None and seed_run is None:
            for d in seed_results:
                for (mode, qps, inp), s in d.items():
                    if qps == 8 and inp == 16384:
                        by.setdefault(mode, []).append(s)
        else:
            update: dict[str, Any] = {"pool_run_blocks": r}
            if r is not None:
                update["pool_history"] = "none"
            engine = sc.engine.model_copy(update=update)
            base = sc.model_copy(update={"engine": engine})
            pts = [p for k in range(seeds) for p in _seeded(base, k).points()
                   if p.qps == 8 and p.input_len == 16384]
            res = _run_points(pts, jobs)
            for p, (_, s) in zip(pts, res, strict=True):
                by.setdefault(p.mode, []).append(s)

        def m(mode: str, metric: str, by: dict[str, list[dict[str, Any]]] = by) -> Interval:
            return mean_interval([s[metric]["mean"] for s in by[mode]])

        tr = mean_interval([b[ "ttft_ms"]["mean"] / a["ttft_ms"]["mean"]
                            for a, b in zip(by["push"], by["pull"], strict=True)])
        pr = mean_interval([b["tpot_ms"]["mean"] / a["tpot_ms"]["mean"]
                            for a, b in zip(by["push"], by["pull"], strict=True)])
        label = r if r is not None else (
            "none (the allocator alone)" if not history else
            f"none (the allocator after the {sc.engine.pool_history} history)")
        run_len = mean_interval([s["mean_run_blocks"] for v in by.values() for s in v
                                 if s["mean_run_blocks"] is not None])
        lines.append(f"| {label} | {run_len.mean:.1f} | {m('push', 'ttft_ms').mean:.0f}"
                     f" | {m('pull', 'ttft_ms').mean:.0f} | {tr.text('.2f')}x | "
                     f"{m('push', 'tpot_ms').mean:.2f} | {m('pull', 'tpot_ms').mean:.2f} | "
                     f"{pr.text('.2f')}x |")
    return lines


def fitted_map(calibration: CalibrationProfile | None, scenario: str) -> dict[str, list[str]]:
    return calibration.fitted_figures(scenario) if calibration is not None else {}


def run_validation(jobs: int = 0, seeds: int = DEFAULT_SEEDS,
                   calibration: CalibrationProfile | None = None,
                   sensitivity_table: bool = True,
                   scenario_loader: Callable[[str], Scenario] = load_scenario,
                   ) -> tuple[bool, str]:
    from .calibration import apply_calibration, calibration_for

    pp = scenario_loader("seed_push_vs_pull")
    bd = scenario_loader("seed_bidirectional")
    if calibration is not None:
        pp, bd = apply_calibration(pp, calibration), apply_calibration(bd, calibration)
    cal_pp = calibration or calibration_for(pp)
    cal_bd = calibration or calibration_for(bd)
    pp_results = run_push_pull(pp, seeds, jobs)
    checks = push_pull_checks(pp, pp_results, fitted_map(cal_pp, "seed_push_vs_pull"))
    checks += bidirectional_checks(bd, run_bidirectional(bd, seeds, jobs),
                                   fitted_map(cal_bd, "seed_bidirectional"))
    from .config import load_published

    checks += reader_thread_checks(pp, load_published()["vllm_prs"], seeds, jobs)
    predicted = [c for c in checks if c.counted]
    fitted = [c for c in checks if c.kind == "fitted"]
    names = sorted({c.name for c in (cal_pp, cal_bd) if c is not None})
    lines = [
        "# Validation: simulated against published",
        "",
        "Produced by `kvplane validate` (scenarios `seed_push_vs_pull` and `seed_bidirectional`;",
        "published figures from `scenarios/published.yaml`, described in docs/published.md;",
        (f"calibration {', '.join(f'`{n}`' for n in names) or '(none)'}). Every figure is the "
         f"mean over {seeds} seeds with its 95 % t-interval; a check passes when the interval "
         "overlaps the tolerance band. Only *predicted* figures count: a figure some constant "
         "was fitted to is shown as *fitted* and not counted."),
        "",
        "## Predicted (counted)",
        "",
        *HEADER,
        *[c.row() for c in predicted],
        "",
        "## Fitted (a constant or scenario choice was solved from it; not counted)",
        "",
        *HEADER,
        *[c.row() for c in fitted],
        "",
        "What each fitted figure was used for:",
        "",
        *[f"- `{fid}`: {', '.join(by)}" for fid, by in
          {c.figure.id: c.fitted_by for c in fitted}.items()],
    ]
    context = [c for c in checks if c.kind == "context"]
    if context:
        lines += ["", "## Context (no tolerance: shown, never counted)", "", *HEADER,
                  *[c.row() for c in context]]
    notes = [c for c in checks if c.anchor_note and c.counted and not c.within]
    if notes:
        lines += ["", "Inconsistent anchors:"]
        lines += [f"- {c.name}: {c.anchor_note}." for c in notes]
    if sensitivity_table:
        lines += ["", *sensitivity(pp, seeds, jobs, seed_results=pp_results)]
    failed = [c for c in predicted if not c.ok]
    passed = [c for c in predicted if c.within]
    lines += ["", (f"{len(passed)} of {len(predicted)} predicted checks pass; {len(failed)} fail; "
                   f"{len(notes)} miss an inconsistent published anchor; {len(fitted)} figures "
                   "were fitted and are not counted.")]
    return not failed, "\n".join(lines)
