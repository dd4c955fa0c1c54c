"""The live tests need real NIXL: without it they fail loudly (never skip) and say how to fix it.

The helper modules of this folder (servers.py, tiny_model.py, vllm_api.py) and the GPU suite the
CPU suite borrows tests from (tests/gpu/gpu_live.py) are loaded here, once, before any test
module, under names no other test folder can shadow (`kvplane_live_servers`, ...,
`kvplane_gpu_live`; see servers.helper): a test module imports them by those names.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from kvplane.live.nixl_env import NixlUnavailable, import_nixl_api

_HERE = Path(__file__).resolve().parent
if "kvplane_live_servers" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("kvplane_live_servers", _HERE / "servers.py")
    assert _spec is not None and _spec.loader is not None
    sys.modules[_spec.name] = _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
_servers = sys.modules["kvplane_live_servers"]
for _name in ("tiny_model", "vllm_api"):
    _servers.helper(_name)
_servers.helper("gpu_live", _HERE.parent / "gpu" / "gpu_live.py")


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


LOG_TAIL_LINES = 25
_dirs_before = pytest.StashKey[int]()  # log folders made before a test began


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    item.stash[_dirs_before] = len(_servers.CREATED_LOG_DIRS)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    """A failed test's report ends with the last lines of every server log its clusters wrote:
    a CI run keeps only the test output, and a vLLM instance that died says why there."""
    report = yield
    if report.failed and call.when == "call":
        made = _servers.CREATED_LOG_DIRS
        # the clusters this test started, else the newest (a module's shared cluster)
        for folder in made[item.stash.get(_dirs_before, 0):] or made[-1:]:
            for log in sorted(folder.glob("*.log")):
                lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
                report.sections.append((f"last lines of {log}", "\n".join(lines)))
    return report
