"""drop llm_calls: the demo's model calls go to the framework's cost ledger (model_calls)

Revision ID: j0002
Revises: j0001
Create Date: 2026-12-02 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "j0002"
down_revision = "j0001"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_COMMON = (
    "task_name, idempotency_key, step, run_id, fencing_token, model, input_tokens, output_tokens, latency_ms, ok, "
    "error, created_at"
)


def upgrade() -> None:
    """Apply this revision: keep the demo's spent calls in model_calls (if the framework has it), drop llm_calls."""
    if sa.inspect(op.get_bind()).has_table("model_calls"):
        # The demo named each call after its prompt ("summarize", ...), which was also its step's name.
        op.execute(f"INSERT INTO model_calls (prompt, {_COMMON}) SELECT step, {_COMMON} FROM llm_calls ORDER BY id")
    with op.batch_alter_table("llm_calls", schema=None) as batch_op:
        batch_op.drop_index("ix_llm_calls_task_name_idempotency_key")
    op.drop_table("llm_calls")


def downgrade() -> None:
    """Revert this revision (an empty llm_calls: its rows stay in model_calls)."""
    op.create_table(
        "llm_calls",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("task_name", sa.String(length=255), nullable=True),
        sa.Column("idempotency_key", sa.String(length=255), nullable=True),
        sa.Column("step", sa.String(length=255), nullable=True),
        sa.Column("run_id", _ID, nullable=True),
        sa.Column("fencing_token", sa.Integer(), nullable=True),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("model_version", sa.String(length=64), nullable=True),
        sa.Column("seed", _ID, nullable=True),
        sa.Column("temperature", sa.Float(), nullable=False),
        sa.Column("prompt_hash", sa.String(length=64), nullable=False),
        sa.Column("input_tokens", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("latency_ms", sa.Float(), nullable=False),
        sa.Column("ok", sa.Boolean(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.text("(CURRENT_TIMESTAMP)"), nullable=False
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_llm_calls")),
    )
    with op.batch_alter_table("llm_calls", schema=None) as batch_op:
        batch_op.create_index("ix_llm_calls_task_name_idempotency_key", ["task_name", "idempotency_key"], unique=False)
