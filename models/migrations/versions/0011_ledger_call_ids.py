"""ledger call ids: model_calls.call_id, unique, so a spooled row replayed after an unknown commit counts once

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01 18:45:00

Rows written before this revision keep call_id NULL (NULLs never collide in a unique index), so the upgrade
needs no backfill. No table is rebuilt: SQLite adds the column with ALTER TABLE ADD COLUMN (model_calls has no
trigger either way), and the index is created on its own.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    op.add_column("model_calls", sa.Column("call_id", sa.String(length=64), nullable=True))
    op.create_index("uq_model_calls_call_id", "model_calls", ["call_id"], unique=True)


def downgrade() -> None:
    """Revert this revision."""
    op.drop_index("uq_model_calls_call_id", table_name="model_calls")
    with op.batch_alter_table("model_calls", schema=None) as batch_op:
        batch_op.drop_column("call_id")
