"""Revision 0004: events name their run by an integer `runs.key`.

A store written by kvplane before 0004 (`tests/data/store_rev0003.sqlite`, made by
`tests/data/make_old_store.py` with the old code) is read as it is, read-only, and upgraded by
the first writer, with every event, run and parent kept; the database gives every new run
its key on both backends, whichever way the run's row is inserted.
"""

from __future__ import annotations

import shutil
import sqlite3
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import func, insert, select
from store_samples import every_type_samples, in_threads, schema3_samples

from kvplane.core.events import SCHEMA_VERSION, BlocksReserved
from kvplane.results import request_rows
from kvplane.store import (
    events_of_runs,
    events_table,
    has_run_keys,
    head_revision,
    model_drift,
    open_store,
    run_id_of,
    runs_table,
)
from kvplane.store.migrate import current_revision, downgrade, upgrade

DATA = Path(__file__).resolve().parents[1] / "data"
sys.path.insert(0, str(DATA))
from make_old_store import BIG, RUNS

A, SWEEP, CHILD = RUNS


def old_store(tmp_path: Path) -> str:
    path = tmp_path / "old.db"
    shutil.copyfile(DATA / "store_rev0003.sqlite", path)
    return f"sqlite:///{path}"


def per_run(engine: object, run_ids: list[str]) -> dict[str, int]:
    """Events per run id, grouped in SQL by `events.run` and named through `run_id_of`."""
    e = events_table
    with engine.connect() as conn:  # type: ignore[attr-defined]
        return dict(conn.execute(
            select(run_id_of(engine), func.count())  # type: ignore[arg-type]
            .where(events_of_runs(engine, run_ids)).group_by(e.c.run)).all())


def test_a_store_from_before_0004_is_read_as_it_is_then_upgraded(tmp_path: Path) -> None:
    samples = schema3_samples(per_type=3)  # what the old store holds
    wanted = {A: [*samples, BIG, *samples], CHILD: samples[:10]}
    url = old_store(tmp_path)
    with open_store(url, read_only=True) as old:
        assert old.revision == "0003" and not has_run_keys(old.engine)
        assert {r.id for r in old.runs()} == set(RUNS)
        for run, events in wanted.items():
            assert list(old.events(run)) == events
        assert list(old.events(A, BlocksReserved, request="r9")) == [BIG]
        assert per_run(old.engine, [A, CHILD, SWEEP]) == {A: 235, CHILD: 10}
        rows_before = request_rows(old.engine, A)
        assert current_revision(old.engine) == "0003"  # reading wrote nothing
    with open_store(url) as new:  # a writer migrates it
        assert current_revision(new.engine) == head_revision() and has_run_keys(new.engine)
        assert model_drift(new.engine) == []
        with new.engine.connect() as conn:
            keys = dict(conn.execute(select(runs_table.c.id, runs_table.c.key)).all())
        assert keys == {SWEEP: 1, A: 2, CHILD: 3}  # in the order the runs started
        for run, events in wanted.items():
            assert list(new.events(run)) == events
            assert new.count(run) == len(events)
        assert list(new.events(A, BlocksReserved, request="r9")) == [BIG]
        assert per_run(new.engine, [A, CHILD, SWEEP]) == {A: 235, CHILD: 10}
        assert request_rows(new.engine, A) == rows_before
        assert new.run(CHILD).parent == SWEEP and new.run(A).meta == {"n": 1}
        # writing goes on where the old rows end; a new run gets the next key
        assert new.append(A, [BIG]) == range(235, 236)
        fresh = new.create_run("sim", "new")
        new.append(fresh, samples[:3])
        assert per_run(new.engine, [A, fresh]) == {A: 236, fresh: 3}
        # deleting a run deletes exactly its events; its child is kept, orphaned
        assert new.delete_run(SWEEP) == 0 and new.run(CHILD).parent is None
        assert new.delete_run(A) == 236
        assert per_run(new.engine, [A, CHILD, fresh]) == {CHILD: 10, fresh: 3}
    con = sqlite3.connect(url.removeprefix("sqlite:///"))
    try:
        assert con.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert con.execute("PRAGMA foreign_key_check").fetchall() == []
    finally:
        con.close()


def test_down_to_0003_and_up_again_keeps_every_event(store_url: str) -> None:
    samples = every_type_samples(per_type=2)
    with open_store(store_url) as store:
        runs = [store.create_run("sim", f"r{i}") for i in range(3)]
        for i, run in enumerate(runs):
            store.append(run, [*samples[i:], BIG])
        downgrade(store.engine, "0003")
        assert not has_run_keys(store.engine)
        with store.engine.connect() as conn:  # the text id again, as before 0004
            stored = set(conn.execute(select(events_table.c.run).distinct()).scalars())
        assert stored == set(runs)
    with open_store(store_url, read_only=True) as old:
        for i, run in enumerate(runs):
            assert list(old.events(run)) == [*samples[i:], BIG]
    with open_store(store_url) as new:
        assert has_run_keys(new.engine) and model_drift(new.engine) == []
        for i, run in enumerate(runs):
            assert list(new.events(run)) == [*samples[i:], BIG]
        assert per_run(new.engine, runs) == {
            run: len(samples) - i + 1 for i, run in enumerate(runs)}


def test_the_database_gives_each_new_run_its_own_key(store_url: str) -> None:
    with open_store(store_url) as store:
        made = [store.create_run("sim", f"r{i}") for i in range(3)]
        other = "44444444-0000-4000-8000-000000000004"
        with store.engine.begin() as conn:  # as imports insert runs: no key given
            conn.execute(insert(runs_table).values(
                id=other, kind="import", scenario="x", started=datetime.now(UTC), parent=None,
                meta={}, schema_version=SCHEMA_VERSION))
        def create(_: int) -> None:
            for i in range(5):
                made.append(store.create_run("sim", f"t{i}"))

        in_threads(create, range(3))
        with store.engine.connect() as conn:
            keys = dict(conn.execute(select(runs_table.c.id, runs_table.c.key)).all())
        assert set(keys) == {*made, other} and None not in keys.values()
        assert len(set(keys.values())) == len(keys)
        # a run's events are its own, whichever key a later run gets
        last = max(keys, key=keys.__getitem__)
        store.append(last, [BIG])
        store.delete_run(last)
        after = store.create_run("sim", "after")
        assert store.count(after) == 0 and list(store.events(after)) == []


def test_an_old_store_opened_by_a_reader_is_read_after_a_writer_upgrades_it(
        tmp_path: Path) -> None:
    url = old_store(tmp_path)
    with open_store(url, read_only=True) as reader:  # as the dashboard keeps its store open
        assert reader.count(CHILD) == 10
        with open_store(url) as writer:
            assert writer.count(CHILD) == 10
        assert reader.count(CHILD) == 10
        assert per_run(reader.engine, [A, CHILD]) == {A: 235, CHILD: 10}


@pytest.mark.parametrize("to", ["0001", "0002"])
def test_older_revisions_still_upgrade_through_0004(store_url: str, to: str) -> None:
    with open_store(store_url) as store:
        run = store.create_run("sim", "old")
        store.append(run, [BIG])
        downgrade(store.engine, to)
        upgrade(store.engine)
        assert model_drift(store.engine) == [] and list(store.events(run)) == [BIG]
