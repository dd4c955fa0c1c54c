"""Plotly figures built from the frames in `queries`; no Streamlit, no database here.

Rules kept here:
- Times on axes are milliseconds (relative to a request's arrival on the timeline, or run
  time in seconds where the axis is the run's clock), token counts are tokens.
- Every figure is bounded in size whatever the run's size: the timeline draws at most the
  page of requests it is given, CDFs and step lines are thinned to a few thousand points.
- Colours are fixed per phase, per mode and per reuse setting, so two pages read alike.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .queries import PHASES

PHASE_COLORS = {
    "queue": "#b0b0b0",
    "reuse read (D->P)": "#8c564b",
    "prefill": "#1f77b4",
    "registration wait": "#ff7f0e",
    "rendezvous": "#e377c2",
    "transfer (P->D)": "#d62728",
    "first decode step": "#9467bd",
    "decode": "#2ca02c",
}
MODE_DASH = {"push": "solid", "pull": "dash"}
REUSE_COLORS = {"reuse off": "#d62728", "reuse on": "#2ca02c"}
_MAX_POINTS = 4000


def _layout(fig: go.Figure, title: str, height: int = 450) -> go.Figure:
    fig.update_layout(title=title, height=height, margin={"l": 60, "r": 20, "t": 60, "b": 50},
                      legend={"orientation": "h", "y": -0.18}, template="plotly_white")
    return fig


def _event_line(ev: dict[str, Any], t0: float) -> str:
    payload = ev.get("payload") or {}
    if isinstance(payload, str):
        payload = json.loads(payload)
    short = {k: v for k, v in payload.items() if not isinstance(v, list) or len(v) <= 4}
    longs = {k: f"[{len(v)} items]" for k, v in payload.items() if isinstance(v, list)
             and len(v) > 4}
    text = ", ".join(f"{k}={v}" for k, v in {**short, **longs}.items())
    if len(text) > 110:
        text = text[:107] + "..."
    return f"+{(ev['time'] - t0) * 1e3:.2f} ms {ev['type']} @{ev['instance']}<br>   {text}"


def _event_lines(events: list[dict[str, Any]], t0: float, most: int = 14) -> list[str]:
    """Hover lines for a bar's events; a run of one type (the notifications of every TP rank,
    say) is one line with its count."""
    groups: list[list[dict[str, Any]]] = []
    for e in events:
        if groups and groups[-1][0]["type"] == e["type"]:
            groups[-1].append(e)
        else:
            groups.append([e])
    lines = []
    for g in groups[:most]:
        line = _event_line(g[0], t0)
        if len(g) > 1:
            line = line.replace(f" {g[0]['type']} ", f" {g[0]['type']} x{len(g)} ", 1)
        lines.append(line)
    if len(groups) > most:
        lines.append(f"... {sum(len(g) for g in groups[most:])} more")
    return lines


def timeline(requests: pd.DataFrame, segments: pd.DataFrame, events: pd.DataFrame, *,
             align: bool = True) -> go.Figure:
    """Gantt chart: one row per request (in the order of `requests`, slowest on top), one bar
    per phase; hovering a bar lists the events of that request within the bar's span."""
    order = list(requests["request"])
    arrived = dict(zip(requests["request"], requests["arrived"].fillna(0.0), strict=True))
    by_req: dict[str, list[dict[str, Any]]] = {}
    for ev in events.to_dict("records"):
        by_req.setdefault(ev["request"], []).append(ev)
    fig = go.Figure()
    for name, _, _ in PHASES:
        seg = segments[segments["phase"] == name]
        if seg.empty:
            continue
        base, width, hover = [], [], []
        for s in seg.to_dict("records"):
            t0 = arrived.get(s["request"], 0.0)
            origin = t0 if align else 0.0
            base.append((s["start"] - origin) * 1e3)
            width.append(max((s["end"] - s["start"]) * 1e3, 0.02))
            inside = [e for e in by_req.get(s["request"], [])
                      if s["start"] - 1e-9 <= e["time"] <= s["end"] + 1e-9]
            lines = _event_lines(inside, t0)
            hover.append(f"<b>{s['request']}</b> {name}: {(s['end'] - s['start']) * 1e3:.2f} ms"
                         "<br>" + "<br>".join(lines))
        fig.add_trace(go.Bar(
            name=name, y=seg["request"], x=width, base=base, orientation="h",
            marker_color=PHASE_COLORS.get(name), hovertext=hover, hoverinfo="text",
        ))
    fig.update_layout(barmode="overlay")
    fig.update_yaxes(categoryorder="array", categoryarray=order[::-1], title="request")
    fig.update_xaxes(title="ms since arrival" if align else "ms since the run's start")
    return _layout(fig, "Request timeline (slowest first)", height=max(320, 26 * len(order) + 140))


def metric_vs_length(points: pd.DataFrame, published: pd.DataFrame, *, stat: str = "mean"
                     ) -> go.Figure:
    """TTFT and TPOT against input length: a line per (QPS, mode, source), published points
    overlaid as black markers (ranges as error bars)."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=(f"TTFT ({stat}, ms)",
                                                        f"TPOT ({stat}, ms)"))
    qps_values = sorted(points["qps"].dropna().unique()) if not points.empty else []
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#17becf"]
    colors = {q: palette[i % len(palette)] for i, q in enumerate(qps_values)}
    for col, metric in ((1, "ttft"), (2, "tpot")):
        if points.empty:
            continue
        for (source, qps, mode), grp in points.groupby(["source", "qps", "mode"], dropna=False):
            grp = grp.sort_values("input_len")
            fig.add_trace(go.Scatter(
                x=grp["input_len"], y=grp[f"{metric}_{stat}"], mode="lines+markers",
                name=f"{mode} · {qps:g} QPS" + (f" · {source}" if source else ""),
                legendgroup=f"{source}{qps}{mode}",
                showlegend=col == 1,
                line={"color": colors.get(qps), "dash": MODE_DASH.get(str(mode), "dot")},
                marker={"symbol": "circle" if source == points["source"].iloc[0] else "diamond"},
                hovertemplate=f"{mode} {qps:g} QPS<br>input %{{x}}<br>{metric.upper()} "
                              "%{y:.1f} ms<extra></extra>",
            ), row=1, col=col)
        pub = published[published["metric"] == f"{metric}_ms"] if not published.empty else \
            published
        for p in pub.to_dict("records") if not pub.empty else []:
            xs = [p["input_len"]] if p.get("input_len") is not None and not pd.isna(
                p["input_len"]) else list(points["input_len"].dropna().unique())
            y = p["value"] if p.get("value") is not None and not pd.isna(p["value"]) else \
                (p["low"] + p["high"]) / 2
            err = None if p.get("value") is not None and not pd.isna(p["value"]) else \
                (p["high"] - p["low"]) / 2
            fig.add_trace(go.Scatter(
                x=xs, y=[y] * len(xs), mode="markers", name="published",
                legendgroup="published", showlegend=False,
                marker={"symbol": "x", "size": 12, "color": "black"},
                error_y={"type": "constant", "value": err, "visible": err is not None},
                hovertext=f"published {p['metric']}: {p['text']}<br>{p['source']}",
                hoverinfo="text",
            ), row=1, col=col)
    if not published.empty:
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="published",
                                 marker={"symbol": "x", "size": 12, "color": "black"}))
    fig.update_xaxes(title="input length (tokens)", type="log")
    return _layout(fig, "Push vs pull", height=480)


def reuse_scatter(df: pd.DataFrame, published: pd.DataFrame) -> go.Figure:
    """TTFT against prompt length, reuse on and off: every request, and the mean per bin."""
    fig = go.Figure()
    for setting, grp in df.groupby("setting"):
        color = REUSE_COLORS.get(str(setting))
        fig.add_trace(go.Scatter(
            x=grp["prompt_tokens"], y=grp["ttft"] * 1e3, mode="markers", name=str(setting),
            marker={"color": color, "opacity": 0.45, "size": 6}, legendgroup=str(setting),
            hovertemplate="%{x} tokens<br>TTFT %{y:.1f} ms<extra>" + str(setting) + "</extra>"))
        binned = _binned(grp, "prompt_tokens", "ttft")
        fig.add_trace(go.Scatter(
            x=binned["x"], y=binned["y"] * 1e3, mode="lines", name=f"{setting} (mean per bin)",
            line={"color": color, "width": 3}, legendgroup=str(setting)))
    for p in published.to_dict("records") if not published.empty else []:
        if p["metric"] != "ttft_ms" or p.get("prompt_tokens") is None:
            continue
        fig.add_trace(go.Scatter(
            x=[p["prompt_tokens"]], y=[p["value"]], mode="markers", showlegend=False,
            marker={"symbol": "x", "size": 13, "color": "black"},
            hovertext=f"published: {p['text']}<br>{p['source']}", hoverinfo="text"))
    if not published.empty:
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="published",
                                 marker={"symbol": "x", "size": 12, "color": "black"}))
    fig.update_xaxes(title="prompt length (tokens)")
    fig.update_yaxes(title="TTFT (ms)")
    return _layout(fig, "TTFT against prompt length, reuse on and off")


def _binned(df: pd.DataFrame, x: str, y: str, bins: int = 12) -> pd.DataFrame:
    d = df[[x, y]].dropna()
    if d.empty:
        return pd.DataFrame({"x": [], "y": []})
    lo, hi = float(d[x].min()), float(d[x].max())
    if hi <= lo:
        return pd.DataFrame({"x": [lo], "y": [float(d[y].mean())]})
    edges = np.linspace(lo, hi, bins + 1)
    idx = np.clip(np.digitize(d[x], edges) - 1, 0, bins - 1)
    g = d.groupby(idx).agg(x=(x, "mean"), y=(y, "mean"))
    return g.reset_index(drop=True)


def prefill_split(df: pd.DataFrame) -> go.Figure:
    """Prefill time split into recompute and reuse read, by prompt-length bin, on and off."""
    d = df.dropna(subset=["prompt_tokens", "recompute"]).copy()
    fig = go.Figure()
    if d.empty:
        return _layout(fig, "Prefill time: recompute and transfer")
    edges = np.unique(np.quantile(d["prompt_tokens"], np.linspace(0, 1, 7)))
    if edges.size < 2:
        edges = np.array([d["prompt_tokens"].min(), d["prompt_tokens"].max() + 1])
    d["bin"] = pd.cut(d["prompt_tokens"], edges, include_lowest=True, duplicates="drop")
    d["bin_label"] = d["bin"].map(lambda b: f"{int(b.left)}-{int(b.right)}")
    g = d.groupby(["bin_label", "setting"], observed=True, sort=False).agg(
        recompute=("recompute", "mean"), read=("read", "mean"), first=("prompt_tokens", "min")
    ).reset_index().sort_values("first")
    for part, color in (("recompute", "#1f77b4"), ("read", "#8c564b")):
        for setting, grp in g.groupby("setting", sort=False):
            fig.add_trace(go.Bar(
                x=[grp["bin_label"], [str(setting)] * len(grp)], y=grp[part] * 1e3,
                name=f"{'recompute' if part == 'recompute' else 'transfer (D->P read)'}",
                legendgroup=part, showlegend=bool(setting == g["setting"].iloc[0]),
                marker_color=color,
                hovertemplate="%{x}<br>%{y:.1f} ms<extra>" + part + "</extra>"))
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title="prompt length bin (tokens) · reuse setting")
    fig.update_yaxes(title="mean prefill time (ms)")
    return _layout(fig, "Prefill time split into recompute and transfer")


def outcome_bars(counts: pd.DataFrame) -> go.Figure:
    fig = go.Figure()
    for setting, grp in counts.groupby("setting"):
        fig.add_trace(go.Bar(x=grp["what"], y=grp["count"], name=str(setting),
                             marker_color=REUSE_COLORS.get(str(setting)),
                             text=grp["count"], textposition="outside"))
    fig.update_layout(barmode="group")
    return _layout(fig, "Reuse outcomes", height=360)


def _thin(df: pd.DataFrame, n: int = _MAX_POINTS) -> pd.DataFrame:
    if len(df) <= n:
        return df
    step = int(np.ceil(len(df) / n))
    return pd.concat([df.iloc[::step], df.iloc[[-1]]])


def leases(blocks: pd.DataFrame, lease_rows: pd.DataFrame, purpose: str) -> go.Figure:
    """Blocks held per instance over time (steps), and lease events per time bin."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.62, 0.38],
                        vertical_spacing=0.08,
                        subplot_titles=(f"{purpose} KV blocks held, per instance",
                                        "lease events"))
    for inst, grp in blocks.groupby("instance"):
        g = _thin(grp)
        fig.add_trace(go.Scatter(x=g["time"], y=g["blocks"], mode="lines", line_shape="hv",
                                 name=str(inst)), row=1, col=1)
    if not lease_rows.empty:
        t_max = float(lease_rows["time"].max()) or 1.0
        edges = np.linspace(0.0, t_max * 1.0001, 41)
        centers = (edges[:-1] + edges[1:]) / 2
        colors = {"LeaseGranted": "#2ca02c", "LeaseRenewed": "#1f77b4",
                  "LeaseExpired": "#d62728", "LeaseReleased": "#7f7f7f",
                  "LeaseRenewalRefused": "#ff7f0e", "ReadRefused": "#9467bd"}
        for typ, grp in lease_rows.groupby("type"):
            if typ not in colors:
                continue
            hist, _ = np.histogram(grp["time"], bins=edges)
            fig.add_trace(go.Bar(x=centers, y=hist, name=str(typ), marker_color=colors[typ]),
                          row=2, col=1)
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title="run time (s)", row=2, col=1)
    fig.update_yaxes(title="blocks", row=1, col=1)
    fig.update_yaxes(title="events", row=2, col=1)
    return _layout(fig, "Leases", height=620)


def cdfs(a: pd.DataFrame, b: pd.DataFrame, names: Sequence[str]) -> go.Figure:
    """CDFs of TTFT, TPOT and E2E for two runs."""
    fig = make_subplots(rows=1, cols=3, subplot_titles=("TTFT (ms)", "TPOT (ms)", "E2E (ms)"))
    for df, name, dash in ((a, names[0], "solid"), (b, names[1], "dash")):
        for col, metric in enumerate(("ttft", "tpot", "e2e"), start=1):
            v = np.sort(pd.to_numeric(df[metric], errors="coerce").dropna().to_numpy() * 1e3)
            if v.size == 0:
                continue
            y = np.arange(1, v.size + 1) / v.size
            if v.size > _MAX_POINTS:
                idx = np.linspace(0, v.size - 1, _MAX_POINTS).astype(int)
                v, y = v[idx], y[idx]
            fig.add_trace(go.Scatter(x=v, y=y, mode="lines", name=name, legendgroup=name,
                                     showlegend=col == 1,
                                     line={"dash": dash,
                                           "color": "#1f77b4" if dash == "solid" else "#ff7f0e"}),
                          row=1, col=col)
    fig.update_yaxes(title="share of requests", row=1, col=1)
    return _layout(fig, "Distributions", height=420)


def per_request(joined: pd.DataFrame, metric: str, names: Sequence[str]) -> go.Figure:
    """Per-request scatter: the first run's value against the second's, with the diagonal."""
    d = joined.dropna(subset=[f"{metric}_a", f"{metric}_b"])
    d = _thin(d)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=d[f"{metric}_a"] * 1e3, y=d[f"{metric}_b"] * 1e3, mode="markers",
                             text=d["request"], name="request",
                             hovertemplate="%{text}<br>%{x:.1f} ms vs %{y:.1f} ms<extra></extra>",
                             marker={"size": 6, "opacity": 0.6}))
    if not d.empty:
        lo = float(min(d[f"{metric}_a"].min(), d[f"{metric}_b"].min()) * 1e3)
        hi = float(max(d[f"{metric}_a"].max(), d[f"{metric}_b"].max()) * 1e3)
        fig.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", name="equal",
                                 line={"dash": "dot", "color": "gray"}))
    fig.update_xaxes(title=f"{names[0]} {metric.upper()} (ms)")
    fig.update_yaxes(title=f"{names[1]} {metric.upper()} (ms)")
    return _layout(fig, f"Per request: {metric.upper()}", height=420)


def attainment_vs_rate(curve: pd.DataFrame, rate_unit: str, planned: float) -> go.Figure:
    """SLO attainment (% of requests meeting both SLOs) against offered rate, one line per
    instance shape (`label`, with GPUs), the planned rate marked."""
    fig = go.Figure()
    for (label, gpus), part in curve.sort_values("rate").groupby(["shape", "gpus"], sort=False):
        fig.add_trace(go.Scatter(x=part["rate"], y=part["attainment"] * 100, mode="lines+markers",
                                 name=f"{label} · {gpus} GPUs"))
    fig.add_vline(x=planned, line_dash="dot", annotation_text="planned rate")
    fig.update_xaxes(title=f"offered rate ({rate_unit})")
    fig.update_yaxes(title="SLO attainment (%)", range=[0, 105])
    return _layout(fig, "SLO attainment against rate, per instance shape")


def attainment_grid(curve: pd.DataFrame, rate_unit: str) -> go.Figure:
    """The same search as a heatmap: instance shapes (rows) by rate (columns)."""
    grid = curve.pivot_table(index="shape", columns="rate", values="attainment") * 100
    fig = go.Figure(go.Heatmap(z=grid.values, x=[f"{r:g}" for r in grid.columns],
                               y=list(grid.index), colorscale="RdYlGn", zmin=0, zmax=100,
                               colorbar={"title": "%"}, texttemplate="%{z:.0f}"))
    fig.update_xaxes(title=f"offered rate ({rate_unit})", type="category")
    fig.update_yaxes(title="instances (xPyD)")
    return _layout(fig, "SLO attainment (%) by instances and rate", height=380)
