"""forks: oncelery_forks, a past run forked from step N under its own key namespace

Revision ID: 0024
Revises: 0022
Create Date: 2026-12-02 20:00:00

A fork records its source run, the step it re-runs from, its overrides, where its effects go and the key of the
run it makes. A new table only: nothing stored is rewritten. Kept arguments (`keep_arguments=`) need no column:
they stay in task_runs.message after completion, until retention clears them.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0024"
down_revision = "0022"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "oncelery_forks",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("source_run_id", sa.BigInteger(), nullable=False),
        sa.Column("task_name", sa.String(255), nullable=False),
        sa.Column("tenant", sa.String(255), nullable=False, server_default=""),
        sa.Column("source_key", sa.String(512), nullable=False),
        sa.Column("from_step", sa.String(255), nullable=False),
        sa.Column("from_position", sa.Integer(), nullable=False),
        sa.Column("overrides", sa.JSON(), nullable=False),
        sa.Column(
            "effects",
            sa.Enum("dry", "shadow", "live", name="fork_effects", native_enum=False, create_constraint=True, length=16),
            nullable=False,
        ),
        sa.Column("shadow_url", sa.String(1024)),
        sa.Column("fork_key", sa.String(255), nullable=False),
        sa.Column("cohort_id", sa.BigInteger()),
        sa.Column("cohort_cap_micros", sa.BigInteger()),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.current_timestamp()),
        sa.CheckConstraint("from_position >= 0", name=op.f("ck_oncelery_forks_from_position_non_negative")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_oncelery_forks")),
        sa.UniqueConstraint("fork_key", name=op.f("uq_oncelery_forks_fork_key")),
    )
    op.create_index(op.f("ix_oncelery_forks_source_run_id"), "oncelery_forks", ["source_run_id"])
    op.create_index(op.f("ix_oncelery_forks_cohort_id"), "oncelery_forks", ["cohort_id"])


def downgrade() -> None:
    """Revert this revision."""
    op.drop_index(op.f("ix_oncelery_forks_cohort_id"), table_name="oncelery_forks")
    op.drop_index(op.f("ix_oncelery_forks_source_run_id"), table_name="oncelery_forks")
    op.drop_table("oncelery_forks")
