"""batch steps: llm_batches, llm_batch_items (parked model calls) and oncelery_leases (the batcher's lease)

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-02 02:00:00

Three new tables, no change to an existing one (an intent of a batch step is an ordinary `llm_intents` row of
mode "batch").
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

_BATCH_STATES = ("claimed", "uploaded", "submitted", "ended", "failed")
_ITEM_STATES = ("queued", "claimed", "submitted", "done", "failed", "fallback", "cancelled")
_BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _state(values: tuple[str, ...], name: str) -> sa.Enum:
    return sa.Enum(*values, name=name, native_enum=False, create_constraint=True, length=16)


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "llm_batches",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("provider", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("group_key", sa.String(length=400), nullable=False),
        sa.Column("state", _state(_BATCH_STATES, "batch_state"), nullable=False),
        sa.Column("items", sa.Integer(), nullable=False),
        sa.Column("file_id", sa.String(length=255), nullable=True),
        sa.Column("provider_batch_id", sa.String(length=255), nullable=True),
        sa.Column("provider_status", sa.String(length=64), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.text("CURRENT_TIMESTAMP"), nullable=False
        ),
        sa.Column("submitted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("next_poll_at", sa.Float(), nullable=True),
        sa.Column("polls", sa.Integer(), server_default="0", nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_llm_batches")),
    )
    op.create_index("ix_llm_batches_state", "llm_batches", ["state"], unique=False)
    op.create_table(
        "llm_batch_items",
        sa.Column("id", _BIG_ID, autoincrement=True, nullable=False),
        sa.Column("custom_id", sa.String(length=64), nullable=False),
        sa.Column("run_id", _BIG_ID, nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("provider", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("group_key", sa.String(length=400), nullable=False),
        sa.Column("max_items", sa.Integer(), nullable=False),
        sa.Column("max_wait_s", sa.Float(), nullable=False),
        sa.Column("fallback_after_s", sa.Float(), nullable=True),
        sa.Column("state", _state(_ITEM_STATES, "batch_item_state"), nullable=False),
        sa.Column("batch_id", sa.String(length=64), nullable=True),
        sa.Column("request", sa.JSON(), nullable=True),
        sa.Column("response", sa.JSON(), nullable=True),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("queued_at", sa.Float(), nullable=False),
        sa.Column("done_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_llm_batch_items")),
        sa.UniqueConstraint("custom_id", name=op.f("uq_llm_batch_items_custom_id")),
    )
    op.create_index("ix_llm_batch_items_state_group_key", "llm_batch_items", ["state", "group_key"], unique=False)
    op.create_index("ix_llm_batch_items_batch_id", "llm_batch_items", ["batch_id"], unique=False)
    op.create_table(
        "oncelery_leases",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("token", sa.Integer(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_oncelery_leases")),
    )


def downgrade() -> None:
    """Revert this revision."""
    op.drop_table("oncelery_leases")
    op.drop_index("ix_llm_batch_items_batch_id", table_name="llm_batch_items")
    op.drop_index("ix_llm_batch_items_state_group_key", table_name="llm_batch_items")
    op.drop_table("llm_batch_items")
    op.drop_index("ix_llm_batches_state", table_name="llm_batches")
    op.drop_table("llm_batches")
