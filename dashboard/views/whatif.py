"""What-if: change one or more knobs of a baseline's scenario (mode, reuse, rate, burstiness,
lengths, TTL, reuse threshold, xPyD, TP, routing policy, model or hardware profile), and run
both the baseline's scenario (the control) and the changed one in the simulator, with the
same seeds and request count, so they differ in the changed fields only; results as mean and
95 % interval over seeds."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from .. import common, figures

TITLE = "What-if"
SLUG = "what-if"
_KEEP = "as the baseline"


def _workload_knobs(wl: dict[str, Any]) -> tuple[float, int, int]:
    kind = wl.get("kind")
    if kind == "poisson":
        return float(wl["qps"]), int(wl["input_len"]["mean"]), int(wl["output_len"]["mean"])
    if kind == "multi_turn":
        return (float(wl["conversation_rate"]), int(wl["first_prompt"]["mean"]),
                int(wl["output_len"]["mean"]))
    return 1.0, 0, 0


def knobs_of(base: dict[str, Any]) -> dict[str, Any]:
    """The form's fields at the baseline's values."""
    qps, inp, out = _workload_knobs(base["workload"])
    con, cl = base["connector"], base["cluster"]
    return {"mode": con["mode"], "bidirectional": bool(con["bidirectional"]), "qps": qps,
            "requests": int(base["requests"]), "input_len": inp, "output_len": out,
            "ttl": float(con["decoder_kv_blocks_ttl"]),
            "threshold": int(con["kv_recompute_threshold"]),
            "prefill_instances": int(cl["prefill_instances"]),
            "decode_instances": int(cl["decode_instances"]),
            "prefill_tp": cl.get("prefill_tp"), "decode_tp": cl.get("decode_tp"),
            "routing": cl.get("routing", "round_robin"),
            "burstiness": float(base["workload"].get("burstiness", 1.0)),
            "model": _KEEP, "hardware": _KEEP}


def apply_changes(base: dict[str, Any], ch: dict[str, Any]) -> dict[str, Any]:
    """A scenario (model_dump) with the form's fields applied (workload knobs by kind)."""
    from kvplane.sim.profiles import load_profile

    d = {**base, "sweep": {}, "published": None}
    d["connector"] = {**base["connector"], "mode": ch["mode"],
                      "bidirectional": ch["bidirectional"],
                      "decoder_kv_blocks_ttl": ch["ttl"],
                      "kv_recompute_threshold": ch["threshold"]}
    d["cluster"] = {**base["cluster"], "prefill_instances": ch["prefill_instances"],
                    "decode_instances": ch["decode_instances"],
                    "prefill_tp": ch.get("prefill_tp", base["cluster"].get("prefill_tp")),
                    "decode_tp": ch.get("decode_tp", base["cluster"].get("decode_tp")),
                    "routing": ch.get("routing", base["cluster"].get("routing", "round_robin"))}
    d["requests"] = ch["requests"]
    wl = dict(base["workload"])
    if wl.get("kind") == "poisson":
        wl["qps"] = ch["qps"]
        wl["input_len"] = {**wl["input_len"], "mean": ch["input_len"]}
        wl["output_len"] = {**wl["output_len"], "mean": ch["output_len"]}
        wl["burstiness"] = ch.get("burstiness", wl.get("burstiness", 1.0))
    elif wl.get("kind") == "multi_turn":
        wl["conversation_rate"] = ch["qps"]
        wl["first_prompt"] = {**wl["first_prompt"], "mean": ch["input_len"]}
        wl["output_len"] = {**wl["output_len"], "mean": ch["output_len"]}
    d["workload"] = wl
    profiles = dict(base["profiles"])
    for kind in ("model", "hardware"):
        name = ch.get(kind, _KEEP)
        if name and name != _KEEP:
            profiles[kind] = load_profile(name, kind=kind).model_dump(mode="json")
    d["profiles"] = profiles
    return d


def arm_table(kids: pd.DataFrame) -> pd.DataFrame:
    """Control and what-if per metric and statistic: mean +- 95 % interval over seeds, and the
    change with its interval (paired by seed: the two arms share each seed's arrivals)."""
    from kvplane.sim.planner import mean_interval

    rows = []
    by_arm: dict[str, dict[int, dict[str, Any]]] = {}
    for meta in kids["meta"]:
        if not isinstance(meta, dict) or "summary" not in meta:
            continue
        by_arm.setdefault(meta.get("arm", "what-if"), {})[int(meta.get("seed", 0))] = \
            meta["summary"]
    ctl, new = by_arm.get("control", {}), by_arm.get("what-if", {})
    seeds = sorted(set(ctl) & set(new)) if ctl else sorted(new)
    for metric in ("ttft", "tpot", "e2e"):
        for stat in ("mean", "p50", "p90", "p99"):
            b = _vals(new, seeds, metric, stat)
            if not b:
                continue
            row: dict[str, Any] = {"metric": metric.upper(), "stat": stat}
            mb, hb = mean_interval(b)
            if ctl:
                a = _vals(ctl, seeds, metric, stat)
                if len(a) == len(b) and a:
                    ma, ha = mean_interval(a)
                    row["control (ms)"] = f"{ma:.2f} ± {ha:.2f}"
                    rel = [(y - x) / x * 100 for x, y in zip(a, b, strict=True) if x]
                    if rel:
                        mr, hr = mean_interval(rel)
                        row["change"] = f"{mr:+.1f} % ± {hr:.1f}"
            row["what-if (ms)"] = f"{mb:.2f} ± {hb:.2f}"
            rows.append(row)
    return pd.DataFrame(rows, columns=["metric", "stat", "control (ms)", "what-if (ms)",
                                       "change"])


def _vals(arm: dict[int, dict[str, Any]], seeds: list[int], metric: str, stat: str
          ) -> list[float]:
    return [float(arm[s][f"{metric}_ms"][stat]) for s in seeds
            if arm.get(s) and arm[s][f"{metric}_ms"].get(stat) is not None]


def render(url: str, table: pd.DataFrame) -> None:
    from kvplane.sim.config import (
        ScenarioError,
        bundled_scenario_names,
        load_scenario,
        scenario_from_data,
    )
    from kvplane.sim.profiles import bundled_profile_names

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
    if baseline:  # as many requests as the baseline saw
        seen = int(table.loc[table["id"] == baseline, "requests"].iloc[0])
        if seen and seen != int(base["requests"]) + int(base.get("warmup_requests", 0)):
            # not the scenario's own size (a smaller sweep, a replay, a live run): its
            # warm-up cannot be told, so the what-if runs as many requests, none left out
            base = {**base, "warmup_requests": 0, "requests": seen}
    k0 = knobs_of(base)
    devices = int(base["profiles"]["hardware"]["node"]["devices_per_node"]["value"])
    tp0 = int(base["profiles"]["hardware"]["node"]["tp_size"]["value"])
    multi = base["workload"]["kind"] == "multi_turn"

    def k(name: str) -> str:  # widget keys per baseline, so a new baseline resets the form
        return f"whatif_{name}:{baseline or base['name']}"

    with st.form("whatif_form"):
        st.caption(f"Base: **{base['name']}**, {base['workload']['kind']} workload. The "
                   "baseline's scenario runs too (the control), with the same seeds and "
                   "requests: the two differ only in what you change here.")
        c1, c2, c3, c4, c5 = st.columns(5)
        mode = c1.selectbox("Mode", ["push", "pull"], index=["push", "pull"].index(k0["mode"]),
                            key=k("mode"))
        bidi = c1.checkbox("Reuse (bidirectional)", k0["bidirectional"], key=k("bidi"))
        routing = c1.selectbox("Routing policy", ["round_robin", "least_loaded"],
                               index=["round_robin", "least_loaded"].index(k0["routing"]),
                               key=k("routing"))
        qps = c2.number_input("Conversations/s" if multi else "QPS", 0.0001, 1000.0, k0["qps"],
                              format="%.4g", key=k("qps"))
        burst = c2.number_input("Burstiness (gamma shape; 1 = Poisson)", 0.01, 100.0,
                                k0["burstiness"], disabled=base["workload"]["kind"] != "poisson",
                                key=k("burst"))
        requests = c2.number_input("Requests (both arms)", 1, 1_000_000, k0["requests"], step=10,
                                   key=k("requests"))
        in0, out0 = k0["input_len"], k0["output_len"]
        in_len = c3.number_input("Input length (first prompt)", 1, 1_000_000, max(in0, 1),
                                 step=256, disabled=in0 == 0, key=k("in"))
        out_len = c3.number_input("Output length", 1, 100_000, max(out0, 1), step=16,
                                  disabled=out0 == 0, key=k("out"))
        ttl = c4.number_input("Retained KV TTL (s)", 0.1, 100_000.0, k0["ttl"], key=k("ttl"))
        threshold = c4.number_input("Recompute threshold (tokens)", 0, 1_000_000,
                                    k0["threshold"], key=k("threshold"))
        px = c5.number_input("Prefill instances (x)", 1, 64, k0["prefill_instances"],
                             key=k("x"))
        dy = c5.number_input("Decode instances (y)", 1, 64, k0["decode_instances"], key=k("y"))
        c6, c7, c8, c9, c10 = st.columns(5)
        ptp = c6.number_input("Prefill TP", 1, devices, int(k0["prefill_tp"] or tp0),
                              key=k("ptp"))
        dtp = c7.number_input("Decode TP", 1, devices, int(k0["decode_tp"] or tp0),
                              key=k("dtp"))
        model = c8.selectbox("Model profile", [_KEEP, *bundled_profile_names("model")],
                             key=k("model"))
        hardware = c9.selectbox("Hardware profile", [_KEEP, *bundled_profile_names("hardware")],
                                key=k("hardware"))
        seeds = c10.number_input("Seeds (per arm)", 1, 10, 3, key=k("seeds"))
        go = st.form_submit_button("Run the simulator", key="whatif_go")
    if go:
        changes = {"mode": mode, "bidirectional": bidi, "qps": float(qps),
                   "requests": int(requests), "input_len": int(in_len),
                   "output_len": int(out_len), "ttl": float(ttl), "threshold": int(threshold),
                   "prefill_instances": int(px), "decode_instances": int(dy),
                   "prefill_tp": int(ptp) if int(ptp) != tp0 or k0["prefill_tp"] else
                   k0["prefill_tp"],
                   "decode_tp": int(dtp) if int(dtp) != tp0 or k0["decode_tp"] else
                   k0["decode_tp"],
                   "routing": routing, "burstiness": float(burst), "model": model,
                   "hardware": hardware}
        same = {**k0, "requests": int(requests)}
        try:
            sc = scenario_from_data(apply_changes(base, changes), file="what-if form")
            control = scenario_from_data(apply_changes(base, same), file="what-if baseline")
        except ScenarioError as exc:
            st.error(str(exc))
            return
        bar = st.progress(0.0, text="simulating...")

        def progress(done: int, total: int, what: str) -> None:
            bar.progress(min(done / max(total, 1), 1.0), text=f"{what}: {done}/{total} requests")

        from kvplane.sim.replay_sim import run_whatif

        result = run_whatif(url, sc, baseline=baseline,
                            changes={c: v for c, v in changes.items() if v != k0.get(c)},
                            progress=progress, seeds=int(seeds), control=control)
        bar.progress(1.0, text="done")
        common.clear_caches()
        st.session_state["whatif_last"] = result["run_id"]
        st.success(f"what-if recorded as run {result['run_id']}")
    last = st.session_state.get("whatif_last")
    if not last:
        return
    kids = common.children(url, last)
    sweep_meta = table.loc[table["id"] == last, "meta"]
    if sweep_meta.empty:
        common.clear_caches()
        sweep_meta = common.runs(url).loc[lambda t: t["id"] == last, "meta"]
    meta = sweep_meta.iloc[0] if not sweep_meta.empty else {}
    st.subheader("Result beside the control")
    diff = (meta or {}).get("differences") or []
    if diff:
        st.markdown("**What differs** between the arms (everything else is equal):\n"
                    + "\n".join(f"- `{d}`" for d in diff))
    else:
        st.info("Nothing was changed: both arms ran the baseline's scenario (the spread "
                "between them is the seeds' noise).")
    st.dataframe(arm_table(kids), hide_index=True, width="stretch")
    st.caption(f"Mean ± 95 % interval over {(meta or {}).get('seeds', 1)} seed(s) per arm; "
               "change paired by seed (both arms saw each seed's arrivals).")
    arms = {a: [r for r, m in zip(kids["id"], kids["meta"], strict=True)
                if isinstance(m, dict) and m.get("arm", "what-if") == a]
            for a in ("control", "what-if")}
    if arms["control"] and arms["what-if"]:
        fin = common.finished_requests(url, tuple(arms["control"] + arms["what-if"]))
        a = fin[fin["run"].isin(arms["control"])]
        b = fin[fin["run"].isin(arms["what-if"])]
        st.plotly_chart(figures.cdfs(a, b, ("control", "what-if")), width="stretch",
                        key="whatif_cdfs")
