"""Every dashboard page, through Streamlit's own AppTest, on a store of real runs (conftest).

Each test opens the app on a private copy of the store, goes to a page as a person would (the
sidebar radio), changes a widget or two, and checks what the page shows: the tables' numbers
and the Plotly figures' traces, as the browser would receive them.
"""

from __future__ import annotations

import base64
import json
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from see_store import APP
from streamlit.testing.v1 import AppTest

from kvplane.core.replay import replay
from kvplane.dashboard import queries
from kvplane.store import open_store

pytestmark = pytest.mark.timeout(300)


def open_app(store: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, page: str = "Runs"
             ) -> AppTest:
    monkeypatch.setenv("KVPLANE_DB", store.url)
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.run()
    assert not at.exception, at.exception
    if page != "Runs":
        at.sidebar.radio[0].set_value(page).run()
    ok(at)
    return at


def ok(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def charts(at: AppTest) -> list[dict[str, Any]]:
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def trace_names(fig: dict[str, Any]) -> list[str]:
    return [t.get("name") for t in fig["data"]]


def arr(value: Any) -> list[Any]:
    """A trace's data array as a list (Plotly sends numpy data as base64 typed arrays)."""
    if isinstance(value, dict) and "bdata" in value:
        return np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"]).tolist()
    return list(value)


def frame(at: AppTest, i: int) -> Any:
    return at.dataframe[i].value


def test_runs_page_lists_every_run_with_headline_figures(see_store, monkeypatch):
    at = open_app(see_store, monkeypatch)
    assert at.header[0].value == "Runs"
    table = frame(at, 0)
    assert len(table) == see_store.runs
    assert set(table["kind"]) == {"sim", "import", "replay", "live"}
    push = table[table["id"] == see_store.push_point].iloc[0]
    assert push["requests"] == 12 and push["finished"] == 12 and push["failed"] == 0
    live = table[table["id"] == see_store.live].iloc[0]
    assert live["requests"] == 6  # recorded at three hops, one request each
    assert 10 < push["TTFT mean (ms)"] < 1000 and 3 < push["TPOT mean (ms)"] < 20
    sweep = table[table["id"] == see_store.sweep].iloc[0]
    assert sweep["children"] == 8 and sweep["events"] == 0
    failed = table[table["scenario"].str.endswith("pull_qps4_in4096_out128_iter0")
                   & (table["kind"] == "import")].iloc[0]
    assert failed["failed"] == 1

    at.multiselect(key="runs_pick").set_value([see_store.push_point, see_store.sweep]).run()
    ok(at)
    assert [s.value for s in at.subheader][:2] == [
        "seed_push_vs_pull:push_qps4_in4096_out128_iter0", "seed_push_vs_pull"]
    stats = frame(at, 1)
    assert list(stats.index) == ["TTFT", "TPOT", "E2E"] and stats.loc["TTFT", "n"] == 12
    assert len(frame(at, 2)) == 8  # the sweep's points

    at.text_input(key="runs_filter").set_value("bidirectional").run()
    assert set(frame(at, 0)["scenario"].str.split(":").str[0]) == {"seed_bidirectional"}


def test_timeline_shows_each_phase_slowest_first_with_events_on_hover(see_store, monkeypatch):
    at = open_app(see_store, monkeypatch, "Request timeline")
    at.selectbox(key="timeline_run").set_value(see_store.push_point).run()
    ok(at)
    [fig] = charts(at)
    names = trace_names(fig)
    for phase in ("prefill", "rendezvous", "transfer (P->D)", "first decode step", "decode"):
        assert phase in names
    with open_store(see_store.url) as store:
        reqs = queries.request_table(store.engine, see_store.push_point)
    # a queue bar exactly when some request waited for prefill
    assert ("queue" in names) == bool((reqs["prefill_started"] > reqs["arrived"]).any())
    slowest = reqs.sort_values("e2e", ascending=False)["request"].tolist()
    assert fig["layout"]["yaxis"]["categoryarray"] == slowest[::-1]  # slowest on top
    prefill = fig["data"][names.index("prefill")]
    assert "PrefillStarted" in " ".join(prefill["hovertext"])
    transfer = fig["data"][names.index("transfer (P->D)")]
    assert "TransferPlanned" in " ".join(transfer["hovertext"])
    assert "KVReceived" in " ".join(transfer["hovertext"])

    at.number_input(key="timeline_limit").set_value(5).run()
    [fig] = charts(at)
    assert fig["layout"]["yaxis"]["categoryarray"] == slowest[:5][::-1]
    at.multiselect(key="timeline_phases").set_value(["rendezvous", "prefill"]).run()
    assert sorted(trace_names(charts(at)[0])) == ["prefill", "rendezvous"]
    at.selectbox(key="timeline_req").set_value(slowest[0]).run()
    events = frame(at, 2)
    assert events["type"].iloc[0] == "RequestArrived"
    assert events["type"].iloc[-1] == "RequestFinished"


def test_timeline_filters_failed_requests_of_an_imported_run(see_store, monkeypatch):
    with open_store(see_store.url) as store:
        failed_run = next(r.id for r in store.runs("import")
                          if r.scenario.endswith("pull_qps4_in4096_out128_iter0"))
    at = open_app(see_store, monkeypatch, "Request timeline")
    at.selectbox(key="timeline_run").set_value(failed_run).run()
    at.checkbox(key="timeline_failed").check().run()
    ok(at)
    [fig] = charts(at)
    assert fig["layout"]["yaxis"]["categoryarray"] == ["req-5"]
    assert "1 of 16 requests match" in at.caption[0].value


def test_push_pull_draws_a_line_per_qps_and_mode_with_published_points(see_store, monkeypatch):
    at = open_app(see_store, monkeypatch, "Push vs pull")
    at.selectbox(key="pp_sweep").set_value(see_store.sweep).run()
    ok(at)
    [fig] = charts(at)
    lines = [t for t in fig["data"] if t.get("mode") == "lines+markers"]
    assert {t["name"] for t in lines} == {"push · 1 QPS", "push · 4 QPS", "pull · 1 QPS",
                                          "pull · 4 QPS"}
    assert len(lines) == 8  # TTFT and TPOT panels
    for t in lines:
        assert arr(t["x"]) == [1024, 4096] and all(v > 0 for v in arr(t["y"]))
    published = [t for t in fig["data"] if t.get("marker", {}).get("symbol") == "x"]
    assert published, "seed_push_vs_pull's published figures are overlaid"
    assert any("TPOT at light load" in str(t.get("hovertext")) for t in published)
    compare = frame(at, 0)
    light = compare[compare["figure"].str.startswith("tpot_ms 5.6-5.8")].iloc[0]
    assert light["this sweep"] > 0
    points = frame(at, 1)
    # the sweep records its scenario, so the page leaves the 2 warm-up requests out
    assert len(points) == 8 and set(points["requests"]) == {10}

    at.selectbox(key="pp_sweep").set_value(see_store.import_sweep).run()
    at.selectbox(key="pp_sweep2").set_value(see_store.sweep).run()
    at.selectbox(key="pp_stat").set_value("p90").run()
    ok(at)
    names = {t["name"] for t in charts(at)[0]["data"] if t.get("mode") == "lines+markers"}
    assert "push · 4 QPS · A" in names and "pull · 1 QPS · B" in names
    at.multiselect(key="pp_modes").set_value(["push"]).run()
    names = {t["name"] for t in charts(at)[0]["data"] if t.get("mode") == "lines+markers"}
    assert names and all(n.startswith("push") for n in names)


def test_reuse_compares_on_and_off_and_counts_outcomes(see_store, monkeypatch):
    at = open_app(see_store, monkeypatch, "Reuse")
    assert at.selectbox(key="reuse_run").value == see_store.reuse_sweep  # the sweep with reuse
    ok(at)
    scatter, split, outcomes = charts(at)
    names = trace_names(scatter)
    assert {"reuse off", "reuse on", "published"} <= set(names)
    on = scatter["data"][names.index("reuse on (mean per bin)")]
    off = scatter["data"][names.index("reuse off (mean per bin)")]
    assert arr(on["y"])[-1] < arr(off["y"])[-1]  # reuse lowers TTFT at the longest prompts
    parts = {t["name"] for t in split["data"]}
    assert parts == {"recompute", "transfer (D->P read)"}
    counts = frame(at, 0)
    assert counts.loc["hit (read)", "reuse on"] > 0
    assert "reuse off" not in counts.columns or counts["reuse off"].sum() == 0
    summary = frame(at, 1)
    assert summary.loc["reuse on", "read_ms"] > 0 and summary.loc["reuse off", "read_ms"] == 0
    assert summary.loc["reuse on", "recompute_ms"] < summary.loc["reuse off", "recompute_ms"]
    assert outcomes["data"]


def test_leases_shows_retained_blocks_per_decode_instance(see_store, monkeypatch):
    at = open_app(see_store, monkeypatch, "Leases")
    assert at.selectbox(key="leases_run").value == see_store.reuse_on
    ok(at)
    [fig] = charts(at)
    names = trace_names(fig)
    assert "decode-0" in names and "LeaseGranted" in names
    held = fig["data"][names.index("decode-0")]
    assert max(arr(held["y"])) > 0 and arr(held["y"])[-1] == 0  # everything is given back by the end
    table = frame(at, 0)
    assert table.loc["decode-0", "LeaseGranted"] == 27
    assert table.loc["decode-0", "peak blocks held"] > 0
    at.radio(key="leases_purpose").set_value("pull_hold").run()
    ok(at)
    assert "prefill-0" in trace_names(charts(at)[0])


def test_sim_vs_live_opens_on_the_live_run_and_its_twin(see_store, monkeypatch):
    """Out of the box: the recorded live run beside the twin made from the scenario it ships
    with, with CDFs, per-percentile errors and a per-request scatter."""
    at = open_app(see_store, monkeypatch, "Sim vs live")
    assert at.selectbox(key="twin_a").value == see_store.live
    assert at.selectbox(key="twin_b").value == see_store.live_twin
    errors = frame(at, 0)
    assert len(errors) == 12 and (errors["measured (ms)"] > 0).all()
    cdf, scatter = charts(at)
    assert len(cdf["data"]) == 6 and len(arr(scatter["data"][0]["x"])) == 6
    # the recording mixes push and pull+reuse; a twin runs one mode, and the page says so
    assert [w.value for w in at.warning] == [next(w.value for w in at.warning
                                                  if w.value.startswith("Routed differently"))]
    assert "measured pull+reuse 3, push 3" in at.warning[0].value


def test_sim_vs_live_pairs_only_runs_of_one_workload_and_says_why(see_store, monkeypatch):
    at = open_app(see_store, monkeypatch, "Sim vs live")
    at.selectbox(key="twin_a").set_value(see_store.measured).run()
    assert len(at.selectbox(key="twin_b").options) == 1  # its twin only
    assert at.selectbox(key="twin_b").value == see_store.twin
    at.toggle(key="twin_any").set_value(True).run()
    at.selectbox(key="twin_b").set_value(see_store.reuse_on).run()
    ok(at)
    assert "share no request" in at.warning[0].value
    assert not at.get("plotly_chart") and not at.dataframe  # no table of unrelated numbers


def test_sim_vs_live_lays_a_run_beside_its_twin(see_store, monkeypatch):
    at = open_app(see_store, monkeypatch, "Sim vs live")
    at.selectbox(key="twin_a").set_value(see_store.measured).run()
    assert at.selectbox(key="twin_b").value == see_store.twin
    ok(at)
    errors = frame(at, 0)
    assert len(errors) == 12 and set(errors["metric"]) == {"TTFT", "TPOT", "E2E"}
    assert (errors["measured (ms)"] > 0).all() and (errors["twin (ms)"] > 0).all()
    cdf, scatter = charts(at)
    assert len(cdf["data"]) == 6
    assert len(arr(scatter["data"][0]["x"])) == 16  # every request matched by id
    assert "16 requests in both runs" in " ".join(c.value for c in at.caption)


def test_sim_vs_live_makes_a_twin(see_store, monkeypatch):
    at = open_app(see_store, monkeypatch, "Sim vs live")
    at.selectbox(key="twin_a").set_value(see_store.pull_point).run()
    assert "no twin yet" in at.info[0].value and not at.dataframe
    at.button(key="twin_make").click().run()
    ok(at)
    with open_store(see_store.url) as store:
        twins = [r for r in store.runs("replay") if r.parent == see_store.pull_point]
    assert len(twins) == 1
    assert at.selectbox(key="twin_b").value == twins[0].id
    assert any("12 requests in both runs" in c.value for c in at.caption)


def test_what_if_runs_control_and_change_with_seeds_and_says_what_differs(
        see_store, monkeypatch):
    at = open_app(see_store, monkeypatch, "What-if")
    at.selectbox(key="whatif_base").set_value(see_store.push_point).run()
    ok(at)
    k = f":{see_store.push_point}"
    assert at.number_input(key="whatif_requests" + k).value == 10  # the recorded scenario's
    assert at.selectbox(key="whatif_mode" + k).value == "push"
    at.selectbox(key="whatif_mode" + k).set_value("pull")
    at.number_input(key="whatif_y" + k).set_value(2)
    at.number_input(key="whatif_dtp" + k).set_value(4)
    at.number_input(key="whatif_seeds" + k).set_value(2)
    at.button(key="whatif_go").click().run()
    ok(at)
    assert at.success and "what-if recorded" in at.success[0].value
    with open_store(see_store.url) as store:
        sweeps = [r for r in store.runs("sim") if r.parent == see_store.push_point]
        assert len(sweeps) == 1
        meta = sweeps[0].meta
        assert meta["whatif"] == {"mode": "pull", "decode_instances": 2, "decode_tp": 4}
        assert sorted(meta["differences"]) == [
            "cluster.decode_instances: 1 -> 2", "cluster.decode_tp: None -> 4",
            "connector.mode: 'push' -> 'pull'"]
        points = [r for r in store.runs("sim") if r.parent == sweeps[0].id]
        arms = sorted(r.meta["arm"] for r in points)
        assert arms == ["control", "control", "what-if", "what-if"]
        seeds = {a: sorted(r.meta["seed"] for r in points if r.meta["arm"] == a)
                 for a in ("control", "what-if")}
        assert seeds["control"] == seeds["what-if"] and len(set(seeds["control"])) == 2
        new = next(r for r in points if r.meta["arm"] == "what-if")
        old = next(r for r in points if r.meta["arm"] == "control")
        routed = {e.decode for e in store.events(new.id, "RequestRouted")}  # type: ignore[attr-defined]
        assert routed == {"decode-0", "decode-1"}
        assert {e.decode for e in store.events(old.id, "RequestRouted")} == {"decode-0"}  # type: ignore[attr-defined]
        assert store.count(new.id, "RequestArrived") == store.count(old.id, "RequestArrived")
    text = " ".join(m.value for m in at.markdown)
    assert "What differs" in text and "connector.mode" in text
    result = frame(at, 0)
    assert list(result.columns) == ["metric", "stat", "control (ms)", "what-if (ms)", "change"]
    assert len(result) == 12 and result["change"].str.contains("±").all()
    assert len(charts(at)[0]["data"]) == 6
    progress = at.get("progress")
    assert progress and progress[-1].proto.value == 100


def test_a_page_link_opens_that_page_on_the_runs_it_names(see_store, monkeypatch):
    monkeypatch.setenv("KVPLANE_DB", see_store.url)
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.query_params["page"] = "timeline"
    at.query_params["run"] = see_store.pull_point[:8]  # a short id, as the pages show them
    at.run()
    ok(at)
    assert at.header[0].value == "Request timeline"
    assert at.selectbox(key="timeline_run").value == see_store.pull_point


def test_an_empty_store_says_how_to_fill_it(tmp_path, monkeypatch):
    store = SimpleNamespace(url=f"sqlite:///{tmp_path / 'empty.db'}")
    at = open_app(store, monkeypatch)
    assert "no run yet" in at.info[0].value
    for page in ("Request timeline", "Push vs pull", "Reuse", "Leases", "Sim vs live"):
        at.sidebar.radio[0].set_value(page).run()
        ok(at)
        assert at.info, page
    at.sidebar.radio[0].set_value("What-if").run()
    ok(at)  # offers the bundled scenarios to start from
    assert at.selectbox(key="whatif_bundled").value


def test_sim_vs_live_compares_a_real_live_run_with_its_twin(see_store, monkeypatch):
    """The live run was recorded through real vLLM + NIXL (tests/data/live_run)."""
    with open_store(see_store.url) as store:
        assert store.run(see_store.live).kind == "live"
        assert replay(sorted(store.events(see_store.live), key=lambda e: e.at), final=True).ok
    at = open_app(see_store, monkeypatch, "Sim vs live")
    at.selectbox(key="twin_a").set_value(see_store.live).run()
    at.selectbox(key="twin_b").set_value(see_store.live_twin).run()
    ok(at)
    errors = frame(at, 0)
    assert (errors["measured (ms)"] > 0).all() and (errors["twin (ms)"] > 0).all()
    assert any("6 requests in both runs" in c.value for c in at.caption)


def test_plan_page_states_the_workload_and_draws_attainment_against_instances_and_rate(
        see_store, monkeypatch):
    at = open_app(see_store, monkeypatch, "Plan")
    assert at.selectbox(key="plan_run").value == see_store.plan
    text = " ".join(m.value for m in at.markdown)
    assert "4 requests/s, input 4096 tokens, output 128 tokens, 20 requests per run, 2 seeds" \
        in text
    verdicts = frame(at, 0)
    assert list(verdicts["GPUs"]) == sorted(verdicts["GPUs"])  # cheapest first
    assert set(verdicts["candidate"]) >= {"1P1D push", "1P1D pull"}
    assert (verdicts["attainment %"].between(0, 100)).all()
    chosen = at.success[0].value  # a choice: it meets the SLO, the curve ran for it
    assert "Cheapest meeting the SLO" in chosen
    assert verdicts[verdicts["meets SLO"]]["candidate"].isin([chosen.split("**")[1]]).any()
    line, grid = charts(at)
    assert all(t["name"].endswith("GPUs") for t in line["data"])
    rates = sorted({x for t in line["data"] for x in arr(t["x"])})
    assert rates[0] == 1.0 and rates[-1] == 8.0  # 0.25x to 2x the planned 4 QPS
    assert grid["data"][0]["type"] == "heatmap"


def test_operations_draws_per_instance_series_for_live_and_simulated_runs(see_store,
                                                                         monkeypatch):
    at = open_app(see_store, monkeypatch, "Operations")
    assert at.selectbox(key="ops_run").value == see_store.live  # live runs first
    figs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    names = {n for f in figs for n in trace_names(f)}
    # the live run's two vLLM instances (named prefill and decode by the router)
    assert {"prefill · waiting", "prefill · running", "decode · running"} <= names
    assert any(n.startswith("decode · P->D") for n in names)  # transfers into decode
    assert "decode · retained" in names and "decode pool capacity" in names
    occ = next(f for f in figs if "waiting and running" in f["layout"]["title"]["text"])
    running = next(t for t in occ["data"] if t["name"] == "decode · running")
    counts = arr(running["y"])
    assert max(counts) == 1 and min(counts) == 0  # one request at a time, idle between
    at.selectbox(key="ops_run").set_value(see_store.reuse_on).run()
    ok(at)
    figs = charts(at)
    names = {n for f in figs for n in trace_names(f)}
    assert {"prefill-0 · running", "decode-0 · waiting"} <= names
    assert "prefill-0 · reuse read" in names  # the D->P reuse hit rate
    kv = next(f for f in figs if "KV cache use" in f["layout"]["title"]["text"])
    pct = [v for t in kv["data"] for v in arr(t["y"])]
    assert 0 < max(pct) <= 100
    slo = next(f for f in figs if f["layout"]["title"]["text"].startswith("Per window"))
    assert {"SLO attainment (%)", "goodput per GPU (req/s)"} == set(trace_names(slo))


def test_timeline_draws_the_live_run(see_store, monkeypatch):
    monkeypatch.setenv("KVPLANE_DB", see_store.url)
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.query_params["page"] = "timeline"
    at.query_params["run"] = "live"  # a prefix of live-sample
    at.run()
    ok(at)
    assert at.selectbox(key="timeline_run").value == see_store.live
    names = set(trace_names(charts(at)[0]))
    assert {"prefill", "transfer (P->D)", "decode", "reuse read (D->P)"} <= names
    assert "6 of 6 requests match" in " ".join(c.value for c in at.caption)
