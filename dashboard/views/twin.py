"""Sim vs live: a run and its simulated twin (or any two runs) side by side: CDFs, per-request
scatter (requests matched by id), and the error at each percentile."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from .. import common, figures

TITLE = "Sim vs live"
SLUG = "sim-vs-live"


def error_table(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """Percentiles of TTFT, TPOT, E2E in both runs (ms) and the second's relative error."""
    rows = []
    for metric in ("ttft", "tpot", "e2e"):
        va = pd.to_numeric(a[metric], errors="coerce").dropna() * 1e3
        vb = pd.to_numeric(b[metric], errors="coerce").dropna() * 1e3
        for stat, qv in (("mean", None), ("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
            if va.empty or vb.empty:
                continue
            x = float(va.mean() if qv is None else va.quantile(qv))
            y = float(vb.mean() if qv is None else vb.quantile(qv))
            rows.append({"metric": metric.upper(), "stat": stat, "measured (ms)": round(x, 2),
                         "twin (ms)": round(y, 2),
                         "error": f"{(y - x) / x * 100:+.1f} %" if x else "n/a"})
    return pd.DataFrame(rows)


def render(url: str, table: pd.DataFrame) -> None:
    st.header("Sim vs live")
    points = common.point_runs(table)
    has_twin = set(table.loc[table["kind"] == "replay", "parent"].dropna())
    points = common.preferring(points, points["kind"].isin(["live", "import"]))
    points = common.preferring(points, points["id"].isin(has_twin))
    c1, c2 = st.columns(2)
    with c1:
        measured = common.pick_run("Measured run (live, import, or any)", points, "twin_a")
    if measured is None:
        st.info("No run with requests in the store.")
        return
    twins = points[(points["parent"] == measured) & (points["kind"] == "replay")]
    names = common.labels(table)
    others = points[points["id"] != measured]
    order = list(twins["id"]) + [i for i in others["id"] if i not in set(twins["id"])]
    picked = common.picked()
    default = order[0] if len(twins) else (picked[1] if len(picked) > 1 and picked[1] in order
                                            else None)
    with c2:
        if "twin_new" in st.session_state:  # a twin just made: select it
            st.session_state["twin_b"] = st.session_state.pop("twin_new")
        if "twin_b" in st.session_state and st.session_state["twin_b"] not in order:
            del st.session_state["twin_b"]
        twin = st.selectbox("Twin (its replay children first)", order,
                            index=order.index(default) if default in order else 0,
                            format_func=lambda i: names.get(i, i), key="twin_b") \
            if order else None
    with st.expander("Make a simulated twin of the measured run"):
        from kvplane.sim.config import bundled_scenario_names

        choice = st.selectbox("Scenario", ["as recorded", *bundled_scenario_names()],
                              key="twin_scenario")
        if st.button("Re-simulate its arrivals", key="twin_make"):
            _make_twin(url, measured, None if choice == "as recorded" else choice)
    if twin is None:
        st.info("No second run to compare with: make a twin above.")
        return
    fin = common.finished_requests(url, (measured, twin))
    a, b = fin[fin["run"] == measured], fin[fin["run"] == twin]
    labels = ("measured", "twin")
    st.subheader("Error per percentile")
    st.dataframe(error_table(a, b), hide_index=True, width="stretch")
    st.plotly_chart(figures.cdfs(a, b, labels), width="stretch", key="twin_cdfs")
    joined = a.merge(b, on="request", suffixes=("_a", "_b"))
    st.caption(f"{len(joined)} requests in both runs (matched by request id); "
               f"{len(a)} measured, {len(b)} in the twin.")
    metric = st.radio("Per-request metric", ["ttft", "tpot", "e2e"], horizontal=True,
                      key="twin_metric")
    st.plotly_chart(figures.per_request(joined, metric, labels), width="stretch",
                    key="twin_scatter")


def _make_twin(url: str, run_id: str, scenario: str | None) -> None:
    from kvplane.sim.config import ScenarioError
    from kvplane.sim.replay_sim import replay_into_sim

    bar = st.progress(0.0, text="re-simulating...")

    def progress(done: int, total: int, what: str) -> None:
        bar.progress(min(done / max(total, 1), 1.0), text=f"{what}: {done}/{total} requests")

    try:
        new = replay_into_sim(url, run_id, scenario, progress=progress)
    except ScenarioError as exc:
        st.error(str(exc))
        return
    common.clear_caches()
    st.session_state["twin_new"] = new
    st.success(f"twin {new} recorded")
    st.rerun()
