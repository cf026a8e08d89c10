"""A scrape reads no table that grows with the runs: the plans of its queries on 20,000 runs, letters, steps,
outbox rows and model calls, and the totals triggers keep instead of counting FAILED/DEAD runs and dead letters
(exact after every kind of write, and after the upgrade that creates them), on SQLite and PostgreSQL.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, text

from oncelery.models.migrate import downgrade
from oncelery.ops.metrics import ClaimsCollector
from oncelery.store.database import Database, get_engine
from oncelery.store.schema import upgrade_schema
from tests.test_metrics import Samples, migrated_database, scrape

ROWS = 20_000
RUNNING = ROWS // 1000
PENDING = 10
# Every table here holds ROWS rows or more; a scrape may read the RUNNING runs, their steps and the PENDING
# outbox rows (a few per run), never a table's worth: the old FAILED/DEAD count alone read 4,000 rows.
GROWING = ("task_runs", "step_results", "dead_letters", "model_calls", "outbox")
MAX_ROWS_READ = 10 * RUNNING + 2 * PENDING
SERIES = f"WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < {ROWS}) "
_STATUS = "CASE WHEN i % 1000 = 0 THEN 'RUNNING' WHEN i % 10 = 1 THEN 'FAILED' WHEN i % 10 = 2 THEN 'DEAD' "
_STATUS += "ELSE 'COMPLETED' END"
FILL = (
    SERIES + "INSERT INTO task_runs (task_name, tenant, idempotency_key, fingerprint, field_digests, status, "
    "fencing_token, attempts, lease_expires_at) SELECT 'bench.t' || (i % 5), '', 'k' || i, 'f', "
    f"CAST('{{}}' AS JSON), {_STATUS}, 2, 1, CURRENT_TIMESTAMP FROM s",
    "INSERT INTO step_results (run_id, position, step_name, token) SELECT r.id, p.n, 'step', 1 FROM task_runs r, "
    "(SELECT 1 AS n UNION ALL SELECT 2 UNION ALL SELECT 3) p WHERE r.id % 5 = 0 OR r.status = 'RUNNING'",
    SERIES + "INSERT INTO dead_letters (task_name, tenant, reason, attempts, replayed_at) "
    "SELECT 'bench.t' || (i % 5), '', 'conflict', 1, CASE WHEN i % 2 = 0 THEN CURRENT_TIMESTAMP END FROM s",
    SERIES + "INSERT INTO outbox (task_name, args, kwargs, options, celery_task_id, tenant, status) "
    "SELECT 'bench.t', CAST('[]' AS JSON), CAST('{}' AS JSON), CAST('{}' AS JSON), 'c' || i, '', "
    f"CASE WHEN i <= {PENDING} THEN 'PENDING' ELSE 'DONE' END FROM s",
    SERIES + "INSERT INTO model_calls (task_name, tenant, model, input_tokens, output_tokens, latency_ms, ok) "
    "SELECT 'bench.t', '', 'gpt-x', 10, 1, 1.0, TRUE FROM s",
)


@pytest.fixture(params=["sqlite", "postgresql"])
def metrics_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A migrated claims database of this test alone: a SQLite file, or a new PostgreSQL `metrics_*` database."""
    yield from migrated_database(request.param, tmp_path)


def _fill(url: str) -> None:
    engine = get_engine(url)
    with engine.begin() as conn:
        for statement in FILL:
            conn.execute(text(statement))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("ANALYZE"))  # the plans of a database that knows its sizes


def _scrape_statements(url: str) -> list[tuple[str, Any]]:
    """Every statement one scrape sends, with its parameters."""
    sent: list[tuple[str, Any]] = []

    def capture(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        sent.append((statement, parameters))

    collector = ClaimsCollector(url)
    event.listen(collector.db.read_engine, "before_cursor_execute", capture)
    try:
        families = list(collector.collect())
    finally:
        event.remove(collector.db.read_engine, "before_cursor_execute", capture)
    assert families[0].samples[0].value == 1  # oncelery_database_up: the scrape read the database
    return [(s, p) for s, p in sent if s.lstrip().upper().startswith("SELECT")]


_NODE = re.compile(r" on (\w+)(?: \w+)?\s+\(.*actual time=\S+ rows=(\d+) loops=(\d+)\)")
_REMOVED = re.compile(r"Rows Removed by (?:Filter|Index Recheck): (\d+)")


def rows_read(plan: list[str]) -> dict[str, int]:
    """Rows each growing table gave a PostgreSQL EXPLAIN ANALYZE plan: returned plus filtered out, x loops."""
    read: dict[str, int] = {}
    table, loops = "", 1
    for line in plan:
        node = _NODE.search(line)
        if node is not None:
            table, loops = node.group(1), int(node.group(3))
            if table in GROWING:
                read[table] = read.get(table, 0) + int(node.group(2)) * loops
            continue
        removed = _REMOVED.search(line)
        if removed is not None and table in GROWING:
            read[table] = read.get(table, 0) + int(removed.group(1)) * loops
    return read


def _pg_plans(url: str) -> dict[str, list[str]]:
    plans = {}
    with Database(url).read_engine.connect() as conn:
        for statement, parameters in _scrape_statements(url):
            plans[statement] = [r[0] for r in conn.exec_driver_sql("EXPLAIN ANALYZE " + statement, parameters)]
    return plans


def _sqlite_plans(url: str) -> dict[str, list[str]]:
    plans = {}
    with Database(url).read_engine.connect() as conn:
        for statement, parameters in _scrape_statements(url):
            plans[statement] = [r[-1] for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, parameters)]
    return plans


def test_a_scrape_reads_no_table_that_grows_with_the_runs(metrics_url: str) -> None:
    """On 20,000 runs (4,000 FAILED or DEAD), letters, steps, outbox rows and model calls, every query of a scrape
    reads the RUNNING runs, their steps, the PENDING outbox rows and small totals tables only.

    PostgreSQL: EXPLAIN ANALYZE, rows read per growing table (returned + filtered out). SQLite, whose plans
    carry no row counts: no full SCAN of a growing table, and none of dead_letters or model_calls at all."""
    _fill(metrics_url)
    if metrics_url.startswith("postgresql"):
        for statement, plan in _pg_plans(metrics_url).items():
            shown = "\n".join([statement, *plan])
            assert not any("Seq Scan on" in line and any(t in line for t in GROWING) for line in plan), shown
            assert sum(rows_read(plan).values()) <= MAX_ROWS_READ, shown
        return
    for statement, plan in _sqlite_plans(metrics_url).items():
        shown = "\n".join([statement, *plan])
        for line in plan:
            assert "dead_letters" not in line and "model_calls" not in line, shown
            assert not re.match(rf"SCAN ({'|'.join(GROWING)})\b", line), shown
        # Only RUNNING or WAITING runs (the work in flight, the runs parked now), each by an index on its status.
        bounded = ("'RUNNING'", "'WAITING'")
        assert "task_runs" not in statement or any(status in statement for status in bounded), shown
        if "'WAITING'" in statement:
            assert any("USING INDEX" in line and "status" in line for line in plan), shown


# -- the totals the triggers keep -----------------------------------------------------------------------------


def counted(url: str) -> Samples:
    """The FAILED/DEAD runs and dead letters as the rows say (GROUP BY): what the scrape must report."""
    want: Samples = {}
    with Database(url).begin() as conn:
        runs = conn.execute(
            text(
                "SELECT task_name, status, COUNT(*) FROM task_runs WHERE status IN ('FAILED', 'DEAD') "
                "GROUP BY task_name, status"
            )
        )
        for task, status, n in runs:
            want["oncelery_runs", (("name", task), ("status", status))] = n
        letters = text("SELECT task_name, reason, COUNT(*), COUNT(replayed_at) FROM dead_letters GROUP BY 1, 2")
        for task, reason, n, replayed in conn.execute(letters):
            want["oncelery_dead_letters", (("name", task), ("reason", reason))] = n
            want["oncelery_dead_letters_replayed", (("name", task), ("reason", reason))] = replayed
    return {key: value for key, value in want.items() if value}


def reported(url: str) -> Samples:
    """The same series as one scrape reports them (a total that fell to 0 is left out, as GROUP BY does)."""
    names = ("oncelery_runs", "oncelery_dead_letters", "oncelery_dead_letters_replayed")
    got = scrape(url)
    return {
        (name, labels): value
        for (name, labels), value in got.items()
        if name in names and value and ("status", "RUNNING") not in labels
    }


def _run(conn: Any, key: str, status: str, task: str = "t.a") -> int:
    row = {"t": task, "k": key, "s": status}
    conn.execute(
        text(
            "INSERT INTO task_runs (task_name, tenant, idempotency_key, fingerprint, field_digests, status, "
            "fencing_token, attempts) VALUES (:t, '', :k, 'f', '{}', :s, 1, 1)"
        ),
        row,
    )
    return int(conn.execute(text("SELECT id FROM task_runs WHERE idempotency_key = :k"), row).scalar_one())


def _letter(conn: Any, run_id: int | None, reason: str, task: str = "t.a") -> None:
    conn.execute(
        text("INSERT INTO dead_letters (run_id, task_name, tenant, reason, attempts) VALUES (:r, :t, '', :why, 1)"),
        {"r": run_id, "t": task, "why": reason},
    )


def _writes() -> list[tuple[str, ...]]:
    """Each phase: what production does to runs and letters (claims, fails, kills, replays, purges)."""
    return [
        ("UPDATE task_runs SET status = 'FAILED' WHERE idempotency_key IN ('r1', 'r2')",),  # bodies raised
        ("UPDATE task_runs SET status = 'RUNNING' WHERE idempotency_key = 'r1'",),  # a retry took it over
        ("UPDATE task_runs SET status = 'DEAD' WHERE idempotency_key = 'r2'",),  # retries exhausted
        ("UPDATE task_runs SET status = 'COMPLETED' WHERE idempotency_key = 'r1'",),  # and completed
        ("UPDATE task_runs SET status = status",),  # every status written unchanged: counts nothing
        ("UPDATE dead_letters SET replayed_at = CURRENT_TIMESTAMP, replays = replays + 1 WHERE reason = 'dead'",),
        ("UPDATE task_runs SET status = 'FAILED' WHERE idempotency_key = 'd1'",),  # dlq replay: DEAD -> FAILED
        ("DELETE FROM dead_letters WHERE reason = 'conflict'",),  # letters purged
        ("DELETE FROM task_runs WHERE idempotency_key = 'd2'",),  # a run purged: its letter goes by cascade
        ("DELETE FROM task_runs WHERE status = 'COMPLETED'",),  # retention: COMPLETED runs count nothing
    ]


def test_the_totals_follow_every_write(metrics_url: str) -> None:
    """Inserted, moved between statuses, replayed, purged, deleted by a cascade: after each write the scrape
    reports exactly what a GROUP BY of the rows gives (and nothing after a TRUNCATE on PostgreSQL)."""
    with Database(metrics_url).begin() as conn:
        for key in ("r1", "r2", "c1"):
            _run(conn, key, "RUNNING" if key != "c1" else "COMPLETED")
        for key in ("d1", "d2"):
            _letter(conn, _run(conn, key, "DEAD", task="t.b"), "dead", task="t.b")
        _letter(conn, None, "conflict")
        _letter(conn, None, "conflict", task="t.b")
    assert reported(metrics_url) == counted(metrics_url) != {}
    for phase in _writes():
        with Database(metrics_url).begin() as conn:
            for statement in phase:
                conn.execute(text(statement))
        assert reported(metrics_url) == counted(metrics_url), phase
    # r2 died; d1 was replayed (FAILED), d2 purged with its letter; the conflict letters purged.
    assert reported(metrics_url) == {
        ("oncelery_runs", (("name", "t.a"), ("status", "DEAD"))): 1,
        ("oncelery_runs", (("name", "t.b"), ("status", "FAILED"))): 1,
        ("oncelery_dead_letters", (("name", "t.b"), ("reason", "dead"))): 1,
        ("oncelery_dead_letters_replayed", (("name", "t.b"), ("reason", "dead"))): 1,
    }
    if metrics_url.startswith("postgresql"):
        with Database(metrics_url).begin() as conn:
            conn.execute(text("TRUNCATE task_runs, dead_letters RESTART IDENTITY CASCADE"))
        assert reported(metrics_url) == counted(metrics_url) == {}


def test_the_upgrade_counts_the_rows_already_there(metrics_url: str) -> None:
    """A database at 0008 with FAILED and DEAD runs and letters: after `db upgrade` the scrape reports them
    (the backfill), and the triggers count the next write."""
    engine = get_engine(metrics_url)
    downgrade(engine, "0008")
    with engine.begin() as conn:
        _run(conn, "f1", "FAILED")
        _letter(conn, _run(conn, "x1", "DEAD"), "retries_exhausted")
        for task in ("t.a", "t.b", "t.b"):
            _letter(conn, None, "conflict", task=task)
        conn.execute(text("UPDATE dead_letters SET replayed_at = CURRENT_TIMESTAMP WHERE task_name = 't.b'"))
    upgrade_schema(metrics_url)
    want = counted(metrics_url)
    assert reported(metrics_url) == want and want["oncelery_dead_letters", (("name", "t.b"), ("reason", "conflict"))]
    with engine.begin() as conn:
        conn.execute(text("UPDATE task_runs SET status = 'DEAD' WHERE idempotency_key = 'f1'"))
    assert reported(metrics_url)["oncelery_runs", (("name", "t.a"), ("status", "DEAD"))] == 2
