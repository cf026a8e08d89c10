"""scrape totals: runs FAILED/DEAD and dead letters counted by triggers, so a metrics scrape never scans them

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04 09:00:00

`run_status_totals` and `letter_totals` (models/totals.py) are kept by triggers on task_runs and dead_letters,
created here for PostgreSQL and SQLite, then backfilled from the rows already there. The triggers are created
before the backfill: on PostgreSQL, CREATE TRIGGER locks the table against writes until this transaction
commits, so no row is counted twice or missed; the backfill reads the FAILED/DEAD runs through their index and
every dead letter once (about a second at 1,000,000 letters).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

# -- PostgreSQL ------------------------------------------------------------------------------------------------
# Runs: row triggers whose WHEN lets a status write that changes no count (every claim, heartbeat and completion)
# queue nothing; production moves one run at a time. Deletes (retention, `dlq purge`) come in bulk: a statement
# trigger sums them, so no counter row is updated once per deleted run (in one transaction, each update of a
# row leaves a version the next one walks past: quadratic). Letters: statement triggers for every event, for the
# same reason (bulk purges, cascades). Sums are upserted in key order, so concurrent writers lock rows in order.

_UPSERT_RUNS = "ON CONFLICT (task_name, status, shard) DO UPDATE SET runs = t.runs + EXCLUDED.runs"
_UPSERT_LETTERS = (
    "ON CONFLICT (task_name, reason, shard) DO UPDATE "
    "SET letters = t.letters + EXCLUDED.letters, replayed = t.replayed + EXCLUDED.replayed"
)
_PG_RUNS = f"""
CREATE FUNCTION oncelery_run_status_totals() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        DELETE FROM run_status_totals;
    ELSIF TG_LEVEL = 'STATEMENT' THEN  -- DELETE, its rows in old_rows
        INSERT INTO run_status_totals AS t (task_name, status, shard, runs)
        SELECT task_name, status, id % 16, -COUNT(*) FROM old_rows WHERE status IN ('FAILED', 'DEAD')
        GROUP BY 1, 2, 3 ORDER BY 1, 2, 3 {_UPSERT_RUNS};
    ELSE
        IF TG_OP = 'UPDATE' AND OLD.status IN ('FAILED', 'DEAD') THEN
            INSERT INTO run_status_totals AS t (task_name, status, shard, runs)
            VALUES (OLD.task_name, OLD.status, OLD.id % 16, -1) {_UPSERT_RUNS};
        END IF;
        IF NEW.status IN ('FAILED', 'DEAD') THEN
            INSERT INTO run_status_totals AS t (task_name, status, shard, runs)
            VALUES (NEW.task_name, NEW.status, NEW.id % 16, 1) {_UPSERT_RUNS};
        END IF;
    END IF;
    RETURN NULL;
END
$$
"""


def _pg_letters(*sides: tuple[str, int]) -> str:
    # The net change of a statement's rows per key: +1 per row in new_rows, -1 per row in old_rows.
    rows = " UNION ALL ".join(
        f"SELECT task_name, reason, id % 16, {sign}, {sign} * (replayed_at IS NOT NULL)::int FROM {table}"
        for table, sign in sides
    )
    return (
        "INSERT INTO letter_totals AS t (task_name, reason, shard, letters, replayed) "
        f"SELECT task_name, reason, shard, SUM(n), SUM(r) FROM ({rows}) AS d (task_name, reason, shard, n, r) "
        f"GROUP BY 1, 2, 3 HAVING SUM(n) <> 0 OR SUM(r) <> 0 ORDER BY 1, 2, 3 {_UPSERT_LETTERS};"
    )


_PG_LETTERS = f"""
CREATE FUNCTION oncelery_letter_totals() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        DELETE FROM letter_totals;
    ELSIF TG_OP = 'INSERT' THEN
        {_pg_letters(("new_rows", 1))}
    ELSIF TG_OP = 'DELETE' THEN
        {_pg_letters(("old_rows", -1))}
    ELSE
        {_pg_letters(("new_rows", 1), ("old_rows", -1))}
    END IF;
    RETURN NULL;
END
$$
"""
# A status written unchanged (every completion sets status) evaluates the WHEN and queues nothing.
_COUNTED = "('FAILED', 'DEAD')"
_PG_RUN_STATUS_CHANGED = (
    f"(OLD.status IN {_COUNTED} OR NEW.status IN {_COUNTED}) "
    "AND (OLD.status IS DISTINCT FROM NEW.status OR OLD.task_name IS DISTINCT FROM NEW.task_name)"
)
_RUNS_FN = "EXECUTE FUNCTION oncelery_run_status_totals()"
_LETTERS_FN = "EXECUTE FUNCTION oncelery_letter_totals()"
_PG = (
    _PG_RUNS,
    _PG_LETTERS,
    "CREATE TRIGGER oncelery_run_status_totals_insert AFTER INSERT ON task_runs FOR EACH ROW "
    f"WHEN (NEW.status IN {_COUNTED}) {_RUNS_FN}",
    "CREATE TRIGGER oncelery_run_status_totals_update AFTER UPDATE OF status, task_name ON task_runs FOR EACH ROW "
    f"WHEN ({_PG_RUN_STATUS_CHANGED}) {_RUNS_FN}",
    "CREATE TRIGGER oncelery_run_status_totals_delete AFTER DELETE ON task_runs REFERENCING OLD TABLE AS old_rows "
    f"FOR EACH STATEMENT {_RUNS_FN}",
    f"CREATE TRIGGER oncelery_run_status_totals_truncate AFTER TRUNCATE ON task_runs FOR EACH STATEMENT {_RUNS_FN}",
    "CREATE TRIGGER oncelery_letter_totals_insert AFTER INSERT ON dead_letters REFERENCING NEW TABLE AS new_rows "
    f"FOR EACH STATEMENT {_LETTERS_FN}",
    "CREATE TRIGGER oncelery_letter_totals_update AFTER UPDATE ON dead_letters "
    f"REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT {_LETTERS_FN}",
    "CREATE TRIGGER oncelery_letter_totals_delete AFTER DELETE ON dead_letters REFERENCING OLD TABLE AS old_rows "
    f"FOR EACH STATEMENT {_LETTERS_FN}",
    f"CREATE TRIGGER oncelery_letter_totals_truncate AFTER TRUNCATE ON dead_letters FOR EACH STATEMENT {_LETTERS_FN}",
)
_PG_DROP = (
    "DROP TRIGGER IF EXISTS oncelery_run_status_totals_insert ON task_runs",
    "DROP TRIGGER IF EXISTS oncelery_run_status_totals_update ON task_runs",
    "DROP TRIGGER IF EXISTS oncelery_run_status_totals_delete ON task_runs",
    "DROP TRIGGER IF EXISTS oncelery_run_status_totals_truncate ON task_runs",
    "DROP TRIGGER IF EXISTS oncelery_letter_totals_insert ON dead_letters",
    "DROP TRIGGER IF EXISTS oncelery_letter_totals_update ON dead_letters",
    "DROP TRIGGER IF EXISTS oncelery_letter_totals_delete ON dead_letters",
    "DROP TRIGGER IF EXISTS oncelery_letter_totals_truncate ON dead_letters",
    "DROP FUNCTION IF EXISTS oncelery_run_status_totals()",
    "DROP FUNCTION IF EXISTS oncelery_letter_totals()",
)

# -- SQLite: the same counts, one trigger per event (no functions; UPSERT inside triggers since 3.24) ---------


def _sqlite_add_run(row: str, delta: int) -> str:
    # INSERT ... SELECT needs a WHERE before ON CONFLICT (SQLite's parsing rule); it also filters the status.
    return (
        "INSERT INTO run_status_totals (task_name, status, shard, runs) "
        f"SELECT {row}.task_name, {row}.status, {row}.id % 16, {delta} WHERE {row}.status IN {_COUNTED} "
        "ON CONFLICT (task_name, status, shard) DO UPDATE SET runs = runs + excluded.runs;"
    )


def _sqlite_add_letter(row: str, delta: int) -> str:
    return (
        "INSERT INTO letter_totals (task_name, reason, shard, letters, replayed) "
        f"VALUES ({row}.task_name, {row}.reason, {row}.id % 16, {delta}, "
        f"{delta} * ({row}.replayed_at IS NOT NULL)) "
        "ON CONFLICT (task_name, reason, shard) DO UPDATE "
        "SET letters = letters + excluded.letters, replayed = replayed + excluded.replayed;"
    )


_SQLITE_RUN_STATUS_CHANGED = (
    f"(OLD.status IN {_COUNTED} OR NEW.status IN {_COUNTED}) "
    "AND (OLD.status IS NOT NEW.status OR OLD.task_name IS NOT NEW.task_name)"
)
_SQLITE_LETTER_CHANGED = (
    "OLD.task_name IS NOT NEW.task_name OR OLD.reason IS NOT NEW.reason "
    "OR (OLD.replayed_at IS NULL) <> (NEW.replayed_at IS NULL)"
)
_SQLITE = (
    "CREATE TRIGGER oncelery_run_status_totals_insert AFTER INSERT ON task_runs "
    f"WHEN NEW.status IN {_COUNTED} BEGIN {_sqlite_add_run('NEW', 1)} END",
    "CREATE TRIGGER oncelery_run_status_totals_update AFTER UPDATE OF status, task_name ON task_runs "
    f"WHEN {_SQLITE_RUN_STATUS_CHANGED} BEGIN {_sqlite_add_run('OLD', -1)} {_sqlite_add_run('NEW', 1)} END",
    "CREATE TRIGGER oncelery_run_status_totals_delete AFTER DELETE ON task_runs "
    f"WHEN OLD.status IN {_COUNTED} BEGIN {_sqlite_add_run('OLD', -1)} END",
    "CREATE TRIGGER oncelery_letter_totals_insert AFTER INSERT ON dead_letters "
    f"BEGIN {_sqlite_add_letter('NEW', 1)} END",
    "CREATE TRIGGER oncelery_letter_totals_update AFTER UPDATE OF task_name, reason, replayed_at ON dead_letters "
    f"WHEN {_SQLITE_LETTER_CHANGED} BEGIN {_sqlite_add_letter('OLD', -1)} {_sqlite_add_letter('NEW', 1)} END",
    "CREATE TRIGGER oncelery_letter_totals_delete AFTER DELETE ON dead_letters "
    f"BEGIN {_sqlite_add_letter('OLD', -1)} END",
)
_SQLITE_DROP = tuple(
    f"DROP TRIGGER IF EXISTS {name}"
    for name in (
        "oncelery_run_status_totals_insert",
        "oncelery_run_status_totals_update",
        "oncelery_run_status_totals_delete",
        "oncelery_letter_totals_insert",
        "oncelery_letter_totals_update",
        "oncelery_letter_totals_delete",
    )
)
_CREATE = {"postgresql": _PG, "sqlite": _SQLITE}
_DROP = {"postgresql": _PG_DROP, "sqlite": _SQLITE_DROP}

_BACKFILL = (
    "INSERT INTO run_status_totals (task_name, status, shard, runs) "
    f"SELECT task_name, status, id % 16, COUNT(*) FROM task_runs WHERE status IN {_COUNTED} "
    "GROUP BY task_name, status, id % 16",
    "INSERT INTO letter_totals (task_name, reason, shard, letters, replayed) "
    "SELECT task_name, reason, id % 16, COUNT(*), COUNT(replayed_at) FROM dead_letters "
    "GROUP BY task_name, reason, id % 16",
)


def upgrade() -> None:
    """Create the totals tables and their triggers, then count the rows already there."""
    op.create_table(
        "run_status_totals",
        sa.Column("task_name", sa.String(length=255), nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                "RUNNING",
                "COMPLETED",
                "FAILED",
                "DEAD",
                name="run_status",
                native_enum=False,
                create_constraint=True,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("shard", sa.Integer(), nullable=False),
        sa.Column("runs", sa.BigInteger(), server_default="0", nullable=False),
        sa.PrimaryKeyConstraint("task_name", "status", "shard", name=op.f("pk_run_status_totals")),
    )
    op.create_table(
        "letter_totals",
        sa.Column("task_name", sa.String(length=255), nullable=False),
        sa.Column("reason", sa.String(length=32), nullable=False),
        sa.Column("shard", sa.Integer(), nullable=False),
        sa.Column("letters", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("replayed", sa.BigInteger(), server_default="0", nullable=False),
        sa.PrimaryKeyConstraint("task_name", "reason", "shard", name=op.f("pk_letter_totals")),
    )
    for statement in (*_CREATE[op.get_bind().dialect.name], *_BACKFILL):
        op.execute(statement)


def downgrade() -> None:
    """Revert this revision (the triggers and totals go; the rows they counted stay)."""
    for statement in _DROP[op.get_bind().dialect.name]:
        op.execute(statement)
    op.drop_table("letter_totals")
    op.drop_table("run_status_totals")
