"""Block-id lists packed beside the payload instead of inside its JSON.

Revision ID: 0003
Revises: 0002

- `events.lists` (BLOB / bytea, NULL allowed): an event's block-id lists as runs of
  consecutive ids (`encoding.pack_lists`); the payload JSON then lacks those fields. A
  1,024-block list is 12 bytes instead of about 5 KB of JSON, so a recording writes a
  fraction of the bytes, and the writer no longer turns every id into text.
- Rows already stored keep their lists in the payload (`lists` NULL): a reader merges the two
  (`encoding.merge_lists`), so nothing is rewritten and the upgrade is instant.

Downgrading puts the packed lists back into the payload JSON (row by row, in Python: SQL
cannot unpack them), so a store taken back to 0002 is read by an older kvplane as it was.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import sqlalchemy as sa
from alembic import op

if TYPE_CHECKING:  # the same module under the name mypy can follow (see store/_core.py)
    from store.encoding import merge_lists
else:
    from kvplane.store.encoding import merge_lists

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None

_BATCH = 2000


def upgrade() -> None:
    op.add_column("events", sa.Column("lists", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    bind = op.get_bind()
    events = sa.table("events", sa.column("run", sa.String()), sa.column("seq", sa.Integer()),
                      sa.column("payload", sa.JSON()), sa.column("lists", sa.LargeBinary()))
    payload_text = sa.cast(events.c.payload, sa.Text)
    after: tuple[str, int] = ("", -1)
    while True:  # keyset pages over (run, seq): each page read whole before it is rewritten
        page = bind.execute(
            sa.select(events.c.run, events.c.seq, payload_text, events.c.lists)
            .where(events.c.lists.is_not(None), sa.tuple_(events.c.run, events.c.seq)
                   > sa.tuple_(*after))
            .order_by(events.c.run, events.c.seq).limit(_BATCH)).all()
        if not page:
            break
        bind.execute(
            events.update().where(events.c.run == sa.bindparam("r"),
                                  events.c.seq == sa.bindparam("s"))
            .values(payload=sa.bindparam("p"), lists=None),
            [{"r": run, "s": seq, "p": merge_lists(json.loads(text), lists)}
             for run, seq, text, lists in page])
        after = (page[-1][0], page[-1][1])
    op.drop_column("events", "lists")
