"""Reuse: TTFT against prompt length with reuse on and off, prefill time split into recompute
and transfer (the D->P read), and how reuse went (hit, miss, expired, refused, ...)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from .. import common, figures, rollup
from .push_pull import published_points

TITLE = "Reuse"
SLUG = "reuse"

_OUTCOME_NAMES = {"read": "hit (read)", "recompute": "recompute (below threshold)",
                  "miss": "miss", "mismatch": "prefix mismatch", "expired": "expired",
                  "refused": "refused"}


def _runs_of(url: str, table: pd.DataFrame, run_id: str) -> list[str]:
    row = table[table["id"] == run_id].iloc[0]
    if row["requests"] > 0:
        return [run_id]
    kids = common.children(url, run_id)
    has = set(table.loc[table["requests"] > 0, "id"])
    return [k for k in kids["id"] if k in has]


def render(url: str, table: pd.DataFrame) -> None:
    st.header("Reuse")
    candidates = table[(table["requests"] > 0) | (table["children"] > 0)]
    with_reuse = set(table.loc[table["reuse_decisions"] > 0, "id"])
    sweeps_with = set(table.loc[table["id"].isin(with_reuse), "parent"].dropna())
    candidates = common.preferring(candidates, candidates["id"].isin(sweeps_with))
    c1, c2 = st.columns(2)
    with c1:
        first = common.pick_run("Sweep or run", candidates, "reuse_run",
                                help="A sweep with reuse off and on (seed_bidirectional), or a run")
    if first is None:
        st.info("No run in the store.")
        return
    names = common.labels(table)
    others = candidates[candidates["id"] != first]
    second = c2.selectbox("Compare with (optional)", [None, *others["id"]], key="reuse_run2",
                          format_func=lambda i: "none" if i is None else names.get(i, i))
    run_ids = _runs_of(url, table, first) + (_runs_of(url, table, second) if second else [])
    if not run_ids:
        st.info("No requests in that choice.")
        return
    # from the runs' rollups when each has a current one (a long run's requests are not read
    # on a visit); else from the events. A run of more than REUSE_POINTS requests is drawn
    # by an even sample of them either way.
    kept = {r: common.rollup_part(url, r, "reuse") for r in run_ids}
    if all(b is not None for b in kept.values()):
        split = pd.concat([rollup.from_json(b["split"]) for b in kept.values() if b])
        counts = pd.concat([rollup.from_json(b["outcomes"]) for b in kept.values() if b])
        sizes = {r: int(b["requests"]) for r, b in kept.items() if b}
    else:
        # runs without a reuse decision made no D->P read: their transfers need not be read
        whole = common.prefill_split(url, tuple(run_ids), bool(with_reuse & set(run_ids)))
        sizes = whole.groupby("run").size().to_dict() if not whole.empty else {}
        split = pd.concat([rollup.reuse_sample(g) for _, g in whole.groupby("run", sort=False)]
                          ) if not whole.empty else whole
        counts = common.reuse_outcomes(url, tuple(run_ids))
    if split.empty:
        st.info("No requests in that choice.")
        return
    setting = split.groupby("run")["bidirectional"].mean().map(
        lambda b: "reuse on" if b and b >= 0.5 else "reuse off")
    if setting.nunique() < len(setting):  # two runs of one setting: tell them apart by name
        setting = pd.Series({r: f"{setting[r]} · {r[:8]}" for r in setting.index})
    split["setting"] = split["run"].map(setting)
    scenario = common.sweep_scenario(url, first) if table.loc[
        table["id"] == first, "children"].iloc[0] else None
    pub = published_points(scenario)
    if not pub.empty:
        pub = pub[pub["metric"].isin(["ttft_ms", "prefill_ms", "kv_transfer_ms"])
                  & pub["prompt_tokens"].notna()]
    st.plotly_chart(figures.reuse_scatter(split.dropna(subset=["ttft"]), pub),
                    width="stretch", key="reuse_scatter")
    st.plotly_chart(figures.prefill_split(split), width="stretch", key="reuse_split")
    sampled = {r: n for r, n in sizes.items() if n > rollup.REUSE_POINTS}
    if sampled:
        st.caption(f"Long runs are drawn by an even sample of {rollup.REUSE_POINTS:,} of their "
                   "requests: " + ", ".join(f"{names.get(r, r[:8])}: of {n:,}"
                                            for r, n in sampled.items())
                   + ". The outcome counts below cover every request.")

    counts["setting"] = counts["run"].map(setting)
    counts["what"] = counts["what"].map(lambda w: _OUTCOME_NAMES.get(w, w))
    counts = counts.groupby(["setting", "what"], as_index=False)["count"].sum()
    st.subheader("Outcomes")
    if counts.empty:
        st.caption("No reuse decision in these runs (reuse off, or no multi-turn requests).")
    else:
        c3, c4 = st.columns([3, 2])
        c3.plotly_chart(figures.outcome_bars(counts), width="stretch",
                        key="reuse_outcomes")
        c4.dataframe(counts.pivot_table(index="what", columns="setting", values="count",
                                        fill_value=0), width="stretch")
    by = split.groupby("setting").agg(
        requests=("request", "count"), ttft_ms=("ttft", lambda s: s.mean() * 1e3),
        recompute_ms=("recompute", lambda s: s.mean() * 1e3),
        read_ms=("read", lambda s: s.mean() * 1e3),
        cached_tokens=("cached_tokens", "mean"), prompt_tokens=("prompt_tokens", "mean"))
    st.dataframe(by.round(1), width="stretch")
