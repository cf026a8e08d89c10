"""`oncelery metrics`: a scrape returns exactly what the database holds, on both stores, across worker processes.

The end-to-end proof (test_scrape_counts_what_two_workers_and_a_restart_did): 100 deliveries, 70 executed and 30
replayed, by two `celery worker` processes one of which restarts, read back over HTTP from the real CLI.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import insert, text
from sqlalchemy.engine import make_url

from oncelery.basetask.metering import MeteredCall, _Origin, _record
from oncelery.models import OutboxStatus, Outcome, RunStatus
from oncelery.models.migrate import downgrade
from oncelery.ops.costs import cost_report
from oncelery.ops.metrics import claims_registry
from oncelery.runs.outcomes import record_outcome
from oncelery.store.database import Database, dispose_engines, get_engine
from oncelery.store.schema import upgrade_schema
from oncelery.store.tables import LETTERS, OUTBOX, RUNS
from oncelery.testing import OnceleryDb, WorkerProcess, wait_until
from oncelery.testing.worker import import_app
from tests import services

TASK = "oncelery.crash_effect"  # tests/apps/crash_app.py
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(params=["sqlite", "postgresql"])
def metrics_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A migrated claims database of this test alone: a SQLite file, or a new PostgreSQL `metrics_*` database."""
    yield from migrated_database(request.param, tmp_path)


def migrated_database(store: str, tmp_path: Path) -> Iterator[str]:
    """The body of a `metrics_url` fixture (other modules declare their own): `store` is sqlite or postgresql."""
    if store == "sqlite":
        url = f"sqlite:///{tmp_path / 'claims.db'}"
        upgrade_schema(url)
        yield url
        dispose_engines()
        return
    yield from _pg_database()


@pytest.fixture
def pg_metrics_url() -> Iterator[str]:
    """A new PostgreSQL `metrics_*` database, migrated, dropped after the test."""
    yield from _pg_database()


def _pg_database() -> Iterator[str]:
    services.need("PostgreSQL", services.postgres_available(), "start it (see README: Services)")
    name = f"metrics_{uuid.uuid4().hex[:12]}"
    admin = get_engine(services.PG_ADMIN_URL)
    with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(services.PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    try:
        upgrade_schema(url)
        yield url
    finally:
        dispose_engines()
        with get_engine(services.PG_ADMIN_URL).connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def samples(exposition: str) -> Samples:
    """{(sample name, sorted labels): value} of a text exposition, as Prometheus would parse it."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
    }


def scrape(url: str) -> Samples:
    """One scrape of the exporter's registry for `url`, parsed."""
    return samples(generate_latest(claims_registry(url)).decode())


def _run_row(key: str, status: RunStatus, **values: Any) -> dict[str, Any]:
    return {
        "task_name": TASK,
        "tenant": "",
        "idempotency_key": key,
        "fingerprint": "f" * 64,
        "field_digests": {},
        "status": status,
        **values,
    }


def _orphan(url: str, key: str = "orphan") -> None:
    # A RUNNING run whose holder vanished an hour ago (its lease expired, no sweeper ran): what the lease gauge
    # and the alert on it exist for.
    past = datetime.now(UTC) - timedelta(hours=1)
    with Database(url).begin() as conn:
        conn.execute(insert(RUNS).values(**_run_row(key, RunStatus.RUNNING, fencing_token=2, lease_expires_at=past)))


def test_every_metric_equals_the_database(metrics_url: str) -> None:
    """Outcomes, runs, leases, outbox, dead letters and the ledger come back exactly as written (both stores)."""
    for _ in range(3):
        record_outcome(Database(metrics_url), TASK, Outcome.EXECUTED, "acme")
    with Database(metrics_url).begin() as conn:
        run_id = conn.execute(
            insert(RUNS).values(**_run_row("done", RunStatus.COMPLETED, replays=0)).returning(RUNS.c.id)
        ).scalar_one()
        conn.execute(insert(RUNS).values(**_run_row("dead", RunStatus.DEAD)))
        conn.execute(
            insert(OUTBOX).values(
                task_name=TASK, args=[], kwargs={}, options={}, celery_task_id="c1", status=OutboxStatus.PENDING
            )
        )
        conn.execute(insert(LETTERS).values(task_name=TASK, reason="never_succeeds", attempts=1))
    # What the ledger records when a run's step makes a call (same code path as model_call's).
    call = MeteredCall("gpt-x", "summarize", {})
    call.input_tokens, call.output_tokens, call.latency_ms, call.ok, call.cost = 100, 20, 5.0, True, 0.25
    _record(_Origin(metrics_url, None, TASK, "", "done", "summarize", run_id, 1), call)
    record_outcome(Database(metrics_url), TASK, Outcome.REPLAYED, replayed_run=run_id)
    record_outcome(Database(metrics_url), TASK, Outcome.LEASE_LOST)
    _orphan(metrics_url)

    got = samples(generate_latest(claims_registry(metrics_url)).decode())

    def value(metric: str, **labels: str) -> float:
        return got[metric, tuple(sorted(labels.items()))]

    assert value("oncelery_database_up") == 1
    assert value("oncelery_deliveries_total", name=TASK, tenant="acme", outcome="executed") == 3
    assert value("oncelery_deliveries_total", name=TASK, tenant="", outcome="replayed") == 1
    assert value("oncelery_zombie_writes_refused_total", name=TASK, tenant="") == 1
    assert value("oncelery_runs_completed_total", name=TASK, tenant="acme") == 3
    assert value("oncelery_duplicate_ratio", name=TASK) == pytest.approx(1 / 5)
    assert value("oncelery_runs", name=TASK, status="RUNNING") == 1
    assert value("oncelery_runs", name=TASK, status="DEAD") == 1
    assert value("oncelery_running_takeovers", name=TASK) == 1
    # Expired an hour ago by the database clock (a few seconds of slack for a slow machine).
    assert 3590 < value("oncelery_oldest_expired_lease_age_seconds", name=TASK) < 3700
    assert value("oncelery_oldest_live_lease_age_seconds", name=TASK) == 0
    assert value("oncelery_outbox_pending") == 1
    assert 0 <= value("oncelery_outbox_oldest_pending_age_seconds") < 300
    assert value("oncelery_dead_letters", name=TASK, reason="never_succeeds") == 1
    assert value("oncelery_llm_calls_total", name=TASK, tenant="", model="gpt-x") == 1
    assert value("oncelery_llm_tokens_total", name=TASK, tenant="", model="gpt-x", direction="input") == 100
    assert value("oncelery_llm_cost_usd_total", name=TASK, tenant="", model="gpt-x") == pytest.approx(0.25)
    # One replay of a run that made one ok call saved that call, its tokens and its cost.
    assert value("oncelery_llm_saved_calls_total", name=TASK, tenant="") == 1
    assert value("oncelery_llm_saved_cost_usd_total", name=TASK, tenant="") == pytest.approx(0.25)
    assert value("oncelery_llm_saved_tokens_total", name=TASK, tenant="", direction="output") == 20


def test_unreadable_database_reports_down(tmp_path: Path) -> None:
    """A database that cannot be read gives `oncelery_database_up 0`, not a failed scrape."""
    got = samples(generate_latest(claims_registry(f"sqlite:///{tmp_path / 'missing.db'}")).decode())
    assert got == {("oncelery_database_up", ()): 0}


# -- the end-to-end proof: real workers, a restart, the real CLI over HTTP ------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return str(response.read().decode())
    except OSError:
        return None


@pytest.mark.crash
def test_scrape_counts_what_two_workers_and_a_restart_did(
    pg_metrics_url: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """100 deliveries (70 keys, 30 duplicates of completed ones) over two workers and a restart: 70 + 30 exactly."""
    db = OnceleryDb(pg_metrics_url)
    services.test_metadata.create_all(get_engine(pg_metrics_url))
    queue = services.unique_queue()
    env = {
        "ONCELERY_BROKER_URL": redis_url,
        "ONCELERY_RESULT_BACKEND": services.results_url(redis_url),
        "ONCELERY_CRASH_QUEUE": queue,
        "ONCELERY_TEST_LOG_DIR": str(tmp_path),
    }
    # The kit's workers isolate the app in this process too (its queues are the test's): this process imports
    # the crash app on the same environment, and sends through it.
    for name, value in {**env, "ONCELERY_DATABASE_URL": pg_metrics_url}.items():
        monkeypatch.setenv(name, value)
    workers: list[WorkerProcess] = []
    exporter: subprocess.Popen[str] | None = None

    def start(name: str) -> WorkerProcess:
        worker = WorkerProcess("tests.apps.crash_app", db, f"{name}-{uuid.uuid4().hex[:6]}@%h", 2, env)
        workers.append(worker)
        return worker

    def send(*keys: str) -> None:
        client = import_app("tests.apps.crash_app")  # the isolated app: its default queue is the test's
        for key in keys:
            client.send_task(TASK, args=[key, 0.0])

    def counts_reach(executed: int, replayed: int) -> bool:
        counts = db.outcome_counts(TASK)
        return counts.get("executed", 0) >= executed and counts.get("replayed", 0) >= replayed

    try:
        # Both boot at once (each start waits until its worker consumes): two workers, one boot's wait.
        with ThreadPoolExecutor(2) as boot:
            first, _ = boot.map(start, ("metrics-a", "metrics-b"))
        send(*(f"k{i}" for i in range(40)))
        wait_until(lambda: counts_reach(40, 0), 60, what="40 executions")
        first.stop()  # a restart: the new process knows nothing the old one counted
        start("metrics-a2")
        send(*(f"k{i}" for i in range(40, 70)), *(f"k{i}" for i in range(30)))
        wait_until(lambda: counts_reach(70, 30), 60, what="70 executions and 30 replays")
        _orphan(pg_metrics_url)

        port = _free_port()
        argv = [services.ONCELERY, "--database-url", pg_metrics_url, "metrics", "--port", str(port)]
        exporter = subprocess.Popen([*argv, "--addr", "127.0.0.1"], stdout=subprocess.PIPE, text=True)
        exposition = wait_until(lambda: _scrape(port), 30, what="the exporter to answer")
        got = samples(exposition)
        key = (("name", TASK), ("outcome", "executed"), ("tenant", ""))
        assert got["oncelery_deliveries_total", key] == 70
        assert got["oncelery_deliveries_total", (("name", TASK), ("outcome", "replayed"), ("tenant", ""))] == 30
        assert sum(v for (name, _), v in got.items() if name == "oncelery_deliveries_total") == 100
        assert got["oncelery_runs_completed_total", (("name", TASK), ("tenant", ""))] == 70
        assert got["oncelery_duplicate_ratio", (("name", TASK),)] == pytest.approx(0.3)
        assert got["oncelery_oldest_expired_lease_age_seconds", (("name", TASK),)] > 3500

        exporter.send_signal(signal.SIGTERM)
        out, _ = exporter.communicate(timeout=15)
        assert exporter.returncode == 0 and "metrics stopped" in out
    finally:
        if exporter is not None and exporter.poll() is None:
            exporter.kill()
            exporter.wait(10)
        for worker in workers:
            worker.kill()  # the scrape is checked: how the workers end is not (first.stop() above is the restart)
        services.delete_queue_keys(redis_url, queue)


def test_upgrade_backfills_the_running_totals_from_existing_rows(metrics_url: str) -> None:
    """A database at 0006 with runs, steps, replays and model calls: after `db upgrade`, the exporter's totals
    equal the ledger's scan (`cost_report`) and the rows, and no delivery count moved."""
    engine = get_engine(metrics_url)
    downgrade(engine, "0006")
    with engine.begin() as conn:
        for key, token, replays in (("a", 2, 3), ("b", 1, 0)):
            row = _run_row(key, RunStatus.COMPLETED, fencing_token=token, replays=replays)
            conn.execute(
                text(
                    "INSERT INTO task_runs (task_name, tenant, idempotency_key, fingerprint, field_digests, status, "
                    "fencing_token, attempts, replays) VALUES (:task_name, '', :idempotency_key, :fingerprint, "
                    "'{}', 'COMPLETED', :fencing_token, 1, :replays)"
                ),
                row,
            )
        ids = dict(conn.execute(text("SELECT idempotency_key, id FROM task_runs")).all())
        for position in range(2):
            conn.execute(
                text("INSERT INTO step_results (run_id, position, step_name, token) VALUES (:r, :p, 's', 1)"),
                {"r": ids["a"], "p": position},
            )
        calls = [("a", 100, 10, True, 0.5), ("a", 50, 5, True, None), ("a", 7, 0, False, 0.1), ("b", 30, 3, True, 0.2)]
        for key, tokens_in, tokens_out, ok, cost in calls:
            conn.execute(
                text(
                    "INSERT INTO model_calls (task_name, tenant, run_id, model, input_tokens, output_tokens, "
                    "latency_ms, ok, cost) VALUES (:t, '', :r, 'gpt-x', :i, :o, 1.0, :ok, :c)"
                ),
                {"t": TASK, "r": ids[key], "i": tokens_in, "o": tokens_out, "ok": ok, "c": cost},
            )
        conn.execute(
            text(
                "INSERT INTO delivery_outcomes (task_name, tenant, outcome, shard, count) "
                "VALUES (:t, '', 'executed', 0, 1)"
            ),
            {"t": TASK},
        )
    upgrade_schema(metrics_url)

    got = scrape(metrics_url)
    line = cost_report(metrics_url).lines[0]
    run = (("name", TASK), ("tenant", ""))
    model = (("model", "gpt-x"), *run)
    assert got["oncelery_llm_calls_total", model] == line.made.calls == 4
    assert got["oncelery_llm_failed_calls_total", model] == 1
    assert got["oncelery_llm_cost_usd_total", model] == pytest.approx(float(line.made.cost or 0))
    # Run a's 2 ok calls (150 + 15 tokens, $0.5 priced) saved 3 times over.
    assert got["oncelery_llm_saved_calls_total", run] == line.saved.calls == 6
    assert got["oncelery_llm_saved_tokens_total", (("direction", "input"), *run)] == line.saved.input_tokens == 450
    assert got["oncelery_llm_saved_cost_usd_total", run] == pytest.approx(float(line.saved.cost or 0)) == 1.5
    assert got["oncelery_steps_executed_total", run] == 2
    assert got["oncelery_takeovers_total", run] == 1
    assert got["oncelery_deliveries_total", (("name", TASK), ("outcome", "executed"), ("tenant", ""))] == 1
    assert got["oncelery_deliveries_total", (("name", TASK), ("outcome", "replayed"), ("tenant", ""))] == 0
