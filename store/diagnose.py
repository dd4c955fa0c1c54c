"""Saying what is wrong with a store, in words a user can act on.

Rules kept here:
- A read never creates a store: a SQLite file that is not there is `StoreMissing` ("no store at
  typo.db"), found before any connection is made; PostgreSQL's "database does not exist" is the
  same error.
- A database the driver cannot read is `StoreUnreadable`, saying why: not a SQLite file (its
  first bytes are not SQLite's header), truncated (the header promises more pages than the
  file holds), otherwise damaged; or, for PostgreSQL, that the server cannot be reached.
  `translated` maps a driver error to one of these, or returns None for any other error,
  which then propagates as it is (a bug is not dressed up as a damaged store).
- Opened read-only, a database must already be a kvplane store: our version table present
  and at a revision this kvplane knows (`migrate.check_revision`; an older one is read as it
  is, see `migrate.upgrade_note`). No version table is
  `NotAStore`, naming the tables found (another application's database) or saying it is
  empty.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

from sqlalchemy import Connection, inspect
from sqlalchemy.exc import DBAPIError

from .errors import NotAStore, StoreError, StoreMissing, StoreUnreadable
from .migrate import check_revision, revision_of
from .schema import VERSION_TABLE

_SQLITE_MAGIC: Final = b"SQLite format 3\x00"
_SHOWN_TABLES: Final = 6


def require_file(path: str) -> None:
    """`StoreMissing` unless `path` is there to be read (a read must not create it)."""
    file = Path(path)
    if not file.exists():
        raise StoreMissing(path)
    if file.is_dir():
        raise StoreUnreadable(f"{path} is a directory, not a store")


def check_schema(conn: Connection, where: str) -> str:
    """Refuse a database that is not a kvplane store this kvplane can read as it is; its
    revision otherwise."""
    tables = inspect(conn).get_table_names()
    if VERSION_TABLE not in tables:
        if not tables:
            raise NotAStore(f"{where} holds no kvplane store (the database is empty)")
        shown = ", ".join(sorted(tables)[:_SHOWN_TABLES])
        more = f" and {len(tables) - _SHOWN_TABLES} more" if len(tables) > _SHOWN_TABLES else ""
        raise NotAStore(
            f"{where} is not a kvplane store (no {VERSION_TABLE} table; it holds {shown}{more})"
        )
    revision = revision_of(conn)
    if revision is None:
        raise NotAStore(f"{where} is not a kvplane store (its {VERSION_TABLE} table is empty)")
    check_revision(revision)
    return revision


@contextmanager
def reading(where: str, path: str | None) -> Iterator[None]:
    """Turn the driver's errors about a broken database into the store's own errors."""
    try:
        yield
    except DBAPIError as exc:
        better = translated(exc, where, path)
        if better is None:
            raise
        raise better from exc


def translated(exc: DBAPIError, where: str, path: str | None) -> StoreError | None:
    """The store error a driver error means, or None when it is not about the database."""
    orig = exc.orig
    if isinstance(orig, sqlite3.Error):
        name = getattr(orig, "sqlite_errorname", "")
        if name in ("SQLITE_NOTADB", "SQLITE_CORRUPT") or name.startswith("SQLITE_CORRUPT_"):
            return StoreUnreadable(damage(where, path, str(orig)))
        if name == "SQLITE_CANTOPEN" and path is not None and not Path(path).exists():
            return StoreMissing(where)
        if name == "SQLITE_CANTOPEN" or name.startswith("SQLITE_IOERR"):
            return StoreUnreadable(f"cannot read {where}: {orig}")
        return None
    if type(orig).__module__.startswith("psycopg") and type(orig).__name__ == "OperationalError":
        # psycopg says 'connection to server at "h", port p failed: FATAL:  <why>'
        first = (str(orig).strip().splitlines() or [type(orig).__name__])[0]
        why = first.rsplit("FATAL:", 1)[-1].strip().removeprefix("connection failed: ")
        if why.startswith("database") and why.endswith("does not exist"):
            return StoreMissing(where, why)
        return StoreUnreadable(f"cannot reach the store at {where}: {why}")
    return None


def damage(where: str, path: str | None, reason: str) -> str:
    """What is wrong with a SQLite file SQLite calls corrupt, read from its header."""
    if path is None:
        return f"{where} is damaged ({reason})"
    try:
        with open(path, "rb") as f:
            header = f.read(100)
        size = Path(path).stat().st_size
    except OSError as exc:
        return f"cannot read {where}: {exc}"
    if not header.startswith(_SQLITE_MAGIC):
        return f"{where} is not a SQLite database (it does not start with SQLite's header)"
    if len(header) == 100:
        page_size = int.from_bytes(header[16:18], "big")
        page_size = 65536 if page_size == 1 else page_size
        pages = int.from_bytes(header[28:32], "big")
        # The page count is trustworthy only when its "valid-for" counter matches.
        if pages and header[24:28] == header[92:96] and pages * page_size > size:
            return (
                f"{where} is truncated: its header promises {pages} pages of {page_size} bytes "
                f"({pages * page_size} bytes), the file holds {size} bytes"
            )
    return f"{where} is damaged ({reason}); restore it from a copy"
