"""budgets: llm_budgets (spent + reserved <= limit, a CHECK), operator caps and their audit, reservations on intents

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-02 02:00:00

`llm_budgets` holds one row per budget window in integer micro-USD; its CHECK constraint is the invariant
(`spent + reserved <= limit`), so no writer, a bug or an operator's SQL included, can commit an overspend.
`oncelery_caps` keeps the caps an operator set with the CLI (they win over the configuration) and
`oncelery_cap_changes` every change (who, when, from, to). `llm_intents.reserved`/`released_at` record what a
call reserved and when the reservation was released (once). `llm_limiters.capped_spu` is an operator's limit.
All are additions: no table is rebuilt.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def _micros(name: str) -> sa.Column[int]:
    return sa.Column(name, sa.BigInteger(), server_default="0", nullable=False)


def _when(name: str) -> sa.Column[object]:
    return sa.Column(name, sa.DateTime(timezone=True), server_default=sa.text("CURRENT_TIMESTAMP"), nullable=False)


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "llm_budgets",
        sa.Column("name", sa.String(length=320), nullable=False),
        sa.Column("scope", sa.String(length=300), nullable=False),
        sa.Column("limit_micros", sa.BigInteger(), nullable=False),
        _micros("spent_micros"),
        _micros("reserved_micros"),
        _micros("overrun_micros"),
        _micros("refused"),
        sa.Column("resets_at", sa.Float(), nullable=True),
        sa.CheckConstraint("spent_micros + reserved_micros <= limit_micros", name=op.f("ck_llm_budgets_within_limit")),
        sa.CheckConstraint("spent_micros >= 0 AND reserved_micros >= 0", name=op.f("ck_llm_budgets_not_negative")),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_llm_budgets")),
    )
    op.create_table(
        "oncelery_caps",
        sa.Column("name", sa.String(length=320), nullable=False),
        sa.Column("value", sa.BigInteger(), nullable=False),
        sa.Column("set_by", sa.String(length=255), nullable=False),
        _when("set_at"),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_oncelery_caps")),
    )
    op.create_table(
        "oncelery_cap_changes",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=320), nullable=False),
        sa.Column("old_value", sa.BigInteger(), nullable=True),
        sa.Column("new_value", sa.BigInteger(), nullable=True),
        sa.Column("set_by", sa.String(length=255), nullable=False),
        _when("set_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_oncelery_cap_changes")),
    )
    with op.batch_alter_table("llm_intents", schema=None, recreate="never") as batch_op:
        batch_op.add_column(sa.Column("reserved", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("released_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("llm_limiters", schema=None, recreate="never") as batch_op:
        batch_op.add_column(sa.Column("capped_spu", sa.Float(), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("llm_limiters", schema=None, recreate="never") as batch_op:
        batch_op.drop_column("capped_spu")
    with op.batch_alter_table("llm_intents", schema=None, recreate="never") as batch_op:
        batch_op.drop_column("released_at")
        batch_op.drop_column("reserved")
    op.drop_table("oncelery_cap_changes")
    op.drop_table("oncelery_caps")
    op.drop_table("llm_budgets")
