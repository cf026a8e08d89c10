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

import re

import sqlalchemy as sa
from alembic import op

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


def _in_list(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN (" + ", ".join(f"'{v}'" for v in values) + ")"


def _set_checks(widen: bool) -> None:
    bind = op.get_bind()
    if bind.dialect.name == "sqlite":
        _sqlite_set_checks(bind, widen)
        return
    for table, name, column, before, added in _CHECKS:
        values = (*before, added) if widen else before
        op.drop_constraint(op.f(name), table, type_="check")
        op.create_check_constraint(op.f(name), table, _in_list(column, values))


def _sqlite_set_checks(bind: sa.Connection, widen: bool) -> None:
    """Rewrite each CHECK's IN list in sqlite_master (see the module's docstring for why not a rebuild)."""
    version = bind.exec_driver_sql("PRAGMA schema_version").scalar_one()
    bind.exec_driver_sql("PRAGMA writable_schema=ON")
    try:
        for table, name, column, before, added in _CHECKS:
            sql = bind.exec_driver_sql(
                "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
            ).scalar_one()
            values = (*before, added) if widen else before
            pattern = re.compile(rf"CONSTRAINT {name} CHECK \({column} IN \([^)]*\)\)")
            new, count = pattern.subn(f"CONSTRAINT {name} CHECK ({_in_list(column, values)})", sql)
            if count != 1:
                raise RuntimeError(f"{table}: constraint {name} not found as expected in its schema: {sql}")
            bind.exec_driver_sql("UPDATE sqlite_master SET sql = ? WHERE type = 'table' AND name = ?", (new, table))
        bind.exec_driver_sql(f"PRAGMA schema_version={int(version) + 1}")
    finally:
        bind.exec_driver_sql("PRAGMA writable_schema=OFF")
    problems = bind.exec_driver_sql("PRAGMA quick_check").scalars().all()
    if problems != ["ok"]:
        raise RuntimeError(f"SQLite schema check failed after the CHECK change: {problems}")


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
