"""Fixtures shared by every room's tests: a real PostgreSQL server, started and stopped here.

- `postgres_server` (session): one private server for the whole test session, started from
  Debian's PostgreSQL binaries (`kvplane.store.pg_temp.TemporaryPostgres`: run as the
  `postgres` OS user when we are root, data and socket in a temporary directory, a free port
  on 127.0.0.1, trust auth) and stopped at the end. If the binaries are missing or the server
  will not start, every test that asks for it FAILS with the reason; it is never skipped.
- `postgres_url` (function): a fresh, empty database on that server, as a SQLAlchemy URL
  (`postgresql+psycopg://postgres@127.0.0.1:<port>/<db>`), so tests never see each other's
  rows. Mark such tests `@pytest.mark.postgres`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvplane.store.pg_temp import PostgresUnavailable, TemporaryPostgres


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[TemporaryPostgres]:
    server = TemporaryPostgres()
    try:
        server.start()
    except PostgresUnavailable as exc:
        pytest.fail(f"the PostgreSQL test server could not be started: {exc}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def postgres_url(postgres_server: TemporaryPostgres) -> str:
    return postgres_server.create_database()
