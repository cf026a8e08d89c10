"""conflict letters: one per (task, tenant, key, payload fingerprint), counted, instead of one per delivery

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01 16:20:00

Letters written before this revision keep fingerprint NULL (NULLs never collide in a unique index), so the
upgrade needs no de-duplication; retention purges them like any run-less letter.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

_CONFLICT = sa.text("reason = 'conflict'")


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("dead_letters", schema=None) as batch_op:
        batch_op.add_column(sa.Column("fingerprint", sa.String(length=64), nullable=True))
    op.create_index(
        "uq_dead_letters_conflict",
        "dead_letters",
        ["task_name", "tenant", "idempotency_key", "fingerprint"],
        unique=True,
        postgresql_where=_CONFLICT,
        sqlite_where=_CONFLICT,
    )


def downgrade() -> None:
    """Revert this revision."""
    op.drop_index("uq_dead_letters_conflict", table_name="dead_letters")
    with op.batch_alter_table("dead_letters", schema=None) as batch_op:
        batch_op.drop_column("fingerprint")
