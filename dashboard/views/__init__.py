"""The dashboard's pages: each module has `TITLE`, `SLUG` and `render(url, runs_table)`."""

from __future__ import annotations

from types import ModuleType

from . import leases, operations, plan, push_pull, reuse, runs, timeline, twin, whatif

PAGES: dict[str, ModuleType] = {
    m.TITLE: m for m in (runs, operations, timeline, push_pull, reuse, leases, twin, whatif, plan)
}
