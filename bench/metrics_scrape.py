"""Benchmark: what one `oncelery metrics` scrape costs on 1,000,000 runs and 1,000,000 dead letters.

Run: python bench/metrics_scrape.py [--admin-url URL] [--runs 1000000] [--letters 1000000] [--scrapes 50] [--keep]
Creates a PostgreSQL database of its own (`metrics_bench_*`, dropped at the end unless --keep), fills it with
INSERT ... SELECT generate_series (the totals triggers of migration 0009 fire for every letter and FAILED/DEAD
run, as in production), checks those totals against a GROUP BY of the rows, serves the database with the real
`oncelery metrics` command, times N scrapes over HTTP (p50/p99), and prints the EXPLAIN ANALYZE of every query
one scrape sends, failing if any plan reads task_runs, step_results or model_calls with a Seq Scan, or reads
dead_letters at all. Goal: p99 <= 50 ms. Figures go to docs/benchmarks.md. Not a test: nothing asserts a time.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from sqlalchemy import event, text
from sqlalchemy.engine import make_url

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: bench.support
from bench.support.harness import admin_engine, drop_database, new_database, percentile
from oncelery.ops.metrics import ClaimsCollector
from oncelery.store.database import get_engine
from oncelery.store.schema import upgrade_schema

ONCELERY = str(Path(sys.executable).parent / "oncelery")
TASKS = 5

# A realistic mix: 1 run in 1000 RUNNING (half of those with an expired lease: lost holders), 1 % FAILED
# (waiting for a retry), 0.5 % DEAD, the rest COMPLETED; a third of the runs answered one duplicate (replays).
FILL_RUNS = """
INSERT INTO task_runs (task_name, tenant, idempotency_key, fingerprint, field_digests, status, fencing_token,
                       owner, lease_expires_at, attempts, replays, updated_at, finished_at)
SELECT 'bench.task_' || (i % {tasks}), '', 'key-' || i, repeat('f', 64), '{{}}'::json,
       CASE WHEN i % 1000 = 0 THEN 'RUNNING' WHEN i % 100 = 1 THEN 'FAILED'
            WHEN i % 200 = 2 THEN 'DEAD' ELSE 'COMPLETED' END,
       1 + (i % 7 = 0)::int, 'owner',
       CASE WHEN i % 1000 = 0 THEN clock_timestamp() + ((i % 2000) - 500) * interval '1 second' END,
       1, (i % 3 = 0)::int, clock_timestamp() - (i % 86400) * interval '1 second', NULL
FROM generate_series(1, {runs}) AS i
"""
# Three checkpointed steps per run for every 5th run and for every RUNNING one (token 1: a RUNNING run with
# token 2 shows them as replayed from its earlier holder).
FILL_STEPS = """
INSERT INTO step_results (run_id, position, step_name, result, token)
SELECT r.id, p, 'step' || p, '"ok"'::json, 1
FROM task_runs r, generate_series(1, 3) AS p
WHERE r.id % 5 = 0 OR r.status = 'RUNNING'
"""
FILL_OUTCOMES = """
INSERT INTO delivery_outcomes (task_name, tenant, outcome, shard, count)
SELECT 'bench.task_' || t, '', o, s, 1000 + t * 10 + s
FROM generate_series(0, {tasks} - 1) AS t,
     unnest(ARRAY['executed', 'replayed', 'resumed', 'in_progress', 'lease_lost', 'failed', 'dead']) AS o,
     generate_series(0, 15) AS s
"""
# One model call per run (a step's LLM call), priced.
FILL_CALLS = """
INSERT INTO model_calls (task_name, tenant, idempotency_key, step, run_id, fencing_token, model, input_tokens,
                         output_tokens, latency_ms, ok, cost_micros)
SELECT 'bench.task_' || (i % {tasks}), '', 'key-' || i, 'step1', i, 1, 'gpt-4o-mini', 800, 120, 900.0,
       i % 50 <> 0, 200
FROM generate_series(1, {runs}) AS i
"""
# The running totals the workers keep with each row (migration 0007's backfill does the same).
FILL_TOTALS = """
INSERT INTO ledger_totals (task_name, tenant, model, calls, failed_calls, input_tokens, output_tokens,
                           cost_micros, unpriced_calls)
SELECT task_name, tenant, model, count(*), sum(CASE WHEN ok THEN 0 ELSE 1 END), sum(input_tokens),
       sum(output_tokens), sum(cost_micros), 0
FROM model_calls GROUP BY task_name, tenant, model
"""
FILL_OUTBOX = """
INSERT INTO outbox (task_name, args, kwargs, options, celery_task_id, tenant, status, created_at)
SELECT 'bench.task_' || (i % {tasks}), '[]'::json, '{{}}'::json, '{{}}'::json, 'celery-' || i, '',
       CASE WHEN i % 2000 = 0 THEN 'PENDING' ELSE 'DONE' END, clock_timestamp() - i * interval '1 second'
FROM generate_series(1, 100000) AS i
"""
# A letter per DEAD run (half of them replayed), then run-less letters up to --letters: conflicting payloads,
# and one in ten a message without an identity.
FILL_LETTERS = """
INSERT INTO dead_letters (run_id, task_name, tenant, idempotency_key, reason, attempts, replayed_at)
SELECT id, task_name, '', idempotency_key, 'retries_exhausted', 3, CASE WHEN id % 2 = 0 THEN clock_timestamp() END
FROM task_runs WHERE status = 'DEAD'
"""
FILL_RUNLESS_LETTERS = """
INSERT INTO dead_letters (task_name, tenant, idempotency_key, reason, attempts)
SELECT 'bench.task_' || (i % {tasks}), '', 'conflict-' || i,
       CASE WHEN i % 10 = 0 THEN 'bad_message' ELSE 'conflict' END, 1
FROM generate_series(1, {letters} - (SELECT count(*) FROM dead_letters)) AS i
"""
# What the triggers counted must be what the rows say (a GROUP BY each, once, after the fill).
CHECK_TOTALS = """
SELECT (SELECT array_agg(x ORDER BY x) FROM (SELECT task_name || reason || sum(letters) || '/' || sum(replayed)
                                              FROM letter_totals GROUP BY task_name, reason) AS t(x))
     = (SELECT array_agg(x ORDER BY x) FROM (SELECT task_name || reason || count(*) || '/' || count(replayed_at)
                                              FROM dead_letters GROUP BY task_name, reason) AS l(x)),
       (SELECT array_agg(x ORDER BY x) FROM (SELECT task_name || status || sum(runs)
                                              FROM run_status_totals GROUP BY task_name, status HAVING sum(runs) <> 0)
                                        AS t(x))
     = (SELECT array_agg(x ORDER BY x) FROM (SELECT task_name || status || count(*) FROM task_runs
                                              WHERE status IN ('FAILED', 'DEAD') GROUP BY task_name, status) AS r(x))
"""
GROWING = ("task_runs", "step_results", "model_calls", "dead_letters")


def fill(url: str, runs: int, letters: int) -> None:
    """Migrate and fill the database, check the triggers' totals, then ANALYZE (the planner must know sizes)."""
    upgrade_schema(url)
    engine = get_engine(url)
    for label, sql in (
        ("task_runs", FILL_RUNS),
        ("step_results", FILL_STEPS),
        ("delivery_outcomes", FILL_OUTCOMES),
        ("model_calls", FILL_CALLS),
        ("ledger_totals", FILL_TOTALS),
        ("outbox", FILL_OUTBOX),
        ("dead_letters of DEAD runs", FILL_LETTERS),
        ("run-less dead_letters", FILL_RUNLESS_LETTERS),
    ):
        started = time.perf_counter()
        with engine.begin() as conn:
            n = conn.execute(text(sql.format(runs=runs, letters=letters, tasks=TASKS))).rowcount
        print(f"filled {label}: {n} rows in {time.perf_counter() - started:.1f} s", flush=True)
    with engine.connect() as conn:
        letters_ok, runs_ok = conn.execute(text(CHECK_TOTALS)).one()
    print(f"totals kept by the triggers equal the rows: letters {letters_ok}, FAILED/DEAD runs {runs_ok}")
    if not (letters_ok and runs_ok):
        raise SystemExit("the triggers' totals differ from the rows")
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE"))


def explain(url: str) -> list[str]:
    """Print the plan of every query one scrape sends; return those that scan a growing table or read letters."""
    sent: list[tuple[str, Any]] = []

    def capture(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if not statement.lstrip().upper().startswith("EXPLAIN"):
            sent.append((statement, parameters))

    collector = ClaimsCollector(url)
    engine = collector.db.read_engine
    event.listen(engine, "before_cursor_execute", capture)
    try:
        list(collector.collect())
    finally:
        event.remove(engine, "before_cursor_execute", capture)
    bad = []
    with engine.connect() as conn:
        for statement, parameters in sent:
            plan = "\n".join(row[0] for row in conn.exec_driver_sql("EXPLAIN ANALYZE " + statement, parameters))
            print(f"\n-- {' '.join(statement.split())}\n{plan}")
            if any(f"Seq Scan on {table}" in plan for table in GROWING) or " on dead_letters" in plan:
                bad.append(statement)
    return bad


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(port: int) -> bytes | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            return bytes(response.read())
    except OSError:
        return None


def time_scrapes(url: str, scrapes: int) -> list[float]:
    """Start the real `oncelery metrics` command and time `scrapes` scrapes over HTTP (ms each)."""
    port = _free_port()
    argv = [ONCELERY, "--database-url", url, "metrics", "--addr", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while _get(port) is None:  # the first answer also warms the pool
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("oncelery metrics did not answer within 30 s")
            time.sleep(0.05)
        took = []
        for _ in range(scrapes):
            started = time.perf_counter()
            body = _get(port)
            took.append((time.perf_counter() - started) * 1000)
            if body is None or b"oncelery_database_up 1.0" not in body:
                raise SystemExit("a scrape failed")
        return took
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def main() -> None:
    """Fill, explain, time, and print the figures for docs/benchmarks.md."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_admin = os.environ.get(
        "ONCELERY_TEST_PG_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    )
    parser.add_argument("--admin-url", default=default_admin, help="A PostgreSQL server to create the database on.")
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--letters", type=int, default=1_000_000, help="Dead letters, those of DEAD runs included.")
    parser.add_argument("--scrapes", type=int, default=50)
    parser.add_argument("--keep", action="store_true", help="Keep the filled database (its URL is printed).")
    args = parser.parse_args()
    url = new_database(args.admin_url, "metrics_bench")
    print(f"database: {make_url(url).database}", flush=True)
    try:
        fill(url, args.runs, args.letters)
        bad = explain(url)
        took = time_scrapes(url, args.scrapes)
        p50, p99 = statistics.median(took), percentile(took, 0.99)
        print("\n| runs | letters | scrapes | p50 ms | p99 ms | goal p99 |\n|---|---|---|---|---|---|")
        print(f"| {args.runs:,} | {args.letters:,} | {args.scrapes} | {p50:.1f} | {p99:.1f} | 50 ms |")
        print("\nqueries reading a growing table (Seq Scan) or dead_letters: " + (str(len(bad)) if bad else "none"))
        if bad:
            raise SystemExit(1)
    finally:
        if args.keep:
            print(f"kept: {url}")
        else:
            drop_database(admin_engine(url), make_url(url).database or "")


if __name__ == "__main__":
    main()
