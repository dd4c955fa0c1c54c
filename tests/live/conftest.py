"""The live tests need real NIXL: without it they fail loudly (never skip) and say how to fix it."""

from __future__ import annotations

import pytest

from kvplane.live.nixl_env import NixlUnavailable, import_nixl_api


@pytest.fixture(scope="session", autouse=True)
def _require_nixl() -> None:
    try:
        import_nixl_api()
    except NixlUnavailable as exc:
        pytest.fail(
            f"{exc}\nThe live tests move real bytes through NIXL and are never skipped: "
            "run `bash scripts/install_live.sh .venv` (or the venv you test with) first.",
            pytrace=False,
        )
