"""The store's contract fixtures: every contract test runs once per backend.

`store_url` is a fresh SQLite file in a temporary directory, or a fresh database on the real
PostgreSQL server the top-level conftest starts (`postgres_url`); `store` is that URL opened
with `open_store` and closed afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvplane.store import EventStore, open_store

BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]


@pytest.fixture(params=BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'events.db'}"
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture
def store(store_url: str) -> Iterator[EventStore]:
    opened = open_store(store_url)
    try:
        yield opened
    finally:
        opened.close()
