"""llm intents: the write-ahead llm_intents table, and model_calls.reason / reattached for repeated calls

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01 19:00:00

New table, and two columns added without rebuilding model_calls (it carries 0012's histogram trigger, which a
SQLite batch rebuild would drop): ALTER TABLE ADD COLUMN on both dialects, DROP COLUMN on downgrade (SQLite
3.35+).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

_STATES = ("prepared", "sent", "done", "failed", "lost", "cancelled")
_REASONS = ("create_window", "sync_unknown", "lost", "failed", "cancelled", "superseded")


def upgrade() -> None:
    """Apply this revision."""
    big_id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
    op.create_table(
        "llm_intents",
        sa.Column("id", big_id, autoincrement=True, nullable=False),
        sa.Column("public_id", sa.String(length=40), nullable=False),
        sa.Column("run_id", big_id, nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("step_name", sa.String(length=255), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("token", sa.Integer(), nullable=False),
        sa.Column("provider", sa.String(length=64), nullable=False),
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("mode", sa.String(length=16), nullable=False),
        sa.Column("request_digest", sa.String(length=64), nullable=False),
        sa.Column(
            "state",
            sa.Enum(*_STATES, name="intent_state", native_enum=False, create_constraint=True, length=16),
            nullable=False,
        ),
        sa.Column("reference", sa.String(length=255), nullable=True),
        sa.Column("cursor", sa.Integer(), nullable=True),
        sa.Column(
            "repeat_reason",
            sa.Enum(*_REASONS, name="repeat_reason", native_enum=False, create_constraint=True, length=16),
            nullable=True,
        ),
        sa.Column("retention_s", sa.Float(), nullable=True),
        sa.Column(
            "prepared_at", sa.DateTime(timezone=True), server_default=sa.text("CURRENT_TIMESTAMP"), nullable=False
        ),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("input_tokens", sa.Integer(), nullable=True),
        sa.Column("output_tokens", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_llm_intents")),
        sa.UniqueConstraint("public_id", name=op.f("uq_llm_intents_public_id")),
    )
    op.create_index(
        "ix_llm_intents_run_id_position_attempt", "llm_intents", ["run_id", "position", "attempt"], unique=True
    )
    op.create_index("ix_llm_intents_state", "llm_intents", ["state"], unique=False)
    op.add_column("model_calls", sa.Column("reason", sa.String(length=32), nullable=True))
    op.add_column("model_calls", sa.Column("reattached", sa.Boolean(), server_default=sa.false(), nullable=False))


def downgrade() -> None:
    """Revert this revision."""
    op.drop_column("model_calls", "reattached")
    op.drop_column("model_calls", "reason")
    op.drop_index("ix_llm_intents_state", table_name="llm_intents")
    op.drop_index("ix_llm_intents_run_id_position_attempt", table_name="llm_intents")
    op.drop_table("llm_intents")
