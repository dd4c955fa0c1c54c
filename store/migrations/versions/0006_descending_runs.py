"""Packed block lists may hold descending runs (kind 5), written per run.

Revision ID: 0006
Revises: 0005

The schema is unchanged. What changes is what `events.lists` may hold: since this revision
the simulator's block lists reach the recorder with their runs (`core.blocks.RunBlocks`), and
a list with a descending run (a decode pool hands its LIFO free queue out from the tail) is
stored as kind 5, `(start, signed length)` pairs (`encoding.pack_lists` has the format). A
kvplane before this revision cannot read kind 5; this revision is how it learns that the
store is newer than itself (`StoreTooNew`) instead of calling those rows damaged.

Upgrading changes nothing: every row written before reads as it was. Downgrading rewrites
each row holding a kind-5 piece with the older kinds (row by row in Python), so a store taken
back to 0005 is read by an older kvplane as it was.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sqlalchemy as sa
from alembic import op

if TYPE_CHECKING:  # the same module under the name mypy can follow (see store/_core.py)
    from store.encoding import without_descending_runs
else:
    from kvplane.store.encoding import without_descending_runs

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | None = None
depends_on: str | None = None

_BATCH = 2000


def upgrade() -> None:
    pass


def downgrade() -> None:
    bind = op.get_bind()
    events = sa.table("events", sa.column("run", sa.Integer()), sa.column("seq", sa.Integer()),
                      sa.column("lists", sa.LargeBinary()))
    after: tuple[int, int] = (-1, -1)
    while True:  # keyset pages over (run, seq): each page read whole before it is rewritten
        page = bind.execute(
            sa.select(events.c.run, events.c.seq, events.c.lists)
            .where(events.c.lists.is_not(None), sa.tuple_(events.c.run, events.c.seq)
                   > sa.tuple_(*after))
            .order_by(events.c.run, events.c.seq).limit(_BATCH)).all()
        if not page:
            break
        changed = [{"r": run, "s": seq, "l": new} for run, seq, lists in page
                   if (new := without_descending_runs(lists)) is not None]
        if changed:
            bind.execute(
                events.update().where(events.c.run == sa.bindparam("r"),
                                      events.c.seq == sa.bindparam("s"))
                .values(lists=sa.bindparam("l")), changed)
        after = (page[-1][0], page[-1][1])
