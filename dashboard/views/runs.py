"""Runs: every run in the store with its kind, scenario, parent, size and headline figures;
pick one or two for the other pages."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from .. import common

#: A run this long without a rollup gets a hint on how to write one.
LONG_RUN_EVENTS = 200_000
TITLE = "Runs"
SLUG = "runs"


def render(url: str, table: pd.DataFrame) -> None:
    st.header("Runs")
    if table.empty:
        st.info("The store holds no run yet. Record one with `kvplane sim run seed_push_vs_pull` "
                "or `kvplane demo`, or import results with `kvplane import vllm-bench DIR`.")
        return
    kinds = sorted(table["kind"].unique())
    c1, c2 = st.columns([2, 3])
    shown_kinds = c1.multiselect("Kinds", kinds, default=kinds, key="runs_kinds")
    text = c2.text_input("Scenario contains", "", key="runs_filter")
    view = table[table["kind"].isin(shown_kinds)]
    if text:
        view = view[view["scenario"].str.contains(text, case=False, regex=False)]
    names = common.labels(table)
    short = {r["id"]: f"{str(r['scenario']).rpartition(':')[2]} · {r['id'][:8]}"
             for r in table.to_dict("records")}
    shown = pd.DataFrame({
        "scenario": view["scenario"],
        "kind": view["kind"],
        "requests": view["requests"],
        "TTFT mean (ms)": view["ttft_ms"].round(1),
        "TPOT mean (ms)": view["tpot_ms"].round(2),
        "E2E mean (ms)": view["e2e_ms"].round(1),
        "finished": view["finished"],
        "failed": view["failed"],
        "events": view["events"],
        "children": view["children"],
        "parent": view["parent"].map(lambda p: short.get(p, p) if isinstance(p, str) else ""),
        "started": view["started"],
        "id": view["id"],
    })
    st.caption(f"{len(view)} of {len(table)} runs · {int(table['events'].sum()):,} events")
    slow = table[(table["events"] >= LONG_RUN_EVENTS) & ~table["rollup"]]
    if not slow.empty:
        st.caption(f"{len(slow)} run(s) of {LONG_RUN_EVENTS:,} events or more without a current "
                   "rollup: their pages read every request of the run. `kvplane rollup` "
                   "writes their rollups (`kvplane sim run` does for the points it records).")
    st.dataframe(shown, hide_index=True, width="stretch", key="runs_table")

    ids = list(table["id"])
    current = [i for i in common.picked() if i in ids]
    chosen = st.multiselect(
        "Pick one or two runs (the other pages start from them)", ids, default=current,
        max_selections=2, format_func=lambda i: names.get(i, i), key="runs_pick",
    )
    if chosen != current:
        common.set_picked(chosen)
        if chosen:
            st.query_params["run"] = chosen[0]
        if len(chosen) > 1:
            st.query_params["run2"] = chosen[1]
    if not chosen:
        return
    cols = st.columns(len(chosen))
    for col, run_id in zip(cols, chosen, strict=True):
        row = table[table["id"] == run_id].iloc[0]
        with col:
            st.subheader(row["scenario"])
            st.caption(f"{row['kind']} · {run_id}")
            if row["requests"]:
                got = common.request_stats(url, run_id)  # the run's rollup, or its events
                figures = pd.DataFrame({m.upper(): got[m] for m in ("ttft", "tpot", "e2e")}
                                       ).T[["n", "mean", "p50", "p90", "p99"]]
                st.dataframe(figures.round(2), width="stretch")
            kids = table[table["parent"] == run_id]
            if not kids.empty:
                st.write(f"{len(kids)} child runs:")
                st.dataframe(kids[["scenario", "kind", "requests", "ttft_ms", "tpot_ms"]]
                             .rename(columns={"ttft_ms": "TTFT ms", "tpot_ms": "TPOT ms"})
                             .round(2), hide_index=True, width="stretch")
            with st.expander("meta"):
                st.json(row["meta"] or {}, expanded=False)
