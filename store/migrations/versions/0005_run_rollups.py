"""Per-run rollups: what the dashboard's pages show of a whole run, written once per run.

Revision ID: 0005
Revises: 0004

- `run_rollups`: rows per run (`run` = `runs.key`, ON DELETE CASCADE) and `part` (what a
  page reads at once: `heads` for the runs table, the others a page's own), `events` (how many
  events the run had when it was rolled up: a reader uses the rollup only while the run still
  has exactly that many, so a run recorded on afterwards is read from its events again),
  `made` (when) and `data` (JSON: the run's headline figures, percentiles, per-time-bin series
  or slowest requests, as `kvplane.dashboard.rollup` computes them from the events).
- Nothing is computed here: runs stored before it have no rollup and are read from their
  events as before (`kvplane rollup` writes theirs). Downgrading drops the table.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "run_rollups",
        sa.Column("run", sa.Integer(), nullable=False, autoincrement=False),
        sa.Column("part", sa.String(32), nullable=False),
        sa.Column("events", sa.Integer(), nullable=False),
        sa.Column("made", sa.DateTime(timezone=True), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("run", "part", name="pk_run_rollups"),
        sa.ForeignKeyConstraint(["run"], ["runs.key"], ondelete="CASCADE",
                                name="fk_run_rollups_run_runs"),
    )


def downgrade() -> None:
    op.drop_table("run_rollups")
