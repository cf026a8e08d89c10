"""The relay's other duties: backing off (then DEAD) while the broker is down, the beat task, bulk dlq replay."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from celery import Celery
from click.testing import CliRunner
from sqlalchemy import delete, select
from sqlalchemy.engine import Engine

from oncelery import DeadLetters, IdempotentTask, Relay, Runs, RunStatus, install_relay_task, outbox
from oncelery.cli import oncelery
from oncelery.models import OutboxMessage, OutboxStatus
from tests.conftest import ON_SQLITE
from tests.services import wait_for

TIMEOUT = 60.0


def _rows(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(OutboxMessage.__table__).order_by(OutboxMessage.__table__.c.id)).all())


@ON_SQLITE
def test_a_broker_that_is_down_backs_off_then_marks_the_row_dead(db_url: str, db_engine: Engine) -> None:
    down = Celery("broker-down", broker="redis://127.0.0.1:1/0")  # nothing listens on port 1
    down.conf.broker_connection_retry_on_startup = False
    down.conf.broker_connection_timeout = 0.5  # how long one publish may wait for the broker (default 4 s)
    try:
        with db_engine.begin() as conn:
            task_id = outbox.enqueue(conn, down.signature("oncelery.t_never_published", [1]))
            later_id = outbox.enqueue(conn, down.signature("oncelery.t_never_published", [2]))
        relay = Relay(down, db_url, max_attempts=2, sweep_interval=None)  # backed off once (1 s), then DEAD
        first = relay.run_once()
        assert (first.published, first.failed, first.dead) == (0, 1, 0)
        row, later = _rows(db_engine)
        assert row.status is OutboxStatus.PENDING and row.attempts == 1 and row.last_error
        # The broker failed, not the row: the round stopped there, the next row untouched (not backed off).
        assert later.celery_task_id == later_id and later.attempts == 0 and later.last_error is None
        with db_engine.begin() as conn:
            conn.execute(delete(OutboxMessage.__table__).where(OutboxMessage.__table__.c.id == later.id))
        # Backed off: the next round right away does not try the row again (it is not due yet).
        assert relay.run_once().failed == 0
        totals = {"dead": 0}

        def dead() -> bool:
            totals["dead"] += relay.run_once().dead
            return totals["dead"] == 1

        wait_for(dead, timeout=TIMEOUT, interval=0.2, what="the row to be marked DEAD after 2 failed publishes")
        [row] = _rows(db_engine)
        assert row.status is OutboxStatus.DEAD and row.attempts == 2 and row.celery_task_id == task_id
        assert row.publishes == 0 and row.sent_at is None
        assert relay.run_once().failed == 0  # a DEAD row is never tried again
    finally:
        down.close()


def test_the_beat_task_relays_from_a_worker(app: Celery, worker_factory: Any, db_url: str, db_engine: Engine) -> None:
    ran: list[int] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_beat_job", idempotency_key="beat:{n}")
    def job(self: IdempotentTask, n: int) -> int:
        ran.append(n)
        return n * 2

    relay_task = install_relay_task(app, every=1.0, url=db_url)
    assert app.conf.beat_schedule["oncelery-relay-outbox"] == {"task": "oncelery.relay_outbox", "schedule": 1.0}
    with db_engine.begin() as conn:
        task_id = outbox.enqueue(conn, job, 21)
    with worker_factory(app):
        relay_task.delay()  # what beat sends every second
        assert app.AsyncResult(task_id).get(timeout=TIMEOUT) == 42
    [row] = _rows(db_engine)
    assert row.status is OutboxStatus.SENT and row.publishes == 1
    assert ran == [21] and job.outcome_counts() == {"executed": 1}


def test_dlq_replay_in_bulk_by_task(app: Celery, worker_factory: Any, db_url: str) -> None:
    broken = {"a": True, "b": True}

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_bulk_a", max_retries=0)
    def task_a(self: IdempotentTask, n: int) -> int:
        if broken["a"]:
            raise RuntimeError("a is broken")
        return n

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_bulk_b", max_retries=0)
    def task_b(self: IdempotentTask, n: int) -> int:
        if broken["b"]:
            raise RuntimeError("b is broken")
        return n

    runner = CliRunner()
    runs = Runs(db_url)

    def invoke(*args: str) -> Any:
        return runner.invoke(oncelery, ["--database-url", db_url, "dlq", *args], obj=SimpleNamespace(app=app))

    with worker_factory(app):
        for result in [task_a.delay(1), task_a.delay(2), task_b.delay(3)]:
            wait_for(lambda r=result: r.ready(), timeout=TIMEOUT, what="the failure")
        assert {r.status for r in runs.list(limit=None)} == {RunStatus.DEAD}
        refused = invoke("replay")
        assert refused.exit_code == 2 and "--all" in refused.output  # never everything by accident
        broken["a"] = False
        done = invoke("replay", "--task", "oncelery.t_bulk_a")
        assert done.exit_code == 0, done.output
        assert "2 replayed, 0 skipped" in done.output

        def a_completed() -> bool:
            return {r.status for r in runs.list(task_name="oncelery.t_bulk_a", limit=None)} == {RunStatus.COMPLETED}

        wait_for(a_completed, timeout=TIMEOUT, what="both replayed runs of task a")
    b_runs = runs.list(task_name="oncelery.t_bulk_b", limit=None)
    assert [r.status for r in b_runs] == [RunStatus.DEAD]  # the filter left task b's letter alone
    letters = DeadLetters(db_url)
    assert [x.task_name for x in letters.list()] == ["oncelery.t_bulk_b"]
    assert sorted(x.replays for x in letters.list(task_name="oncelery.t_bulk_a", include_replayed=True)) == [1, 1]
