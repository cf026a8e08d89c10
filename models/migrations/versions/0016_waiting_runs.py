"""waiting runs: the WAITING run status, the `waiting` delivery outcome, and the waker's index

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-01 22:10:00

A run whose background model call outlasts the inline wait is parked WAITING (no worker slot, a wake time on the
database clock in `not_before`), and the delivery that parked it counts `waiting`. Both are new values of a
VARCHAR + CHECK column (native_enum=False), so this is a CHECK change on task_runs.status,
run_status_totals.status and delivery_outcomes.outcome, plus a partial index the waker scans.

SQLite cannot alter a CHECK in place, and a batch rebuild would DROP task_runs: with foreign keys on (every
Oncelery connection), that DROP deletes the step checkpoints and intents that cascade from it, and drops the
table's triggers. Widening an IN list only admits more rows, so the schema text is edited in place instead,
the procedure SQLite's ALTER TABLE documentation gives for changes that leave the stored rows valid
(`PRAGMA writable_schema`, then a new schema_version so every connection reloads it): no copy, no lost rows,
triggers and indexes untouched, O(1) on a table of any size.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from oncelery.models.migrations.checks import set_in_check

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

_STATUSES = ("RUNNING", "COMPLETED", "FAILED", "DEAD")
_OUTCOMES = ("executed", "replayed", "resumed", "in_progress", "conflict", "stale", "lease_lost", "failed", "dead")
# (table, constraint, column, values before this revision); each gains one value.
_CHECKS = (
    ("task_runs", "ck_task_runs_run_status", "status", _STATUSES, "WAITING"),
    ("run_status_totals", "ck_run_status_totals_run_status", "status", _STATUSES, "WAITING"),
    ("delivery_outcomes", "ck_delivery_outcomes_outcome", "outcome", _OUTCOMES, "waiting"),
)


def _set_checks(widen: bool) -> None:
    # One CHECK at a time, each in place (models/migrations/checks.py; see the module's docstring for why).
    for table, name, column, before, added in _CHECKS:
        set_in_check(table, name, column, (*before, added) if widen else before)


def upgrade() -> None:
    """Apply this revision."""
    _set_checks(widen=True)
    op.create_index(
        "ix_task_runs_waiting_wake",
        "task_runs",
        ["not_before"],
        unique=False,
        postgresql_where=sa.text("status = 'WAITING'"),
        sqlite_where=sa.text("status = 'WAITING'"),
    )


def downgrade() -> None:
    """Revert this revision: a WAITING run becomes FAILED with its wake time kept (the earlier sweeper re-sends
    a FAILED run whose retry is due), and the `waiting` outcome counts are dropped (no older outcome means it)."""
    op.execute(
        "UPDATE task_runs SET status = 'FAILED', error = 'waiting for a model call (schema downgraded)' "
        "WHERE status = 'WAITING'"
    )
    op.execute("DELETE FROM delivery_outcomes WHERE outcome = 'waiting'")
    op.drop_index("ix_task_runs_waiting_wake", table_name="task_runs")
    _set_checks(widen=False)
