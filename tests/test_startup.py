"""A worker that cannot run Oncelery's tasks refuses to start, before it takes a single message; and
`oncelery db upgrade` creates the framework's tables only, the demo pipeline adding its own.

Real `celery worker` subprocesses on the real Redis broker; every process started here is stopped here.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from celery import Celery
from sqlalchemy.engine import make_url

from oncelery import Runs, RunStatus
from tests import services
from tests.services import ONCELERY, clean_env, run_to_completion, stop_sessions, unique_queue, wait_for

TASK = "oncelery.startup_job"
FRAMEWORK_TABLES = {
    "task_runs",
    "step_results",
    "delivery_outcomes",
    "oncelery_secrets",
    "outbox",
    "dead_letters",
    "entity_versions",
    "model_calls",
    "ledger_totals",
    "ledger_label_totals",
    "run_status_totals",
    "letter_totals",
    "histogram_buckets",
    "llm_intents",
    "llm_limiters",
    "llm_budgets",
    "oncelery_caps",
    "oncelery_cap_changes",
    "llm_batches",
    "llm_batch_items",
    "oncelery_leases",
    "oncelery_forks",
    "oncelery_debounce",
    "oncelery_alembic_version",
}
JOBS_TABLES = {"article_scores", "oncelery_jobs_alembic_version"}

APP_SOURCE = f"""
import os
from celery import Celery
from oncelery import IdempotentTask

app = Celery("startupapp", broker=os.environ["STARTUP_BROKER"])
app.conf.task_default_queue = os.environ["STARTUP_QUEUE"]
app.conf.broker_connection_retry_on_startup = True
if os.environ.get("STARTUP_DB"):
    app.conf.oncelery_database_url = os.environ["STARTUP_DB"]


@app.task(base=IdempotentTask, bind=True, name={TASK!r})
def job(self, n):
    return n * 2
"""


def queue_length(queue: str) -> int:
    """Return how many messages the Redis list of `queue` holds right now."""
    db = make_url(services.REDIS_URL.replace("redis://", "redis+x://", 1)).database or "0"
    return int(services.redis_cli("-n", db, "LLEN", queue) or 0)


def sqlite_tables(path: Path) -> set[str]:
    """Return the table names of a SQLite file."""
    with sqlite3.connect(path) as conn:
        return {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


@pytest.fixture
def project(tmp_path: Path, redis_url: str) -> tuple[Path, str]:
    """A user project with one idempotent task, and a queue holding one message for it."""
    (tmp_path / "startupapp.py").write_text(APP_SOURCE)
    queue = unique_queue()
    producer = Celery("producer", broker=redis_url)
    try:
        producer.send_task(TASK, args=[21], queue=queue)
    finally:
        producer.close()
    wait_for(lambda: queue_length(queue) == 1, timeout=30, what="the message to reach the queue")
    return tmp_path, queue


def start_worker(cwd: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start `celery -A startupapp worker` in a session of its own, logging to a file in `cwd`."""
    log = (cwd / "worker.log").open("ab")
    try:
        argv = [sys.executable, "-m", "celery", "-A", "startupapp", "worker", "--pool", "solo", "-l", "INFO"]
        return subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()


def refused(cwd: Path, env: dict[str, str]) -> str:
    """Start a worker that must exit by itself with an error; return its log."""
    proc = start_worker(cwd, env)
    try:
        code = proc.wait(timeout=90)
    finally:
        stop_sessions([proc])
    log = (cwd / "worker.log").read_text()
    assert code != 0, log
    return log


def test_a_worker_without_a_database_refuses_to_start_and_leaves_the_message(project: tuple[Path, str]) -> None:
    """No oncelery_database_url and no ONCELERY_DATABASE_URL: one line saying what to set; nothing consumed."""
    cwd, queue = project
    env = clean_env(PYTHONPATH=str(cwd), STARTUP_BROKER=services.REDIS_URL, STARTUP_QUEUE=queue)
    log = refused(cwd, env)
    assert "refuses to start" in log and "ONCELERY_DATABASE_URL" in log
    assert "Traceback" not in log
    assert queue_length(queue) == 1
    assert not (cwd / "oncelery.db").exists()  # no silent per-host default database


def test_a_worker_on_a_database_without_schema_refuses_then_one_with_it_runs_the_job(
    project: tuple[Path, str],
) -> None:
    """A database without Oncelery's tables: the worker exits with the `oncelery db upgrade` hint and the
    message stays queued; after the upgrade a worker starts and runs that very message."""
    cwd, queue = project
    db = cwd / "claims.db"
    sqlite3.connect(db).close()  # exists, but has no tables
    url = f"sqlite:///{db}"
    env = clean_env(PYTHONPATH=str(cwd), STARTUP_BROKER=services.REDIS_URL, STARTUP_QUEUE=queue, STARTUP_DB=url)
    log = refused(cwd, env)
    assert "refuses to start" in log and "oncelery db upgrade" in log
    assert queue_length(queue) == 1

    code, _out, err = run_to_completion(
        [ONCELERY, "--database-url", url, "db", "upgrade"], cwd, clean_env(), 60, lambda _out: None
    )
    assert code == 0, err
    worker = start_worker(cwd, env)
    try:
        runs = Runs(url)
        done = wait_for(
            lambda: runs.list(task_name=TASK, status=RunStatus.COMPLETED),
            timeout=90,
            what="the queued job to complete once the schema exists",
        )
    finally:
        stop_sessions([worker])
    assert [run.result for run in done] == [42]
    assert queue_length(queue) == 0


def test_db_upgrade_creates_only_the_framework_tables_and_process_adds_its_own(tmp_path: Path) -> None:
    """Schema ownership: a user's database gets Oncelery's tables only; the demo pipeline migrates its branch."""
    db = tmp_path / "app.db"
    url = f"sqlite:///{db}"
    code, out, err = run_to_completion(
        [ONCELERY, "--database-url", url, "db", "upgrade"], tmp_path, clean_env(), 60, print
    )
    assert code == 0, err
    assert sqlite_tables(db) == FRAMEWORK_TABLES

    samples = Path(__file__).resolve().parents[1] / "samples" / "articles.jsonl"
    argv = [ONCELERY, "process", str(samples), "--limit", "2", "--call-seconds", "0"]
    code, out, err = run_to_completion(argv, tmp_path, clean_env(ONCELERY_DATABASE_URL=url), 150, print)
    assert code == 0, f"{out}\n{err}"
    assert sqlite_tables(db) == FRAMEWORK_TABLES | JOBS_TABLES
