"""cost ledger: model_calls (one row per real model call) and task_runs.replays

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_NOW = sa.text("(CURRENT_TIMESTAMP)")


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("task_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("replays", sa.Integer(), server_default="0", nullable=False))
    op.create_table(
        "model_calls",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("task_name", sa.String(length=255), nullable=True),
        sa.Column("tenant", sa.String(length=255), server_default="", nullable=False),
        sa.Column("idempotency_key", sa.String(length=255), nullable=True),
        sa.Column("step", sa.String(length=255), nullable=True),
        sa.Column("run_id", _ID, nullable=True),
        sa.Column("fencing_token", sa.Integer(), nullable=True),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("prompt", sa.String(length=255), nullable=True),
        sa.Column("input_tokens", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("latency_ms", sa.Float(), nullable=False),
        sa.Column("ok", sa.Boolean(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("cost", sa.Float(), nullable=True),
        sa.Column("meta", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_NOW, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_model_calls")),
    )
    op.create_index(
        "ix_model_calls_task_name_idempotency_key", "model_calls", ["task_name", "idempotency_key"], unique=False
    )
    op.create_index("ix_model_calls_run_id", "model_calls", ["run_id"], unique=False)


def downgrade() -> None:
    """Revert this revision (the ledger's rows are dropped with it)."""
    op.drop_index("ix_model_calls_run_id", table_name="model_calls")
    op.drop_index("ix_model_calls_task_name_idempotency_key", table_name="model_calls")
    op.drop_table("model_calls")
    with op.batch_alter_table("task_runs", schema=None) as batch_op:
        batch_op.drop_column("replays")
