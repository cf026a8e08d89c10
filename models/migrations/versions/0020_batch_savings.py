"""batch savings: model_calls.batch_saved_micros, what the batch price saved against the synchronous price

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-02 05:30:00

A batch item's ledger row is priced at the batch price; this column keeps, exactly and per row, what the same
call would have cost more at the synchronous price (NULL: not a batch call, or no price), so `oncelery costs`
sums the savings in one grouped query without the price table of the day each row was written. An addition:
no table is rebuilt.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("model_calls", schema=None, recreate="never") as batch_op:
        batch_op.add_column(sa.Column("batch_saved_micros", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("model_calls", schema=None, recreate="never") as batch_op:
        batch_op.drop_column("batch_saved_micros")
