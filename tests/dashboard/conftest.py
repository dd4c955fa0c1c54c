"""Fixtures for the dashboard tests: a store of real runs, built once per session.

`see_store` is a SimpleNamespace with `url`, `path` and the run ids the tests use (see
`see_store.build_store`), on a private copy of the session's store, so a test that writes
(what-if, make a twin) stays alone.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from see_store import build_store


@pytest.fixture(scope="session")
def see_store_master(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    return build_store(tmp_path_factory.mktemp("see") / "see.db")


@pytest.fixture
def see_store(see_store_master: SimpleNamespace, tmp_path: Path) -> SimpleNamespace:
    """A private copy of the session's store (a test that writes, the what-if, stays alone)."""
    copy = tmp_path / "see.db"
    for suffix in ("", "-wal", "-shm"):
        src = Path(f"{see_store_master.path}{suffix}")
        if src.exists():
            shutil.copyfile(src, f"{copy}{suffix}")
    return SimpleNamespace(**{**vars(see_store_master), "path": copy,
                              "url": f"sqlite:///{copy}"})
