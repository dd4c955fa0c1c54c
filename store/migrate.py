"""Schema migrations, run by Alembic from code: no alembic.ini, no env.py.

Rules kept here:
- `upgrade(engine)` brings a database to the newest revision in `migrations/versions` and is
  idempotent: on an up-to-date database it changes nothing. `open_store` calls it every time.
- All of it happens in one transaction, DDL included (both SQLite and PostgreSQL have
  transactional DDL), holding a lock first, so that two processes opening a fresh database at
  once neither race nor leave half a schema: PostgreSQL takes a transaction-scoped advisory
  lock, SQLite takes the write lock with `BEGIN IMMEDIATE`.
- Alembic's version table is `schema_meta` (see `schema.VERSION_TABLE`).
- A database at a revision this kvplane does not know was migrated by a newer kvplane:
  `upgrade` refuses it with `StoreTooNew` before Alembic looks for the revision, and
  `check_revision` (the read-only open) does the same.
- An older revision opened read-only is read as it is (a read-only open never writes, so it
  cannot migrate): every read works on every revision here, only slower on one that lacks what
  a later revision added (0002: stored block counts and the covering index; 0003: packed
  block lists, which only new rows use; 0004: integer run keys in `events`; 0006 changes no
  table, its rows may hold descending runs, see `encoding.pack_lists`). `upgrade_note`
  says so and how to migrate (`kvplane upgrade`); `has_block_counts` and `has_packed_lists`
  tell readers which SQL to use, and `events_of`, `events_of_runs` and `run_id_of` write the
  run part of a read of `events` for the revision at hand.
- A new revision is written by hand next to `0001_initial.py` (`revision`, `down_revision`,
  `upgrade()`), together with the model change in `schema.py`; `model_drift(engine)` lists any
  difference between a migrated database and the models, and a test insists it is empty.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.environment import EnvironmentContext
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import (
    Column,
    ColumnElement,
    Connection,
    Engine,
    Select,
    func,
    inspect,
    select,
    text,
)

from ._core import EVENT_TYPES
from .engine import WRITE_LOCK
from .errors import StoreTooNew
from .schema import VERSION_TABLE, events_table, metadata, rollups_table, runs_table

MIGRATIONS_DIR: Final = Path(__file__).resolve().parent / "migrations"

# Any fixed 64-bit number; it only has to be the same in every process that migrates.
_ADVISORY_LOCK_KEY: Final = 0x6B76_706C_616E_6501  # "kvplane" + 1


def _config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(_config()).get_current_head()
    assert head is not None, "no migrations found"
    return head


def known_revisions() -> set[str]:
    """Every revision in `migrations/versions`."""
    return {rev.revision for rev in ScriptDirectory.from_config(_config()).walk_revisions()}


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return revision_of(connection)


def revision_of(connection: Connection) -> str | None:
    context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    return context.get_current_revision()


def check_revision(revision: str | None) -> None:
    """`StoreTooNew` for a revision we do not know (older ones are read as they are)."""
    if revision is not None and revision not in known_revisions():
        raise StoreTooNew(revision)


def upgrade_note(revision: str | None, where: str) -> str | None:
    """What a reader of a store at an older revision should know, or None when it is current."""
    head = head_revision()
    if revision is None or revision == head or revision in _READ_AS_FAST:
        return None
    return (f"the store at {where} has the older schema revision {revision} (this kvplane "
            f"writes {head}): it is read correctly but pages are slower; `kvplane upgrade "
            f"--db {where}` migrates it (a one-time write)")


# Revisions whose reads are as fast as the head's: 0006 only widened what `events.lists` may
# hold (descending runs), so a store at 0005 needs no upgrade to be read well.
_READ_AS_FAST = frozenset({"0005", "0006"})


def has_block_counts(engine: Engine) -> bool:
    """Whether the events table has the `blocks` column (revision 0002 on)."""
    return _has_block_counts(engine)


TYPE_INDEX: Final = "ix_events_run_type_cover"


def by_type(stmt: Select[Any], engine: Engine) -> Select[Any]:
    """`stmt`, a read of some event types of some runs, told to find its rows through the
    (run, type, ...) index on SQLite. Without statistics SQLite's planner prefers the (run,
    request) index whenever a query groups by request, and then reads every row of the run to
    look at its type: 30x the rows of a query on four types. (PostgreSQL plans by its own
    statistics; the hint is rendered for SQLite only.)"""
    name = TYPE_INDEX if has_block_counts(engine) else "ix_events_run_type"  # before 0002
    return stmt.with_hint(events_table, f"INDEXED BY {name}", "sqlite")


def has_packed_lists(engine: Engine) -> bool:
    """Whether the events table has the `lists` column (revision 0003 on): a reader must
    then read it beside the payload (`encoding.merge_lists`)."""
    return "lists" in _event_columns(engine)


def has_run_keys(engine: Engine) -> bool:
    """Whether `events.run` holds the run's integer `runs.key` (revision 0004 on) rather
    than its text id. Only a yes is remembered: a reader that opened a store before 0004
    (the dashboard keeps its engine) goes on reading it right after a writer upgrades it."""
    if "key" in _columns(engine, "runs"):
        return True
    _columns.cache_clear()  # asked again next time: a few PRAGMA reads, old stores only
    return False


def has_rollups(engine: Engine) -> bool:
    """Whether the store has the `run_rollups` table (revision 0005 on). Only a yes is
    remembered, as for `has_run_keys`."""
    if inspect(engine).has_table("run_rollups"):
        _ROLLUPS_SEEN.add(engine)
    return engine in _ROLLUPS_SEEN


_ROLLUPS_SEEN: weakref.WeakSet[Engine] = weakref.WeakSet()  # forgets disposed engines


def fresh_rollups(engine: Engine, run_ids: Iterable[str], part: str
                  ) -> dict[str, dict[str, Any]]:
    """The rollups' `part` (`run_rollups.data`) of those of the runs whose rollup is current: made
    when the run had the events it has now (one probe of the run's last seq each). A run
    without one, recorded on since, or a store before revision 0005: not in the answer (read
    the run's events instead)."""
    ids = list(run_ids)
    if not ids or not has_rollups(engine):
        return {}
    ru, ev = rollups_table, events_table
    last = select(func.max(ev.c.seq)).where(ev.c.run == ru.c.run).scalar_subquery()
    stmt = (select(runs_table.c.id, ru.c.events, last, ru.c.data)
            .join(runs_table, runs_table.c.key == ru.c.run)
            .where(runs_table.c.id.in_(ids), ru.c.part == part))
    with engine.connect() as conn:
        rows = conn.execute(stmt).all()
    return {run: dict(data) for run, events, top, data in rows
            if events == (0 if top is None else int(top) + 1) and isinstance(data, dict)}


def run_ref(engine: Engine) -> Column[object]:
    """The column of `runs` whose value `events.run` holds: `key`, or `id` before 0004."""
    return runs_table.c.key if has_run_keys(engine) else runs_table.c.id


def events_of(engine: Engine, run_id: str) -> ColumnElement[bool]:
    """The condition on `events` for the rows of the run with public id `run_id`.

    The run's key is a scalar subquery (`runs` by its primary key, evaluated once), so the
    condition is an equality on the first column of every index of `events`."""
    key = select(run_ref(engine)).where(runs_table.c.id == run_id).correlate(None)
    return events_table.c.run == key.scalar_subquery()


def events_of_runs(engine: Engine, run_ids: Iterable[str]) -> ColumnElement[bool]:
    """`events_of` for several runs."""
    keys = select(run_ref(engine)).where(runs_table.c.id.in_(list(run_ids))).correlate(None)
    return events_table.c.run.in_(keys)


def run_id_of(engine: Engine, run: ColumnElement[Any] = events_table.c.run
              ) -> ColumnElement[str]:
    """The public id of the run that `run` (`events.run`, or a subquery's column of it)
    names, for a select from `events` or that subquery: group by `run` and select this
    beside it (one index probe of `runs` a group)."""
    ids = select(runs_table.c.id).where(run_ref(engine) == run)
    return ids.correlate_except(runs_table).scalar_subquery()


def all_types() -> list[str]:
    """Every event type's name: a read of some requests' events names them all (`type IN
    (...)`), so that the (run, type, request, ...) index finds the rows, one probe per type
    and request (revision 0004 dropped the (run, request) index)."""
    return sorted(EVENT_TYPES)


def _has_block_counts(engine: Engine) -> bool:
    return "blocks" in _event_columns(engine)


def _event_columns(engine: Engine) -> frozenset[str]:
    return _columns(engine, "events")


@functools.lru_cache(maxsize=64)
def _columns(engine: Engine, table: str) -> frozenset[str]:
    # Asked once per engine: a store is only ever migrated forwards, so a stale answer only
    # means the slower (still correct) SQL until the reader opens it again.
    return frozenset(c["name"] for c in inspect(engine).get_columns(table))


def upgrade(engine: Engine, to: str = "head") -> None:
    """Migrate the database behind `engine` to the head revision (a no-op when it is there);
    `to` an older revision only to make old stores in tests."""
    _migrate(engine, lambda script, revision: script._upgrade_revs(to, revision))


def downgrade(engine: Engine, to: str) -> None:
    """Migrate back to revision `to` (tests make old stores with it; data of later revisions
    is dropped)."""
    _migrate(engine, lambda script, revision: script._downgrade_revs(to, revision))


def _migrate(engine: Engine, plan: Any) -> None:
    config = _config()
    script = ScriptDirectory.from_config(config)
    with engine.execution_options(**{WRITE_LOCK: True}).begin() as connection:
        if connection.dialect.name == "postgresql":
            connection.execute(
                text("SELECT pg_advisory_xact_lock(:key)"), {"key": _ADVISORY_LOCK_KEY}
            )
        check_revision(revision_of(connection))
        _run_steps(config, script, connection, plan)
    _columns.cache_clear()


def _run_steps(config: Config, script: ScriptDirectory, connection: Connection,
               plan: Any) -> None:
    def steps(revision: Any, _context: MigrationContext) -> Any:
        return plan(script, revision)

    with EnvironmentContext(config, script, fn=steps) as environment:
        environment.configure(
            connection=connection,
            target_metadata=metadata,
            version_table=VERSION_TABLE,
            transactional_ddl=True,
        )
        # The connection is already in our transaction, so Alembic joins it.
        with environment.begin_transaction():
            environment.run_migrations()


def model_drift(engine: Engine) -> list[Any]:
    """Differences between the database and `schema.metadata` (empty when they agree)."""
    with engine.connect() as connection:
        context = MigrationContext.configure(
            connection, opts={"version_table": VERSION_TABLE, "compare_type": True}
        )
        return list(compare_metadata(context, metadata))
