"""A run's retries belong to the run: its countdown holds off duplicates, and its retry budget is not reset.

A duplicate that arrives during self.retry(countdown=...) waits for it; a new message for a run that spent
its retries does not get a fresh allowance. On SQLite and PostgreSQL, through a real worker on Redis.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from celery import Celery

from oncelery import IdempotentTask, Runs, RunStatus
from oncelery.runs.claims import RunStore
from tests.conftest import ON_SQLITE
from tests.services import wait_for


def test_a_retry_countdown_holds_off_duplicates(app: Celery, worker_factory: Any, db_url: str) -> None:
    """self.retry(countdown=2): a duplicate arriving meanwhile waits; the body runs again only after it."""
    runs: list[float] = []

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_countdown",
        idempotency_key="c:{n}",
        max_retries=3,
    )
    def paid(self: IdempotentTask, n: int) -> int:
        runs.append(time.monotonic())
        if len(runs) == 1:
            raise self.retry(countdown=2)
        return n

    with worker_factory(app, concurrency=4):
        first = paid.delay(5)
        wait_for(lambda: runs, timeout=60, what="the first attempt")
        run = wait_for(
            lambda: (
                (r := Runs(db_url).get("oncelery.t_countdown", "c:5")) is not None
                and r.status is RunStatus.FAILED
                and r
            ),
            timeout=60,
            what="the run recorded FAILED with its countdown",
        )
        assert run.retry_wait and run.retries == 1
        duplicates = [paid.delay(5) for _ in range(3)]
        assert [d.get(timeout=90) for d in duplicates] == [5, 5, 5]
        assert first.get(timeout=90) == 5

    assert len(runs) == 2  # two paid calls in all, not one per waiting copy
    assert runs[1] - runs[0] >= 1.5  # the countdown held (database clock; a little slack for clock reads)
    counts = paid.outcome_counts()
    assert counts.get("executed", 0) + counts.get("resumed", 0) == 1


def test_retries_are_counted_per_run_not_per_message(db_url: str) -> None:
    """A new message for a run that spent its retries does not get a fresh allowance."""
    app = Celery("per-run-retries")
    app.conf.oncelery_database_url = db_url
    app.conf.task_always_eager = False
    attempts: list[int] = []
    barrier = threading.Event()

    @app.task(
        shared=False, base=IdempotentTask, bind=True, name="oncelery.t_budget", idempotency_key="b:{n}", max_retries=1
    )
    def flaky(self: IdempotentTask, n: int) -> int:
        attempts.append(self.request.retries)
        barrier.set()
        return n

    app.finalize()
    store = RunStore(db_url)
    ident = flaky.identity_of((1,))
    claimed = store.claim("oncelery.t_budget", ident, lease=30)
    assert claimed.claim is not None
    assert store.fail(claimed.claim, "retry requested", retry_in=0.0)
    # The run has spent one retry; a fresh message (request.retries == 0) runs with the run's count.
    assert flaky(1) == 1
    assert attempts == [1]


@ON_SQLITE
def test_a_naive_retry_eta_means_utc_to_the_run_as_to_celery(app: Celery, worker_factory: Any, db_url: str) -> None:
    """Suspected: with enable_utc=False a naive `eta` shifts the run's not_before by the UTC offset. Refuted:
    Celery's worker reads a naive ETA as UTC (celery.utils.time.maybe_make_aware, naive_as_utc), and so does the
    run. With timezone=America/New_York, a naive ETA of local time + 60 s is 5 h in the past for Celery: its retry
    arrives at once, and the run's not_before is that same moment (read as UTC), so no duplicate waits longer."""
    app.conf.update(enable_utc=False, timezone="America/New_York")
    zone = ZoneInfo("America/New_York")
    etas: list[datetime] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_naive_eta", max_retries=3)
    def later(self: IdempotentTask, n: int) -> int:
        if not etas:
            etas.append(datetime.now(zone).replace(tzinfo=None) + timedelta(seconds=60))  # naive, local time
            raise self.retry(eta=etas[0])
        return n

    with worker_factory(app):
        started = time.monotonic()
        assert later.delay(1).get(timeout=60) == 1
        took = time.monotonic() - started
        run = Runs(db_url).list(task_name=later.name)[0]
    assert took < 30, f"the retry waited {took:.0f} s: Celery read the naive ETA as local time"
    assert run.status is RunStatus.COMPLETED and run.retries == 1
    waited_until = datetime.now(UTC) - timedelta(hours=4)  # New York is 4-5 h behind UTC
    assert etas[0].replace(tzinfo=UTC) < waited_until, "the naive ETA was read in local time, not UTC"
