"""Where the store lives and how SQLite is set up."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import text

from kvplane.core.events import BlocksReserved
from kvplane.store import BatchingRecorder, open_store, resolve_url


def test_url_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPLANE_DB", raising=False)
    assert str(resolve_url()) == "sqlite:///./kvplane.db"
    monkeypatch.setenv("KVPLANE_DB", "sqlite:////tmp/from-env.db")
    assert str(resolve_url()) == "sqlite:////tmp/from-env.db"
    assert str(resolve_url("sqlite:///explicit.db")) == "sqlite:///explicit.db"
    assert str(resolve_url("/data/runs.db")) == "sqlite:////data/runs.db"
    pg = resolve_url("postgresql://me:secret@db.example:5433/kv")
    assert pg.drivername == "postgresql+psycopg" and pg.port == 5433 and pg.database == "kv"
    assert resolve_url("postgresql+psycopg://h/kv").drivername == "postgresql+psycopg"


def test_env_var_picks_the_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPLANE_DB", str(tmp_path / "env.db"))
    with open_store() as store:
        store.create_run("sim", "env")
    assert (tmp_path / "env.db").exists()


def test_sqlite_runs_in_wal_mode(tmp_path: Path) -> None:
    with open_store(f"sqlite:///{tmp_path / 'wal.db'}") as store, store.engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar_one() == "wal"
        assert conn.execute(text("PRAGMA synchronous")).scalar_one() == 1  # NORMAL
        assert conn.execute(text("PRAGMA foreign_keys")).scalar_one() == 1


def test_in_memory_sqlite_works_with_a_background_writer() -> None:
    with open_store("sqlite://") as store:
        run = store.create_run("sim", "memory")
        with BatchingRecorder(store, run, batch_size=10) as recorder:
            for i in range(25):
                recorder.record(BlocksReserved(at=i, instance="p", blocks=(i,), purpose="reuse"))
        assert store.count(run) == 25


def test_store_url_hides_the_password(tmp_path: Path) -> None:
    with open_store(f"sqlite:///{tmp_path / 'x.db'}") as store:
        assert store.url.endswith("x.db") and "EventStore" in repr(store)


def test_missing_postgres_binaries_fail_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvplane.store import pg_temp

    monkeypatch.delenv("KVPLANE_PG_BIN", raising=False)
    monkeypatch.setattr(pg_temp.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(pg_temp.shutil, "which", lambda name: None)
    with pytest.raises(pg_temp.PostgresUnavailable, match="initdb, pg_ctl"):
        pg_temp.TemporaryPostgres().start()
