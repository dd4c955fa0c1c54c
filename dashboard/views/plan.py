"""Plan: a `kvplane plan` search kept in the store: the workload it planned for, every
candidate with its intervals over seeds, the choice, and SLO attainment against instances and
rate."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from .. import common, figures

TITLE = "Plan"
SLUG = "plan"


def _plan(meta: Any) -> dict[str, Any] | None:
    plan = meta.get("plan") if isinstance(meta, dict) else None
    return plan if isinstance(plan, dict) else None


def verdict_table(plan: dict[str, Any]) -> pd.DataFrame:
    rows = []
    for v in plan["verdicts"]:
        rows.append({
            "GPUs": v["gpus"], "$/h": v["dollars_per_hour"], "candidate": v["label"],
            "TTFT p90 (ms)": round(v["ttft_p90"][0], 1), "± (95 %)": round(v["ttft_p90"][1], 1),
            "TPOT p90 (ms)": round(v["tpot_p90"][0], 2), "± (95 % )": round(v["tpot_p90"][1], 2),
            "attainment %": round(v["attainment"][0] * 100, 1),
            "goodput/GPU (req/s)": round(v["goodput_per_gpu"], 3),
            "margin %": round(v["margin"] * 100, 1), "meets SLO": v["meets"],
        })
    return pd.DataFrame(rows)


def render(url: str, table: pd.DataFrame) -> None:
    st.header("Plan")
    plans = table[table["meta"].map(lambda m: _plan(m) is not None)]
    if plans.empty:
        st.info("No plan in the store: run `kvplane plan seed_push_vs_pull` (it keeps its "
                "search here).")
        return
    run_id = common.pick_run("Search", plans, "plan_run")
    assert run_id is not None
    plan = _plan(plans.loc[plans["id"] == run_id, "meta"].iloc[0])
    assert plan is not None
    w, slo = plan["workload"], plan["slo"]
    what = "first-turn prompt" if w["kind"] == "multi_turn" else "input"
    st.markdown(
        f"**Workload planned for**: {w['rate']:g} {w['rate_unit']}, {what} {w['input_len']} "
        f"tokens, output {w['output_len']} tokens, {w['requests']} requests per run, "
        f"{len(w['seeds'])} seeds ({', '.join(str(s) for s in w['seeds'])}).  \n"
        f"**SLO**: p90 TTFT ≤ {slo['ttft_p90_ms']:g} ms and p90 TPOT ≤ "
        f"{slo['tpot_p90_ms']:g} ms at every seed"
        + (f"; ${plan['gpu_hour_price']:g} per GPU-hour." if plan.get("gpu_hour_price") else "."))
    chosen = plan.get("chosen")
    if chosen:
        price = (f" (${chosen['dollars_per_hour']:.2f}/h)" if chosen.get("dollars_per_hour")
                 is not None else "")
        st.success(f"Cheapest meeting the SLO: **{chosen['label']}** on {chosen['gpus']} GPUs"
                   f"{price}, margin {chosen['margin'] * 100:.1f} %.")
    else:
        st.warning(f"No configuration of up to {plan['max_instances']} instances meets the "
                   "SLO.")
    st.subheader("Candidates, cheapest first")
    st.dataframe(verdict_table(plan), hide_index=True, width="stretch")
    curve = pd.DataFrame(plan.get("curve") or [])
    if curve.empty:
        st.caption("This search ran without the attainment curve (`--no-curve`).")
        return
    curve["shape"] = curve["candidate"].map(lambda c: f"{c['prefill']}P{c['decode']}D")
    mode = curve["label"].iloc[0].partition(" ")[2]
    st.subheader(f"SLO attainment against instances and rate ({mode}, one seed each)")
    st.plotly_chart(figures.attainment_vs_rate(curve, w["rate_unit"], w["rate"]),
                    width="stretch", key="plan_curve")
    st.plotly_chart(figures.attainment_grid(curve, w["rate_unit"]), width="stretch",
                    key="plan_grid")
    good = curve.assign(goodput_per_gpu=curve["goodput"] / curve["gpus"])
    st.dataframe(good.pivot_table(index="shape", columns="rate", values="goodput_per_gpu")
                 .round(3), width="stretch")
    st.caption("Goodput per GPU (requests/s meeting both SLOs, per GPU), by shape and rate.")
