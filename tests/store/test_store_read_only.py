"""Reading a store: read-only opens, and what is wrong with a store or a run, said clearly.

Real SQLite files (written by the real store, then damaged on disk) and the real PostgreSQL
server the top-level conftest starts.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import psycopg
import pytest
from recorded_stores import PAIRS, clean_run, execute, record, sqlite_path
from sqlalchemy import delete, insert, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from kvplane.core.errors import SchemaError
from kvplane.core.events import SCHEMA_VERSION, BlocksFreed
from kvplane.store import (
    NotAStore,
    RunTooNew,
    SequenceGap,
    StoredEventUnreadable,
    StoreMissing,
    StoreReadOnly,
    StoreTooNew,
    StoreUnreadable,
    events_of,
    events_table,
    open_store,
    runs_table,
)
from kvplane.store.bulk import run_keys
from kvplane.store.pg_temp import TemporaryPostgres

# --- read-only opens ---------------------------------------------------------------------------


def test_a_read_only_open_of_a_missing_file_creates_nothing(tmp_path: Path) -> None:
    with pytest.raises(StoreMissing, match=r"^no store at .*typo\.db$"):
        open_store(str(tmp_path / "typo.db"), read_only=True)
    with pytest.raises(StoreMissing):
        open_store(f"sqlite:///{tmp_path / 'typo2.db'}", read_only=True)
    assert list(tmp_path.iterdir()) == []


def test_read_only_reads_what_the_writer_wrote_and_refuses_writes(store_url: str) -> None:
    run = record(store_url)
    with open_store(store_url, read_only=True) as reader:
        assert [r.id for r in reader.runs()] == [run]
        assert list(reader.events(run)) == clean_run()
        with pytest.raises(StoreReadOnly, match="opened read-only"):
            reader.create_run("sim", "nope")
        with pytest.raises(StoreReadOnly):
            reader.append(run, clean_run(1))
        with pytest.raises(StoreReadOnly):
            reader.delete_run(run)
        # and the database itself refuses, not only our guard
        with pytest.raises(DBAPIError, match="read-only|readonly"), reader.engine.begin() as c:
            c.execute(delete(events_table))
        # a writer's later batch is seen by the open reader
        with open_store(store_url) as writer:
            writer.append(run, clean_run(1))
        assert reader.count(run) == 2 * PAIRS + 2
    if (path := sqlite_path(store_url)) is not None:
        assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_random_bytes_are_not_a_store(tmp_path: Path) -> None:
    bad = tmp_path / "random.db"
    bad.write_bytes(os.urandom(16384))
    for read_only in (True, False):
        with pytest.raises(StoreUnreadable, match=r"random\.db is not a SQLite database"):
            open_store(str(bad), read_only=read_only)


def test_a_truncated_store_says_so(tmp_path: Path) -> None:
    whole = tmp_path / "whole.db"
    record(str(whole))
    data = whole.read_bytes()
    assert not Path(f"{whole}-wal").exists() and len(data) > 16 * 4096
    half = tmp_path / "half.db"
    half.write_bytes(data[: len(data) // 2])
    with pytest.raises(StoreUnreadable, match=r"half\.db is truncated: its header promises \d+ "
                       r"pages of 4096 bytes \(\d+ bytes\), the file holds \d+ bytes"):  # fmt: skip
        open_store(str(half), read_only=True)


def test_a_damaged_page_is_reported_when_a_read_reaches_it(tmp_path: Path) -> None:
    path = tmp_path / "damaged.db"
    run = record(str(path))
    data = bytearray(path.read_bytes())
    page = 4096
    # overwrite every page after the first few with noise, leaving the header and schema
    for start in range(4 * page, len(data), page):
        data[start : start + page] = os.urandom(page)
    path.write_bytes(bytes(data))
    with (
        pytest.raises(StoreUnreadable, match=r"damaged\.db is damaged \(.*\); restore it"),
        open_store(str(path), read_only=True) as store,
    ):
        list(store.events(run))


def test_another_applications_sqlite_database_is_not_a_store(tmp_path: Path) -> None:
    foreign = tmp_path / "shop.db"
    with sqlite3.connect(foreign) as conn:
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, total REAL)")
        conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
    before = foreign.read_bytes()
    with pytest.raises(NotAStore, match=r"shop\.db is not a kvplane store \(no schema_meta "
                       r"table; it holds customers, orders\)"):  # fmt: skip
        open_store(str(foreign), read_only=True)
    assert foreign.read_bytes() == before
    empty = tmp_path / "empty.db"
    empty.touch()
    with pytest.raises(NotAStore, match=r"empty\.db holds no kvplane store \(the database is "
                       r"empty\)"):  # fmt: skip
        open_store(str(empty), read_only=True)
    assert empty.stat().st_size == 0


@pytest.mark.postgres
def test_postgres_missing_foreign_or_empty_databases(
    postgres_server: TemporaryPostgres, postgres_url: str
) -> None:
    missing = postgres_server.url("no_such_db")
    with pytest.raises(StoreMissing, match=r'no store at .*/no_such_db \(database "no_such_db" '
                       r"does not exist\)"):  # fmt: skip
        open_store(missing, read_only=True)
    with pytest.raises(NotAStore, match="the database is empty"):
        open_store(postgres_url, read_only=True)
    dsn = make_url(postgres_url).set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int)")
    with pytest.raises(NotAStore, match=r"is not a kvplane store \(no schema_meta table; it "
                       r"holds orders\)"):  # fmt: skip
        open_store(postgres_url, read_only=True)


def test_unreachable_postgres_is_one_clear_error() -> None:
    with pytest.raises(StoreUnreadable, match=r"cannot reach the store at postgresql"):
        open_store("postgresql://postgres@127.0.0.1:1/kv", read_only=True)


def test_a_store_from_a_newer_kvplane_is_refused_by_readers_and_writers(store_url: str) -> None:
    record(store_url)
    execute(store_url, "UPDATE schema_meta SET version_num = '9999_from_the_future'")
    message = (r"^this store was written by a newer kvplane \(revision 9999_from_the_future\); "
               r"upgrade kvplane$")  # fmt: skip
    with pytest.raises(StoreTooNew, match=message):
        open_store(store_url, read_only=True)
    with pytest.raises(StoreTooNew, match=message):
        open_store(store_url)


# --- reading runs ------------------------------------------------------------------------------


def test_a_run_from_a_newer_event_schema_is_refused(store_url: str) -> None:
    run = record(store_url)
    with open_store(store_url) as store, store.engine.begin() as conn:
        conn.execute(update(runs_table).where(runs_table.c.id == run)
                     .values(schema_version=SCHEMA_VERSION + 1))  # fmt: skip
    with open_store(store_url, read_only=True) as store:
        with pytest.raises(RunTooNew, match=rf"run {run} was recorded with event schema version "
                           rf"{SCHEMA_VERSION + 1}, newer than this kvplane's {SCHEMA_VERSION}; "
                           "upgrade kvplane to read it"):  # fmt: skip
            store.events(run)
        assert store.count(run) == 2 * PAIRS  # what needs no decoding still works


def test_a_payload_that_is_not_json_names_run_seq_and_type(tmp_path: Path) -> None:
    url = str(tmp_path / "s.db")
    run = record(url)
    execute(url, "UPDATE events SET payload = '{\"blocks\": [1, 2' WHERE run = (SELECT key FROM runs WHERE id = :r) AND seq = 7",
            r=run)  # fmt: skip
    with open_store(url, read_only=True) as store:
        events = store.events(run)
        with pytest.raises(StoredEventUnreadable, match=rf"^run {run}, event seq 7 \(BlocksFreed\)"
                           r": its payload is not JSON \(Expecting"):  # fmt: skip
            list(events)


@pytest.mark.postgres
def test_postgres_itself_refuses_a_payload_that_is_not_json(postgres_url: str) -> None:
    run = record(postgres_url, clean_run(2))
    with pytest.raises(DBAPIError, match="invalid input syntax for type json"):
        execute(postgres_url, "UPDATE events SET payload = '{oops' WHERE run = (SELECT key FROM runs WHERE id = :r)", r=run)


@pytest.mark.parametrize("payload, why", [
    ('[1, 2]', "payload must be an object"),
    ('{"blocks": "7", "purpose": "decode", "attempt": 0}', "BlocksReserved.blocks"),
    ('{"blocks": [1], "purpose": "decode", "attempt": 0, "extra": 1}', "unknown field"),
])  # fmt: skip
def test_a_malformed_payload_names_run_seq_and_type(store_url: str, payload: str, why: str) -> None:
    run = record(store_url)
    # the whole payload in the JSON, as the slow way and stores before 0003 write it
    execute(store_url, "UPDATE events SET payload = :p, lists = NULL WHERE run = (SELECT key FROM runs WHERE id = :r) AND seq = 4",
            p=payload, r=run)  # fmt: skip
    with (
        open_store(store_url, read_only=True) as store,
        pytest.raises(StoredEventUnreadable,
                      match=rf"^run {run}, event seq 4 \(BlocksReserved\): .*{why}") as caught,
    ):  # fmt: skip
        list(store.events(run))
    assert isinstance(caught.value, SchemaError)  # callers catching schema errors still do


@pytest.mark.parametrize("sql, seq, kind, why", [
    ("UPDATE events SET lists = :b WHERE run = (SELECT key FROM runs WHERE id = :r) AND seq = 4", 4, "BlocksReserved",
     "its block lists end before 'blocks'"),
    ("UPDATE events SET payload = :p WHERE run = (SELECT key FROM runs WHERE id = :r) AND seq = 4", 4, "BlocksReserved",
     "field 'blocks' is stored twice"),
    ("UPDATE events SET type = 'FromTheFuture' WHERE run = (SELECT key FROM runs WHERE id = :r) AND seq = 2", 2, "FromTheFuture",
     "unknown event type"),
])  # fmt: skip
def test_a_damaged_row_names_run_seq_and_type(store_url: str, sql: str, seq: int, kind: str,
                                              why: str) -> None:
    run = record(store_url)
    execute(store_url, sql, b=b"\x01blocks:\x01\x00", r=run,
            p='{"blocks": [1], "purpose": "decode", "attempt": 0}')
    with (
        open_store(store_url, read_only=True) as store,
        pytest.raises(StoredEventUnreadable,
                      match=rf"^run {run}, event seq {seq} \({kind}\): {why}"),
    ):  # fmt: skip
        list(store.events(run))


def test_a_sequence_gap_is_reported(store_url: str) -> None:
    run = record(store_url)
    with open_store(store_url) as store, store.engine.begin() as conn:
        conn.execute(delete(events_table).where(events_of(store.engine, run))
                     .where(events_table.c.seq.between(3, 5)))  # fmt: skip
        conn.execute(delete(events_table).where(events_of(store.engine, run))
                     .where(events_table.c.seq == 0))  # fmt: skip
    with open_store(store_url, read_only=True) as store:
        with pytest.raises(SequenceGap, match=rf"^run {run}: sequence-gap: event 0 missing$"):
            list(store.events(run))
        gaps: list[SequenceGap] = []
        read = list(store.events(run, on_gap=gaps.append))
        assert [(g.first, g.last, g.missing) for g in gaps] == [
            (0, 0, "event 0 missing"), (3, 5, "events 3..5 missing")]  # fmt: skip
        assert read == [e for i, e in enumerate(clean_run()) if i not in (0, 3, 4, 5)]
        # a filtered read cannot tell a gap from a filtered-out event, so it does not guess
        assert len(list(store.events(run, BlocksFreed))) == PAIRS - 2


def test_a_contiguous_run_has_no_gap_however_it_was_batched(store_url: str) -> None:
    with open_store(store_url) as store:
        run = store.create_run("sim", "batches")
        for k in range(5):
            store.append(run, clean_run(k + 1))
        other = store.create_run("sim", "other")  # another run's events change nothing
        with store.engine.begin() as conn:
            conn.execute(insert(events_table).values(
                run=run_keys(conn, [other])[other], seq=0, time=0.0, type="BlocksFreed", request="x", instance="d0",
                payload={"blocks": [1], "reason": "r", "attempt": 0}))  # fmt: skip
    with open_store(store_url, read_only=True) as store:
        gaps: list[SequenceGap] = []
        assert len(list(store.events(run, on_gap=gaps.append))) == 2 * (1 + 2 + 3 + 4 + 5)
        assert gaps == []


def test_create_missing_makes_an_empty_store_then_only_reads(tmp_path: Path) -> None:
    """What the dashboard asks for: its What-if page fills, through a writer of its own, the
    store it shows, so a missing one is created empty; the reader itself stays read-only."""
    path = tmp_path / "fresh.db"
    with open_store(str(path), read_only=True, create_missing=True) as reader:
        assert path.exists() and reader.runs() == []
        with pytest.raises(StoreReadOnly):
            reader.create_run("sim", "nope")
        run = record(str(path))
        assert [r.id for r in reader.runs()] == [run]
    (tmp_path / "shop.db").write_bytes(b"")  # an existing file is opened, never re-created
    with pytest.raises(NotAStore):
        open_store(str(tmp_path / "shop.db"), read_only=True, create_missing=True)
