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


def same_workload(table: pd.DataFrame, measured: str) -> list[str]:
    """Runs that replayed the same arrivals as `measured`: its twins (replay children), and
    when it is itself a twin, the run it replays and that run's other twins."""
    row = table[table["id"] == measured]
    kin = table[(table["kind"] == "replay") & (table["parent"] == measured)]
    out = list(kin.sort_values("started", ascending=False)["id"])
    if not row.empty and row.iloc[0]["kind"] == "replay" and isinstance(row.iloc[0]["parent"], str):
        parent = row.iloc[0]["parent"]
        out.append(parent)
        sibs = table[(table["kind"] == "replay") & (table["parent"] == parent)
                     & (table["id"] != measured)]
        out += list(sibs["id"])
    have = set(table.loc[table["requests"] > 0, "id"])
    return [i for i in out if i in have]


def render(url: str, table: pd.DataFrame) -> None:
    st.header("Sim vs live")
    points = common.point_runs(table)
    has_twin = set(table.loc[table["kind"] == "replay", "parent"].dropna())
    points = common.preferring(points, points["kind"].isin(["live", "import"]))
    points = common.preferring(points, points["id"].isin(has_twin))
    points = common.preferring(points, points["id"].isin(has_twin) & (points["kind"] == "live"))
    c1, c2 = st.columns(2)
    with c1:
        measured = common.pick_run("Measured run (live, import, or any)", points, "twin_a")
    if measured is None:
        st.info("No run with requests in the store.")
        return
    names = common.labels(table)
    paired = same_workload(table, measured)
    any_run = c2.toggle("List runs of other workloads too", False, key="twin_any",
                        help="A twin replays the measured run's arrivals; any other run ran "
                             "other requests, so its errors compare unrelated requests.")
    order = paired + ([i for i in points["id"] if i != measured and i not in set(paired)]
                      if any_run else [])
    with c2:
        if "twin_new" in st.session_state:  # a twin just made: select it
            st.session_state["twin_b"] = st.session_state.pop("twin_new")
        if "twin_b" in st.session_state and st.session_state["twin_b"] not in order:
            del st.session_state["twin_b"]
        twin = st.selectbox("Twin (runs of the same arrivals first)", order, index=0,
                            format_func=lambda i: names.get(i, i), key="twin_b") \
            if order else None
    with st.expander("Make a simulated twin of the measured run", expanded=not paired):
        from kvplane.sim.config import bundled_scenario_names

        recorded = common.scenario_of(url, measured)
        first = (f"as recorded ({recorded['name']})" if recorded else
                 "as recorded (none recorded: pick a scenario)")
        choice = st.selectbox("Scenario", [first, *bundled_scenario_names()],
                              key="twin_scenario")
        if st.button("Re-simulate its arrivals", key="twin_make"):
            _make_twin(url, measured, None if choice == first else choice)
    if twin is None:
        st.info("This run has no twin yet: no other run replayed its arrivals, so there is "
                "nothing to compare it with request by request. Make one above "
                "(`kvplane twin RUN` does the same).")
        return
    fin = common.finished_requests(url, (measured, twin))
    a, b = fin[fin["run"] == measured], fin[fin["run"] == twin]
    joined = a.merge(b, on="request", suffixes=("_a", "_b"))
    # one workload: the same request ids with the same prompts (ids like req-0 repeat across
    # unrelated runs)
    joined = joined[joined["prompt_tokens_a"].fillna(-1) == joined["prompt_tokens_b"].fillna(-1)]
    if joined.empty:
        st.warning(f"{names.get(measured)} and {names.get(twin)} share no request (same id and prompt "
                   "length): "
                   "they ran different workloads, so their percentiles would compare unrelated "
                   "requests. Pick a twin of the measured run, or make one above.")
        return
    if len(joined) < max(len(a), len(b)):
        st.warning(f"Only {len(joined)} requests are in both runs ({len(a)} measured, "
                   f"{len(b)} in the other): the comparison below uses those only.")
        keep = set(joined["request"])
        a, b = a[a["request"].isin(keep)], b[b["request"].isin(keep)]
    ra, rb = _routing(a), _routing(b)
    if ra != rb:
        st.warning(f"Routed differently: measured {_fmt(ra)}; twin {_fmt(rb)}. A twin runs "
                   "one mode (the recording's most common); the errors below mix that in.")
    labels = ("measured", "twin")
    st.subheader("Error per percentile")
    st.dataframe(error_table(a, b), hide_index=True, width="stretch")
    st.plotly_chart(figures.cdfs(a, b, labels), width="stretch", key="twin_cdfs")
    st.caption(f"{len(joined)} requests in both runs (matched by request id); "
               f"{len(a)} measured, {len(b)} in the twin.")
    metric = st.radio("Per-request metric", ["ttft", "tpot", "e2e"], horizontal=True,
                      key="twin_metric")
    st.plotly_chart(figures.per_request(joined, metric, labels), width="stretch",
                    key="twin_scatter")


def _routing(df: pd.DataFrame) -> dict[str, int]:
    if "mode" not in df or df.empty:
        return {}
    key = df["mode"].fillna("?") + df["bidirectional"].fillna(0).astype(int).map(
        {1: "+reuse", 0: ""})
    return {str(k): int(v) for k, v in key.value_counts().sort_index().items()}


def _fmt(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "unknown"


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
