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
- Payloads arrive as JSON text from `encoding.encode_event` (`payload_json`), else are
  serialised here with the standard `json` module; both backends read them back through
  SQLAlchemy's JSON type, so the write path and the read path agree.
"""

from __future__ import annotations

import functools
import json
import sqlite3
from collections.abc import Sequence
from typing import Any, Final

from sqlalchemy import Connection, insert

from .encoding import EncodedEvent
from .schema import events_table

_COLUMNS: Final = ("run", "seq", "time", "type", "request", "instance", "payload")
_SQLITE_ROWS: Final = 4000  # 28000 parameters; SQLite allows 32766 by default since 3.32
_SQLITE_ROW: Final = "(" + ", ".join("?" * len(_COLUMNS)) + ")"
_PG_COPY: Final = f"COPY events ({', '.join(_COLUMNS)}) FROM STDIN"

_dumps = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def bulk_insert(conn: Connection, run_id: str, first: int, rows: Sequence[EncodedEvent]) -> None:
    """Insert `rows` as seqs `first`, `first + 1`, ... of `run_id`."""
    dialect = conn.dialect.name
    if dialect == "postgresql" and conn.dialect.driver == "psycopg":
        _copy_postgresql(conn, run_id, first, rows)
    elif dialect == "sqlite":
        _insert_sqlite(conn, run_id, first, rows)
    else:
        conn.execute(
            insert(events_table),
            [{"run": run_id, "seq": first + i, "time": row["time"], "type": row["type"],
              "request": row["request"], "instance": row["instance"], "payload": row["payload"]}
             for i, row in enumerate(rows)],
        )


def _tuples(run_id: str, first: int, rows: Sequence[EncodedEvent]) -> list[tuple[Any, ...]]:
    dumps = _dumps
    return [
        (run_id, first + i, r["time"], r["type"], r["request"], r["instance"],
         r["payload_json"] if "payload_json" in r else dumps(r["payload"]))
        for i, r in enumerate(rows)
    ]  # fmt: skip


@functools.lru_cache(maxsize=8)
def _sqlite_insert(rows: int) -> str:
    return f"INSERT INTO events ({', '.join(_COLUMNS)}) VALUES " + ", ".join([_SQLITE_ROW] * rows)


def _insert_sqlite(conn: Connection, run_id: str, first: int, rows: Sequence[EncodedEvent]) -> None:
    raw: Any = conn.connection.dbapi_connection
    per_statement = min(
        _SQLITE_ROWS, raw.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // len(_COLUMNS)
    )
    cursor = raw.cursor()
    try:
        for start in range(0, len(rows), per_statement):
            chunk = _tuples(run_id, first + start, rows[start : start + per_statement])
            cursor.execute(_sqlite_insert(len(chunk)), [v for row in chunk for v in row])
    finally:
        cursor.close()


def _copy_postgresql(
    conn: Connection, run_id: str, first: int, rows: Sequence[EncodedEvent]
) -> None:
    raw: Any = conn.connection.dbapi_connection
    with raw.cursor() as cursor, cursor.copy(_PG_COPY) as copy:
        for row in _tuples(run_id, first, rows):
            copy.write_row(row)
