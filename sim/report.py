"""Plain-text tables of simulated points, for the terminal."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any


def points_table(points: Sequence[dict[str, Any]]) -> str:
    head = (f"{'point':<34} {'n':>5} {'TTFT mean':>10} {'p90':>8} {'TPOT mean':>10} "
            f"{'p90':>7} {'prefill':>8} {'xfer':>7} {'reuse read':>10} {'tok/s':>8} {'preempt':>7}")
    rows = [head, "-" * len(head)]
    for p in points:
        label = p["label"]
        if p.get("rate_unit") == "conversations/s":  # a multi-turn rate: new conversations/s
            label = re.sub(r"(^|_)qps([0-9.eE+-]+)(?=_|$)", r"\1\2conv/s", label)
        rows.append(
            f"{label:<34} {p['n']:>5} {p['ttft_ms']['mean']:>10.1f} "
            f"{p['ttft_ms']['p90']:>8.1f} {p['tpot_ms']['mean']:>10.2f} {p['tpot_ms']['p90']:>7.2f}"
            f" {p['prefill_ms']['mean']:>8.1f} {_num(p['transfer_ms']['mean']):>7}"
            f" {_num(p['reuse_read_ms']['mean']):>10} {p['throughput_tok_s']:>8.0f}"
            f" {p.get('preemptions', 0):>7}")
    return "\n".join(rows) + "\n(times in ms; conv/s: new conversations per second)" \
        if any(p.get("rate_unit") == "conversations/s" for p in points) \
        else "\n".join(rows) + "\n(times in ms)"


def _num(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.1f}"


def comparison_table(summary: dict[str, Any]) -> str:
    """Push against pull at each (QPS, input length): the shape of the published figures."""
    pts = summary["points"]
    by = {(p["mode"], p["qps"], p["input_len"]): p for p in pts}
    keys = sorted({(p["qps"], p["input_len"]) for p in pts})
    head = (f"{'QPS':>4} {'input':>6} | {'TTFT push':>9} {'TTFT pull':>9} {'pull/push':>9} | "
            f"{'TPOT push':>9} {'TPOT pull':>9} {'pull/push':>9}")
    rows = [f"push vs pull, {summary['scenario']} (mean, ms)", head, "-" * len(head)]
    for qps, inp in keys:
        a, b = by.get(("push", qps, inp)), by.get(("pull", qps, inp))
        if a is None or b is None:
            continue
        ta, tb = a["ttft_ms"]["mean"], b["ttft_ms"]["mean"]
        pa, pb = a["tpot_ms"]["mean"], b["tpot_ms"]["mean"]
        rows.append(f"{qps:>4g} {inp:>6} | {ta:>9.1f} {tb:>9.1f} {tb / ta:>8.2f}x | "
                    f"{pa:>9.2f} {pb:>9.2f} {pb / pa:>8.2f}x")
    from .config import load_published

    figs = load_published()["push_vs_pull"].figures
    rows.append("published (docs/published.md):")
    rows += [f"  {f.id}: {f.value:.4g}" if f.value is not None else f"  {f.id}: {f.low:g}-{f.high:g}"
             for f in figs]
    return "\n".join(rows)
