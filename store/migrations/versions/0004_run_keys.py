"""Events name their run by a small integer key instead of the 36-character run id.

Revision ID: 0004
Revises: 0003

- `runs.key` (INTEGER, unique index `uq_runs_key`): given by the database to every new run
  (PostgreSQL: the sequence `runs_key_seq` as the column's default; SQLite: the trigger
  `runs_key_given`, the largest key + 1, safe because SQLite has one writer at a time).
  Runs already stored get 1, 2, ... in the order they started.
- `events.run` becomes that key (foreign key to `runs.key`, ON DELETE CASCADE as before).
  Every B-tree of `events` (the table's (run, seq) key and both secondary indexes) starts
  with the run, so each insert compared and stored a 36-byte text three times; as an integer
  the writer spends about a quarter less CPU a row. The public run id stays `runs.id`.
- The (run, request) index `ix_events_run_request` is not rebuilt (about a sixth of a write's
  CPU): a read of some requests' events names every event type as well, and the covering
  (run, type, request, ...) index finds them, one probe per (type, request).

The upgrade rewrites `events` once (a new table filled from the old with one INSERT ...
SELECT, the indexes built after it): seconds for a million events. SQLite cannot change a
key column's type in place, so both backends take the same way. Downgrading rewrites it back.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None

_COVER = ("run", "type", "request", "time", "instance", "blocks")
_COLUMNS = "seq, time, type, request, instance, blocks, payload, lists"
_TRIGGER = """
CREATE TRIGGER runs_key_given AFTER INSERT ON runs WHEN NEW.key IS NULL
BEGIN
    UPDATE runs SET key = (SELECT coalesce(max(key), 0) + 1 FROM runs) WHERE id = NEW.id;
END
"""


def _json() -> sa.types.TypeEngine[object]:
    return sa.JSON()


def _events(run: sa.Column[object]) -> None:
    op.create_table(
        "events",
        run,
        sa.Column("seq", sa.Integer(), nullable=False, autoincrement=False),
        sa.Column("time", sa.Double(), nullable=False),
        sa.Column("type", sa.String(64), nullable=False),
        sa.Column("request", sa.Text(), nullable=True),
        sa.Column("instance", sa.Text(), nullable=False),
        sa.Column("payload", _json(), nullable=False),
        sa.Column("blocks", sa.Integer(), nullable=True),
        sa.Column("lists", sa.LargeBinary(), nullable=True),
        sa.PrimaryKeyConstraint("run", "seq", name="pk_events"),
        sa.ForeignKeyConstraint(
            ["run"], [f"runs.{'key' if isinstance(run.type, sa.Integer) else 'id'}"],
            name="fk_events_run_runs", ondelete="CASCADE",
        ),
    )


def _set_aside(old: str, *, by_request: bool) -> None:
    """Rename `events` to `old` and free the names the new table will take."""
    op.drop_index("ix_events_run_type_cover", table_name="events")
    if by_request:
        op.drop_index("ix_events_run_request", table_name="events")
    op.rename_table("events", old)
    if op.get_bind().dialect.name == "postgresql":  # its key's index name is schema-wide
        op.execute(f"ALTER TABLE {old} RENAME CONSTRAINT pk_events TO pk_{old}")


def _index_events(*, by_request: bool) -> None:
    op.create_index("ix_events_run_type_cover", "events", list(_COVER))
    if by_request:
        op.create_index("ix_events_run_request", "events", ["run", "request"])


def upgrade() -> None:
    bind = op.get_bind()
    op.add_column("runs", sa.Column("key", sa.Integer(), nullable=True))
    runs = sa.table("runs", sa.column("id", sa.String()), sa.column("started", sa.DateTime()),
                    sa.column("key", sa.Integer()))
    ids = bind.execute(sa.select(runs.c.id).order_by(runs.c.started, runs.c.id)).scalars().all()
    if ids:
        bind.execute(runs.update().where(runs.c.id == sa.bindparam("i"))
                     .values(key=sa.bindparam("k")),
                     [{"i": run_id, "k": k} for k, run_id in enumerate(ids, start=1)])
    op.create_index("uq_runs_key", "runs", ["key"], unique=True)
    if bind.dialect.name == "postgresql":
        op.execute("CREATE SEQUENCE runs_key_seq OWNED BY runs.key")
        op.execute(f"SELECT setval('runs_key_seq', {len(ids) + 1}, false)")
        op.execute("ALTER TABLE runs ALTER COLUMN key SET DEFAULT nextval('runs_key_seq')")
    else:
        op.execute(_TRIGGER)

    _set_aside("events_0003", by_request=True)
    _events(sa.Column("run", sa.Integer(), nullable=False, autoincrement=False))
    op.execute(f"INSERT INTO events (run, {_COLUMNS}) "
               f"SELECT r.key, {_prefixed('e')} FROM events_0003 e JOIN runs r ON r.id = e.run")
    op.drop_table("events_0003")
    _index_events(by_request=False)


def downgrade() -> None:
    bind = op.get_bind()
    _set_aside("events_0004", by_request=False)
    _events(sa.Column("run", sa.String(36), nullable=False))
    op.execute(f"INSERT INTO events (run, {_COLUMNS}) "
               f"SELECT r.id, {_prefixed('e')} FROM events_0004 e JOIN runs r ON r.key = e.run")
    op.drop_table("events_0004")
    _index_events(by_request=True)
    if bind.dialect.name == "postgresql":
        op.execute("ALTER TABLE runs ALTER COLUMN key DROP DEFAULT")
        op.execute("DROP SEQUENCE runs_key_seq")
    else:
        op.execute("DROP TRIGGER runs_key_given")
    op.drop_index("uq_runs_key", table_name="runs")
    op.drop_column("runs", "key")


def _prefixed(alias: str) -> str:
    return ", ".join(f"{alias}.{c.strip()}" for c in _COLUMNS.split(","))
