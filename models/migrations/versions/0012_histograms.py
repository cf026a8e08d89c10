"""histograms and letters created: histogram_buckets kept by triggers, step_results.seconds, letter_totals.created

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01 19:00:00

The exporter reads the database at scrape time, so a histogram is a table of bucket counters written with what
it measures (models/totals.py): triggers on task_runs (a run's first claim to COMPLETED), step_results (the
step's seconds, a new nullable column the holder writes with its checkpoint) and model_calls (latency_ms). The
wait of a duplicate for a live holder has no row of its own: the delivery that ends the wait writes its bucket
(oncelery.runs.waits). `letter_totals.created` counts letters ever inserted; unlike `letters` no delete, purge
or TRUNCATE lowers it, so `oncelery_dead_letters_created_total` is a counter.

The bucket bounds are frozen here (a later change of models.totals.HISTOGRAMS is a new migration). The triggers
are created before the backfill (PostgreSQL's CREATE TRIGGER blocks writes to the table until this commits):
completed runs and model calls already there are counted once, in one read of each table (a few seconds at
1,000,000 runs); steps checkpointed before this revision have no duration and are not counted. Only ADD COLUMN
on SQLite: no table is rebuilt, so the triggers of 0009 stay.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

_BOUNDS = {
    "run_duration": (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
    "step_duration": (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
    "llm_call_duration": (0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300),
}
_KEY = "(family, task_name, tenant, label, bucket, shard)"
_COLUMNS = "(family, task_name, tenant, label, bucket, shard, count, total)"


def _bucket(family: str, seconds: str) -> str:
    # The first bucket whose upper bound the value does not exceed (Prometheus' `le`), else +Inf (len(bounds)).
    bounds = _BOUNDS[family]
    whens = " ".join(f"WHEN {seconds} <= {bound} THEN {i}" for i, bound in enumerate(bounds))
    return f"CASE {whens} ELSE {len(bounds)} END"


# -- PostgreSQL: a row trigger per completion or checkpoint (one upsert of a bucket counter), a statement one per
#    insert of model calls -----------------------------------------------------------------------------------

_PG_UPSERT = f"ON CONFLICT {_KEY} DO UPDATE SET count = h.count + 1, total = h.total + EXCLUDED.total"


def _pg_function(name: str, seconds: str, insert: str) -> str:
    return f"""
CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    s double precision;
BEGIN
    s := GREATEST(0, {seconds});
    {insert} {_PG_UPSERT};
    RETURN NULL;
END
$$
"""


_PG_RUN = _pg_function(
    "oncelery_histogram_run_duration",
    "EXTRACT(EPOCH FROM (COALESCE(NEW.finished_at, clock_timestamp()) - NEW.created_at))",
    f"INSERT INTO histogram_buckets AS h {_COLUMNS} VALUES ('run_duration', NEW.task_name, NEW.tenant, '', "
    f"{_bucket('run_duration', 's')}, NEW.id % 16, 1, s)",
)
_PG_STEP = _pg_function(
    "oncelery_histogram_step_duration",
    "NEW.seconds",
    f"INSERT INTO histogram_buckets AS h {_COLUMNS} SELECT 'step_duration', r.task_name, r.tenant, '', "
    f"{_bucket('step_duration', 's')}, NEW.id % 16, 1, s FROM task_runs r WHERE r.id = NEW.run_id",
)
# Model calls: a statement trigger summing its rows per bucket. Calls are written one per transaction, but a
# spool replay or an import inserts many in one statement: a row trigger would then update the same bucket row
# once per call within one transaction (each update leaving a version the next walks past: quadratic).
_PG_CALL_SECONDS = "GREATEST(0, latency_ms / 1000.0)"
_PG_CALL = f"""
CREATE FUNCTION oncelery_histogram_llm_call_duration() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO histogram_buckets AS h {_COLUMNS}
    SELECT 'llm_call_duration', task, tenant, model, bucket, shard, COUNT(*), SUM(s) FROM (
        SELECT COALESCE(task_name, '') AS task, tenant, model, {_bucket("llm_call_duration", _PG_CALL_SECONDS)}
               AS bucket, id % 16 AS shard, {_PG_CALL_SECONDS} AS s FROM new_rows
    ) AS calls GROUP BY 2, 3, 4, 5, 6 ORDER BY 2, 3, 4, 5, 6
    ON CONFLICT {_KEY} DO UPDATE SET count = h.count + EXCLUDED.count, total = h.total + EXCLUDED.total;
    RETURN NULL;
END
$$
"""

# Letters: as 0009's function, plus `created` (+1 per inserted row); a TRUNCATE zeroes the kept counts only.


def _pg_letters(*sides: tuple[str, int], created: int | None) -> str:
    # created=None: 0009's statement (no `created` column), which the downgrade restores.
    extra = "" if created is None else f", {created}"
    rows = " UNION ALL ".join(
        f"SELECT task_name, reason, id % 16, {sign}, {sign} * (replayed_at IS NOT NULL)::int{extra} FROM {table}"
        for table, sign in sides
    )
    if created is None:
        columns, sums, names, having, more = "", "", "", "", ""
    else:
        columns, sums, names = ", created", ", SUM(c)", ", c"
        having, more = " OR SUM(c) <> 0", ", created = t.created + EXCLUDED.created"
    return (
        f"INSERT INTO letter_totals AS t (task_name, reason, shard, letters, replayed{columns}) "
        f"SELECT task_name, reason, shard, SUM(n), SUM(r){sums} FROM ({rows}) AS d (task_name, reason, shard, n, r"
        f"{names}) GROUP BY 1, 2, 3 HAVING SUM(n) <> 0 OR SUM(r) <> 0{having} ORDER BY 1, 2, 3 "
        "ON CONFLICT (task_name, reason, shard) DO UPDATE SET letters = t.letters + EXCLUDED.letters, "
        f"replayed = t.replayed + EXCLUDED.replayed{more};"
    )


def _pg_letters_function(created: bool) -> str:
    # 0009 emptied the totals on TRUNCATE; now the kept counts go to 0 and `created` stays (a counter).
    truncate = "UPDATE letter_totals SET letters = 0, replayed = 0" if created else "DELETE FROM letter_totals"
    inserted = 1 if created else None
    return f"""
CREATE OR REPLACE FUNCTION oncelery_letter_totals() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        {truncate};
    ELSIF TG_OP = 'INSERT' THEN
        {_pg_letters(("new_rows", 1), created=inserted)}
    ELSIF TG_OP = 'DELETE' THEN
        {_pg_letters(("old_rows", -1), created=0 if created else None)}
    ELSE
        {_pg_letters(("new_rows", 1), ("old_rows", -1), created=0 if created else None)}
    END IF;
    RETURN NULL;
END
$$
"""


_PG_LETTERS = _pg_letters_function(created=True)
_PG_LETTERS_0009 = _pg_letters_function(created=False)

_PG = (
    _PG_RUN,
    _PG_STEP,
    _PG_CALL,
    _PG_LETTERS,
    # Every completion evaluates this WHEN; only a status change to COMPLETED runs the function.
    "CREATE TRIGGER oncelery_histogram_run_duration AFTER UPDATE OF status ON task_runs FOR EACH ROW "
    "WHEN (NEW.status = 'COMPLETED' AND OLD.status IS DISTINCT FROM NEW.status) "
    "EXECUTE FUNCTION oncelery_histogram_run_duration()",
    "CREATE TRIGGER oncelery_histogram_step_duration AFTER INSERT OR UPDATE OF seconds ON step_results "
    "FOR EACH ROW WHEN (NEW.seconds IS NOT NULL) EXECUTE FUNCTION oncelery_histogram_step_duration()",
    "CREATE TRIGGER oncelery_histogram_llm_call_duration AFTER INSERT ON model_calls "
    "REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION oncelery_histogram_llm_call_duration()",
)
_PG_DROP = (
    "DROP TRIGGER IF EXISTS oncelery_histogram_run_duration ON task_runs",
    "DROP TRIGGER IF EXISTS oncelery_histogram_step_duration ON step_results",
    "DROP TRIGGER IF EXISTS oncelery_histogram_llm_call_duration ON model_calls",
    "DROP FUNCTION IF EXISTS oncelery_histogram_run_duration()",
    "DROP FUNCTION IF EXISTS oncelery_histogram_step_duration()",
    "DROP FUNCTION IF EXISTS oncelery_histogram_llm_call_duration()",
)

# -- SQLite: the same upserts inside the triggers (INSERT ... SELECT needs a WHERE before ON CONFLICT) ---------

_SQLITE_UPSERT = f"ON CONFLICT {_KEY} DO UPDATE SET count = count + 1, total = total + excluded.total;"


def _sqlite_observe(family: str, task: str, tenant: str, label: str, seconds: str, source: str) -> str:
    s = f"MAX(0, {seconds})"
    return (
        f"INSERT INTO histogram_buckets {_COLUMNS} SELECT '{family}', {task}, {tenant}, {label}, "
        f"{_bucket(family, s)}, NEW.id % 16, 1, {s} {source} {_SQLITE_UPSERT}"
    )


_SQLITE_STEP = _sqlite_observe(
    "step_duration", "r.task_name", "r.tenant", "''", "NEW.seconds", "FROM task_runs r WHERE r.id = NEW.run_id"
)
_SQLITE = (
    "CREATE TRIGGER oncelery_histogram_run_duration AFTER UPDATE OF status ON task_runs "
    "WHEN NEW.status = 'COMPLETED' AND OLD.status IS NOT NEW.status BEGIN "
    + _sqlite_observe(
        "run_duration",
        "NEW.task_name",
        "NEW.tenant",
        "''",
        "(julianday(COALESCE(NEW.finished_at, strftime('%Y-%m-%d %H:%M:%f', 'now'))) - julianday(NEW.created_at))"
        " * 86400.0",
        "WHERE true",
    )
    + " END",
    f"CREATE TRIGGER oncelery_histogram_step_insert AFTER INSERT ON step_results WHEN NEW.seconds IS NOT NULL "
    f"BEGIN {_SQLITE_STEP} END",
    f"CREATE TRIGGER oncelery_histogram_step_update AFTER UPDATE OF seconds ON step_results "
    f"WHEN NEW.seconds IS NOT NULL BEGIN {_SQLITE_STEP} END",
    "CREATE TRIGGER oncelery_histogram_llm_call_duration AFTER INSERT ON model_calls BEGIN "
    + _sqlite_observe(
        "llm_call_duration",
        "COALESCE(NEW.task_name, '')",
        "NEW.tenant",
        "NEW.model",
        "NEW.latency_ms / 1000.0",
        "WHERE true",
    )
    + " END",
    # Letters: 0009's insert trigger, plus `created`.
    "DROP TRIGGER oncelery_letter_totals_insert",
    "CREATE TRIGGER oncelery_letter_totals_insert AFTER INSERT ON dead_letters BEGIN "
    "INSERT INTO letter_totals (task_name, reason, shard, letters, replayed, created) "
    "VALUES (NEW.task_name, NEW.reason, NEW.id % 16, 1, (NEW.replayed_at IS NOT NULL), 1) "
    "ON CONFLICT (task_name, reason, shard) DO UPDATE SET letters = letters + excluded.letters, "
    "replayed = replayed + excluded.replayed, created = created + excluded.created; END",
)
_SQLITE_DROP = (
    "DROP TRIGGER IF EXISTS oncelery_histogram_run_duration",
    "DROP TRIGGER IF EXISTS oncelery_histogram_step_insert",
    "DROP TRIGGER IF EXISTS oncelery_histogram_step_update",
    "DROP TRIGGER IF EXISTS oncelery_histogram_llm_call_duration",
    "DROP TRIGGER IF EXISTS oncelery_letter_totals_insert",
    "CREATE TRIGGER oncelery_letter_totals_insert AFTER INSERT ON dead_letters BEGIN "
    "INSERT INTO letter_totals (task_name, reason, shard, letters, replayed) "
    "VALUES (NEW.task_name, NEW.reason, NEW.id % 16, 1, (NEW.replayed_at IS NOT NULL)) "
    "ON CONFLICT (task_name, reason, shard) DO UPDATE "
    "SET letters = letters + excluded.letters, replayed = replayed + excluded.replayed; END",
)
_CREATE = {"postgresql": _PG, "sqlite": _SQLITE}
_DROP = {"postgresql": (*_PG_DROP, _PG_LETTERS_0009), "sqlite": _SQLITE_DROP}

_RUN_SECONDS = {
    "postgresql": "GREATEST(0, EXTRACT(EPOCH FROM (finished_at - created_at)))",
    "sqlite": "MAX(0, (julianday(finished_at) - julianday(created_at)) * 86400.0)",
}
_CALL_SECONDS = {"postgresql": "GREATEST(0, latency_ms / 1000.0)", "sqlite": "MAX(0, latency_ms / 1000.0)"}


def _backfill(dialect: str) -> tuple[str, ...]:
    run, call = _RUN_SECONDS[dialect], _CALL_SECONDS[dialect]
    return (
        f"INSERT INTO histogram_buckets {_COLUMNS} SELECT 'run_duration', task_name, tenant, '', "
        f"{_bucket('run_duration', run)}, id % 16, COUNT(*), SUM({run}) FROM task_runs "
        "WHERE status = 'COMPLETED' AND finished_at IS NOT NULL GROUP BY 2, 3, 5, 6",
        f"INSERT INTO histogram_buckets {_COLUMNS} SELECT 'llm_call_duration', COALESCE(task_name, ''), tenant, "
        f"model, {_bucket('llm_call_duration', call)}, id % 16, COUNT(*), SUM({call}) FROM model_calls "
        "GROUP BY 2, 3, 4, 5, 6",
        "UPDATE letter_totals SET created = letters",
    )


def upgrade() -> None:
    """Create histogram_buckets, the step seconds and letters-created columns, the triggers, then backfill."""
    op.create_table(
        "histogram_buckets",
        sa.Column("family", sa.String(length=32), nullable=False),
        sa.Column("task_name", sa.String(length=255), nullable=False),
        sa.Column("tenant", sa.String(length=255), nullable=False),
        sa.Column("label", sa.String(length=255), nullable=False),
        sa.Column("bucket", sa.Integer(), nullable=False),
        sa.Column("shard", sa.Integer(), nullable=False),
        sa.Column("count", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("total", sa.Float(), server_default="0", nullable=False),
        sa.PrimaryKeyConstraint(
            "family", "task_name", "tenant", "label", "bucket", "shard", name=op.f("pk_histogram_buckets")
        ),
    )
    op.add_column("step_results", sa.Column("seconds", sa.Float(), nullable=True))
    op.add_column("letter_totals", sa.Column("created", sa.BigInteger(), server_default="0", nullable=False))
    dialect = op.get_bind().dialect.name
    for statement in (*_CREATE[dialect], *_backfill(dialect)):
        op.execute(statement)


def downgrade() -> None:
    """Revert this revision (the triggers and buckets go; 0009's letter trigger is restored)."""
    for statement in _DROP[op.get_bind().dialect.name]:
        op.execute(statement)
    # ALTER TABLE DROP COLUMN on both (SQLite >= 3.35): a batch copy of letter_totals could not be renamed back
    # while 0009's triggers name it, and one of step_results would drop nothing but time.
    op.execute("ALTER TABLE letter_totals DROP COLUMN created")
    op.execute("ALTER TABLE step_results DROP COLUMN seconds")
    op.drop_table("histogram_buckets")
