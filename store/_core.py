"""The store's single doorway into the core: the event schema and its errors.

Why a doorway: at run time the core is `kvplane.core` (setuptools maps the `core/` folder onto
it through an editable-install import hook), but mypy cannot follow that hook, so for the type
checker the same files are named by their folder, `core`. Both names point at the same source
files, so the types agree; every other store module imports the core from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from core.blocks import RunBlocks
    from core.errors import KvplaneError, SchemaError
    from core.events import EVENT_TYPES, SCHEMA_VERSION, Event, decode, encode, validate
else:
    from kvplane.core.blocks import RunBlocks
    from kvplane.core.errors import KvplaneError, SchemaError
    from kvplane.core.events import EVENT_TYPES, SCHEMA_VERSION, Event, decode, encode, validate

__all__ = [
    "EVENT_TYPES",
    "SCHEMA_VERSION",
    "Event",
    "KvplaneError",
    "RunBlocks",
    "SchemaError",
    "decode",
    "encode",
    "validate",
]
