"""shared limiters: llm_limiters (GCRA state per limiter on the database clock), llm_intents.admitted

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-01 22:45:00

One row per limiter ("<scope>/<kind>"), created on first use by the admission itself, so no migration or
start-up step is needed per configured limit. `llm_intents.admitted` keeps what a call was admitted for
({limiter: cost}): settlement gives back the unused part when the intent ends, whichever holder ends it.
Both are additions (no table is rebuilt).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def _counter(name: str) -> sa.Column[int]:
    return sa.Column(name, sa.BigInteger(), server_default="0", nullable=False)


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "llm_limiters",
        sa.Column("name", sa.String(length=320), nullable=False),
        sa.Column("tat", sa.Float(), server_default="0", nullable=False),
        sa.Column("seconds_per_unit", sa.Float(), nullable=False),
        sa.Column("tau_s", sa.Float(), server_default="0", nullable=False),
        sa.Column("factor", sa.Float(), server_default="1", nullable=False),
        _counter("admitted"),
        _counter("throttled_local"),
        _counter("throttled_provider"),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_llm_limiters")),
    )
    with op.batch_alter_table("llm_intents", schema=None, recreate="never") as batch_op:
        batch_op.add_column(sa.Column("admitted", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("llm_intents", schema=None, recreate="never") as batch_op:
        batch_op.drop_column("admitted")
    op.drop_table("llm_limiters")
