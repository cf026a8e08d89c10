"""tenants and retries

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 10:48:44.862190
"""

from __future__ import annotations

import secrets

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    secrets_table = op.create_table(
        "oncelery_secrets",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("value", sa.String(length=255), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_oncelery_secrets")),
    )
    # Generated here, once per database: per-field digests are keyed with it unless ONCELERY_DIGEST_KEY is set,
    # so a low-entropy argument cannot be brute-forced from task_runs alone.
    op.bulk_insert(secrets_table, [{"name": "digest_key", "value": secrets.token_hex(32)}])
    with op.batch_alter_table("delivery_outcomes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("tenant", sa.String(length=255), server_default="", nullable=False))
        # The counters are per tenant too: the tenant joins the primary key.
        batch_op.drop_constraint("pk_delivery_outcomes", type_="primary")
        batch_op.create_primary_key("pk_delivery_outcomes", ["task_name", "tenant", "outcome", "shard"])

    with op.batch_alter_table("task_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("tenant", sa.String(length=255), server_default="", nullable=False))
        batch_op.add_column(sa.Column("retries", sa.Integer(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("not_before", sa.DateTime(timezone=True), nullable=True))
        batch_op.drop_constraint(batch_op.f("uq_task_runs_task_name_idempotency_key"), type_="unique")
        batch_op.drop_index(
            batch_op.f("uq_task_runs_running_concurrency_key"), sqlite_where=sa.text("status = 'RUNNING'")
        )
        batch_op.create_index(
            "uq_task_runs_running_concurrency_key",
            ["tenant", "concurrency_key"],
            unique=True,
            postgresql_where=sa.text("status = 'RUNNING'"),
            sqlite_where=sa.text("status = 'RUNNING'"),
        )
        batch_op.create_unique_constraint(
            batch_op.f("uq_task_runs_task_name_tenant_idempotency_key"), ["task_name", "tenant", "idempotency_key"]
        )


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("task_runs", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("uq_task_runs_task_name_tenant_idempotency_key"), type_="unique")
        batch_op.drop_index(
            "uq_task_runs_running_concurrency_key",
            postgresql_where=sa.text("status = 'RUNNING'"),
            sqlite_where=sa.text("status = 'RUNNING'"),
        )
        batch_op.create_index(
            batch_op.f("uq_task_runs_running_concurrency_key"),
            ["concurrency_key"],
            unique=True,
            postgresql_where=sa.text("status = 'RUNNING'"),
            sqlite_where=sa.text("status = 'RUNNING'"),
        )
        batch_op.create_unique_constraint(
            batch_op.f("uq_task_runs_task_name_idempotency_key"), ["task_name", "idempotency_key"]
        )
        batch_op.drop_column("not_before")
        batch_op.drop_column("retries")
        batch_op.drop_column("tenant")

    with op.batch_alter_table("delivery_outcomes", schema=None) as batch_op:
        batch_op.drop_constraint("pk_delivery_outcomes", type_="primary")
        batch_op.create_primary_key("pk_delivery_outcomes", ["task_name", "outcome", "shard"])
        batch_op.drop_column("tenant")

    op.drop_table("oncelery_secrets")
