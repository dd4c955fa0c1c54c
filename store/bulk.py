"""Writing one batch of rows as fast as each backend allows, inside the caller's transaction.

Rules kept here:
- Rows arrive checked (`encoding.encode_event`) and numbered by the caller; this module only
  moves them, in the transaction of the `Connection` it is given, so a batch is still all or
  nothing.
- PostgreSQL: `COPY events ... FROM STDIN` through psycopg (about twice as fast as
  executemany). Any other backend but SQLite: SQLAlchemy's executemany insert.
- SQLite: multi-row `INSERT ... VALUES (...), (...), ...` statements of up to
  `_SQLITE_ROWS` rows (fewer if the library allows fewer parameters), not `executemany`. The
  sqlite3 module lets go of the GIL around every `sqlite3_step`, i.e. once per row under
  executemany; while the recording thread is busy, the writer then waits for the GIL on every
  row (measured: 130 us a row instead of 6). One statement per few thousand rows lets go
  once, and SQLite does the whole chunk in parallel with the caller.
- Rows are `encoding.EncodedEvent` tuples whose fields are the columns after (run, seq), in
  order, the payload already JSON text and the block lists already packed: a row is written
  as it is, prefixed with its run and seq. Or `encoding.FlatRows`: the same fields, row after
  row, in one list (a trusted recorder's batch).
"""

from __future__ import annotations

import functools
import json
import sqlite3
from collections.abc import Iterable, Sequence
from itertools import chain, count, repeat
from typing import Any, Final

from sqlalchemy import Connection, insert, select

from .encoding import WIDTH, EncodedEvent, FlatRows
from .errors import RunNotFound
from .schema import events_table, runs_table

_COLUMNS: Final = ("run", "seq", *EncodedEvent._fields)
_SQLITE_ROWS: Final = 3600  # 32400 parameters; SQLite allows 32766 by default since 3.32
_SQLITE_ROW: Final = "(" + ", ".join("?" * len(_COLUMNS)) + ")"
_PG_COPY: Final = f"COPY events ({', '.join(_COLUMNS)}) FROM STDIN"


def bulk_insert(conn: Connection, run_key: int, first: int,
                rows: Sequence[EncodedEvent] | FlatRows) -> None:
    """Insert `rows` as seqs `first`, `first + 1`, ... of the run whose `runs.key` is
    `run_key` (`run_keys` gives it for a run id)."""
    dialect = conn.dialect.name
    if dialect == "postgresql" and conn.dialect.driver == "psycopg":
        _copy_postgresql(conn, run_key, first, rows)
    elif dialect == "sqlite":
        _insert_sqlite(conn, run_key, first, rows)
    else:
        listed = rows.as_rows() if isinstance(rows, FlatRows) else rows
        conn.execute(
            insert(events_table),
            [{"run": run_key, "seq": first + i, **row._asdict(),
              "payload": json.loads(row.payload)} for i, row in enumerate(listed)],
        )


def run_keys(conn: Connection, run_ids: Iterable[str]) -> dict[str, int]:
    """The `runs.key` of each run id (the database gave it when the run was inserted)."""
    ids = list(run_ids)
    found = conn.execute(select(runs_table.c.id, runs_table.c.key)
                         .where(runs_table.c.id.in_(ids))).all()
    keys = {run_id: key for run_id, key in found if key is not None}
    missing = [run_id for run_id in ids if run_id not in keys]
    if missing:
        raise RunNotFound(missing[0])
    return keys


def _tuples(run_key: int, first: int, rows: Sequence[EncodedEvent] | FlatRows) -> Any:
    """(run, seq, *row) for every row, lazily, in C (no Python frame per row; from flat
    rows, one tuple reused by `zip` for all of them)."""
    if isinstance(rows, FlatRows):
        return zip(repeat(run_key), count(first), *[iter(rows)] * WIDTH)
    return map(tuple.__add__, zip(repeat(run_key), count(first)), rows)


@functools.lru_cache(maxsize=8)
def _sqlite_insert(rows: int) -> str:
    return f"INSERT INTO events ({', '.join(_COLUMNS)}) VALUES " + ", ".join([_SQLITE_ROW] * rows)


def _insert_sqlite(conn: Connection, run_key: int, first: int,
                   rows: Sequence[EncodedEvent] | FlatRows) -> None:
    raw: Any = conn.connection.dbapi_connection
    per_statement = min(
        _SQLITE_ROWS, raw.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // len(_COLUMNS)
    )
    flat = isinstance(rows, FlatRows)
    total = rows.rows if isinstance(rows, FlatRows) else len(rows)
    cursor = raw.cursor()
    try:
        for start in range(0, total, per_statement):
            end = min(start + per_statement, total)
            chunk: Any = (FlatRows(rows[start * WIDTH:end * WIDTH]) if flat
                          else rows[start:end])
            values = list(chain.from_iterable(_tuples(run_key, first + start, chunk)))
            cursor.execute(_sqlite_insert(end - start), values)
    finally:
        cursor.close()


def _copy_postgresql(
    conn: Connection, run_key: int, first: int, rows: Sequence[EncodedEvent] | FlatRows
) -> None:
    raw: Any = conn.connection.dbapi_connection
    with raw.cursor() as cursor, cursor.copy(_PG_COPY) as copy:
        for row in _tuples(run_key, first, rows):
            copy.write_row(row)
