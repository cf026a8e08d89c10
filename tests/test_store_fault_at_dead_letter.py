"""A store fault where a dead letter is written: the delivery is sent again; one letter, one outcome.

The call sites of the `dead_letter` point (and the claim's read of the run's field digests before a
conflict's letter): a poison run killed after max_deliveries lost deliveries, a conflicting payload's run-less
letter, and the run-less letter of a message without an identity. The job, the faults and the checks:
tests/store_faults.py.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import insert

from oncelery import IdempotencyConflict, IdempotentTask, LeaseLost, RunIsDead, RunStatus, testing
from oncelery.runs.faults import fault_injected
from tests.conftest import running_worker
from tests.services import effects_table, executions_table, wait_for
from tests.store_faults import (
    FAULTS,
    JOB_TIMEOUT,
    LEASE,
    Db,
    LogLines,
    Once,
    expected,
    fault_of,
    job_key,
    letters,
    only_for,
    query,
    report,
    retrying,
    run_row,
    warm_up,
)


def expire_lease(db: Db, task_name: str, key: str) -> None:
    """Move the run's lease into the past by the database clock (the kit's helper, retried past a fault)."""
    retrying(lambda: testing.expire_lease(db.url, task_name, key), "expiring a lease")


# -- the poison kill (max_deliveries lost deliveries) --------------------------------------------------------


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


# -- the conflict's run-less letter --------------------------------------------------------------------------


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


# -- the run-less letter of a message without an identity ----------------------------------------------------


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
