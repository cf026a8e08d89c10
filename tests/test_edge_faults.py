# ruff: noqa: F811  (the fixtures imported from test_store_faults are test parameters by name)
"""G8 on the delivery edges (issue 9): the database breaks at each new call site, and nothing is lost or doubled.

The new fault points: "version_check" (a versioned event reads its entity's applied version), "dead_letter"
(a poison run is made DEAD; a conflicting payload's run-less letter is written), "record_failure" when the
run goes DEAD (retries exhausted, its letter in the same transaction) and "complete" when the completion
advances the entity's version. The outbox relay is a database client too: it serves through killed backends
and a server restart.

A real in-process Celery worker (threads pool, real Redis) runs the jobs against the throwaway PostgreSQL
cluster of tests/pg_cluster.py (backends terminated, or the server restarted, right at the point). SQLite's
one fault (a write lock held past busy_timeout, 30 s per test) is exercised by tests/test_store_faults.py on
the shared paths (claim, completion, failure record) that these points lead into.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import insert, text

from oncelery import (
    IdempotencyConflict,
    IdempotentTask,
    LeaseLost,
    Relay,
    RelayRound,
    RunIsDead,
    RunStatus,
    outbox,
    testing,
)
from oncelery.runs.faults import fault_injected
from tests.conftest import running_worker
from tests.pg_cluster import pg_cluster  # noqa: F401  (the module's throwaway cluster)
from tests.services import effects_table, executions_table, wait_for
from tests.test_store_faults import (  # noqa: F401  (fixtures are used by name)
    FAULTS,
    JOB_TIMEOUT,
    LEASE,
    Db,
    LogLines,
    Once,
    WriteLock,
    assert_once,
    define_job,
    expected,
    fault_of,
    job_key,
    logs,
    pg_app,
    pg_db,
    report,
    retrying,
)

VERSION = 3
RELAY_JOBS = 200
RELAY_BATCH = 20
# The relay's publishing rounds (1-based) that meet a fault right after publishing, before marking rows SENT.
RELAY_FAULTS = {2: "terminate", 4: "terminate", 6: "restart", 8: "terminate"}
RELAY_TIMEOUT = 120.0

Hook = Callable[[str, dict[str, Any]], None]


# -- observations (always on the observer's own connections, never the worker's pools) -----------------------


def query(db: Db, sql: str, **params: Any) -> list[Any]:
    """Run `sql` on the observer (retried past a fault) and return its rows."""

    def once() -> list[Any]:
        with db.observer.connect() as conn:
            return list(conn.execute(text(sql), params).all())

    return retrying(once, f"running {sql[:40]!r}")


def status_of(db: Db, task_name: str, key: str) -> str | None:
    rows = query(db, "SELECT status FROM task_runs WHERE task_name = :t AND idempotency_key = :k", t=task_name, k=key)
    return str(rows[0][0]) if rows else None


def applied_version(db: Db, task_name: str, entity: str) -> int | None:
    rows = query(db, "SELECT version FROM entity_versions WHERE task_name = :t AND entity = :e", t=task_name, e=entity)
    return int(rows[0][0]) if rows else None


def letters(db: Db, task_name: str, key: str) -> list[Any]:
    """(reason, run_id, attempts) of every dead letter of (task, key)."""
    return query(
        db,
        "SELECT reason, run_id, attempts FROM dead_letters WHERE task_name = :t AND idempotency_key = :k ORDER BY id",
        t=task_name,
        k=key,
    )


def run_row(db: Db, task_name: str, key: str) -> Any:
    """(id, status, lost, attempts, retries, lease expired by the database clock) of the run."""
    now = "clock_timestamp()" if db.url.startswith("postgresql") else "strftime('%Y-%m-%d %H:%M:%f', 'now')"
    rows = query(
        db,
        "SELECT id, status, lost, attempts, retries, "
        f"(lease_expires_at IS NULL OR lease_expires_at < {now}) AS expired "
        "FROM task_runs WHERE task_name = :t AND idempotency_key = :k",
        t=task_name,
        k=key,
    )
    return rows[0] if rows else None


def expire_lease(db: Db, task_name: str, key: str) -> None:
    """Move the run's lease into the past by the database clock (the kit's helper, retried past a fault)."""
    retrying(lambda: testing.expire_lease(db.url, task_name, key), "expiring a lease")


def only_for(task_name: str, key: str, hook: Hook) -> Hook:
    """`hook`, called only when the point is reached for this task and key."""

    def call(name: str, ctx: dict[str, Any]) -> None:
        if ctx.get("task") == task_name and ctx.get("key") == key:
            hook(name, ctx)

    return call


def on_retried_run(db: Db, task_name: str, key: str, hook: Hook) -> Hook:
    """`hook`, called only when the run has already spent a retry: its last attempt (max_retries=1)."""

    def call(name: str, ctx: dict[str, Any]) -> None:
        if ctx.get("task") != task_name or ctx.get("key") != key:
            return
        row = run_row(db, task_name, key)
        if row is not None and row.retries >= 1:
            hook(name, ctx)

    return call


# -- the jobs ---------------------------------------------------------------------------------------------


def define_versioned(app: Celery, db: Db, name: str, *, effects: bool = True) -> Any:
    """A versioned event (entity "e:{n}", version argument `version`) that writes one effect row.

    Keyed and valued like test_store_faults' job (key "fault:{n}", result expected(n)), so `assert_once`
    applies; with effects=False the completion commits in a transaction of its own (the version with it).
    """

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name=name,
        idempotency_key="fault:{n}",
        entity="e:{n}",
        entity_version="version",
        lease=LEASE,
    )
    def job(self: IdempotentTask, n: int, version: int) -> dict[str, int]:
        key = job_key(n)
        db.record(executions_table, key)
        if effects:
            with self.effects() as session:
                session.execute(insert(effects_table).values(key=key, pid=os.getpid()))
        return expected(n)

    return job


def define_doomed(app: Celery, db: Db, name: str) -> Any:
    """A job that always raises, auto-retried once (max_retries=1): its second failure makes the run DEAD."""

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name=name,
        idempotency_key="fault:{n}",
        lease=LEASE,
        autoretry_for=(RuntimeError,),
        max_retries=1,
        retry_kwargs={"countdown": 0.2},
    )
    def job(self: IdempotentTask, n: int) -> None:
        db.record(executions_table, job_key(n))
        raise RuntimeError(f"the model refuses job {n}")

    return job


def warm_up(app: Celery, db: Db) -> Any:
    """A plain job run once first: it fills the worker's pools, so the fault leaves dead sockets in them."""
    return define_job(app, db, "oncelery.t_edge_warmup")


# -- 1. the version check -------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["terminate"])  # a restart at this read is the claim's restart case
def test_a_fault_at_the_version_check_ends_once(fault: str, pg_db: Db, pg_app: Celery, logs: LogLines) -> None:
    n = 11
    key = job_key(n)
    warm = warm_up(pg_app, pg_db)
    job = define_versioned(pg_app, pg_db, f"oncelery.t_edge_version_{fault}")
    killed: list[int] = []
    hook = Once(fault_of(fault, pg_db, killed))

    with running_worker(pg_app, concurrency=4):
        assert warm.delay(1).get(timeout=JOB_TIMEOUT) == expected(1)
        with fault_injected("version_check", only_for(job.name, key, hook)):
            result = job.delay(n, VERSION)
            wait_for(hook.injected.is_set, timeout=JOB_TIMEOUT, what="the fault at 'version_check'")
            counts = assert_once(pg_db, job, n, result, logs)

    detail = report(pg_db, job.name, key, logs)
    assert hook.error is None, f"the fault could not be injected: {hook.error!r}"
    assert killed and killed[0] != 0, f"no backend to kill: {killed}"
    # The fault bit the version read itself (then the job was sent again, not acked).
    assert logs.has("claims database failed checking the version of", f"[{key}]"), detail
    assert applied_version(pg_db, job.name, f"e:{n}") == VERSION, detail
    assert counts.get("stale", 0) == 0, detail
    print(f"version_check/{fault}: outcomes={counts} killed={killed}")


# -- 2. the versioned completion ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "effects"),
    [("terminate", True), ("restart", True), ("terminate", False)],
    ids=["terminate-effects", "restart-effects", "terminate-own-transaction"],
)
def test_a_fault_at_the_versioned_completion_applies_the_version_once(
    fault: str, effects: bool, pg_db: Db, pg_app: Celery, logs: LogLines
) -> None:
    n = 12
    key = job_key(n)
    warm = warm_up(pg_app, pg_db)
    job = define_versioned(pg_app, pg_db, f"oncelery.t_edge_vcomplete_{fault}_{effects}", effects=effects)
    killed: list[int] = []
    hook = Once(fault_of(fault, pg_db, killed))

    with running_worker(pg_app, concurrency=4):
        assert warm.delay(1).get(timeout=JOB_TIMEOUT) == expected(1)
        with fault_injected("complete", only_for(job.name, key, hook)):
            result = job.delay(n, VERSION)
            wait_for(hook.injected.is_set, timeout=JOB_TIMEOUT, what="the fault at 'complete'")
            if effects:
                counts = assert_once(pg_db, job, n, result, logs)
            else:
                # No effects() block: the stored result and the entity's version are what happen once.
                wait_for(
                    lambda: pg_db.completed(job.name, key) or result.state == "FAILURE",
                    timeout=JOB_TIMEOUT,
                    what="the run to complete",
                )
                assert result.get(timeout=JOB_TIMEOUT) == expected(n), report(pg_db, job.name, key, logs)
                counts = pg_db.counts(job.name)

    detail = report(pg_db, job.name, key, logs)
    assert hook.error is None, f"the fault could not be injected: {hook.error!r}"
    assert killed and killed[0] != 0, f"no backend to kill: {killed}"
    assert logs.has("claims database failed finishing", f"[{key}]"), detail
    run = pg_db.run(job.name, key)
    assert run is not None and run.status is RunStatus.COMPLETED and run.result == expected(n), detail
    assert counts.get("executed", 0) + counts.get("resumed", 0) == 1, detail
    assert counts.get("failed", 0) == 0 and counts.get("stale", 0) == 0, detail
    assert applied_version(pg_db, job.name, f"e:{n}") == VERSION, detail
    # The faulted completion rolled back: the body ran twice, the re-sent delivery took the given-up run over.
    assert pg_db.rows(executions_table, key) == 2, detail
    print(f"complete(version)/{fault}/effects={effects}: outcomes={counts} killed={killed}")


# -- 3. the failure that makes the run DEAD (retries exhausted) --------------------------------------------


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_recording_the_dead_failure_ends_dead_once(
    fault: str, pg_db: Db, pg_app: Celery, logs: LogLines
) -> None:
    """Attempt 1 fails and is retried; attempt 2 (the last) meets the fault as it records the run DEAD.

    Its failure is not acked: the job is sent again and takes the run over at once (it names the holder that
    gave up, so no lease wait and no lost delivery), fails again (retries spent) and records the run DEAD with
    its one letter. Outcomes: `failed` 1 (attempt 1's retry is recorded as a failure) and `dead` exactly 1
    (the faulted transaction rolled back, so only the taker's DEAD counted).
    """
    n = 13
    key = job_key(n)
    warm = warm_up(pg_app, pg_db)
    job = define_doomed(pg_app, pg_db, f"oncelery.t_edge_dead_{fault}")
    killed: list[int] = []
    hook = Once(fault_of(fault, pg_db, killed))

    with running_worker(pg_app, concurrency=4):
        assert warm.delay(1).get(timeout=JOB_TIMEOUT) == expected(1)
        with fault_injected("record_failure", on_retried_run(pg_db, job.name, key, hook)):
            result = job.delay(n)
            wait_for(hook.injected.is_set, timeout=JOB_TIMEOUT, what="the fault at the last 'record_failure'")
            try:
                wait_for(
                    lambda: status_of(pg_db, job.name, key) == RunStatus.DEAD.value,
                    timeout=JOB_TIMEOUT,
                    interval=0.1,
                    what="the run to go DEAD",
                )
            except pytest.fail.Exception:
                pytest.fail(f"the run did not go DEAD\n{report(pg_db, job.name, key, logs)}")
            with pytest.raises(RuntimeError, match=f"refuses job {n}"):
                result.get(timeout=JOB_TIMEOUT)

    detail = report(pg_db, job.name, key, logs)
    assert hook.error is None, f"the fault could not be injected: {hook.error!r}"
    assert killed and killed[0] != 0, f"no backend to kill: {killed}"
    assert logs.has("could not record failure of", f"[{key}]"), detail
    assert logs.has("claims database failed recording the failure of", f"[{key}]"), detail
    run = run_row(pg_db, job.name, key)
    assert run is not None and run.status == RunStatus.DEAD.value and run.retries == 1, f"{run}\n{detail}"
    # The re-sent message named the holder that gave up: it took the run over at once, not as a lost delivery.
    assert run.lost == 0, f"the re-sent delivery counted its own given-up run as lost: {run}\n{detail}"
    found = letters(pg_db, job.name, key)
    assert len(found) == 1, f"dead letters: {found}\n{detail}"
    assert found[0].reason == "retries_exhausted" and found[0].run_id == run.id, f"{found}\n{detail}"
    counts = pg_db.counts(job.name)
    assert counts.get("dead") == 1 and counts.get("failed") == 1, detail
    assert set(counts) <= {"dead", "failed"}, detail
    # Attempt 1, attempt 2 (its DEAD rolled back by the fault), and the taker that recorded it.
    assert pg_db.rows(executions_table, key) == 3, detail
    print(f"record_failure(dead)/{fault}: outcomes={counts} killed={killed}")


# -- 4. the poison kill (max_deliveries lost deliveries) ---------------------------------------------------


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_killing_a_poison_run_ends_dead_once(fault: str, pg_db: Db, pg_app: Celery, logs: LogLines) -> None:
    """max_deliveries=2: two deliveries vanish mid-body, the third meets the fault as it makes the run DEAD.

    A vanished holder, for real: a delivery (a direct call, in a thread) whose body blocks while its heartbeat
    stops (max_lease), after which the test expires its lease by the database clock. The second delivery
    takes the run over (lost=1) and vanishes the same way. The worker's delivery then finds lost + 1 >=
    max_deliveries and meets the fault before the kill: it is sent again, and its copy kills the run.
    """
    n = 14
    key = job_key(n)
    gate = threading.Event()
    bodies: list[int] = []
    guard = threading.Lock()

    @pg_app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name=f"oncelery.t_edge_poison_{fault}",
        idempotency_key="fault:{n}",
        lease=LEASE,
        max_lease=0.3,
        max_deliveries=2,
    )
    def poison(self: IdempotentTask, n: int) -> dict[str, int]:
        pg_db.record(executions_table, job_key(n))
        with guard:
            bodies.append(n)
            holder = len(bodies) <= 2
        if holder and not gate.wait(JOB_TIMEOUT + 30):
            raise TimeoutError("the test never released the vanished holder")
        return expected(n)

    pg_app.finalize()
    killed: list[int] = []
    hook = Once(fault_of(fault, pg_db, killed))
    ended: list[BaseException | object] = []
    holders: list[threading.Thread] = []

    def deliver_and_vanish() -> None:
        try:
            ended.append(poison(n))
        except BaseException as exc:
            ended.append(exc)

    try:
        for token in (1, 2):
            holder = threading.Thread(target=deliver_and_vanish, name=f"vanishing-holder-{token}", daemon=True)
            holders.append(holder)
            holder.start()
            wait_for(
                lambda token=token: logs.has(f"{poison.name}[{key}] token={token} ran past its max_lease"),
                timeout=JOB_TIMEOUT,
                what=f"the heartbeat of holder {token} to stop",
            )
            expire_lease(pg_db, poison.name, key)
        run = run_row(pg_db, poison.name, key)
        assert run is not None and run.status == "RUNNING" and run.lost == 1 and run.expired, run

        with running_worker(pg_app, concurrency=4), fault_injected("dead_letter", only_for(poison.name, key, hook)):
            result = poison.delay(n)
            with pytest.raises(RunIsDead, match="poison message"):
                result.get(timeout=JOB_TIMEOUT)
    finally:
        gate.set()
        for holder in holders:
            holder.join(30)
    assert not any(h.is_alive() for h in holders), "a vanished holder did not end"

    detail = report(pg_db, poison.name, key, logs)
    assert hook.error is None, f"the fault could not be injected: {hook.error!r}"
    assert killed and killed[0] != 0, f"no backend to kill: {killed}"
    assert logs.has("claims database failed delivering", f"[{key}]"), detail
    run = run_row(pg_db, poison.name, key)
    assert run is not None and run.status == RunStatus.DEAD.value and run.lost == 2 and run.attempts == 2, run
    found = letters(pg_db, poison.name, key)
    assert len(found) == 1, f"dead letters: {found}\n{detail}"
    letter = found[0]
    assert letter.reason == "max_deliveries" and letter.run_id == run.id and letter.attempts == 2, f"{found}\n{detail}"
    # The body ran only in the two vanished deliveries; released, each found its completion fenced out.
    assert len(bodies) == 2 and pg_db.rows(executions_table, key) == 2, detail
    assert len(ended) == 2 and all(isinstance(e, LeaseLost) for e in ended), ended
    assert pg_db.counts(poison.name) == {"dead": 1, "lease_lost": 2}, detail
    print(f"dead_letter(poison)/{fault}: outcomes={pg_db.counts(poison.name)} killed={killed}")


def test_repeated_database_faults_are_not_lost_deliveries(pg_db: Db, pg_app: Celery, logs: LogLines) -> None:
    """A holder that gives up on a store fault did not vanish: its re-sends never make the run a poison message.

    max_deliveries=2, and the completion meets a killed backend three times in a row. Each holder sends the
    job again naming itself; the re-sent delivery takes that run over at once (no lease wait) and it is not
    counted lost, so the fourth delivery completes the job once instead of finding it DEAD.
    """
    n = 16
    key = job_key(n)
    warm = warm_up(pg_app, pg_db)

    @pg_app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_edge_refaulted",
        idempotency_key="fault:{n}",
        lease=60,  # a takeover that waited for the lease to lapse would outlast the wait below
        max_deliveries=2,
    )
    def job(self: IdempotentTask, n: int) -> dict[str, int]:
        pg_db.record(executions_table, job_key(n))
        with self.effects() as session:
            session.execute(insert(effects_table).values(key=job_key(n), pid=os.getpid()))
        return expected(n)

    killed: list[int] = []
    hook = Once(fault_of("terminate", pg_db, killed), times=3)
    with running_worker(pg_app, concurrency=4):
        assert warm.delay(1).get(timeout=JOB_TIMEOUT) == expected(1)
        with fault_injected("complete", only_for(job.name, key, hook)):
            result = job.delay(n)
            counts = assert_once(pg_db, job, n, result, logs)

    detail = report(pg_db, job.name, key, logs)
    assert hook.error is None and hook.hits == 4, f"faults: hits={hook.hits} error={hook.error!r}\n{detail}"
    assert len(killed) == 3 and all(killed), f"no backend to kill: {killed}"
    run = run_row(pg_db, job.name, key)
    assert run is not None and run.status == RunStatus.COMPLETED.value, f"{run}\n{detail}"
    assert run.lost == 0 and run.attempts == 4, f"{run}\n{detail}"
    assert letters(pg_db, job.name, key) == [], detail
    # Three faulted completions rolled back, the fourth committed: the body ran four times, its effect once.
    assert pg_db.rows(executions_table, key) == 4, detail
    assert counts.get("executed", 0) == 1 and "dead" not in counts and "in_progress" not in counts, detail


# -- 5. the conflict's run-less letter -------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["terminate"])  # one statement: a restart fails it the same way
@pytest.mark.parametrize("point", ["conflict_read", "dead_letter"])
def test_a_fault_writing_the_conflict_letter_still_raises_the_conflict(
    point: str, fault: str, pg_db: Db, pg_app: Celery, logs: LogLines
) -> None:
    """A conflicting payload: the database fails where its claim reads the run's field digests, or where its
    run-less letter is written. The delivery is sent again; one letter, one `conflict`, the first run stands."""
    n = 15 if point == "dead_letter" else 19
    key = job_key(n)

    @pg_app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name=f"oncelery.t_edge_conflict_{point}_{fault}",
        idempotency_key="fault:{n}",
        lease=LEASE,
    )
    def job(self: IdempotentTask, n: int, payload: str) -> dict[str, int]:
        pg_db.record(executions_table, job_key(n))
        with self.effects() as session:
            session.execute(insert(effects_table).values(key=job_key(n), pid=os.getpid()))
        return expected(n)

    killed: list[int] = []
    hook = Once(fault_of(fault, pg_db, killed))
    with running_worker(pg_app, concurrency=4):
        assert job.delay(n, "first payload").get(timeout=JOB_TIMEOUT) == expected(n)
        with fault_injected(point, only_for(job.name, key, hook)):
            second = job.delay(n, "another payload")
            with pytest.raises(IdempotencyConflict, match="different payload"):
                second.get(timeout=JOB_TIMEOUT)

    detail = report(pg_db, job.name, key, logs)
    assert hook.error is None and hook.injected.is_set(), f"the fault was not injected: {hook.error!r}"
    assert killed and killed[0] != 0, f"no backend to kill: {killed}"
    assert logs.has("claims database failed delivering", f"[{key}]"), detail
    found = letters(pg_db, job.name, key)
    assert len(found) == 1, f"dead letters: {found}\n{detail}"
    assert found[0].reason == "conflict" and found[0].run_id is None, f"{found}\n{detail}"
    run = pg_db.run(job.name, key)
    assert run is not None and run.status is RunStatus.COMPLETED and run.result == expected(n), detail
    assert pg_db.rows(effects_table, key) == 1 and pg_db.rows(executions_table, key) == 1, detail
    assert pg_db.counts(job.name) == {"executed": 1, "conflict": 1}, detail
    print(f"{point}(conflict)/{fault}: killed={killed}")


@pytest.mark.parametrize("fault", ["terminate"])
def test_a_fault_writing_a_bad_messages_letter_is_not_a_lost_letter(
    fault: str, pg_db: Db, pg_app: Celery, logs: LogLines
) -> None:
    """A message without an identity is dead-lettered; a store fault right there re-sends it, never drops it."""
    name = f"oncelery.t_edge_badmsg_{fault}"

    @pg_app.task(shared=False, base=IdempotentTask, bind=True, name=name, idempotency_key="bad:{n}", lease=LEASE)
    def job(self: IdempotentTask, n: int) -> int:
        return n

    def task_letters() -> list[Any]:
        sql = "SELECT reason, run_id, message FROM dead_letters WHERE task_name = :t ORDER BY id"
        return query(pg_db, sql, t=name)

    killed: list[int] = []
    hook = Once(fault_of(fault, pg_db, killed))
    warm = warm_up(pg_app, pg_db)
    with running_worker(pg_app, concurrency=4):
        assert warm.delay(1).get(timeout=JOB_TIMEOUT) == expected(1)
        with fault_injected("dead_letter", lambda point, ctx: hook(point, ctx) if ctx.get("task") == name else None):
            result = pg_app.send_task(name, kwargs={"zzz": 1})  # binds to no parameter: no identity
            wait_for(lambda: len(task_letters()) == 1, timeout=JOB_TIMEOUT, what="the bad message's letter")
            with pytest.raises(Exception, match="do not match"):
                result.get(timeout=JOB_TIMEOUT)

    assert hook.error is None and hook.injected.is_set(), f"the fault was not injected: {hook.error!r}"
    assert killed and killed[0] != 0, f"no backend to kill: {killed}"
    assert logs.has("claims database failed before claiming", name), logs.text()
    [letter] = task_letters()
    assert letter.reason == "bad_message" and letter.run_id is None and letter.message["kwargs"] == {"zzz": 1}
    assert pg_db.counts(name) == {"dead": 1}  # the faulted attempt wrote and counted nothing
    print(f"dead_letter(bad message)/{fault}: killed={killed}")


# -- 6. the relay serves through killed backends and a restart ---------------------------------------------


@pytest.mark.timeout(240)
def test_the_relay_serves_through_killed_backends_and_a_restart(pg_db: Db, pg_app: Celery, logs: LogLines) -> None:
    """200 outbox rows; the relay publishes them in batches of 20 while a worker runs the jobs.

    Right after publishing its 2nd, 4th and 8th batches (before marking them SENT) the relay's database is
    cut off (every backend of the database terminated: the relay's, the worker's), and after the 6th the
    server restarts. Each of those rounds fails and rolls back, so its 20 rows are published again by a
    later round: 80 jobs reach the broker twice, and the claim absorbs every copy.
    """
    name = "oncelery.t_edge_relay"

    @pg_app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name=name,
        idempotency_key="relay:{n}",
        lease=LEASE,
        ignore_result=True,
    )
    def job(self: IdempotentTask, n: int) -> dict[str, int]:
        with self.effects() as session:
            session.execute(insert(effects_table).values(key=f"relay:{n}", pid=os.getpid()))
        return {"n": n}

    pg_app.finalize()
    with pg_db.observer.begin() as conn:
        for i in range(RELAY_JOBS):
            outbox.enqueue(conn, job, i)

    rounds = [0]
    killed: list[int] = []
    injected: list[str] = []
    hook_errors: list[BaseException] = []

    def after_publishing(point: str, ctx: dict[str, Any]) -> None:
        if not ctx.get("rows"):
            return
        rounds[0] += 1
        kind = RELAY_FAULTS.get(rounds[0])
        if kind is None:
            return
        try:
            fault_of(kind, pg_db, killed)()
            injected.append(kind)
        except BaseException as exc:
            hook_errors.append(exc)
            raise

    relay = Relay(pg_app, pg_db.url, batch=RELAY_BATCH, republish_after=5.0, sweep_interval=1.0)
    stop = threading.Event()
    totals: list[RelayRound] = []
    serve_errors: list[BaseException] = []

    def serve() -> None:
        try:
            totals.append(relay.serve(stop, interval=0.05))
        except BaseException as exc:
            serve_errors.append(exc)

    server = threading.Thread(target=serve, name="relay", daemon=True)
    started = time.monotonic()

    def statuses() -> dict[str, int]:
        return {str(s): int(c) for s, c in query(pg_db, "SELECT status, count(*) FROM outbox GROUP BY status")}

    def completed() -> int:
        rows = query(pg_db, "SELECT count(*) FROM task_runs WHERE task_name = :t AND status = 'COMPLETED'", t=name)
        return int(rows[0][0])

    with running_worker(pg_app, concurrency=4), fault_injected("relay_published", after_publishing):
        server.start()
        try:
            try:
                wait_for(lambda: completed() == RELAY_JOBS, timeout=RELAY_TIMEOUT, interval=0.25, what="every run")
            except pytest.fail.Exception:
                pytest.fail(f"{completed()} of {RELAY_JOBS} runs completed; outbox={statuses()}\n{logs.text()}")
            settled = time.monotonic() - started
            at_completion = statuses()
            # Every duplicate copy is delivered and answered from the stored result.
            wait_for(
                lambda: pg_db.counts(name).get("replayed", 0) >= len(injected) * RELAY_BATCH,
                timeout=JOB_TIMEOUT,
                interval=0.25,
                what="the duplicate copies to be replayed",
            )
            # The relay kept serving after the faults: it closes every row whose run finished.
            wait_for(lambda: statuses() == {"DONE": RELAY_JOBS}, timeout=JOB_TIMEOUT, interval=0.25, what="DONE")
        finally:
            stop.set()
            server.join(60)
    assert not server.is_alive(), "serve() did not return after its stop event was set"

    failed_rounds = sum("relay round failed" in line for line in logs.lines)
    effects = {str(k): int(c) for k, c in query(pg_db, "SELECT key, count(*) FROM test_effects GROUP BY key")}
    counts = pg_db.counts(name)
    print(
        f"relay: settled_in={settled:.1f}s faults={injected} killed={killed} failed_rounds={failed_rounds} "
        f"totals={totals} outbox_at_completion={at_completion} outcomes={counts}"
    )
    assert not hook_errors and not serve_errors, f"{hook_errors!r} {serve_errors!r}"
    assert injected == [RELAY_FAULTS[k] for k in sorted(RELAY_FAULTS)], injected
    assert all(k != 0 for k in killed), killed
    assert failed_rounds >= len(RELAY_FAULTS), logs.text()
    # No row lost: at the moment every run had completed, every row had been published and marked.
    assert set(at_completion) <= {"SENT", "DONE"} and sum(at_completion.values()) == RELAY_JOBS, at_completion
    [total] = totals
    assert total.published == RELAY_JOBS and total.dead == 0 and total.failed == 0, total
    assert len(effects) == RELAY_JOBS and set(effects.values()) == {1}, {k: c for k, c in effects.items() if c != 1}
    assert counts.get("executed", 0) + counts.get("resumed", 0) == RELAY_JOBS, counts
    assert counts.get("failed", 0) == 0 and counts.get("dead", 0) == 0, counts
