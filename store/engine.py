"""Where the store lives (URL resolution) and how we connect to it (engine set-up).

Rules kept here:
- The URL is, in order: the one passed in, else `$KVPLANE_DB`, else `sqlite:///./kvplane.db`.
  A bare file path means a SQLite file; `postgresql://` means psycopg 3
  (`postgresql+psycopg://`), the only PostgreSQL driver we install.
- SQLite connections run in WAL mode with synchronous=NORMAL (readers never block the writer,
  a commit costs no fsync of the database file) and enforce foreign keys.
- SQLite transactions are begun by us, not by the sqlite3 module, so that every transaction
  really is one (reads included), and so that writers can ask for `BEGIN IMMEDIATE`: a batch
  takes the write lock before it reads the next seq, and concurrent writers queue on the busy
  timeout instead of failing with "database is locked" half-way through.
- Read-only (`read_only=True`, for commands that only read): a SQLite file is opened with
  `mode=ro`, so a missing file is an error instead of a new, empty database, and nothing
  can be written through it; PostgreSQL sessions start with `default_transaction_read_only`.
  The WAL pragma is not sent (a read-only connection cannot change the journal mode).
- SQLite statements may carry an index hint (`INDEXED BY`, see `migrate.by_type`).
- `sqlite://` (in memory) is one connection shared by every thread (else each pooled
  connection would see its own empty database): fine for tests, but do not read from one
  thread while a recorder writes from another; use a file for anything concurrent.
"""

from __future__ import annotations

import os
import sqlite3
import time
from functools import partial
from pathlib import Path
from typing import Any, Final

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.dialects.sqlite.base import SQLiteCompiler
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.pool import StaticPool

DEFAULT_URL: Final = "sqlite:///./kvplane.db"
ENV_VAR: Final = "KVPLANE_DB"

#: Execution option that makes a SQLite transaction begin with `BEGIN IMMEDIATE`.
WRITE_LOCK: Final = "kvplane_write_lock"

_BUSY_TIMEOUT_S: Final = 30.0


def resolve_url(url: str | URL | None = None) -> URL:
    """The database URL to use: explicit, else `$KVPLANE_DB`, else the SQLite default."""
    raw: str | URL = url if url is not None else os.environ.get(ENV_VAR) or DEFAULT_URL
    if isinstance(raw, str) and "://" not in raw:
        raw = f"sqlite:///{raw}"
    parsed = make_url(raw)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def is_sqlite(url: URL) -> bool:
    return url.get_backend_name() == "sqlite"


def sqlite_file(url: URL) -> str | None:
    """The file of a SQLite URL, as given (None for PostgreSQL and in-memory SQLite)."""
    if not is_sqlite(url) or url.database in (None, "", ":memory:"):
        return None
    return url.database


def make_engine(
    url: str | URL | None = None, *, echo: bool = False, read_only: bool = False
) -> Engine:
    """An engine for `url` (resolved as above), with the SQLite settings applied."""
    resolved = resolve_url(url)
    if not is_sqlite(resolved):
        connect_args = {"options": "-c default_transaction_read_only=on"} if read_only else {}
        return create_engine(resolved, echo=echo, pool_pre_ping=True, connect_args=connect_args)
    kwargs: dict[str, Any] = {"connect_args": {"timeout": _BUSY_TIMEOUT_S}}
    path = sqlite_file(resolved)
    if path is None:
        # One shared connection, or every pooled connection would see its own empty database.
        kwargs = {
            "connect_args": {"check_same_thread": False},
            "poolclass": StaticPool,
        }
    elif read_only:
        # A URI, so that SQLite itself refuses to create the file or write to it.
        uri = Path(path).absolute().as_uri() + "?mode=ro"
        kwargs["creator"] = partial(
            sqlite3.connect, uri, uri=True, timeout=_BUSY_TIMEOUT_S, check_same_thread=False
        )
    engine = create_engine(resolved, echo=echo, **kwargs)
    engine.dialect.statement_compiler = _SQLiteCompiler
    event.listen(engine, "connect", partial(_sqlite_on_connect, read_only=read_only))
    event.listen(engine, "begin", _sqlite_on_begin)
    return engine


class _SQLiteCompiler(SQLiteCompiler):
    """SQLAlchemy's SQLite compiler, rendering a table hint (`select().with_hint(table,
    "INDEXED BY ix", "sqlite")`) after the table name: SQLite's own way to name the index a
    query must use, which SQLAlchemy does not render by default (see `migrate.by_type`)."""

    def get_from_hint_text(self, table: Any, text: str | None) -> str | None:
        return text


def _sqlite_on_connect(dbapi_connection: Any, _record: Any, *, read_only: bool) -> None:
    # Hand transaction control to SQLAlchemy's "begin" event below (pysqlite would otherwise
    # begin lazily, only before writes).
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout={int(_BUSY_TIMEOUT_S * 1000)}")
        if not read_only:
            _wal(cursor)
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
    finally:
        cursor.close()


def _wal(cursor: Any) -> None:
    """`PRAGMA journal_mode=WAL`, waiting its turn. Switching a fresh file to WAL needs the
    file to itself, and SQLite answers "database is locked" at once, without its busy handler,
    while another connection is in the middle of the same switch or of the first migration
    (four processes opening a new store together hit it about one time in twenty)."""
    deadline = time.monotonic() + _BUSY_TIMEOUT_S
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _sqlite_on_begin(connection: Connection) -> None:
    immediate = connection.get_execution_options().get(WRITE_LOCK, False)
    connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")
