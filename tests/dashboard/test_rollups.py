"""Per-run rollups (`kvplane.dashboard.rollup`, store revision 0005): the pages show exactly
what they showed from the events, and with a current rollup their first visit reads no
per-request rows of the run.

Each page is opened (Streamlit's AppTest, caches cleared: a first visit) on the store's runs
without rollups, then `kvplane rollup` writes them and the same visits are made again: every
table, caption and figure must be equal."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pandas as pd
import pytest
import streamlit as st
from see_store import APP
from streamlit.testing.v1 import AppTest
from typer.testing import CliRunner

from kvplane.cli import app
from kvplane.dashboard import queries as q
from kvplane.dashboard import rollup
from kvplane.store import open_store

pytestmark = pytest.mark.timeout(600)


def visit(store: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, page: str, run: str,
          widgets: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a first visit of `page` on `run` shows: headers, captions, infos, every table's
    values and every figure's spec (after setting `widgets`, key -> value, if any)."""
    st.cache_data.clear()
    monkeypatch.setenv("KVPLANE_DB", store.url)
    at = AppTest.from_file(str(APP), default_timeout=180)
    at.query_params["page"] = page
    at.query_params["run"] = run
    at.run()
    for key, value in (widgets or {}).items():
        getattr(at, KINDS[key])(key=key).set_value(value)
        at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    return {
        "headers": [h.value for h in at.header] + [h.value for h in at.subheader],
        "captions": [c.value for c in at.caption],
        "infos": [i.value for i in at.info],
        "tables": [d.value.to_json(orient="split", double_precision=15, date_format="iso")
                   for d in at.dataframe],
        "figures": [json.loads(c.proto.spec) for c in at.get("plotly_chart")],
    }


KINDS = {"ops_ttft": "number_input", "timeline_order": "selectbox",
         "timeline_limit": "number_input", "timeline_failed": "checkbox",
         "timeline_search": "text_input"}
VISITS = [
    ("runs", "push_point", None),
    ("runs", "live", None),
    ("operations", "push_point", None),
    ("operations", "reuse_on", None),
    ("operations", "live", None),
    ("operations", "reuse_on", {"ops_ttft": 300.0}),  # another SLO: from the requests
    ("timeline", "push_point", None),
    ("timeline", "live", None),
    ("push-pull", "sweep", None),
    ("push-pull", "import_sweep", None),
    ("timeline", "reuse_on", {"timeline_order": "queue"}),
    ("timeline", "reuse_on", {"timeline_limit": 5, "timeline_order": "ttft"}),
    ("timeline", "push_point", {"timeline_search": "req-1"}),  # a filter: the whole index
    ("reuse", "reuse_on", None),
    ("reuse", "push_point", None),
]


def test_pages_show_the_same_from_rollups_as_from_events(see_store, monkeypatch):
    runs = {name: getattr(see_store, name) for name in ("push_point", "live", "reuse_on",
                                                         "sweep", "import_sweep")}
    before = [visit(see_store, monkeypatch, page, runs[run], widgets)
              for page, run, widgets in VISITS]
    result = CliRunner().invoke(app, ["rollup", "--db", see_store.url])
    assert result.exit_code == 0, result.output
    with open_store(see_store.url, read_only=True) as store:
        with_events = [r.id for r in store.runs() if store.count(r.id)]
        assert set(store.rollups(with_events, "heads")) == set(with_events)
    assert f"rolled up run {see_store.push_point}" in result.output
    after = [visit(see_store, monkeypatch, page, runs[run], widgets)
             for page, run, widgets in VISITS]
    for (page, run, widgets), b, a in zip(VISITS, before, after, strict=True):
        assert b["figures"] or b["tables"], (page, run)  # the visit showed something
        assert a == b, (page, run, widgets)
    again = CliRunner().invoke(app, ["rollup", "--db", see_store.url])
    assert again.exit_code == 0 and "has a current rollup" in again.output


def test_first_visits_on_rolled_up_runs_read_no_per_request_rows(see_store, monkeypatch):
    with open_store(see_store.url) as store:
        points = [r.id for r in store.runs() if r.parent == see_store.sweep]
        rolled = (*points, see_store.reuse_on)
        for run in rolled:
            rollup.write(store, run)

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("read the run's requests")

    # the runs without a rollup still need their figures for the Runs table: read them now
    with open_store(see_store.url, read_only=True) as store:
        others = [r.id for r in store.runs() if r.id not in rolled]
        heads = q.run_heads(store.engine, others)

    def others_heads(_engine: Any, ids: list[str]) -> pd.DataFrame:
        if not set(ids) <= set(others):
            refuse()
        return heads[heads["id"].isin(ids)].reset_index(drop=True)

    for name in ("request_index", "instance_requests", "finished_requests", "block_bins",
                 "transfer_bins", "prefix_bins", "request_table_all", "prefill_split",
                 "reuse_outcomes"):
        if hasattr(q, name):
            monkeypatch.setattr(q, name, refuse)
    monkeypatch.setattr(q, "run_heads", others_heads)
    for page in ("runs", "operations", "timeline", "reuse"):
        got = visit(see_store, monkeypatch, page, see_store.reuse_on)
        assert got["figures"] or got["tables"], page
    got = visit(see_store, monkeypatch, "push-pull", see_store.sweep)  # its points
    assert got["figures"] and got["tables"]
    # a filter on the timeline needs the whole index: read (and refused here)
    with pytest.raises(AssertionError, match="read the run's requests"):
        visit(see_store, monkeypatch, "timeline", see_store.reuse_on, {"timeline_failed": True})


def test_rollup_figures_equal_the_event_level_ones(see_store_master):
    with open_store(see_store_master.url, read_only=True) as store:
        engine = store.engine
        for run in (see_store_master.push_point, see_store_master.live,
                    see_store_master.reuse_on):
            parts = rollup.build(engine, run)
            heads = q.run_heads(engine, [run]).iloc[0]
            for col in q.HEAD_COLUMNS:
                got, want = parts["heads"][col], heads[col]
                assert (got is None and pd.isna(want)) or got == want, (run, col)
            assert parts["heads"]["finished"] > 0
            fin = q.finished_requests(engine, [run])
            for m in ("ttft", "tpot", "e2e"):
                want = q.stats(fin[m])
                got = rollup.stats_of(parts["stats"])[m]
                assert got["n"] == want["n"] == len(fin)
                for k in ("mean", "p50", "p90", "p99"):
                    assert got[k] == want[k] or (pd.isna(got[k]) and pd.isna(want[k]))
            # the block series sums to what the run reserved minus what it freed
            blocks = rollup.from_json(parts["operations"]["blocks"])
            assert blocks.equals(q.block_bins(engine, run, parts["operations"]["width"]))
            reqs = q.request_index(engine, run)
            assert parts["timeline"]["requests"] == len(reqs)
            top = rollup.from_json(parts["timeline"]["top"]["e2e"])
            want = reqs["e2e"].sort_values(ascending=False, na_position="first")
            assert len(top) == min(len(reqs), rollup.TIMELINE_TOP)
            assert top["e2e"].fillna(-1).tolist() == want.fillna(-1).head(len(top)).tolist()
            assert set(top["request"]) <= set(reqs["request"])


def test_sim_run_rolls_up_each_point_it_records(tmp_path):
    import yaml

    from kvplane.sim.config import Sweep, load_scenario

    sc = load_scenario("seed_push_vs_pull").model_copy(update={
        "requests": 6, "warmup_requests": 0,
        "sweep": Sweep(modes=["push", "pull"], qps=[4.0], input_lens=[1024])})
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(sc.model_dump(mode="json")))
    db = f"sqlite:///{tmp_path / 'k.db'}"
    res = CliRunner().invoke(app, ["sim", "run", str(path), "--db", db])
    assert res.exit_code == 0, res.output
    with open_store(db, read_only=True) as store:
        points = [r.id for r in store.runs() if r.parent is not None]
        assert len(points) == 2
        heads = store.rollups(points, "heads")
        assert set(heads) == set(points)
        want = q.run_heads(store.engine, points).set_index("id")
        for run in points:
            assert heads[run]["finished"] == want.loc[run, "finished"] == 6
            assert heads[run]["ttft_ms"] == want.loc[run, "ttft_ms"]
            assert set(store.rollups([run], "timeline")) == {run}


def test_runs_page_names_kvplane_rollup_for_long_runs_without_one(see_store, monkeypatch):
    from kvplane.dashboard.views import runs as runs_view

    monkeypatch.setattr(runs_view, "LONG_RUN_EVENTS", 100)  # the store's runs are small
    with open_store(see_store.url, read_only=True) as store:
        long = [r.id for r in store.runs() if store.count(r.id) >= 100]
    assert long
    got = visit(see_store, monkeypatch, "runs", see_store.push_point)
    hint = [c for c in got["captions"] if "kvplane rollup" in c]
    assert hint and hint[0].startswith(f"{len(long)} run(s) of 100 events or more")
    with open_store(see_store.url) as store:
        rollup.write(store, long[0])
    got = visit(see_store, monkeypatch, "runs", see_store.push_point)
    hint = [c for c in got["captions"] if "kvplane rollup" in c]
    assert (hint[0].startswith(f"{len(long) - 1} run(s)") if len(long) > 1 else not hint)


def test_reuse_page_draws_a_long_run_by_an_even_sample():
    """A run of more than REUSE_POINTS requests is drawn by REUSE_POINTS of them, evenly spaced
    in request order, its first and last included; a shorter run whole."""
    big = pd.DataFrame({"run": "r", "request": [f"req-{i:06d}" for i in range(12_001)],
                        "ttft": range(12_001)}).sample(frac=1.0, random_state=3)
    got = rollup.reuse_sample(big)
    assert len(got) == rollup.REUSE_POINTS and got["request"].is_unique
    assert got["request"].iloc[0] == "req-000000" and got["request"].iloc[-1] == "req-012000"
    gaps = got["ttft"].diff().dropna()
    assert gaps.min() >= 2 and gaps.max() <= 3  # about 12,000 / 5,000 apart, every one
    small = big.head(100)
    assert rollup.reuse_sample(small) is small
