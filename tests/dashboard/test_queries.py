"""The dashboard's SQL (dashboard/queries.py) against the runs it folds, on SQLite and on a
real PostgreSQL server: the same runs give the same figures on both backends."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
from see_store import APP, build_store
from sqlalchemy import text
from streamlit.testing.v1 import AppTest

from kvplane.dashboard import queries as q
from kvplane.store import open_store

pytestmark = pytest.mark.timeout(300)


def test_runs_fold_headline_figures_from_request_finished(see_store_master):
    with open_store(see_store_master.url) as store:
        table = q.runs(store.engine).set_index("id")
        events = list(store.events(see_store_master.push_point, "RequestFinished"))
    row = table.loc[see_store_master.push_point]
    assert row["finished"] == len(events) == 12
    want = sum(e.ttft for e in events) / len(events) * 1e3  # type: ignore[attr-defined]
    assert math.isclose(row["ttft_ms"], want, rel_tol=1e-9)
    assert table.loc[see_store_master.sweep, "points"] == 8
    assert table.loc[see_store_master.measured, "points"] == 0  # its child is a twin
    assert table.loc[see_store_master.reuse_on, "leases"] > 0
    assert table.loc[see_store_master.reuse_on, "reuse_decisions"] == 27


def test_request_milestones_are_in_protocol_order(see_store_master):
    with open_store(see_store_master.url) as store:
        push = q.request_table(store.engine, see_store_master.push_point)
        pull = q.request_table(store.engine, see_store_master.pull_point)
        on = q.request_table(store.engine, see_store_master.reuse_on)
    for df in (push, pull):
        assert len(df) == 12 and df["ok"].all()
        for a, b in (("arrived", "prefill_started"), ("prefill_started", "prefill_finished"),
                     ("prefill_finished", "transfer_planned"), ("transfer_planned", "kv_received"),
                     ("kv_received", "first_token"), ("first_token", "finished")):
            assert (df[a] <= df[b]).all(), (a, b)
    assert push["registration_arrived"].notna().all() and push["matched"].notna().all()
    assert pull["registration_arrived"].isna().all()
    assert (pull["routed"] >= pull["prefill_finished"]).all()  # pull picks decode after prefill
    read = on[on["read_planned"].notna()]
    assert len(read) > 0 and (read["read_done"] <= read["prefill_started"]).all()
    segs = q.phases(on)
    assert set(segs["phase"]) >= {"reuse read (D->P)", "prefill", "transfer (P->D)",
                                  "first decode step", "decode"}
    # a queue segment exactly when some request waited before its read or its prefill (the
    # light-load run queues only when turns overlap: the calibration has no per-request delay)
    waited = (on["read_planned"].fillna(on["prefill_started"]) > on["arrived"]).any()
    assert ("queue" in set(segs["phase"])) == waited
    assert (segs["end"] >= segs["start"]).all()
    # the phases of one request tile its life from arrival to finish, without overlap
    one = segs[segs["request"] == read["request"].iloc[0]].sort_values("start")
    assert one["start"].iloc[0] == read["arrived"].iloc[0]
    assert math.isclose(one["end"].iloc[-1], read["finished"].iloc[0])
    assert (one["start"].iloc[1:].to_numpy() >= one["end"].iloc[:-1].to_numpy() - 1e-12).all()


def test_push_registration_wait_only_when_the_registration_came_late():
    reqs = pd.DataFrame([{
        "request": "r", "arrived": 0.0, "prefill_started": 0.1, "prefill_finished": 0.3,
        "registration_arrived": 0.5, "transfer_planned": 0.5, "kv_received": 0.6,
        "first_token": 0.62, "finished": 1.0,
    }])
    segs = q.phases(reqs).set_index("phase")
    assert segs.loc["registration wait", "start"] == 0.3
    assert segs.loc["registration wait", "end"] == 0.5
    assert segs.loc["rendezvous", "start"] == 0.5  # after the registration came
    early = reqs.assign(registration_arrived=0.05)
    assert "registration wait" not in set(q.phases(early)["phase"])


def test_reuse_and_leases(see_store_master):
    with open_store(see_store_master.url) as store:
        e = store.engine
        outcomes = q.reuse_outcomes(e, [see_store_master.reuse_on, see_store_master.reuse_off])
        split = q.prefill_split(e, [see_store_master.reuse_on])
        leases = q.lease_events(e, see_store_master.reuse_on)
        grants = list(store.events(see_store_master.reuse_on, "LeaseGranted"))
    counts = outcomes.groupby(["run", "what"])["count"].sum()
    assert counts[(see_store_master.reuse_on, "read")] > 0
    assert see_store_master.reuse_off not in set(outcomes["run"])
    read = split[split["outcome"] == "read"]
    assert (read["read"] > 0).all() and (read["cached_tokens"] > 0).all()
    assert (split.loc[split["outcome"] != "read", "read"] == 0).all()
    got = leases[leases["type"] == "LeaseGranted"].set_index("lease")["blocks"]
    assert {g.lease: len(g.blocks) for g in grants} == got.astype(int).to_dict()  # type: ignore[attr-defined]
    held = q.retained_blocks(leases, "retained")
    assert held["blocks"].min() >= 0 and held["blocks"].iloc[-1] == 0


def test_retained_blocks_steps():
    rows = pd.DataFrame([
        {"time": 1.0, "type": "LeaseGranted", "instance": "d0", "lease": "a", "blocks": 4,
         "purpose": "retained"},
        {"time": 2.0, "type": "LeaseGranted", "instance": "d1", "lease": "b", "blocks": 3,
         "purpose": "retained"},
        {"time": 2.5, "type": "LeaseRenewed", "instance": "d0", "lease": "a", "blocks": None,
         "purpose": None},
        {"time": 3.0, "type": "LeaseGranted", "instance": "d0", "lease": "c", "blocks": 2,
         "purpose": "retained"},
        {"time": 4.0, "type": "LeaseExpired", "instance": "d0", "lease": "a", "blocks": None,
         "purpose": None},
        {"time": 5.0, "type": "LeaseReleased", "instance": "d1", "lease": "b", "blocks": None,
         "purpose": None},
    ])
    held = q.retained_blocks(rows)
    d0 = held[held["instance"] == "d0"]["blocks"].tolist()
    d1 = held[held["instance"] == "d1"]["blocks"].tolist()
    assert d0 == [4, 6, 2] and d1 == [3, 0]


def test_a_page_of_requests_reads_only_that_page(see_store, monkeypatch):
    """The timeline on a large run: 100 copies of a run (about 70k events), read a page."""
    with open_store(see_store.url) as store:
        src = see_store.reuse_on
        n = store.count(src)
        big = store.create_run("sim", "big:pull_bidi_qps0.01_iter0")
        with store.engine.begin() as conn:
            conn.execute(text(
                "WITH RECURSIVE k(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM k WHERE n < 99) "
                "INSERT INTO events (run, seq, time, type, request, instance, blocks, "
                "payload, lists) SELECT (SELECT key FROM runs WHERE id = :big), k.n * :n + seq, time + k.n * 1000.0, type, "
                "request || '#' || k.n, instance, blocks, payload, lists FROM events, k "
                "WHERE run = (SELECT key FROM runs WHERE id = :src)"),
                {"big": big, "n": n, "src": src})
        assert store.count(big) == 100 * n
        index = q.request_index(store.engine, big)
        assert len(index) == 2700
        page = list(index.sort_values("e2e", ascending=False)["request"].head(40))
        table = q.request_table(store.engine, big, page)
        events = q.request_events(store.engine, big, page)
    assert sorted(table["request"]) == sorted(page)
    assert set(events["request"]) == set(page) and events["seq"].is_monotonic_increasing
    # every event's whole payload, its packed block lists put back
    assert all(v is not None for v in events["payload"])
    with_blocks = events[events["type"] == "BlocksReserved"]
    assert len(with_blocks) and all(isinstance(p["blocks"], list) and p["blocks"]
                                    for p in with_blocks["payload"])
    monkeypatch.setenv("KVPLANE_DB", see_store.url)
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.query_params["page"] = "timeline"
    at.query_params["run"] = big
    at.run()
    assert not at.exception and not at.error
    assert "40 slowest" in at.caption[0].value


@pytest.mark.postgres
def test_the_same_runs_read_alike_on_postgresql(postgres_url, see_store_master, monkeypatch):
    pg = build_store(postgres_url)
    with open_store(pg.url) as a, open_store(see_store_master.url) as b:
        ra = q.runs(a.engine).set_index("scenario")
        rb = q.runs(b.engine).set_index("scenario")
        for scen in ("seed_push_vs_pull:push_qps4_in4096_out128_iter0",
                     "seed_bidirectional:pull_bidi_qps0.01_iter0"):
            for col in ("events", "requests", "finished", "leases", "reuse_decisions"):
                assert ra.loc[scen, col] == rb.loc[scen, col], (scen, col)
            assert math.isclose(ra.loc[scen, "ttft_ms"], rb.loc[scen, "ttft_ms"])
        for fn in (q.request_table, q.request_index, q.lease_events):
            x = fn(a.engine, pg.reuse_on).drop(columns=["seq"], errors="ignore")
            y = fn(b.engine, see_store_master.reuse_on).drop(columns=["seq"], errors="ignore")
            key = ["request"] if "request" in x and fn is not q.lease_events else ["time", "type"]
            x, y = x.sort_values(key).reset_index(drop=True), y.sort_values(key).reset_index(
                drop=True)
            pd.testing.assert_frame_equal(x, y, check_dtype=False)
        sa = q.prefill_split(a.engine, [pg.reuse_on]).drop(columns="run").sort_values("request")
        sb = q.prefill_split(b.engine, [see_store_master.reuse_on]).drop(columns="run") \
            .sort_values("request")
        pd.testing.assert_frame_equal(sa.reset_index(drop=True), sb.reset_index(drop=True),
                                      check_dtype=False)
    monkeypatch.setenv("KVPLANE_DB", pg.url)
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.run()
    for page in ("Runs", "Request timeline", "Push vs pull", "Reuse", "Leases", "Sim vs live",
                 "What-if"):
        at.sidebar.radio[0].set_value(page).run()
        assert not at.exception and not at.error, (page, at.exception, at.error)
        assert not at.info, (page, [i.value for i in at.info])


def test_reads_by_type_use_the_covering_index_on_sqlite(tmp_path):
    """Without statistics SQLite would take the (run, request) index for a query grouped by
    request and read every row of the run. `by_type` names the covering index, and the hint
    must really reach the SQL (SQLAlchemy's own SQLite compiler drops FROM hints: the store's
    engines render them, `store.engine._SQLiteCompiler`); the per-request query reads each
    type through that index without a hint."""
    from sqlalchemy import select

    from kvplane.results import request_stmt
    from kvplane.store import by_type, events_of, events_table, open_store

    E = events_table
    with open_store(f"sqlite:///{tmp_path / 'plan.db'}") as store:
        grouped = by_type(select(E.c.request, E.c.type).where(events_of(store.engine, "r"))
                          .group_by(E.c.request, E.c.type), store.engine)
        text = str(grouped.compile(store.engine, compile_kwargs={"literal_binds": True}))
        assert "INDEXED BY ix_events_run_type_cover" in text
        sql = str(request_stmt(store.engine, ["r"]).compile(
            store.engine, compile_kwargs={"literal_binds": True}))
        with store.engine.connect() as conn:
            plans = [" ".join(str(r[-1]) for r in conn.exec_driver_sql(
                "EXPLAIN QUERY PLAN " + q)) for q in (text, sql)]
    for plan in plans:
        assert "ix_events_run_type_cover" in plan and "ix_events_run_request" not in plan


def test_reads_of_some_requests_probe_the_covering_index(tmp_path):
    """Revision 0004 dropped the (run, request) index: the timeline's page of requests and
    `EventStore.events(run, request=...)` name every type, so SQLite searches the (run, type,
    request, ...) index (one probe per type and request) instead of scanning the run."""
    from sqlalchemy import event

    from kvplane.core.events import BlocksReserved
    from kvplane.store import open_store

    with open_store(f"sqlite:///{tmp_path / 'plan.db'}") as store:
        run = store.create_run("sim", "plan")
        mine = BlocksReserved(at=1.0, instance="d0", request="a", blocks=(1, 2),
                              purpose="decode")
        store.append(run, [mine, BlocksReserved(at=2.0, instance="d0", request="b",
                                                blocks=(3,), purpose="decode")])
        seen: list[tuple[str, object]] = []

        def keep(conn, cursor, statement, parameters, context, executemany):
            if "FROM events" in statement and "EXPLAIN" not in statement:
                seen.append((statement, parameters))

        event.listen(store.engine, "before_cursor_execute", keep)
        page = q.request_events(store.engine, run, ["a"])
        assert list(page["request"]) == ["a"]
        assert list(store.events(run, request="a")) == [mine]
        event.remove(store.engine, "before_cursor_execute", keep)
        reads = [(s, p) for s, p in seen if "request IN" in s or "request = " in s]
        assert len(reads) == 2, seen
        with store.engine.connect() as conn:
            plans = [" ".join(str(r[-1]) for r in conn.exec_driver_sql(
                "EXPLAIN QUERY PLAN " + s, p)) for s, p in reads]
    for plan in plans:
        assert "SEARCH events USING" in plan and "ix_events_run_type_cover (run=? AND type=? " \
            "AND request=?)" in plan, plan


def test_a_run_of_folded_events_reads_as_its_unfolded_events(tmp_path):
    """A decode macro-step's growth of several requests (one `DecodeBlocksReserved`, of no
    request) and notifications folded into a `KVReceived`: the block figure and a page of
    requests' events read the same as from the same run recorded one event each."""
    from kvplane.core.events import (
        BlocksFreed,
        BlocksReserved,
        DecodeBlocksReserved,
        KVReceived,
        expand,
    )

    folded = [
        BlocksReserved(at=0.5, instance="d0", request="a", blocks=(1, 2), purpose="remote_kv"),
        KVReceived(at=0.8, instance="d0", request="a", attempt=0, num_tokens=32,
                   src_ranks=(0, 1), dst_ranks=(0, 0)),
        DecodeBlocksReserved(at=1.0, instance="d0", requests=("a", "b", "c"),
                             attempts=(0, 2, 0), counts=(2, 1, 0), blocks=(9, 8, 7)),
        BlocksFreed(at=2.0, instance="d0", request="a", blocks=(1, 2, 9, 8), reason="done"),
        # a request's growth lies within its own events' span (reserved ... freed)
        DecodeBlocksReserved(at=9.0, instance="d0", requests=("b", "c"), attempts=(2, 0),
                             counts=(1, 1), blocks=(5, 4)),
        BlocksFreed(at=9.5, instance="d0", request="c", blocks=(4,), reason="done"),
    ]
    folded.insert(0, BlocksReserved(at=0.1, instance="d0", request="c", blocks=(),
                                    purpose="remote_kv"))
    runs = {}
    with open_store(f"sqlite:///{tmp_path / 'folded.db'}") as store:
        for name, events in (("folded", folded), ("unfolded", list(expand(folded)))):
            runs[name] = store.create_run("sim", name)
            store.append(runs[name], events)
        bins = {n: q.block_bins(store.engine, r, 1.0) for n, r in runs.items()}
        pages = {n: q.request_events(store.engine, r, ["a", "c"]) for n, r in runs.items()}
    assert len(bins["folded"]) and bins["folded"].equals(bins["unfolded"])
    a, b = pages["folded"], pages["unfolded"]
    grown = a[a["type"] == "BlocksReserved"]
    assert list(zip(grown["request"], grown["time"], strict=True)) == [
        ("c", 0.1), ("a", 0.5), ("a", 1.0), ("c", 1.0), ("c", 9.0)]
    assert [(p if isinstance(p, dict) else json.loads(p))["blocks"]
            for p in grown["payload"]] == [[], [1, 2], [9, 8], [], [4]]
    same = a[a["type"] != "KVReceived"][["time", "type", "request", "instance"]]
    want = b[~b["type"].isin(["KVReceived", "NotificationReceived"])][
        ["time", "type", "request", "instance"]]
    assert same.reset_index(drop=True).equals(want.reset_index(drop=True))
