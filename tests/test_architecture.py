"""The import rules between the rooms (who may import whom), checked by walking every module's
syntax tree."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROOMS = ["core", "store", "sim", "live", "dashboard"]

# What each room must not import (prefixes of absolute module names).
FORBIDDEN: dict[str, list[str]] = {
    "core": ["kvplane.store", "kvplane.sim", "kvplane.live", "kvplane.dashboard", "kvplane.cli",
             "time", "random", "logging", "socket", "threading", "asyncio", "subprocess", "os",
             "datetime", "uuid", "simpy", "sqlalchemy", "numpy", "pydantic", "yaml",
             "streamlit", "vllm", "nixl", "torch"],
    "store": ["kvplane.sim", "kvplane.live", "kvplane.dashboard", "kvplane.cli", "simpy",
              "vllm", "nixl", "streamlit"],
    "sim": ["kvplane.live", "kvplane.dashboard", "kvplane.cli", "vllm", "nixl", "streamlit"],
    "live": ["kvplane.sim", "kvplane.dashboard", "kvplane.cli", "simpy", "streamlit"],
    "dashboard": ["kvplane.live", "kvplane.cli", "vllm", "nixl"],
}
# Heavy runtimes a room may use only inside functions (imported lazily).
LAZY_ONLY = {"live": ["vllm", "nixl", "torch"]}


def _package(path: Path, room: str) -> str:
    return ".".join(("kvplane", room) + path.relative_to(ROOT / room).parent.parts)


def _imports(path: Path, room: str) -> list[tuple[str, bool]]:
    return _parse(path.read_text(), _package(path, room))


def _parse(source: str, package: str) -> list[tuple[str, bool]]:
    """(absolute module name, imported at module top level) for every import in the source."""
    tree = ast.parse(source)
    top = {id(n) for n in tree.body}
    found: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((name, id(node) in top))
    return found


def _files(room: str) -> list[Path]:
    return sorted((ROOT / room).rglob("*.py"))


@pytest.mark.parametrize("room", ROOMS)
def test_room_imports_only_what_it_may(room: str) -> None:
    problems = []
    for path in _files(room):
        for name, _ in _imports(path, room):
            for bad in FORBIDDEN[room]:
                if name == bad or name.startswith(bad + "."):
                    problems.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not problems, "\n".join(problems)


def test_core_is_stdlib_only() -> None:
    problems = []
    for path in _files("core"):
        for name, _ in _imports(path, "core"):
            head = name.split(".")[0]
            if name.startswith("kvplane.core") or head == "__future__":
                continue
            if head not in sys.stdlib_module_names:
                problems.append(f"{path.relative_to(ROOT)} imports non-stdlib {name}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("room", sorted(LAZY_ONLY))
def test_heavy_runtimes_are_imported_lazily(room: str) -> None:
    problems = []
    for path in _files(room):
        for name, at_top in _imports(path, room):
            if at_top and name.split(".")[0] in LAZY_ONLY[room]:
                problems.append(f"{path.relative_to(ROOT)} imports {name} at module level")
    assert not problems, "\n".join(problems)


def test_the_checker_sees_a_forbidden_import() -> None:
    """The walk must catch a violation: a relative import that climbs into another room."""
    found = _parse("from ..sim import engine\nimport time\ndef f():\n    import nixl\n",
                   "kvplane.core")
    assert ("kvplane.sim", True) in found and ("time", True) in found
    assert ("nixl", False) in found
