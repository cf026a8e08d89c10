"""debounce edit key: oncelery_debounce.edit_key, the idempotency key of a debounce key's latest edit

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-04 09:00:00

A run in flight is fenced out (superseded) only by a newer edit with ANOTHER idempotency key: an identical edit is
the same job, answered by that run. The debounce row therefore keeps its latest edit's key (a key, not payload: the
run it names stores the same key). A nullable addition, so no table is rebuilt: rows written before it hold NULL,
which reads as "another key", the behaviour they were written under.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0027"
down_revision = "0026"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("oncelery_debounce", schema=None, recreate="never") as batch_op:
        batch_op.add_column(sa.Column("edit_key", sa.String(255), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("oncelery_debounce", schema=None, recreate="never") as batch_op:
        batch_op.drop_column("edit_key")
