"""Benchmark: Flower's Runs section (`oncelery flower`) on 1,000,000 runs: the list's pages and a run's page.

Run: python bench/flower_runs.py [--admin-url URL] [--broker-url URL] [--runs 1000000] [--requests 200] [--keep]
     python bench/flower_runs.py --url URL     (a database filled by an earlier --keep run: no fill)

Creates a PostgreSQL database of its own (`flower_bench_*`, dropped at the end unless --keep), fills it with
INSERT ... SELECT generate_series: the runs (5 tasks, 20 tenants and none, every status; taken-over, lost and
retried runs rare, a third answered a duplicate), and for every 5th run three checkpointed steps, two model calls
with their intents, and for each DEAD run its dead letter. Then it starts the real `oncelery flower` (Flower and
its Tornado app, on a Redis broker), and times GET requests over HTTP, each URL `--requests` times after 5 warm-ups:
list pages for each kind of filter (first pages, a page deep in the table, and filters applied to a window) and run
pages (with steps, calls and intents; with a dead letter; with a fork's dry-run preview). It prints p50/p95 per URL
and the EXPLAIN ANALYZE verdict of every statement a list page sends (a Seq Scan on task_runs fails the run).
Goal: p95 < 100 ms for each URL. Figures go to docs/benchmarks.md. Not a test: nothing asserts a time.
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
from oncelery.models import RunStatus
from oncelery.runs.browse import RunFilter, browse_runs
from oncelery.store.database import Database, get_engine
from oncelery.store.schema import upgrade_schema

TASKS = 5
TENANTS = 20
FILL_RUNS = """
INSERT INTO task_runs (task_name, tenant, idempotency_key, fingerprint, field_digests, status, fencing_token,
                       owner, lease_expires_at, not_before, attempts, lost, retries, replays, llm_calls,
                       llm_input_tokens, llm_output_tokens, llm_cost_micros, celery_task_id, error, result,
                       created_at, updated_at, finished_at)
SELECT 'bench.task_' || (i % {tasks}), CASE WHEN i % 2 = 0 THEN 'tenant_' || (i % {tenants}) ELSE '' END,
       'doc:' || i, repeat('f', 64), '{{}}'::json,
       CASE WHEN i % 1000 = 0 THEN 'RUNNING' WHEN i % 200 = 3 THEN 'WAITING' WHEN i % 100 = 1 THEN 'FAILED'
            WHEN i % 200 = 2 THEN 'DEAD' ELSE 'COMPLETED' END,
       1 + (i % 200 = 7)::int, 'owner', CASE WHEN i % 1000 = 0 THEN clock_timestamp() + interval '60 seconds' END,
       CASE WHEN i % 200 = 3 THEN clock_timestamp() + interval '30 seconds' END,
       1 + (i % 200 = 7)::int, (i % 500 = 7)::int, (i % 400 = 7)::int, (i % 3 = 0)::int, 2, 1600, 240, 960,
       md5(i::text), CASE WHEN i % 100 = 1 OR i % 200 = 2 THEN 'ValueError: the upstream answered 500' END,
       '{{"summary": "ok"}}'::json, now() - ({runs} - i) * interval '1 second',
       now() - ({runs} - i) * interval '1 second', now() - ({runs} - i) * interval '1 second'
FROM generate_series(1, {runs}) AS i
"""
FILL_STEPS = """
INSERT INTO step_results (run_id, position, step_name, result, token, seconds, created_at)
SELECT r.id, p, 'step' || p, '"ok"'::json, 1, 0.8, r.created_at + p * interval '1 second'
FROM task_runs r, generate_series(0, 2) AS p WHERE r.id % 5 = 0
"""
FILL_INTENTS = """
INSERT INTO llm_intents (public_id, run_id, position, step_name, attempt, token, provider, endpoint, model, mode,
                         request_digest, state, reference, prepared_at, sent_at, ended_at, input_tokens,
                         output_tokens, admitted, reserved, released_at)
SELECT 'i' || r.id || '-' || p, r.id, p, 'step' || p, 1, 1, 'openai', 'responses', 'gpt-4.1-mini', 'background',
       repeat('d', 64), 'done', 'resp_' || md5(r.id::text || p), r.created_at, r.created_at, r.created_at, 800,
       120, '{{"openai:gpt-4.1-mini/rpm": 1}}'::json,
       '{{"budgets": {{"global/day/x": 480}}, "price": ["1", "2"]}}'::json, r.created_at
FROM task_runs r, generate_series(0, 1) AS p WHERE r.id % 5 = 0
"""
FILL_CALLS = """
INSERT INTO model_calls (call_id, task_name, tenant, idempotency_key, step, run_id, fencing_token, model,
                         input_tokens, output_tokens, latency_ms, ok, cost_micros, created_at)
SELECT 'i' || r.id || '-' || p, r.task_name, r.tenant, r.idempotency_key, 'step' || p, r.id, 1, 'gpt-4.1-mini',
       800, 120, 900.0, true, 480, r.created_at
FROM task_runs r, generate_series(0, 1) AS p WHERE r.id % 5 = 0
"""
FILL_LETTERS = """
INSERT INTO dead_letters (run_id, task_name, tenant, idempotency_key, reason, error, attempts, message)
SELECT id, task_name, tenant, idempotency_key, 'retries_exhausted', error, 3,
       '{{"args": ["sk-secret"], "kwargs": {{}}}}'::json
FROM task_runs WHERE status = 'DEAD'
"""
FILL_OUTCOMES = """
INSERT INTO delivery_outcomes (task_name, tenant, outcome, shard, count)
SELECT 'bench.task_' || t, CASE WHEN n = 0 THEN '' ELSE 'tenant_' || n END, 'executed', 0, 1
FROM generate_series(0, {tasks} - 1) AS t, generate_series(0, {tenants} - 1) AS n
"""


def fill(url: str, runs: int) -> None:
    """Migrate and fill the database, then VACUUM ANALYZE (the planner must know sizes)."""
    upgrade_schema(url)
    engine = get_engine(url)
    # The step-duration histogram's row trigger would upsert its few counter rows 600,000 times in one transaction
    # (each a new row version that transaction cannot prune): off for the fill, on again after (not what is timed).
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE step_results DISABLE TRIGGER oncelery_histogram_step_duration"))
    for label, sql in (("task_runs", FILL_RUNS), ("step_results", FILL_STEPS), ("llm_intents", FILL_INTENTS),
                       ("model_calls", FILL_CALLS), ("dead_letters", FILL_LETTERS),
                       ("delivery_outcomes", FILL_OUTCOMES)):  # fmt: skip
        started = time.perf_counter()
        with engine.begin() as conn:
            n = conn.execute(text(sql.format(runs=runs, tasks=TASKS, tenants=TENANTS))).rowcount
        print(f"filled {label}: {n:,} rows in {time.perf_counter() - started:.1f} s", flush=True)
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE step_results ENABLE TRIGGER oncelery_histogram_step_duration"))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE"))


FILTERS = {  # each with matches (FILL_RUNS's residues), except the last: a window's worst case
    "all": RunFilter(),
    "status=DEAD": RunFilter(status=RunStatus.DEAD),
    "status=WAITING": RunFilter(status=RunStatus.WAITING),
    "task": RunFilter(task_name="bench.task_3"),
    "task+status=FAILED": RunFilter(task_name="bench.task_1", status=RunStatus.FAILED),
    "tenant": RunFilter(tenant="tenant_4"),
    "tenant+status=DEAD": RunFilter(tenant="tenant_2", status=RunStatus.DEAD),
    "outcome=replayed": RunFilter(outcome="replayed"),
    "outcome=resumed": RunFilter(outcome="resumed"),
    "outcome=lost+task (window)": RunFilter(task_name="bench.task_2", outcome="lost"),
    "task+tenant (window)": RunFilter(task_name="bench.task_4", tenant="tenant_4"),
    "task+tenant, no match (window, worst case)": RunFilter(task_name="bench.task_1", tenant="tenant_4"),
}


def _query(flt: RunFilter) -> str:
    pairs = (("task", flt.task_name), ("status", flt.status.value if flt.status else None), ("tenant", flt.tenant),
             ("outcome", flt.outcome))  # fmt: skip
    return "&".join(f"{k}={v}" for k, v in pairs if v)


def explain(url: str) -> list[str]:
    """The EXPLAIN ANALYZE of every statement of each filter's first page; return the filters that read the table."""
    db = Database(url)
    engine = db.read_engine
    sent: list[tuple[str, Any]] = []

    def capture(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if not statement.lstrip().upper().startswith("EXPLAIN"):
            sent.append((statement, parameters))

    bad = []
    for name, flt in FILTERS.items():
        sent.clear()
        event.listen(engine, "before_cursor_execute", capture)
        try:
            browse_runs(db, flt)
        finally:
            event.remove(engine, "before_cursor_execute", capture)
        with engine.connect() as conn:
            for statement, parameters in sent:
                plan = "\n".join(r[0] for r in conn.exec_driver_sql("EXPLAIN ANALYZE " + statement, parameters))
                took = plan.rsplit("Execution Time: ", 1)[-1].strip()
                scans = "Seq Scan on task_runs" in plan
                print(f"plan {name}: {'SEQ SCAN' if scans else 'index only'}, execution {took}")
                if scans:
                    print(plan)
                    bad.append(name)
    return bad


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return bytes(response.read())
    except OSError:
        return None


def _targets(url: str, base: str) -> dict[str, str]:
    """The URLs timed: list pages per filter, a deep page, and three run pages."""
    with get_engine(url).connect() as conn:
        top = int(conn.execute(text("SELECT max(id) FROM task_runs")).scalar_one())
        # The newest COMPLETED run with steps, calls and intents (a fork previews from a COMPLETED run only).
        rich = int(
            conn.execute(text("SELECT max(id) FROM task_runs WHERE id % 5 = 0 AND status = 'COMPLETED'")).scalar()
        )
        dead = int(conn.execute(text("SELECT max(run_id) FROM dead_letters")).scalar_one())
    targets = {f"list {name}": f"{base}/runs?{_query(flt)}" for name, flt in FILTERS.items()}
    targets["list all, deep page (before=half)"] = f"{base}/runs?before={top // 2}"
    targets["run page (3 steps, 2 calls, 2 intents)"] = f"{base}/runs/{rich}"
    targets["run page (DEAD, with its letter)"] = f"{base}/runs/{dead}"
    targets["run page + fork dry-run preview"] = f"{base}/runs/{rich}?fork_from=step1&set=step1.model%3Dgpt-4.1"
    return targets


def time_pages(url: str, broker_url: str, requests: int) -> list[tuple[str, list[float]]]:
    """Start the real `oncelery flower` and time each target `requests` times over HTTP (ms each)."""
    port = _free_port()
    argv = [sys.executable, "-m", "celery", f"--broker={broker_url}", "oncelery", "--database-url", url, "flower",
            f"--port={port}", "--address=127.0.0.1", "--logging=warning"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while _get(f"{base}/healthcheck") is None:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("oncelery flower did not answer within 60 s")
            time.sleep(0.1)
        out = []
        for name, target in _targets(url, base).items():
            for _ in range(5):  # warm: the pool's connections, the template's compilation, the plan cache
                if _get(target) is None:
                    raise SystemExit(f"{name}: {target} failed")
            took = []
            for _ in range(requests):
                started = time.perf_counter()
                if _get(target) is None:
                    raise SystemExit(f"{name}: {target} failed")
                took.append((time.perf_counter() - started) * 1000)
            out.append((name, took))
            print(f"{name}: p50 {statistics.median(took):.1f} ms, p95 {percentile(took, 0.95):.1f} ms", flush=True)
        return out
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
    parser.add_argument("--url", default=None, help="A database an earlier --keep run filled (no fill, kept).")
    parser.add_argument("--broker-url", default="redis://127.0.0.1:6379/15", help="The broker Flower connects to.")
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--keep", action="store_true", help="Keep the filled database (its URL is printed).")
    args = parser.parse_args()
    url = args.url or new_database(args.admin_url, "flower_bench")
    print(f"database: {make_url(url).database}", flush=True)
    try:
        if args.url is None:
            fill(url, args.runs)
        bad = explain(url)
        timed = time_pages(url, args.broker_url, args.requests)
        with get_engine(url).connect() as conn:
            runs = int(conn.execute(text("SELECT count(*) FROM task_runs")).scalar_one())
        print(f"\n{runs:,} runs, {args.requests} requests per URL after 5 warm-ups, HTTP to `oncelery flower`\n")
        print("| page | p50 ms | p95 ms | goal p95 |\n|---|---|---|---|")
        for name, took in timed:
            print(f"| {name} | {statistics.median(took):.1f} | {percentile(took, 0.95):.1f} | 100 ms |")
        print("\nlist statements reading task_runs with a Seq Scan: " + (", ".join(bad) if bad else "none"))
        if bad:
            raise SystemExit(1)
    finally:
        if args.keep or args.url:
            print(f"kept: {url}")
        else:
            drop_database(admin_engine(url), make_url(url).database or "")


if __name__ == "__main__":
    main()
