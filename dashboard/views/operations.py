"""Operations: what an operator keeps open. Per instance over time: requests waiting and
running, KV cache use, prefix-cache and reuse hit rate, KV transfer throughput; SLO attainment
and goodput per GPU against offered rate; leases against pool capacity. The same events for
simulated and live runs, aggregated in SQL (per time bin or per request)."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
import streamlit as st
from plotly.subplots import make_subplots

from .. import common
from ..queries import retained_blocks

TITLE = "Operations"
SLUG = "operations"


def _lines(df: pd.DataFrame, x: str, y: str, by: str, title: str, ytitle: str,
           shape: str = "linear", extra: list[go.Scatter] | None = None) -> go.Figure:
    fig = go.Figure()
    for name, part in df.groupby(by, sort=True):
        # numpy arrays: handed pandas Series, Plotly converts each through narwhals (a
        # third of a 128-trace chart's time on the cluster run)
        fig.add_trace(go.Scatter(x=part[x].to_numpy(), y=part[y].to_numpy(), mode="lines",
                                 name=str(name), line={"shape": shape}))
    for t in extra or []:
        fig.add_trace(t)
    fig.update_layout(title=title, height=330, margin={"l": 60, "r": 20, "t": 50, "b": 40},
                      legend={"orientation": "h", "y": -0.2})
    fig.update_xaxes(title="run time (s)")
    fig.update_yaxes(title=ytitle)
    return fig


def render(url: str, table: pd.DataFrame) -> None:
    st.header("Operations")
    points = common.point_runs(table)
    points = common.preferring(points, points["kind"] == "live")
    c1, c2, c3 = st.columns([3, 1, 1])
    with c1:
        run_id = common.pick_run("Run (simulated or live)", points, "ops_run")
    if run_id is None:
        st.info("No run with requests in the store.")
        return
    ttft_ms = c2.number_input("SLO: TTFT (ms)", 1.0, 1e6, 1000.0, key="ops_ttft")
    tpot_ms = c3.number_input("SLO: TPOT (ms)", 0.1, 1e5, 50.0, key="ops_tpot")
    # the run's series: from its rollup when it has a current one (a long run's events are
    # not read again), else aggregated from its events
    series = common.operations_series(url, run_id)
    if series is None:
        st.info("This run holds no events.")
        return
    span, width = series["span"], series["width"]
    t0 = span[0]
    kind = table.loc[table["id"] == run_id, "kind"].iloc[0]
    st.caption(f"{kind} run · {span[1] - span[0]:.1f} s of events · bins of {width:g} s · "
               "every series is computed from the run's recorded events, alike for "
               "simulated and live runs")

    occ = series["occ"]
    if not occ.empty:
        st.plotly_chart(_lines(occ, "time", "count", "series", "Requests waiting and running, "
                               "per instance (waiting = queue depth)", "requests", "hv"),
                        width="stretch", key="ops_occupancy")

    cap = common.pool_capacity(url, run_id)
    blocks = series["blocks"]
    if not blocks.empty:
        blocks = blocks.sort_values("bin")
        blocks["used"] = blocks.groupby("instance")["delta"].cumsum()
        blocks["time"] = blocks["bin"] * width - t0
        if cap:
            role = blocks["instance"].map(lambda i: "prefill" if "prefill" in str(i)
                                          else "decode")
            blocks["pct"] = blocks["used"] / role.map({"prefill": cap["prefill"],
                                                       "decode": cap["decode"]}) * 100
            st.plotly_chart(_lines(blocks, "time", "pct", "instance", "KV cache use per "
                                   "instance (% of the pool)", "% of KV blocks", "hv"),
                            width="stretch", key="ops_kv")
            if kind == "live":
                st.caption("Pool size as the run's scenario predicts it; vLLM's own pool "
                           "size is not in the recording.")
        else:
            st.plotly_chart(_lines(blocks, "time", "used", "instance", "KV blocks in use per "
                                   "instance (pool size unknown: no scenario)", "blocks", "hv"),
                            width="stretch", key="ops_kv")

    c4, c5 = st.columns(2)
    pre = series["prefix"]
    if not pre.empty:
        pre = pre.assign(time=pre["bin"] * width - t0)
        tokens = pre["cached"] + pre["computed"]
        pre["prefix_hit"] = (pre["cached"] / tokens.where(tokens > 0)) * 100
        pre["reuse_hit"] = (pre["reuse_read"] / pre["reuse_decided"].where(
            pre["reuse_decided"] > 0)) * 100
        long = pd.concat([
            pre.dropna(subset=["prefix_hit"]).assign(series=lambda d: d["instance"]
                                                     + " · prefix cache", value=lambda d:
                                                     d["prefix_hit"]),
            pre.dropna(subset=["reuse_hit"]).assign(series=lambda d: d["instance"]
                                                    + " · reuse read", value=lambda d:
                                                    d["reuse_hit"]),
        ])
        if not long.empty:
            c4.plotly_chart(_lines(long, "time", "value", "series", "Prefix cache and reuse "
                                   "hit rate (per bin)", "% hit", "linear"),
                            width="stretch", key="ops_hits")
    xfer = series["transfers"]
    if not xfer.empty:
        xfer = xfer.assign(time=xfer["bin"] * width - t0,
                           gbps=xfer["bytes"] / width / 1e9,
                           series=xfer["dst"] + " · " + xfer["direction"])
        c5.plotly_chart(_lines(xfer, "time", "gbps", "series", "KV transfer throughput into "
                               "each instance", "GB/s", "hv"), width="stretch", key="ops_xfer")

    st.subheader("SLO attainment and goodput against offered rate")
    slo = common.operations_slo(url, run_id, float(ttft_ms), float(tpot_ms))
    assert slo is not None  # the run has events (series above)
    win = slo["win"]
    prefill_n = series["prefill_n"]
    decode_n = series["decode_n"]
    ptp = cap["prefill_tp"] if cap else 1
    dtp = cap["decode_tp"] if cap else 1
    gpus = max(prefill_n * ptp + decode_n * dtp, 1)
    win = win.dropna(subset=["attainment"])
    if not win.empty:
        fig = make_subplots(specs=[[{"secondary_y": True}]])
        win = win.sort_values("offered")
        fig.add_trace(go.Scatter(x=win["offered"], y=win["attainment"] * 100, mode="markers",
                                 name="SLO attainment (%)"))
        fig.add_trace(go.Scatter(x=win["offered"], y=win["goodput"] / gpus, mode="markers",
                                 name="goodput per GPU (req/s)", marker={"symbol": "diamond"}),
                      secondary_y=True)
        fig.update_layout(title="Per window of arrivals (20 windows)", height=360,
                          margin={"l": 60, "r": 60, "t": 50, "b": 40})
        fig.update_xaxes(title="offered rate in the window (requests/s)")
        fig.update_yaxes(title="SLO attainment (%)", range=[0, 105], secondary_y=False)
        fig.update_yaxes(title="goodput per GPU (req/s)", secondary_y=True)
        st.plotly_chart(fig, width="stretch", key="ops_slo")
    done, met, dur = slo["done"], slo["met"], slo["dur"]
    st.caption(f"{done} finished requests, {met} meet the SLO "
               f"({met / max(done, 1) * 100:.1f} %); goodput {met / dur / gpus if dur else 0:.3g} "
               f"requests/s per GPU on {gpus} GPUs ({prefill_n} prefill x TP {ptp}, {decode_n} "
               f"decode x TP {dtp}{'' if cap else '; TP unknown, taken as 1'}).")

    st.subheader("Leases against pool capacity")
    rows = common.lease_events(url, run_id)
    if rows.empty:
        st.caption("No lease in this run (reuse off and push mode hold no lease).")
        return
    held = pd.concat([retained_blocks(rows, "retained").assign(purpose="retained"),
                      retained_blocks(rows, "pull_hold").assign(purpose="pull_hold")])
    if held.empty:
        st.caption("No blocks held under a lease.")
        return
    held = held.assign(time=held["time"] - t0, series=held["instance"] + " · " + held["purpose"])
    extra = []
    if cap:
        end = float(span[1] - t0)
        for role in sorted({("prefill" if "prefill" in str(i) else "decode")
                            for i in held["instance"]}):
            extra.append(go.Scatter(x=[0, end], y=[cap[role]] * 2, mode="lines",
                                    name=f"{role} pool capacity", line={"dash": "dot"}))
    st.plotly_chart(_lines(held, "time", "blocks", "series", "KV blocks held under leases, "
                           "against each instance's pool", "blocks", "hv", extra),
                    width="stretch", key="ops_leases")
