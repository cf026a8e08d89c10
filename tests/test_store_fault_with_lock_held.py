"""SQLite's one store fault: another connection holds the write lock past busy_timeout at a call site.

The delivery waits out busy_timeout, gives up (re-sent, never acked as failed), and once the lock is gone the
job ends once: at the claim and the completion, at a checkpoint, at the effects' BEGIN IMMEDIATE, at the
failure record, where a replay is counted, and at a lease renewal. The job, the faults and the checks:
tests/store_faults.py.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery

from oncelery import RunStatus
from oncelery.runs.faults import fault_injected
from oncelery.settings import ENV_SQLITE_BUSY_TIMEOUT, sqlite_busy_timeout_ms
from oncelery.store.database import dispose_engines
from tests.conftest import running_worker
from tests.services import effects_table, executions_table, wait_for
from tests.store_faults import (
    JOB_TIMEOUT,
    Db,
    LogLines,
    Once,
    assert_once,
    define_job,
    define_renewal_job,
    expected,
    job_key,
    report,
)


class WriteLock:
    """Another connection holding SQLite's write lock (BEGIN IMMEDIATE) until released."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.conn: sqlite3.Connection | None = None
        self.taken_at = 0.0
        self._guard = threading.Lock()

    def hold(self) -> None:
        with self._guard:
            if self.conn is None:
                conn = sqlite3.connect(self.path, timeout=20, isolation_level=None, check_same_thread=False)
                conn.execute("BEGIN IMMEDIATE")
                self.conn, self.taken_at = conn, time.monotonic()

    def release(self) -> float:
        """Roll back and close; return how long the lock was held."""
        with self._guard:
            conn, self.conn = self.conn, None
            if conn is None:
                return 0.0
            conn.execute("ROLLBACK")
            conn.close()
            return time.monotonic() - self.taken_at


@pytest.fixture
def short_lock(sqlite_db: Db, monkeypatch: pytest.MonkeyPatch) -> Iterator[WriteLock]:
    """The write lock of `sqlite_db`'s file, to hold in a fault hook; busy_timeout is 1 s for the worker's engines."""
    monkeypatch.setenv(ENV_SQLITE_BUSY_TIMEOUT, "1")
    dispose_engines()  # the worker's engines are made anew, with the shorter timeout
    lock = WriteLock(sqlite_db.url.removeprefix("sqlite:///"))
    try:
        yield lock
    finally:
        lock.release()


def release_once_given_up(lock: WriteLock, logs: LogLines, what: str, *line: str) -> float:
    """Wait for the log line (`line`'s parts) that says the worker gave up on the held lock; release it; return
    how long it was held."""
    wait_for(lambda: logs.has(*line), timeout=JOB_TIMEOUT, interval=0.1, what=what)
    return lock.release()


@pytest.mark.timeout(180)
def test_sqlite_lock_held_past_busy_timeout_at_claim_and_complete(
    sqlite_db: Db, sqlite_app: Celery, logs: LogLines, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both jobs wait out busy_timeout (5 s here, $ONCELERY_SQLITE_BUSY_TIMEOUT) on the same held lock.

    At "complete" the job has no effects() block: a body that writes effects holds the write lock itself
    from its first block to its completion (BEGIN IMMEDIATE), so its completion can never wait on a lock.
    """
    monkeypatch.setenv(ENV_SQLITE_BUSY_TIMEOUT, "5")
    dispose_engines()  # the worker's engines are made anew, with the shorter timeout
    path = sqlite_db.url.removeprefix("sqlite:///")
    lock = WriteLock(path)
    at_claim = define_job(sqlite_app, sqlite_db, "oncelery.t_lock_claim")
    at_complete = define_job(sqlite_app, sqlite_db, "oncelery.t_lock_complete", effects=False)
    n_claim, n_complete = 5, 6
    hold_at_claim = Once(lock.hold, job_key(n_claim))
    hold_at_complete = Once(lock.hold, job_key(n_complete))

    def only(task_name: str, hook: Once) -> Callable[[str, dict[str, Any]], None]:
        return lambda name, ctx: hook(name, ctx) if ctx.get("task") == task_name else None

    try:
        with (
            running_worker(sqlite_app, concurrency=4),
            fault_injected("claim", only(at_claim.name, hold_at_claim)),
            fault_injected("complete", only(at_complete.name, hold_at_complete)),
        ):
            r_complete = at_complete.delay(n_complete)
            wait_for(hold_at_complete.injected.is_set, timeout=JOB_TIMEOUT, what="the lock taken at complete")
            r_claim = at_claim.delay(n_claim)
            wait_for(hold_at_claim.injected.is_set, timeout=JOB_TIMEOUT, what="the claim to reach the lock")
            busy = sqlite_busy_timeout_ms() / 1000
            assert busy == 5
            # Released only after the worker has seen both statements fail (each waited out busy_timeout).
            wait_for(
                lambda: (
                    logs.has("claims database failed finishing", f"{at_complete.name}[{job_key(n_complete)}]")
                    and logs.has("claims database failed delivering", f"{at_claim.name}[{job_key(n_claim)}]")
                ),
                timeout=busy + 60,
                interval=0.1,
                what="both deliveries to give up on the lock",
            )
            held = lock.release()
            assert held >= busy, f"the lock was held {held:.1f}s, less than busy_timeout {busy}s"
            claim_counts = assert_once(sqlite_db, at_claim, n_claim, r_claim, logs)
            key = job_key(n_complete)
            wait_for(lambda: sqlite_db.completed(at_complete.name, key), timeout=JOB_TIMEOUT, what="completion")
            value = r_complete.get(timeout=JOB_TIMEOUT)
    finally:
        lock.release()

    detail = report(sqlite_db, at_complete.name, key, logs)
    run = sqlite_db.run(at_complete.name, key)
    counts = sqlite_db.counts(at_complete.name)
    assert run is not None and run.status is RunStatus.COMPLETED and run.result == expected(n_complete), detail
    assert value == expected(n_complete), detail
    assert counts.get("executed", 0) + counts.get("resumed", 0) == 1 and counts.get("failed", 0) == 0, detail
    # Its steps were checkpointed before the lock: the re-run replayed them instead of executing them again.
    assert sqlite_db.rows(executions_table, f"{key}/first") == 1, detail
    assert sqlite_db.rows(executions_table, f"{key}/second") == 1, detail
    print(f"sqlite lock: held={held:.1f}s claim outcomes={claim_counts} complete outcomes={counts}")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", ("step_save", "effects_begin", "record_failure"))
def test_sqlite_lock_held_past_busy_timeout_at_each_stage_ends_once(
    stage: str, sqlite_db: Db, sqlite_app: Celery, logs: LogLines, short_lock: WriteLock
) -> None:
    """The stages between the claim and the completion, on SQLite: another connection holds the write lock
    past busy_timeout right before the stage's statement; the delivery gives up on it (re-sent, not failed),
    and once the lock is gone the job ends once, its effect written once.

    The effects' lock wait is at their transaction's BEGIN IMMEDIATE (effects_begin): inside a block the run
    holds the write lock itself until its completion, so no other connection can take it at effects_flush.
    Reads (load_checkpoints, a replay's answer) never wait on the write lock in WAL mode: no stage of theirs.
    """
    n = 8
    key = job_key(n)
    job = define_job(sqlite_app, sqlite_db, f"oncelery.t_lock_{stage}", fail_once=stage == "record_failure")
    hook = Once(short_lock.hold, key)
    with running_worker(sqlite_app, concurrency=2), fault_injected(stage, hook):
        result = job.delay(n)
        wait_for(hook.injected.is_set, timeout=JOB_TIMEOUT, what=f"the lock taken at {stage!r}")
        what = f"the delivery to give up on the lock at {stage!r}"
        held = release_once_given_up(short_lock, logs, what, "claims database failed", key)
        counts = assert_once(sqlite_db, job, n, result, logs)
    assert hook.error is None, f"the lock could not be taken at {stage!r}: {hook.error!r}"
    assert held >= 1, f"the lock was held {held:.1f}s, less than busy_timeout 1s"
    print(f"sqlite lock at {stage}: held={held:.1f}s outcomes={counts}")


@pytest.mark.timeout(180)
def test_sqlite_lock_held_past_busy_timeout_counting_a_replay_counts_it_once(
    sqlite_db: Db, sqlite_app: Celery, logs: LogLines, short_lock: WriteLock
) -> None:
    """On SQLite a duplicate is answered by a read and counted by a write of its own: the write lock held past
    busy_timeout there sends the duplicate again (uncounted is unsettled), and it is answered and counted once."""
    n = 9
    key = job_key(n)
    job = define_job(sqlite_app, sqlite_db, "oncelery.t_lock_count")
    hook = Once(short_lock.hold, key)
    with running_worker(sqlite_app, concurrency=2):
        assert_once(sqlite_db, job, n, job.delay(n), logs)
        with fault_injected("count_outcome", hook):
            again = job.delay(n)
            wait_for(hook.injected.is_set, timeout=JOB_TIMEOUT, what="the lock taken at the replay's count")
            what = "the duplicate to give up on the lock"
            held = release_once_given_up(short_lock, logs, what, "claims database failed", key)
            assert again.get(timeout=JOB_TIMEOUT) == expected(n), report(sqlite_db, job.name, key, logs)
    assert hook.error is None, f"the lock could not be taken: {hook.error!r}"
    assert held >= 1, f"the lock was held {held:.1f}s, less than busy_timeout 1s"
    detail = report(sqlite_db, job.name, key, logs)
    counts = sqlite_db.counts(job.name)
    assert counts == {"executed": 1, "replayed": 1}, detail
    assert sqlite_db.rows(effects_table, key) == 1, detail
    run = sqlite_db.run(job.name, key)
    assert run is not None and run.replays == 1, detail


@pytest.mark.timeout(180)
def test_sqlite_lock_held_past_busy_timeout_at_a_lease_renewal_ends_once(
    sqlite_db: Db, sqlite_app: Celery, logs: LogLines, short_lock: WriteLock
) -> None:
    """A renewal meets SQLite's write lock held by another connection past busy_timeout: it fails, the
    heartbeat keeps trying, a renewal lands once the lock is gone, and the job completes once (never fenced).

    The renewal is fenced by token only, so a lease that lapsed while the lock was held is renewed as long as
    no other delivery took the run over (none is sent here).
    """
    lock = short_lock
    n = 13
    key = job_key(n)
    name = "oncelery.t_lock_heartbeat"
    hold = Once(lock.hold, key)
    seen: list[Any] = []

    def renewed_after_the_lock() -> bool:
        run = sqlite_db.run(name, key)
        if run is None or not hold.injected.is_set() or lock.conn is not None:
            return False
        seen.append(run.lease_expires_at)
        return len(seen) > 1 and seen[-1] > seen[0]

    job = define_renewal_job(sqlite_app, name, 3.0, renewed_after_the_lock)

    with running_worker(sqlite_app, concurrency=2), fault_injected("heartbeat", hold):
        result = job.delay(n)
        wait_for(hold.injected.is_set, timeout=JOB_TIMEOUT, what="the lock taken at a renewal")
        held = release_once_given_up(lock, logs, "the renewal to give up on the lock", "heartbeat for", key, "failed")
        assert result.get(timeout=JOB_TIMEOUT) == expected(n), report(sqlite_db, name, key, logs)
    assert hold.error is None, f"the lock could not be taken: {hold.error!r}"
    assert held >= 1, f"the lock was held {held:.1f}s, less than busy_timeout 1s"
    detail = report(sqlite_db, name, key, logs)
    assert sqlite_db.rows(effects_table, key) == 1, detail
    run = sqlite_db.run(name, key)
    assert run is not None and run.status is RunStatus.COMPLETED and run.token == 1, detail
    assert sqlite_db.counts(name) == {"executed": 1}, detail
    assert not logs.has("lease lost for", key), detail
