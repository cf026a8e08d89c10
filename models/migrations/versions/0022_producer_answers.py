"""producer answers: delivery_outcomes.at_producer, the calls a producer answered without publishing

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-02 12:00:00

With producer dedupe (`.delay()` of a duplicate answered from the claims database), a replay can be answered
where the job is sent: it is still counted `replayed` (exact counts), and this running total says how many of a
counter row's count were answered there. An addition with a default of 0: no table is rebuilt, and every series
starts at zero.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("delivery_outcomes", schema=None, recreate="never") as batch_op:
        batch_op.add_column(sa.Column("at_producer", sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("delivery_outcomes", schema=None, recreate="never") as batch_op:
        batch_op.drop_column("at_producer")
