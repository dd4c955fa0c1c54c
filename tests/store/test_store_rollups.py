"""Revision 0005: `run_rollups`, what the dashboard shows of a whole run, kept once per run.

A rollup is stamped with the run's event count when it was written and is read only while the
run still has that many events; it goes with its run; a store before 0005 opens and reads as
before (no rollups), upgrades to 0005 and back. Both backends (SQLite and the real PostgreSQL
of `store/pg_temp.py`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from sqlalchemy import func, select
from store_samples import every_type_samples

from kvplane.store import (
    fresh_rollups,
    has_rollups,
    head_revision,
    model_drift,
    open_store,
    rollups_table,
)
from kvplane.store.migrate import current_revision, downgrade, upgrade

DATA = Path(__file__).resolve().parents[1] / "data"


def test_a_rollup_is_read_while_its_run_has_the_events_it_covered(store_url: str) -> None:
    samples = every_type_samples(per_type=2)
    with open_store(store_url) as store:
        a, b = store.create_run("sim", "a"), store.create_run("sim", "b")
        store.append(a, samples)
        assert store.rollups([a, b], "heads") == {}  # none written yet
        covered = store.put_rollup(a, {"heads": {"finished": 3, "ttft_ms": 1.5},
                                       "stats": {"ttft": {"n": 3, "p50": None}}})
        assert covered == len(samples)
        assert store.rollups([a, b], "heads") == {a: {"finished": 3, "ttft_ms": 1.5}}
        assert store.rollups([a], "stats") == {a: {"ttft": {"n": 3, "p50": None}}}
        assert store.rollups([a], "operations") == {}  # a part it does not have
        # a run without events can be rolled up too (covering 0 events)
        assert store.put_rollup(b, {"heads": {"finished": 0}}) == 0
        assert set(store.rollups([a, b], "heads")) == {a, b}
        # recorded on after the rollup: no longer current, read from the events again
        store.append(a, samples[:1])
        assert set(store.rollups([a, b], "heads")) == {b}
        # written again: current again, replacing every part of the old one
        assert store.put_rollup(a, {"heads": {"finished": 4}}) == len(samples) + 1
        assert store.rollups([a], "heads") == {a: {"finished": 4}}
        assert store.rollups([a], "stats") == {}


def test_a_rollup_goes_with_its_run_and_must_be_plain_json(store_url: str) -> None:
    with open_store(store_url) as store:
        a, b = store.create_run("sim", "a"), store.create_run("sim", "b")
        store.put_rollup(a, {"heads": {"x": 1}})
        store.put_rollup(b, {"heads": {"x": 2}})
        store.delete_run(a)
        with store.engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(rollups_table)).scalar() == 1
        assert store.rollups([b], "heads") == {b: {"x": 2}}
        with pytest.raises(ValueError, match="plain JSON"):
            store.put_rollup(b, {"heads": {"x": float("nan")}})
        assert store.rollups([b], "heads") == {b: {"x": 2}}  # the refused one changed nothing


def test_a_read_only_store_has_no_rollup_to_write(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    with open_store(url) as store:
        run = store.create_run("sim", "a")
        store.put_rollup(run, {"heads": {"x": 1}})
    with open_store(url, read_only=True) as reader:
        assert reader.rollups([run], "heads") == {run: {"x": 1}}
        with pytest.raises(Exception, match="read-only"):
            reader.put_rollup(run, {"heads": {"x": 2}})


def test_down_to_0004_and_up_again(store_url: str) -> None:
    samples = every_type_samples(per_type=1)
    with open_store(store_url) as store:
        run = store.create_run("sim", "a")
        store.append(run, samples)
        store.put_rollup(run, {"heads": {"x": 1}})
        downgrade(store.engine, "0004")
        assert current_revision(store.engine) == "0004"
    with open_store(store_url, read_only=True) as old:  # read as it is: no rollups
        assert old.revision == "0004" and not has_rollups(old.engine)
        assert old.rollups([run], "heads") == {}
        assert list(old.events(run)) == samples
    with open_store(store_url) as new:  # a writer upgrades it: the table is back, empty
        assert current_revision(new.engine) == head_revision()
        assert model_drift(new.engine) == []
        assert new.rollups([run], "heads") == {}
        new.put_rollup(run, {"heads": {"x": 2}})
        assert fresh_rollups(new.engine, [run], "heads") == {run: {"x": 2}}


def test_a_store_from_before_0004_upgrades_through_0005(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    shutil.copyfile(DATA / "store_rev0003.sqlite", path)
    url = f"sqlite:///{path}"
    with open_store(url, read_only=True) as old:
        assert old.revision == "0003" and old.rollups([r.id for r in old.runs()], "heads") == {}
    with open_store(url) as new:
        assert model_drift(new.engine) == []
        runs = [r.id for r in new.runs()]
        for run in runs:
            assert new.put_rollup(run, {"heads": {"run": run}}) == new.count(run)
        assert new.rollups(runs, "heads") == {r: {"run": r} for r in runs}
        upgrade(new.engine)  # at the head already: a no-op
        assert len(new.rollups(runs, "heads")) == len(runs)
