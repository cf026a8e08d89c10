"""delivery edges: outbox, dead letters, entity versions, DEAD runs, lost deliveries

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 13:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_NOW = sa.text("(CURRENT_TIMESTAMP)")
_OLD_STATUSES = ("RUNNING", "COMPLETED", "FAILED")
_NEW_STATUSES = (*_OLD_STATUSES, "DEAD")


def _status_check(statuses: tuple[str, ...]) -> str:
    return "status IN (" + ", ".join(f"'{s}'" for s in statuses) + ")"


def _set_statuses(statuses: tuple[str, ...]) -> None:
    # The status is VARCHAR + CHECK (native_enum=False): a new value is a CHECK change on both dialects
    # (SQLite rebuilds the table in batch mode).
    with op.batch_alter_table("task_runs", schema=None, recreate="auto") as batch_op:
        batch_op.drop_constraint(op.f("ck_task_runs_run_status"), type_="check")
        batch_op.create_check_constraint(op.f("ck_task_runs_run_status"), _status_check(statuses))


def upgrade() -> None:
    """Apply this revision."""
    _set_statuses(_NEW_STATUSES)
    with op.batch_alter_table("task_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("lost", sa.Integer(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("first_failed_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("swept_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.create_index(
            "ix_task_runs_running_lease",
            ["lease_expires_at"],
            unique=False,
            postgresql_where=sa.text("status = 'RUNNING'"),
            sqlite_where=sa.text("status = 'RUNNING'"),
        )
    op.create_table(
        "outbox",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("task_name", sa.String(length=255), nullable=False),
        sa.Column("args", sa.JSON(), nullable=False),
        sa.Column("kwargs", sa.JSON(), nullable=False),
        sa.Column("options", sa.JSON(), nullable=False),
        sa.Column("celery_task_id", sa.String(length=255), nullable=False),
        sa.Column("idempotency_key", sa.String(length=255), nullable=True),
        sa.Column("tenant", sa.String(length=255), server_default="", nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                "PENDING",
                "SENT",
                "DONE",
                "DEAD",
                name="outbox_status",
                native_enum=False,
                create_constraint=True,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("publishes", sa.Integer(), server_default="0", nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), server_default=_NOW, nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_NOW, nullable=False),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox")),
        sa.UniqueConstraint("celery_task_id", name=op.f("uq_outbox_celery_task_id")),
    )
    op.create_index("ix_outbox_status_next_attempt_at", "outbox", ["status", "next_attempt_at"], unique=False)
    op.create_table(
        "dead_letters",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("run_id", _ID, nullable=True),
        sa.Column("task_name", sa.String(length=255), nullable=False),
        sa.Column("tenant", sa.String(length=255), server_default="", nullable=False),
        sa.Column("idempotency_key", sa.String(length=255), nullable=True),
        sa.Column("reason", sa.String(length=32), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("traceback", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("message", sa.JSON(), nullable=True),
        sa.Column("first_failed_at", sa.DateTime(timezone=True), server_default=_NOW, nullable=False),
        sa.Column("last_failed_at", sa.DateTime(timezone=True), server_default=_NOW, nullable=False),
        sa.Column("replayed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("replays", sa.Integer(), server_default="0", nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["task_runs.id"], name=op.f("fk_dead_letters_run_id_task_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_dead_letters")),
        sa.UniqueConstraint("run_id", name=op.f("uq_dead_letters_run_id")),
    )
    op.create_index(
        "ix_dead_letters_task_name_last_failed_at", "dead_letters", ["task_name", "last_failed_at"], unique=False
    )
    op.create_table(
        "entity_versions",
        sa.Column("task_name", sa.String(length=255), nullable=False),
        sa.Column("tenant", sa.String(length=255), server_default="", nullable=False),
        sa.Column("entity", sa.String(length=255), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=_NOW, nullable=False),
        sa.PrimaryKeyConstraint("task_name", "tenant", "entity", name=op.f("pk_entity_versions")),
    )


def downgrade() -> None:
    """Revert this revision (DEAD runs become FAILED: the status they had before DEAD existed)."""
    op.drop_table("entity_versions")
    op.drop_index("ix_dead_letters_task_name_last_failed_at", table_name="dead_letters")
    op.drop_table("dead_letters")
    op.drop_index("ix_outbox_status_next_attempt_at", table_name="outbox")
    op.drop_table("outbox")
    op.execute("UPDATE task_runs SET status = 'FAILED' WHERE status = 'DEAD'")
    with op.batch_alter_table("task_runs", schema=None) as batch_op:
        batch_op.drop_index(
            "ix_task_runs_running_lease",
            postgresql_where=sa.text("status = 'RUNNING'"),
            sqlite_where=sa.text("status = 'RUNNING'"),
        )
        batch_op.drop_column("swept_at")
        batch_op.drop_column("first_failed_at")
        batch_op.drop_column("lost")
    _set_statuses(_OLD_STATUSES)
