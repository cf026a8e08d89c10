"""outbox settlement: the outcome that closed a row whose delivery settled without running (stale, conflict)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 16:10:00

A row closed by its relay (its run finished) keeps outcome NULL; a row closed by the worker that refused its
delivery before any run (a stale version, a conflicting payload) says so, and the relay never re-publishes it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("outbox", schema=None) as batch_op:
        batch_op.add_column(sa.Column("outcome", sa.String(length=32), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("outbox", schema=None) as batch_op:
        batch_op.drop_column("outcome")
