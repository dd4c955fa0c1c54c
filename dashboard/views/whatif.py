"""What-if: change a baseline's mode, QPS, lengths, TTL, reuse threshold or xPyD, run the
simulator with progress shown, and see the result beside the baseline."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from .. import common, figures
from .twin import error_table

TITLE = "What-if"
SLUG = "what-if"


def _workload_knobs(wl: dict[str, Any]) -> tuple[float, int, int]:
    kind = wl.get("kind")
    if kind == "poisson":
        return float(wl["qps"]), int(wl["input_len"]["mean"]), int(wl["output_len"]["mean"])
    if kind == "multi_turn":
        return (float(wl["conversation_rate"]), int(wl["first_prompt"]["mean"]),
                int(wl["output_len"]["mean"]))
    return 1.0, 0, 0


def apply_changes(base: dict[str, Any], ch: dict[str, Any]) -> dict[str, Any]:
    """A scenario (model_dump) with the form's changes applied (workload knobs by kind)."""
    d = {**base, "sweep": {}, "published": None}
    d["connector"] = {**base["connector"], "mode": ch["mode"],
                      "bidirectional": ch["bidirectional"],
                      "decoder_kv_blocks_ttl": ch["ttl"],
                      "kv_recompute_threshold": ch["threshold"]}
    d["cluster"] = {**base["cluster"], "prefill_instances": ch["prefill_instances"],
                    "decode_instances": ch["decode_instances"]}
    d["requests"] = ch["requests"]
    wl = dict(base["workload"])
    if wl.get("kind") == "poisson":
        wl["qps"] = ch["qps"]
        wl["input_len"] = {**wl["input_len"], "mean": ch["input_len"]}
        wl["output_len"] = {**wl["output_len"], "mean": ch["output_len"]}
    elif wl.get("kind") == "multi_turn":
        wl["conversation_rate"] = ch["qps"]
        wl["first_prompt"] = {**wl["first_prompt"], "mean": ch["input_len"]}
        wl["output_len"] = {**wl["output_len"], "mean": ch["output_len"]}
    d["workload"] = wl
    return d


def render(url: str, table: pd.DataFrame) -> None:
    from kvplane.sim.config import (
        ScenarioError,
        bundled_scenario_names,
        load_scenario,
        scenario_from_data,
    )

    st.header("What-if")
    points = common.point_runs(table)
    points = points[points["kind"].isin(["sim", "replay", "live", "import"])]
    baseline = common.pick_run("Baseline run", points, "whatif_base") if not points.empty \
        else None
    base: dict[str, Any] | None = common.scenario_of(url, baseline) if baseline else None
    if base is None:
        if baseline:
            st.caption("The baseline's scenario cannot be told; start from a bundled one.")
        name = st.selectbox("Start from the bundled scenario", bundled_scenario_names(),
                            key="whatif_bundled")
        base = load_scenario(name).points()[0].scenario.model_dump(mode="json")
    qps0, in0, out0 = _workload_knobs(base["workload"])
    n0 = int(base["requests"])
    if baseline:  # as many requests as the baseline saw
        seen = int(table.loc[table["id"] == baseline, "requests"].iloc[0])
        if seen and seen != n0 + int(base.get("warmup_requests", 0)):
            # not the scenario's own size (a smaller sweep, a replay, a live run): its
            # warm-up cannot be told, so the what-if runs as many requests, none left out
            base = {**base, "warmup_requests": 0}
            n0 = seen
    con, cl = base["connector"], base["cluster"]
    def k(name: str) -> str:  # widget keys per baseline, so a new baseline resets the form
        return f"whatif_{name}:{baseline or base['name']}"

    with st.form("whatif_form"):
        st.caption(f"Base: **{base['name']}**, {base['workload']['kind']} workload. Fields left "
                   "as they are keep the baseline's value.")
        c1, c2, c3, c4 = st.columns(4)
        mode = c1.selectbox("Mode", ["push", "pull"], index=["push", "pull"].index(con["mode"]),
                            key=k("mode"))
        bidi = c1.checkbox("Reuse (bidirectional)", bool(con["bidirectional"]), key=k("bidi"))
        qps = c2.number_input("QPS (multi-turn: conversations/s)", 0.0001, 1000.0, qps0,
                              format="%.4g", key=k("qps"))
        requests = c2.number_input("Requests", 1, 1_000_000, n0, step=10, key=k("requests"))
        in_len = c3.number_input("Input length (first prompt)", 1, 1_000_000, max(in0, 1),
                                 step=256, disabled=in0 == 0, key=k("in"))
        out_len = c3.number_input("Output length", 1, 100_000, max(out0, 1), step=16,
                                  disabled=out0 == 0, key=k("out"))
        ttl = c4.number_input("Retained KV TTL (s)", 0.1, 100_000.0,
                              float(con["decoder_kv_blocks_ttl"]), key=k("ttl"))
        threshold = c4.number_input("Recompute threshold (tokens)", 0, 1_000_000,
                                    int(con["kv_recompute_threshold"]), key=k("threshold"))
        c5, c6, _ = st.columns([1, 1, 2])
        px = c5.number_input("Prefill instances (x)", 1, 64, int(cl["prefill_instances"]),
                             key=k("x"))
        dy = c6.number_input("Decode instances (y)", 1, 64, int(cl["decode_instances"]),
                             key=k("y"))
        go = st.form_submit_button("Run the simulator", key="whatif_go")
    if go:
        changes = {"mode": mode, "bidirectional": bidi, "qps": float(qps),
                   "requests": int(requests), "input_len": int(in_len),
                   "output_len": int(out_len), "ttl": float(ttl), "threshold": int(threshold),
                   "prefill_instances": int(px), "decode_instances": int(dy)}
        try:
            sc = scenario_from_data(apply_changes(base, changes), file="what-if form")
        except ScenarioError as exc:
            st.error(str(exc))
            return
        bar = st.progress(0.0, text="simulating...")

        def progress(done: int, total: int, what: str) -> None:
            bar.progress(min(done / max(total, 1), 1.0), text=f"{what}: {done}/{total} requests")

        from kvplane.sim.replay_sim import run_whatif

        result = run_whatif(url, sc, baseline=baseline, changes=changes, progress=progress)
        bar.progress(1.0, text="done")
        common.clear_caches()
        st.session_state["whatif_last"] = result["points"][0]["run_id"]
        st.success(f"what-if recorded as run {result['run_id']}")
    last = st.session_state.get("whatif_last")
    if not last:
        return
    st.subheader("Result beside the baseline")
    ids = (baseline, last) if baseline else (last,)
    fin = common.finished_requests(url, tuple(i for i in ids if i))
    b = fin[fin["run"] == last]
    if baseline:
        a = fin[fin["run"] == baseline]
        table_ = error_table(a, b).rename(columns={"measured (ms)": "baseline (ms)",
                                                   "twin (ms)": "what-if (ms)",
                                                   "error": "change"})
        st.dataframe(table_, hide_index=True, width="stretch")
        st.plotly_chart(figures.cdfs(a, b, ("baseline", "what-if")), width="stretch",
                        key="whatif_cdfs")
    else:
        st.dataframe(b[["ttft", "tpot", "e2e"]].describe().T, width="stretch")
