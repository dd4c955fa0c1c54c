"""Block counts beside the events, and a covering index for the dashboard's reads.

Revision ID: 0002
Revises: 0001

- `events.blocks`: how many KV blocks an event names (`encoding.block_count`), written by the
  writer with the event, NULL for an event about no blocks. Readers sum it instead of parsing
  the payload's block list.
- `ix_events_run_type_cover` on (run, type, request, time, instance, blocks) replaces
  `ix_events_run_type` (its first two columns): a query on a run's events of some types that
  needs only these columns reads the index alone, never the rows and their payloads.

Events already stored get their counts here, from the payload's block-id list (the encoding of
every event schema up to this revision): `blocks`, else `dst_blocks`, else `src_blocks`, the
order `encoding.block_count` takes them in.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None

#: Event types with a block-id list in their payload when this revision was written.
_WITH_BLOCKS = ("BlocksReserved", "BlocksFreed", "RegistrationSent", "RegistrationArrived",
                "PrefillFinished", "TransferPlanned", "MetadataRelayed", "LeaseGranted")
_FIELDS = ("blocks", "dst_blocks", "src_blocks")
COVER = ("run", "type", "request", "time", "instance", "blocks")


def upgrade() -> None:
    op.add_column("events", sa.Column("blocks", sa.Integer(), nullable=True))
    bind = op.get_bind()
    payload = sa.column("payload", sa.JSON())
    if bind.dialect.name == "sqlite":
        lengths = [sa.func.json_array_length(payload, f"$.{f}") for f in _FIELDS]
    else:
        lengths = [sa.func.json_array_length(payload[f]) for f in _FIELDS]
    events = sa.table("events", sa.column("type", sa.String()), payload,
                      sa.column("blocks", sa.Integer()))
    op.execute(events.update().where(events.c.type.in_(_WITH_BLOCKS))
               .values(blocks=sa.func.coalesce(*lengths)))
    op.drop_index("ix_events_run_type", table_name="events")
    op.create_index("ix_events_run_type_cover", "events", list(COVER))


def downgrade() -> None:
    op.drop_index("ix_events_run_type_cover", table_name="events")
    op.create_index("ix_events_run_type", "events", ["run", "type"])
    op.drop_column("events", "blocks")
