"""Push vs pull: TTFT and TPOT against input length, one line per QPS and mode, for one or two
sweeps (simulated, imported); the scenario's published figures overlaid when it reproduces
published experiments."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from .. import common, figures, rollup

TITLE = "Push vs pull"
SLUG = "push-pull"


def sweep_points(url: str, sweep_id: str, source: str) -> pd.DataFrame:
    """One row per point of a sweep: axes and TTFT/TPOT statistics (ms)."""
    kids = common.children(url, sweep_id)
    scenario = common.sweep_scenario(url, sweep_id)
    warmup, expected = rollup.warmup_of(scenario)
    rows: list[dict[str, Any]] = []
    for k in kids.to_dict("records"):
        axes = common.point_axes(k["scenario"], k["meta"])
        if axes is None:
            continue
        rows.append({"run": k["id"], "source": source, **axes, "meta": k["meta"]})
    if not rows:
        return pd.DataFrame()
    # a point's figures from its rollup when it was kept under this warm-up; the others'
    # from their finished requests
    kept = {}
    for r in rows:
        body = common.rollup_part(url, r["run"], "point")
        got = rollup.point_of(body, warmup, expected) if body is not None else None
        if got is not None:
            kept[r["run"]] = got
    rest = tuple(r["run"] for r in rows if r["run"] not in kept)
    fin = common.finished_requests(url, rest) if rest else None
    out = []
    for r in rows:
        rec = {k: v for k, v in r.items() if k != "meta"}
        mine = fin[fin["run"] == r["run"]] if fin is not None and r["run"] not in kept \
            else None
        if r["run"] in kept:
            rec.update(kept[r["run"]])
        elif mine is not None and not mine.empty:
            rec.update(rollup.point_figures(mine, r["meta"], warmup, expected))
        else:  # an imported summary without per-request fields
            summary = (r["meta"] or {}).get("summary") or {}
            for metric in ("ttft", "tpot"):
                for stat, key in (("mean", "mean"), ("p50", "median"), ("p90", "p90"),
                                  ("p99", "p99")):
                    rec[f"{metric}_{stat}"] = summary.get(f"{key}_{metric}_ms")
            rec["requests"] = summary.get("completed")
        out.append(rec)
    return pd.DataFrame(out)


def published_points(scenario: dict[str, Any] | None) -> pd.DataFrame:
    cols = ["metric", "value", "low", "high", "stat", "mode", "qps", "input_len",
            "bidirectional", "prompt_tokens", "source", "text"]
    if not scenario or not scenario.get("published"):
        return pd.DataFrame(columns=cols)
    rows = []
    for f in scenario["published"]["figures"]:
        where = f.get("where") or {}
        text = f"{f['value']:g}" if f.get("value") is not None else f"{f['low']:g}-{f['high']:g}"
        rows.append({"metric": f["metric"], "value": f.get("value"), "low": f.get("low"),
                     "high": f.get("high"), "stat": f.get("stat", "mean"),
                     "mode": where.get("mode"), "qps": where.get("qps"),
                     "input_len": where.get("input_len"),
                     "bidirectional": where.get("bidirectional"),
                     "prompt_tokens": where.get("prompt_tokens"), "source": f["source"],
                     "text": f"{text} ({', '.join(f'{k}={v}' for k, v in where.items()) or 'all'})"})
    return pd.DataFrame(rows, columns=cols)


def render(url: str, table: pd.DataFrame) -> None:
    st.header("Push vs pull")
    sweeps = common.sweep_runs(table)
    by_length = set(table.loc[table["scenario"].str.contains(r"_in\d+_", regex=True), "parent"]
                    .dropna())
    sweeps = common.preferring(sweeps, sweeps["id"].isin(by_length))
    if sweeps.empty:
        st.info("No sweep in the store: run `kvplane sim run seed_push_vs_pull`, or import "
                "`vllm bench serve` results with `kvplane import vllm-bench DIR`.")
        return
    c1, c2, c3 = st.columns([3, 3, 1])
    with c1:
        first = common.pick_run("Sweep", sweeps, "pp_sweep")
    others = sweeps[sweeps["id"] != first]
    names = common.labels(table)
    second = c2.selectbox("Compare with (optional)", [None, *others["id"]], key="pp_sweep2",
                          format_func=lambda i: "none" if i is None else names.get(i, i))
    stat = c3.selectbox("Statistic", ["mean", "p50", "p90", "p99"], key="pp_stat")
    assert first is not None
    parts = [sweep_points(url, first, "A")]
    if second:
        parts.append(sweep_points(url, second, "B"))
    points = pd.concat([p for p in parts if not p.empty], ignore_index=True) \
        if any(not p.empty for p in parts) else pd.DataFrame()
    if points.empty:
        st.warning("This sweep's child runs are not named as points "
                   "(<mode>_qps<q>_in<in>_out<out>_iter<i>).")
        return
    if points["input_len"].isna().all():
        st.warning("This sweep does not vary the input length; see the Reuse page for "
                   "multi-turn sweeps.")
    c4, c5 = st.columns(2)
    qps_all = sorted(points["qps"].dropna().unique())
    qps = c4.multiselect("QPS", qps_all, default=qps_all, key="pp_qps")
    modes_all = sorted(points["mode"].unique())
    modes = c5.multiselect("Mode", modes_all, default=modes_all, key="pp_modes")
    points = points[points["qps"].isin(qps) & points["mode"].isin(modes)]
    published = published_points(common.sweep_scenario(url, first))
    if not published.empty:
        published = published[published["metric"].isin(["ttft_ms", "tpot_ms"])
                              & published["stat"].eq(stat if stat != "p50" else "median")
                              & (published["mode"].isna() | published["mode"].isin(modes))
                              & (published["qps"].isna() | published["qps"].isin(qps))]
    if second:
        st.caption(f"A = {names.get(first)} (circles), B = {names.get(second)} (diamonds)")
    else:
        points = points.assign(source="")
    lens = set(points["input_len"].dropna())
    if not published.empty:
        inside = published["input_len"].isna() | published["input_len"].isin(lens)
        if (~inside).any():
            st.caption(f"{int((~inside).sum())} published figure(s) belong to input lengths "
                       "this sweep did not run; they are listed in the table below, not drawn.")
        drawn = published[inside]
    else:
        drawn = published
    st.plotly_chart(figures.metric_vs_length(points, drawn, stat=stat),
                    width="stretch", key="pp_chart")
    if not published.empty:
        st.subheader("Published figures")
        st.dataframe(_compare(points[points["source"].isin(["A", ""])], published, stat),
                     hide_index=True, width="stretch")
    st.subheader("Points")
    cols = ["source", "mode", "qps", "input_len", "output_len", "iteration", "requests",
            f"ttft_{stat}", f"tpot_{stat}"]
    st.dataframe(points[[c for c in cols if c in points]].sort_values(
        ["source", "mode", "qps", "input_len"]).round(2), hide_index=True,
        width="stretch")


def _compare(points: pd.DataFrame, published: pd.DataFrame, stat: str) -> pd.DataFrame:
    rows = []
    for p in published.to_dict("records"):
        metric = p["metric"].removesuffix("_ms")
        sel = points
        for axis in ("mode", "qps", "input_len"):
            if p.get(axis) is not None and not pd.isna(p[axis]):
                sel = sel[sel[axis] == p[axis]]
        got = sel[f"{metric}_{stat}"].mean() if not sel.empty else None
        want = p["value"] if p.get("value") is not None and not pd.isna(p["value"]) else None
        err = None
        if got is not None and want:
            err = f"{(got - want) / want * 100:+.0f} %"
        elif got is not None and p.get("low") is not None:
            err = "inside" if p["low"] <= got <= p["high"] else "outside"
        rows.append({"figure": f"{p['metric']} {p['text']}", "published": p["text"].split(" (")[0],
                     "this sweep": None if got is None else round(float(got), 1), "error": err,
                     "source": p["source"]})
    return pd.DataFrame(rows)
