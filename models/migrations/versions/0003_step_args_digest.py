"""step arguments digest

(No revision 0002: an earlier, unreleased build used that id for the demo tables, which now live on the
jobs branch; a database left at that 0002 fails to upgrade with "Can't locate revision" instead of being
migrated wrongly. Recreate such a demo database.)

Revision ID: 0003
Revises: 0001
Create Date: 2026-11-30 11:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("step_results", schema=None) as batch_op:
        batch_op.add_column(sa.Column("args_digest", sa.String(length=64), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("step_results", schema=None) as batch_op:
        batch_op.drop_column("args_digest")
