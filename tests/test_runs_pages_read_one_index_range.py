"""The Runs section's pages (oncelery.runs.browse): every filter pages through exactly its runs, newest first, and
on PostgreSQL a page reads a bounded stretch of an index, never the table (its plan, with the rows it read, on
200,000 runs).

4,000 runs of 3 tasks, 3 tenants, every status and outcome (taken-over, lost and retried runs rare, as in
production: their partial index stays small); the expected runs of each filter are computed here in
Python from the rows themselves (not from the module's own conditions), and the pages walked to the end with a small
page and a small window, so the window's continuation is walked too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, select, text

from oncelery.models import RunStatus
from oncelery.runs import browse
from oncelery.runs.browse import RunFilter, browse_runs, known_names
from oncelery.store.database import Database, get_engine
from oncelery.store.tables import RUNS
from tests.test_metrics import migrated_database

ROWS = 4_000
# The plans are judged on a table of a size where PostgreSQL's planner prefers an index to reading the table for
# any page (on 4,000 rows a hash join over the whole table is rightly cheaper; at 10^6: bench/flower_runs.py).
PLAN_ROWS = 200_000
PAGE = 25
WINDOW = 40
SERIES = "WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < {rows}) "
PG_SERIES = "WITH s(i) AS (SELECT generate_series(1, {rows})) "
FILL = (
    SERIES + "INSERT INTO task_runs (task_name, tenant, idempotency_key, fingerprint, field_digests, status, "
    "fencing_token, attempts, lost, retries, replays) SELECT 'bench.t' || (i % 3), "
    "CASE i % 4 WHEN 0 THEN 'acme' WHEN 1 THEN 'globex' ELSE '' END, 'k' || i, 'f', CAST('{}' AS JSON), "
    "CASE WHEN i % 101 = 0 THEN 'RUNNING' WHEN i % 50 = 0 THEN 'DEAD' WHEN i % 23 = 0 THEN 'FAILED' "
    "WHEN i % 17 = 0 THEN 'WAITING' ELSE 'COMPLETED' END, CASE WHEN i % 131 = 0 THEN 2 ELSE 1 END, 1, "
    "CASE WHEN i % 393 = 0 THEN 1 ELSE 0 END, CASE WHEN i % 262 = 0 THEN 1 ELSE 0 END, "
    "CASE WHEN i % 7 = 0 THEN 2 ELSE 0 END FROM s"
)
# What each outcome means, written again here from its definition (docs/flower.md), over a run's own row.
OUTCOME: dict[str, Callable[[Any], bool]] = {
    "executed": lambda r: r.status == "COMPLETED" and r.fencing_token == 1,
    "resumed": lambda r: r.status == "COMPLETED" and r.fencing_token > 1,
    "replayed": lambda r: r.replays > 0,
    "lost": lambda r: r.lost > 0,
    "retried": lambda r: r.retries > 0,
}
FILTERS = (
    RunFilter(),
    RunFilter(status=RunStatus.DEAD),
    RunFilter(status=RunStatus.WAITING),
    RunFilter(task_name="bench.t1"),
    RunFilter(task_name="bench.t2", status=RunStatus.FAILED),
    RunFilter(tenant="acme"),
    RunFilter(tenant="globex", status=RunStatus.RUNNING),
    RunFilter(task_name="bench.t0", tenant="acme"),
    *(RunFilter(outcome=name) for name in OUTCOME),
    RunFilter(task_name="bench.t1", outcome="lost"),
    RunFilter(task_name="bench.t2", tenant="globex", outcome="executed"),
    RunFilter(status=RunStatus.DEAD, outcome="executed"),
    RunFilter(task_name="nobody"),
)


def fill(store: str, tmp_path: Path, rows: int) -> Iterator[str]:
    """A migrated claims database holding `rows` runs (a SQLite file, or a new PostgreSQL database)."""
    for url in migrated_database(store, tmp_path):
        engine = get_engine(url)
        with engine.begin() as conn:
            fill_sql = FILL if store == "sqlite" else FILL.replace(SERIES, PG_SERIES)  # the same rows, sooner
            conn.execute(text(fill_sql.replace("{rows}", str(rows))))
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("ANALYZE"))  # the plans of a database that knows its sizes
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def filled(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """ROWS runs in a SQLite file or a PostgreSQL database of this test."""
    yield from fill(request.param, tmp_path, ROWS)


@pytest.fixture
def pg_filled(tmp_path: Path) -> Iterator[str]:
    """PLAN_ROWS runs in a PostgreSQL database of this test."""
    yield from fill("postgresql", tmp_path, PLAN_ROWS)


def expected(url: str, flt: RunFilter) -> list[int]:
    with get_engine(url).connect() as conn:
        rows = conn.execute(select(RUNS).order_by(RUNS.c.id.desc())).all()
    return [
        int(r.id)
        for r in rows
        if (flt.task_name is None or r.task_name == flt.task_name)
        and (flt.tenant is None or r.tenant == flt.tenant)
        and (flt.status is None or r.status == flt.status)
        and (flt.outcome is None or OUTCOME[flt.outcome](_Plain(r)))
    ]


class _Plain:
    def __init__(self, row: Any) -> None:
        self.status = row.status.value
        self.fencing_token, self.lost = row.fencing_token, row.lost
        self.retries, self.replays = row.retries, row.replays


def walk(db: Database, flt: RunFilter) -> list[int]:
    """Every page of `flt`, newest first, following next_before to the end."""
    seen: list[int] = []
    before = None
    for _ in range(ROWS):
        page = browse_runs(db, flt, before, PAGE)
        assert len(page.runs) <= PAGE
        seen += [r.run_id for r in page.runs]
        if page.next_before is None:
            return seen
        before = page.next_before
    raise AssertionError("the pages never ended")


def test_every_filter_pages_through_exactly_its_runs(filled: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(browse, "WINDOW", WINDOW)
    db = Database(filled)
    for flt in FILTERS:
        want = expected(filled, flt)
        assert walk(db, flt) == want, flt
    page = browse_runs(db, RunFilter(task_name="bench.t0", tenant="acme"), None, PAGE)
    assert page.runs[0].outcome in ("executed", "resumed", "running", "failed", "dead", "waiting")
    assert known_names(db) == ([], [])  # no delivery counted here (the fill wrote runs only)


def test_a_page_reads_a_bounded_stretch_of_an_index_on_postgresql(pg_filled: str) -> None:
    engine = get_engine(pg_filled)
    statements: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        statements.append((statement, parameters))

    db = Database(pg_filled)
    for flt in FILTERS:
        statements.clear()
        event.listen(engine, "before_cursor_execute", capture)
        try:
            browse_runs(db, flt, None, 50)
        finally:
            event.remove(engine, "before_cursor_execute", capture)
        # The module's table (docs): one range per status for a task or tenant without a status; a window when a
        # condition sits beside its index (an outcome, or a tenant beside a task); page lookups by id on top.
        ranges = len(RunStatus) if (flt.task_name or flt.tenant) and not (flt.status or flt.outcome) else 1
        per_range = browse.WINDOW if flt.outcome or (flt.task_name and flt.tenant) else 51
        # The planner may rightly prefer a stretch of the primary key, filtered, when the status is common (WAITING
        # is 1 in 17 here): never more than 1% of the table for that.
        bound = max((ranges + 1) * per_range, PLAN_ROWS // 100)
        with engine.connect() as conn:
            for statement, parameters in statements:
                plan = conn.exec_driver_sql("EXPLAIN (ANALYZE, FORMAT JSON) " + statement, parameters).scalar_one()
                scans = [n for n in _nodes(plan[0]["Plan"]) if n.get("Relation Name") == "task_runs"]
                kinds = {n["Node Type"] for n in scans}
                assert scans and not kinds & {"Seq Scan", "Bitmap Heap Scan"}, (flt, plan)
                # Rows a scan read: those it returned and those its filter removed, in every loop.
                read = sum((n["Actual Rows"] + n.get("Rows Removed by Filter", 0)) * n["Actual Loops"] for n in scans)
                assert read <= bound, (flt, read, bound, statement, plan)


def _nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _nodes(child)
