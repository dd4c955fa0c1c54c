"""Stores on disk for the read-side tests: a run written through the ordinary write path, that
replays clean, and a way to damage it with plain SQL afterwards."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import text
from sqlalchemy.engine import make_url

from kvplane.core.events import BlocksFreed, BlocksReserved, Event
from kvplane.store import open_store

PAIRS = 200  # reserve + free per request: a run that replays clean, some dozens of pages


def clean_run(pairs: int = PAIRS) -> list[Event]:
    out: list[Event] = []
    for i in range(pairs):
        blocks = (2 * i, 2 * i + 1)
        out.append(BlocksReserved(at=float(i), instance="d0", request=f"r{i}", blocks=blocks,
                                  purpose="decode"))  # fmt: skip
        out.append(BlocksFreed(at=i + 0.5, instance="d0", request=f"r{i}", blocks=blocks,
                               reason="finished"))  # fmt: skip
    return out


def record(url: str, events: list[Event] | None = None) -> str:
    """A run written through the ordinary write path; the store is closed afterwards (SQLite
    checkpoints its WAL into the file, so the file alone is the store)."""
    with open_store(url) as store:
        run = store.create_run("sim", "read-only")
        store.append(run, clean_run() if events is None else events)
    return run


def sqlite_path(url: str) -> Path | None:
    parsed = make_url(url)
    return Path(parsed.database) if parsed.get_backend_name() == "sqlite" else None


def execute(url: str, sql: str, **params: object) -> None:
    with open_store(url) as store, store.engine.begin() as conn:
        conn.execute(text(sql), params)
