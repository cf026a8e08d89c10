"""The transactional outbox and its relay, end to end: real Redis, real workers, real relay processes.

A job enqueued in a transaction that rolls back is never published; one that commits is published and runs
once. A relay SIGKILLed between publishing and marking the row sent publishes it again and the claim absorbs
the copy; two `oncelery relay` processes over one PostgreSQL outbox never publish a row twice; and a broker
that lost every queued job (a Redis flush) gets them back from the outbox. Over SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from sqlalchemy import func, insert, select
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import Session

from oncelery import ConfigurationError, IdempotentTask, Relay, RelayRound, Runs, RunStatus, outbox
from oncelery.models import OutboxMessage, OutboxStatus
from oncelery.store.database import get_engine
from tests.services import (
    ONCELERY,
    REDIS_URL,
    clean_env,
    count_rows,
    delete_queue_keys,
    effects_table,
    executions_table,
    redis_cli,
    run_to_completion,
    stop_sessions,
    wait_for,
)

REPO = Path(__file__).resolve().parent.parent
OUTBOX_APP = "tests.apps.outbox_app"
# Generous bounds for a noisy 2-core machine; every wait ends as soon as its condition holds.
JOB_TIMEOUT = 60.0
BULK_TIMEOUT = 120.0
STOP_TIMEOUT = 60.0
BULK_JOBS = 500  # five batches of the relay's 100 rows: both relays race for each
FLUSHED_JOBS = 50


@pytest.fixture
def queue(app: Celery, redis_url: str) -> Iterator[str]:
    """The test's queue (the app's default one); every Redis key naming it is deleted afterwards."""
    name = str(app.conf.task_default_queue)
    yield name
    delete_queue_keys(redis_url, name)


def effect_task(app: Celery, name: str, key: str) -> Any:
    """Register an idempotent task `name` keyed by `key` (a template over `n`) that counts each execution
    in its own committed transaction and writes one effect row through `self.effects()`.
    """
    db_url = str(app.conf.oncelery_database_url)

    @app.task(shared=False, base=IdempotentTask, bind=True, name=name, idempotency_key=key, ignore_result=True)
    def job(self: IdempotentTask, n: int) -> dict[str, int]:
        run_key = key.format(n=n)
        with get_engine(db_url).begin() as conn:  # survives whatever the run does next
            conn.execute(insert(executions_table).values(key=run_key, pid=os.getpid()))
        with self.effects() as session:
            session.execute(insert(effects_table).values(key=run_key, pid=os.getpid()))
        return {"n": n}

    app.finalize()
    return job


def outbox_rows(engine: Engine, task_name: str) -> list[Any]:
    """Return the outbox rows of `task_name` (status, publishes, attempts, key, task id), oldest first."""
    o = OutboxMessage
    stmt = (
        select(o.status, o.publishes, o.attempts, o.idempotency_key, o.celery_task_id)
        .where(o.task_name == task_name)
        .order_by(o.id)
    )
    with engine.connect() as conn:
        return list(conn.execute(stmt).all())


def queue_length(queue: str) -> int:
    """Return how many messages wait in `queue` on the test Redis."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        return int(client.llen(queue))
    finally:
        client.close()


def executions_per_key(engine: Engine) -> dict[str, int]:
    """Return {key: how many times its body started}."""
    t = executions_table
    with engine.connect() as conn:
        return {k: int(n) for k, n in conn.execute(select(t.c.key, func.count()).group_by(t.c.key))}


def relay_env(db_url: str, queue: str) -> dict[str, str]:
    """The environment of a relay subprocess on tests/apps/outbox_app.py, publishing to `queue`."""
    return clean_env(
        ONCELERY_DATABASE_URL=db_url,
        ONCELERY_BROKER_URL=REDIS_URL,
        ONCELERY_RESULT_BACKEND=REDIS_URL,
        ONCELERY_OUTBOX_QUEUE=queue,
        PYTHONUNBUFFERED="1",
    )


def add_totals(total: RelayRound, done: RelayRound) -> None:
    """Add one round's counts to `total`."""
    for name, value in vars(done).items():
        setattr(total, name, getattr(total, name) + value)


# -- 1. published iff the caller's transaction commits ------------------------------------------------------


def test_rolled_back_enqueue_publishes_nothing_and_committed_runs_once(
    app: Celery, worker_factory: Any, db_url: str, queue: str
) -> None:
    job = effect_task(app, "oncelery.t_outbox_tx", "tx:{n}")
    engine = get_engine(db_url)
    relay = Relay(app, db_url, sweep_interval=None)

    # The caller writes its own row (an "order") and the job in one transaction, then rolls back.
    with Session(engine) as session:
        session.begin()
        session.execute(insert(effects_table).values(key="order:1", pid=0))
        outbox.enqueue(session, job, 1)
        session.rollback()
    assert relay.run_once() == RelayRound()  # nothing published, nothing else touched
    assert outbox_rows(engine, job.name) == []
    assert count_rows(engine, effects_table, "order:1") == 0
    assert queue_length(queue) == 0

    with worker_factory(app):
        # The same, committed (through a Connection this time): the row, then exactly one publish.
        with engine.begin() as conn:
            conn.execute(insert(effects_table).values(key="order:2", pid=0))
            task_id = outbox.enqueue(conn, job, 2)
        [row] = outbox_rows(engine, job.name)
        assert row.status is OutboxStatus.PENDING and row.publishes == 0
        assert row.idempotency_key == "tx:2" and row.celery_task_id == task_id
        assert relay.run_once().published == 1
        wait_for(
            lambda: (run := Runs(db_url).get(job.name, "tx:2")) is not None and run.status is RunStatus.COMPLETED,
            timeout=JOB_TIMEOUT,
            what="the committed job's run to complete",
        )
        assert relay.run_once().published == 0  # a SENT row is not published again

    [row] = outbox_rows(engine, job.name)
    assert row.status is OutboxStatus.SENT and row.publishes == 1 and row.attempts == 1
    assert count_rows(engine, effects_table, "order:2") == 1
    assert count_rows(engine, executions_table, "tx:2") == 1
    assert count_rows(engine, effects_table, "tx:2") == 1
    # The rolled-back job never ran anywhere.
    assert Runs(db_url).get(job.name, "tx:1") is None
    assert count_rows(engine, executions_table, "tx:1") == 0
    assert job.outcome_counts() == {"executed": 1}


def test_enqueue_refuses_non_json_arguments_and_unknown_options(app: Celery, db_url: str) -> None:
    job = effect_task(app, "oncelery.t_outbox_refuse", "refuse:{n}")
    engine = get_engine(db_url)
    with engine.begin() as conn:
        with pytest.raises(ConfigurationError, match="must be JSON"):
            outbox.enqueue(conn, job, uuid.uuid4())
        with pytest.raises(ConfigurationError, match=r"\['eta'\] cannot be stored"):
            outbox.enqueue(conn, job.s(1).set(eta="2030-01-01T00:00:00+00:00"))
    # The transaction committed, and neither call wrote a row.
    assert outbox_rows(engine, job.name) == []

    # The control: a JSON call with an allowed option is written.
    with engine.begin() as conn:
        outbox.enqueue(conn, job.s(1).set(countdown=5))
    [row] = outbox_rows(engine, job.name)
    assert row.status is OutboxStatus.PENDING and row.idempotency_key == "refuse:1"


# -- 2. a relay SIGKILLed between publishing and marking the row sent ---------------------------------------


def test_relay_killed_after_publishing_republishes_and_claim_absorbs(
    app: Celery, worker_factory: Any, db_url: str, queue: str
) -> None:
    job = effect_task(app, "oncelery.t_outbox_crash", "crash:{n}")
    engine = get_engine(db_url)
    with engine.begin() as conn:
        outbox.enqueue(conn, job, 1)

    code, out, err = run_to_completion(
        [sys.executable, "-m", OUTBOX_APP, "crash-relay"],
        cwd=REPO,
        env=relay_env(db_url, queue),
        timeout=JOB_TIMEOUT,
        on_timeout=lambda _out: None,
    )
    assert code == -signal.SIGKILL, f"exit {code}\n--- stdout\n{out}\n--- stderr\n{err}"
    # It published, then died before its transaction marked the row: the row is still PENDING.
    assert queue_length(queue) == 1
    [row] = outbox_rows(engine, job.name)
    assert row.status is OutboxStatus.PENDING and row.publishes == 0 and row.attempts == 0

    # A normal relay round publishes the row again: the broker now holds two copies of one job.
    assert Relay(app, db_url, sweep_interval=None).run_once().published == 1
    assert queue_length(queue) == 2
    [row] = outbox_rows(engine, job.name)
    assert row.status is OutboxStatus.SENT and row.publishes == 1

    with worker_factory(app):
        wait_for(
            lambda: job.outcome_counts().get("replayed", 0) >= 1,
            timeout=JOB_TIMEOUT,
            what="the second copy to be answered from the completed run",
        )
    assert count_rows(engine, executions_table, "crash:1") == 1
    assert count_rows(engine, effects_table, "crash:1") == 1
    run = Runs(db_url).get(job.name, "crash:1")
    assert run is not None and run.status is RunStatus.COMPLETED and run.token == 1 and run.attempts == 1
    counts = job.outcome_counts()
    # A copy that arrived while the other held the claim waited (in_progress), then replayed.
    assert counts.get("executed") == 1 and counts.get("replayed") == 1
    assert set(counts) <= {"executed", "replayed", "in_progress"}


# -- 3. two relay processes over one PostgreSQL outbox -------------------------------------------------------


def start_relay(name: str, db_url: str, queue: str, tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """Start `oncelery relay` on tests/apps/outbox_app.py in a session of its own; return it and its log."""
    log = tmp_path / f"relay-{name}.log"
    argv = [
        ONCELERY,
        "--database-url",
        db_url,
        "relay",
        "--app",
        f"{OUTBOX_APP}:app",
        "--interval",
        "0.05",
        "--sweep-interval",
        "off",
        "--retention",
        "off",
    ]
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            argv, cwd=REPO, env=relay_env(db_url, queue), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
    return proc, log


def relay_started(proc: subprocess.Popen[bytes], log: Path) -> bool:
    """Return whether the relay reported it is publishing (fail the test if it exited instead)."""
    text = log.read_text(errors="replace")
    if proc.poll() is not None:
        pytest.fail(f"relay exited with {proc.returncode}:\n{text}")
    return "relay: publishing the outbox of postgresql database" in text


def relay_totals(log: Path) -> dict[str, int]:
    """Return the totals a stopped relay printed on its "relay stopped: {json}" line."""
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if line.startswith("relay stopped: ")]
    assert len(lines) == 1, text
    return dict(json.loads(lines[0].removeprefix("relay stopped: ")))


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_two_relays_publish_five_hundred_rows_once_each(
    app: Celery, worker_factory: Any, db_url: str, queue: str, tmp_path: Path
) -> None:
    job = effect_task(app, "oncelery.t_outbox_bulk", "bulk:{n}")
    engine = get_engine(db_url)
    keys = [f"bulk:{n}" for n in range(BULK_JOBS)]
    relays: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        with worker_factory(app, concurrency=4):
            relays = [start_relay(name, db_url, queue, tmp_path) for name in ("a", "b")]
            for proc, log in relays:
                wait_for(partial(relay_started, proc, log), timeout=JOB_TIMEOUT, what=f"relay {proc.pid} to start")
            # Both relays are polling when the 500 rows commit at once: they race for the same rows.
            with engine.begin() as conn:
                for n in range(BULK_JOBS):
                    outbox.enqueue(conn, job, n)
            try:
                wait_for(
                    lambda: Runs(db_url).statuses(job.name, keys) == {RunStatus.COMPLETED: BULK_JOBS},
                    timeout=BULK_TIMEOUT,
                    interval=0.2,
                    what=f"all {BULK_JOBS} runs to complete",
                )
            except pytest.fail.Exception as exc:  # say where the jobs are: it failed once under a heavy load
                rows = outbox_rows(engine, job.name)
                found = {
                    "runs": Runs(db_url).statuses(job.name, keys),
                    "outbox": Counter(str(row.status) for row in rows),
                    "queued on Redis": redis.Redis.from_url(REDIS_URL).llen(queue),
                }
                pytest.fail(f"{exc}; found {found}")
            for proc, _ in relays:
                os.kill(proc.pid, signal.SIGTERM)
            codes = [proc.wait(timeout=STOP_TIMEOUT) for proc, _ in relays]
    finally:
        stop_sessions([proc for proc, _ in relays], grace=STOP_TIMEOUT)
        for proc, log in relays:
            print(f"===== relay pid={proc.pid} rc={proc.returncode} =====\n{log.read_text(errors='replace')}")

    assert codes == [0, 0]
    totals = [relay_totals(log) for _, log in relays]
    assert sum(t["published"] for t in totals) == BULK_JOBS
    assert all(t["republished"] == 0 and t["failed"] == 0 and t["dead"] == 0 for t in totals)
    rows = outbox_rows(engine, job.name)
    assert len(rows) == BULK_JOBS
    assert {row.status for row in rows} <= {OutboxStatus.SENT, OutboxStatus.DONE}
    assert sum(row.publishes for row in rows) == BULK_JOBS and {row.publishes for row in rows} == {1}
    assert executions_per_key(engine) == dict.fromkeys(keys, 1)
    assert count_rows(engine, effects_table) == BULK_JOBS
    assert job.outcome_counts() == {"executed": BULK_JOBS}


# -- 4. Redis flushed with the published jobs still queued ---------------------------------------------------


def test_jobs_lost_in_a_redis_flush_are_republished_from_the_outbox(
    app: Celery, worker_factory: Any, db_url: str, queue: str
) -> None:
    job = effect_task(app, "oncelery.t_outbox_flush", "flush:{n}")
    engine = get_engine(db_url)
    keys = [f"flush:{n}" for n in range(FLUSHED_JOBS)]
    with engine.begin() as conn:
        for n in range(FLUSHED_JOBS):
            outbox.enqueue(conn, job, n)
    relay = Relay(app, db_url, republish_after=0.5, sweep_interval=None)
    total = RelayRound()
    add_totals(total, relay.run_once())
    assert total.published == FLUSHED_JOBS
    assert queue_length(queue) == FLUSHED_JOBS

    # No worker yet: the broker loses every queued job (only the test's own Redis database is flushed).
    redis_db = str(make_url(REDIS_URL.replace("redis://", "redis+x://", 1)).database or "0")
    assert redis_cli("-n", redis_db, "FLUSHDB") == "OK"
    assert queue_length(queue) == 0

    def relay_round_then(done: Any) -> bool:
        add_totals(total, relay.run_once())
        return bool(done())

    with worker_factory(app):
        wait_for(
            lambda: relay_round_then(
                lambda: Runs(db_url).statuses(job.name, keys) == {RunStatus.COMPLETED: FLUSHED_JOBS}
            ),
            timeout=BULK_TIMEOUT,
            interval=0.1,
            what=f"all {FLUSHED_JOBS} flushed jobs to be re-published and complete",
        )
        # Rounds after that close every row: its run has completed.
        wait_for(
            lambda: relay_round_then(
                lambda: {row.status for row in outbox_rows(engine, job.name)} == {OutboxStatus.DONE}
            ),
            timeout=JOB_TIMEOUT,
            interval=0.1,
            what="every outbox row to be marked DONE",
        )

    assert total.published == FLUSHED_JOBS
    assert total.republished >= FLUSHED_JOBS  # each lost job came back from the outbox at least once
    assert total.done == FLUSHED_JOBS and total.failed == 0 and total.dead == 0
    assert executions_per_key(engine) == dict.fromkeys(keys, 1)
    assert count_rows(engine, effects_table) == FLUSHED_JOBS
    counts = job.outcome_counts()
    # A job re-published again before a worker reached it is a duplicate delivery: absorbed by the claim.
    assert counts.get("executed") == FLUSHED_JOBS
    assert set(counts) <= {"executed", "replayed", "in_progress"}
