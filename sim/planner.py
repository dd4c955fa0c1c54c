"""Capacity planning: the cheapest xPyD and connector settings that meet an SLO.

Rules kept here:
- Cost is GPUs: prefill instances x prefill TP + decode instances x decode TP.
- Candidates are tried cheapest first; every candidate of one cost is simulated (in parallel)
  and the search stops at the first cost where one meets the SLO. So the answer is the
  cheapest, and among equally cheap ones the one with the most margin.
- Margin is the smaller of (SLO - p90) / SLO over TTFT and TPOT: how much load growth or
  model error the configuration absorbs before it breaks the SLO.
- Modes tried: push and pull; with a multi-turn workload also bidirectional reuse on and off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import Point, Scenario, Sweep, load_scenario
from .engines import check_engine, map_ordered
from .runner import simulate


@dataclass(frozen=True)
class Candidate:
    prefill: int
    decode: int
    mode: str
    bidirectional: bool

    def label(self) -> str:
        reuse = "+reuse" if self.bidirectional else ""
        return f"{self.prefill}P{self.decode}D {self.mode}{reuse}"


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


def _point(sc: Scenario, c: Candidate, qps: float | None) -> Point:
    cluster = sc.cluster.model_copy(update={"prefill_instances": c.prefill,
                                            "decode_instances": c.decode})
    update: dict[str, Any] = {"cluster": cluster, "sweep": Sweep(
        modes=[c.mode], bidirectional=[c.bidirectional],  # type: ignore[list-item]
        qps=[qps] if qps is not None else None)}
    return sc.model_copy(update=update).points()[0]


def _evaluate(args: tuple[Point, Candidate]) -> tuple[Candidate, dict[str, Any]]:
    point, cand = args
    return cand, simulate(point, drain=False)[1]


def search(scenario: str | Scenario, *, ttft_p90_ms: float, tpot_p90_ms: float,
           qps: float | None = None, max_instances: int = 8, jobs: int = 0,
           engine: str = "local", address: str | None = None) -> tuple[str, bool]:
    """The cheapest configuration meeting the SLO, as a table; candidates of one cost run on
    `engine` (local processes or Ray tasks: the same answer either way)."""
    check_engine(engine, address)
    sc = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    if qps is None and sc.sweep.qps:
        qps = max(sc.sweep.qps)
    lines = [(f"planning {sc.name} at {qps if qps is not None else 'the scenario'} QPS: "
              f"SLO p90 TTFT <= {ttft_p90_ms:g} ms, p90 TPOT <= {tpot_p90_ms:g} ms"),
             f"{'GPUs':>4}  {'candidate':<20} {'TTFT p90':>9} {'TPOT p90':>9} {'margin':>7}"]
    best: tuple[float, Candidate, int] | None = None
    for cost, cands in _candidates(sc, max_instances).items():
        work = [(_point(sc, c, qps), c) for c in cands]
        results = list(map_ordered(_evaluate, work, engine=engine, jobs=jobs,
                                   address=address))
        for c, s in results:
            ttft, tpot = s["ttft_ms"]["p90"], s["tpot_ms"]["p90"]
            margin = min((ttft_p90_ms - ttft) / ttft_p90_ms, (tpot_p90_ms - tpot) / tpot_p90_ms)
            ok = margin >= 0
            lines.append(f"{cost:>4}  {c.label():<20} {ttft:>9.1f} {tpot:>9.2f} "
                         f"{margin * 100:>6.1f}%{'  meets SLO' if ok else ''}")
            if ok and (best is None or margin > best[0]):
                best = (margin, c, cost)
        if best is not None:
            break
    if best is None:
        lines.append(f"no configuration of up to {max_instances} instances meets the SLO")
        return "\n".join(lines), False
    margin, c, cost = best
    lines.append(f"cheapest: {c.label()} on {cost} GPUs, margin {margin * 100:.1f}% "
                 f"(the tighter of TTFT and TPOT)")
    return "\n".join(lines), True
