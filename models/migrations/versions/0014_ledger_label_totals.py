"""ledger label totals: running counts of repeated, unknown-outcome and re-attached model calls

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01 19:30:00

`ledger_label_totals` holds one row per (task, tenant, model, label), added in the transaction of each labelled
`model_calls` row, so `oncelery costs` and the exporter never scan model_calls for them. Backfilled from the rows
already there (0013 added the labels: few rows carry one).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

_BACKFILL = """
INSERT INTO ledger_label_totals (task_name, tenant, model, label, calls)
SELECT COALESCE(task_name, ''), tenant, model, label, COUNT(*) FROM (
    SELECT task_name, tenant, model, reason AS label FROM model_calls WHERE reason IS NOT NULL
    UNION ALL
    SELECT task_name, tenant, model, 'reattached' AS label FROM model_calls WHERE reattached
) AS labelled
GROUP BY COALESCE(task_name, ''), tenant, model, label
"""


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "ledger_label_totals",
        sa.Column("task_name", sa.String(length=255), nullable=False),
        sa.Column("tenant", sa.String(length=255), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("label", sa.String(length=32), nullable=False),
        sa.Column("calls", sa.BigInteger(), server_default="0", nullable=False),
        sa.PrimaryKeyConstraint("task_name", "tenant", "model", "label", name=op.f("pk_ledger_label_totals")),
    )
    op.execute(_BACKFILL)


def downgrade() -> None:
    """Revert this revision."""
    op.drop_table("ledger_label_totals")
