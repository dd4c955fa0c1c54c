"""The tables, as SQLAlchemy 2 declarative models; the read side's map of the database.

Rules kept here:
- `runs`: one row per recorded run (sim, live, replay or import), with an optional parent run
  (a replay or a what-if points at the run it came from), free-form `meta` and the event
  `schema_version` its events were written with.
- `events`: one row per event, keyed by (run, seq); seq is contiguous from 0 within a run, so
  the order of a run is the order of its keys. The common fields (`time` = the event's `at`,
  `type`, `request`, `instance`) are columns, so aggregate SQL needs no JSON; the rest of the
  event is the `payload` JSON exactly as `kvplane.core.events.encode` produced it. `blocks` is
  how many KV blocks the event names (`encoding.block_count`, NULL for none), written with it,
  so counting blocks needs no JSON either (revision 0002; a store not yet migrated lacks it).
  `lists` holds the event's block-id lists packed (`encoding.pack_lists`), and the payload
  then lacks those fields; NULL when the payload holds them (revision 0003: a smaller, faster
  write; rows written before it keep their lists in the payload). Readers put the two back
  together (`encoding.merge_lists`); `blocks` tells how many without reading either.
- A run's public id is its 36-character text `runs.id`; inside the database each run also has
  a small integer `runs.key` (unique, given by the database on insert: a sequence on
  PostgreSQL, a trigger on SQLite), and `events.run` holds that key (revision 0004). Every
  B-tree of `events` starts with the run, so a 36-byte text there made every key comparison
  and every index entry of a write longer: the integer key is about a quarter less of the
  writer's CPU. The same revision dropped the (run, request) index (a sixth of a write): the
  covering index serves a read of some requests when the read names every type
  (`migrate.all_types`). Readers filter by a run id through `migrate.events_of` / `events_of_runs`
  and name a row's run through `migrate.run_id_of`, which work on every revision (a store
  before 0004, read as it is, has the text id in `events.run`).
- `run_rollups`: per run, what the dashboard shows of the whole run (headline figures,
  percentiles, per-time-bin series, slowest requests) as JSON, computed once from the events
  when the run is done (`kvplane.dashboard.rollup`), with the run's event count then: a
  reader uses it only while the run still has that many events (revision 0005).
- The migrations in `migrations/versions` create exactly these tables; a test compares them.
  Change a model only together with a new migration.

Dashboards query `runs_table` and `events_table` (plain `Table` objects) with the engine from
`EventStore.engine`. JSON fields work on both backends through SQLAlchemy, for example
`events_table.c.payload["bytes"].as_integer()`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Final, Literal, get_args

from sqlalchemy import (
    JSON,
    CheckConstraint,
    DateTime,
    Double,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeEngine

RunKind = Literal["sim", "live", "replay", "import"]
RUN_KINDS: Final[tuple[str, ...]] = get_args(RunKind)

#: The Alembic version table; named for this project so a shared PostgreSQL database that
#: also hosts another Alembic-managed schema does not mix the two histories.
VERSION_TABLE: Final = "schema_meta"

# Names are fixed so that migrations, models and both backends agree on them.
NAMING: Final[dict[str, str]] = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def json_type() -> TypeEngine[Any]:
    """JSON on both backends: text in SQLite, `json` in PostgreSQL.

    Not JSONB: JSONB turns every number of a block list into a `numeric` on the way in,
    which made COPY about 1.7x slower here; queries can still cast (`payload::jsonb`).
    """
    return JSON()


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class RunRow(Base):
    __tablename__ = "runs"
    __table_args__ = (
        CheckConstraint("kind IN ('sim', 'live', 'replay', 'import')", name="kind"),
        Index("uq_runs_key", "key", unique=True),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    scenario: Mapped[str] = mapped_column(Text)
    started: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    parent: Mapped[str | None] = mapped_column(
        String(36), ForeignKey("runs.id", ondelete="SET NULL"), index=True
    )
    meta: Mapped[dict[str, Any]] = mapped_column(json_type())
    schema_version: Mapped[int] = mapped_column(Integer)
    # The database gives it (see the module); NULL allowed only because SQLite cannot add a
    # NOT NULL column to a table with rows without rebuilding `runs`, which its foreign keys
    # forbid inside a migration.
    key: Mapped[int | None] = mapped_column(Integer)


class EventRow(Base):
    __tablename__ = "events"
    __table_args__ = (
        # covering: reads of a run's events by type that need only these columns never
        # touch the rows (payloads); its first two columns serve every (run, type) lookup
        # (revision 0004 dropped the (run, request) index: a read of some requests names every
        # type, `all_types`, and this index finds them, one probe per type and request)
        Index("ix_events_run_type_cover", "run", "type", "request", "time", "instance", "blocks"),
    )

    run: Mapped[int] = mapped_column(  # `runs.key`, not the public id (revision 0004)
        Integer, ForeignKey("runs.key", ondelete="CASCADE"), primary_key=True,
        autoincrement=False,
    )
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    time: Mapped[float] = mapped_column(Double)
    type: Mapped[str] = mapped_column(String(64))
    request: Mapped[str | None] = mapped_column(Text)
    instance: Mapped[str] = mapped_column(Text)
    blocks: Mapped[int | None] = mapped_column(Integer)
    payload: Mapped[dict[str, Any]] = mapped_column(json_type())
    lists: Mapped[bytes | None] = mapped_column(LargeBinary)


class RollupRow(Base):
    """What the dashboard shows of a whole run, computed once from its events (revision
    0005): valid while the run still has `events` events."""

    __tablename__ = "run_rollups"

    run: Mapped[int] = mapped_column(  # `runs.key`
        Integer, ForeignKey("runs.key", ondelete="CASCADE"), primary_key=True,
        autoincrement=False,
    )
    part: Mapped[str] = mapped_column(String(32), primary_key=True)  # what a page reads
    events: Mapped[int] = mapped_column(Integer)
    made: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    data: Mapped[dict[str, Any]] = mapped_column(json_type())


metadata: Final[MetaData] = Base.metadata
runs_table: Final[Table] = RunRow.__table__  # type: ignore[assignment]
events_table: Final[Table] = EventRow.__table__  # type: ignore[assignment]
rollups_table: Final[Table] = RollupRow.__table__  # type: ignore[assignment]
