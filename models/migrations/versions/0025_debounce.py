"""debounce: oncelery_debounce (one row per debounce key) and the `debounced` and `superseded` outcomes

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-03 07:30:00

A debounced task's producer upserts one row per (task, tenant, debounce key); the relay's dispatcher sends a due
row through the outbox. A message of an edit a newer one replaced counts `debounced`, and a run in flight for an
older edit that a renewal fences out counts `superseded`: two new values of a VARCHAR + CHECK column
(native_enum=False), so delivery_outcomes.outcome's CHECK is widened. No row is rewritten: every series of the
new outcomes starts at zero (the exporter lists every outcome of the enum, counted or not).

SQLite cannot alter a CHECK in place; as in 0016, the IN list is edited in sqlite_master (widening only admits
more rows), never by a batch rebuild that would drop the table (models/migrations/checks.py).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from oncelery.models.migrations.checks import set_in_check

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None

_OUTCOMES = (
    "executed", "replayed", "resumed", "in_progress", "conflict", "stale", "lease_lost", "failed", "dead", "waiting",
)  # fmt: skip
_ADDED = ("debounced", "superseded")
_TABLE, _NAME, _COLUMN = "delivery_outcomes", "ck_delivery_outcomes_outcome", "outcome"


def _set_check(values: tuple[str, ...]) -> None:
    set_in_check(_TABLE, _NAME, _COLUMN, values)


def upgrade() -> None:
    """Apply this revision."""
    _set_check((*_OUTCOMES, *_ADDED))
    op.create_table(
        "oncelery_debounce",
        sa.Column("task_name", sa.String(255), nullable=False),
        sa.Column("tenant", sa.String(255), nullable=False, server_default=""),
        sa.Column("debounce_key", sa.String(255), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("dispatched_seq", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("task_id", sa.String(255), nullable=False),
        sa.Column("args", sa.JSON(), nullable=True),
        sa.Column("kwargs", sa.JSON(), nullable=True),
        sa.Column("headers", sa.JSON(), nullable=True),
        sa.Column("burst_started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("due_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deadline_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("dispatched_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.current_timestamp()),
        sa.CheckConstraint("seq >= dispatched_seq", name=op.f("ck_oncelery_debounce_seq_not_behind")),
        sa.PrimaryKeyConstraint("task_name", "tenant", "debounce_key", name=op.f("pk_oncelery_debounce")),
    )
    op.create_index(
        "ix_oncelery_debounce_pending_due",
        "oncelery_debounce",
        ["due_at"],
        unique=False,
        postgresql_where=sa.text("seq > dispatched_seq"),
        sqlite_where=sa.text("seq > dispatched_seq"),
    )


def downgrade() -> None:
    """Revert this revision: pending bursts are dropped with the table, and the new outcomes' counts with them."""
    op.drop_index("ix_oncelery_debounce_pending_due", table_name="oncelery_debounce")
    op.drop_table("oncelery_debounce")
    op.execute("DELETE FROM delivery_outcomes WHERE outcome IN ('debounced', 'superseded')")
    _set_check(_OUTCOMES)
