"""A store fault before and at the claim: the delivery is sent again, never acked as failed, and ends once.

The call sites: the path before the claim (a fresh task's first delivery reads the database's digest secret),
the claim statement itself, a versioned event's read of its entity's applied version, and a duplicate's claim
that counts its outcome (answered from the stored result, or told to wait while the run is held). The job,
the faults and the checks: tests/store_faults.py.
"""

from __future__ import annotations

import os
import threading

import pytest
from celery import Celery
from sqlalchemy import insert

from oncelery import IdempotentTask, RunStatus
from oncelery.runs.faults import fault_injected
from tests.conftest import running_worker
from tests.services import effects_table, wait_for
from tests.store_faults import (
    FAULTS,
    JOB_TIMEOUT,
    LEASE,
    VERSION,
    Db,
    LogLines,
    Once,
    applied_version,
    assert_once,
    define_job,
    define_versioned,
    expected,
    fault_at_stage_ends_once,
    fault_of,
    job_key,
    only_for,
    report,
    warm_up,
)

# -- the path before the claim: a fresh task's first delivery reads the digest secret ------------------------


@pytest.mark.parametrize("fault", FAULTS)
def test_a_store_fault_before_the_claim_is_not_a_failure(fault: str, pg_db: Db, pg_app: Celery, logs: LogLines) -> None:
    """The path before the claim (deriving the key's field digests reads the database's secret once per task)."""
    n = 9
    warm = define_job(pg_app, pg_db, "oncelery.t_pre_warmup")
    job = define_job(pg_app, pg_db, f"oncelery.t_pre_claim_{fault}")
    killed: list[int] = []
    with running_worker(pg_app, concurrency=4):
        assert warm.delay(1).get(timeout=JOB_TIMEOUT) == expected(1)
        fault_of(fault, pg_db, killed)()  # the worker is idle: its next database use is this job's
        # send_task: the producer does not derive the identity, so the worker's task has read nothing yet.
        result = pg_app.send_task(job.name, args=[n])
        counts = assert_once(pg_db, job, n, result, logs)
    assert killed and killed[0] != 0
    print(f"pre-claim/{fault}: outcomes={counts} killed={killed}")


# -- the claim statement -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", FAULTS)
def test_a_store_fault_at_the_claim_ends_once(fault: str, pg_db: Db, pg_app: Celery, logs: LogLines) -> None:
    fault_at_stage_ends_once("claim", fault, pg_db, pg_app, logs)


# -- a duplicate's claim counts its outcome ------------------------------------------------------------------


@pytest.mark.parametrize("fault", FAULTS)
def test_a_store_fault_counting_a_replay_ends_once(fault: str, pg_db: Db, pg_app: Celery, logs: LogLines) -> None:
    """A duplicate answered from the stored result meets the fault as it counts its outcome: counted once.

    On PostgreSQL the duplicate's claim statement is what counts it (claim, replay and count in one round
    trip), so the fault strikes right before that statement."""
    n = 8
    job = define_job(pg_app, pg_db, f"oncelery.t_fault_count_{fault}")
    killed: list[int] = []
    hook = Once(fault_of(fault, pg_db, killed), job_key(n))

    with running_worker(pg_app, concurrency=4):
        assert_once(pg_db, job, n, job.delay(n), logs)
        with fault_injected("claim", hook):
            again = job.delay(n)
            wait_for(hook.injected.is_set, timeout=JOB_TIMEOUT, what="the fault at the duplicate's claim")
            assert again.get(timeout=JOB_TIMEOUT) == expected(n), report(pg_db, job.name, job_key(n), logs)

    assert hook.error is None, f"the fault could not be injected: {hook.error!r}"
    assert killed and killed[0] != 0, f"no backend to kill: {killed}"
    counts = pg_db.counts(job.name)
    detail = report(pg_db, job.name, job_key(n), logs)
    assert counts.get("replayed") == 1 and counts.get("executed", 0) + counts.get("resumed", 0) == 1, detail
    assert counts.get("failed", 0) == 0, detail
    assert pg_db.rows(effects_table, job_key(n)) == 1, detail
    # The run's replays count moves with the outcome count (one statement): once, whatever the fault undid.
    run = pg_db.run(job.name, job_key(n))
    assert run is not None and run.replays == 1, detail


def _status(db: Db, task_name: str, key: str) -> RunStatus | None:
    run = db.run(task_name, key)
    return None if run is None else run.status


@pytest.mark.parametrize("fault", FAULTS)
def test_a_store_fault_counting_an_in_progress_wait_ends_once(
    fault: str, pg_db: Db, pg_app: Celery, logs: LogLines
) -> None:
    """A duplicate that finds the run held meets the fault as it counts `in_progress`: sent again, it waits,
    then replays; the job's effect is written once and nothing is counted as failed."""
    n = 10
    key = job_key(n)
    gate = threading.Event()

    name = f"oncelery.t_fault_wait_{fault}"

    @pg_app.task(shared=False, base=IdempotentTask, bind=True, name=name, idempotency_key="fault:{n}", lease=LEASE)
    def job(self: IdempotentTask, n: int) -> dict[str, int]:
        # The holder stays inside a step (no transaction open) until the test has seen the duplicate's fault.
        self.step("wait", lambda: gate.wait(JOB_TIMEOUT))
        with self.effects() as session:
            session.execute(insert(effects_table).values(key=job_key(n), pid=os.getpid()))
        return expected(n)

    killed: list[int] = []
    hook = Once(fault_of(fault, pg_db, killed), key)
    try:
        with running_worker(pg_app, concurrency=4):
            holder = job.delay(n)
            wait_for(lambda: _status(pg_db, job.name, key) is RunStatus.RUNNING, JOB_TIMEOUT, what="the holder")
            with fault_injected("count_outcome", hook):
                again = job.delay(n)
                wait_for(hook.injected.is_set, timeout=JOB_TIMEOUT, what="the fault counting in_progress")
                # Counted through a fresh connection (pre-ping) or not at all and sent again: either way, once.
                wait_for(
                    lambda: (
                        pg_db.counts(job.name).get("in_progress", 0) >= 1
                        or logs.has("claims database failed delivering", f"[{key}]")
                    ),
                    timeout=JOB_TIMEOUT,
                    what="the duplicate's wait counted, or given up on the fault",
                )
            gate.set()
            assert holder.get(timeout=JOB_TIMEOUT) == again.get(timeout=JOB_TIMEOUT) == expected(n)
    finally:
        gate.set()
    assert hook.error is None, f"the fault could not be injected: {hook.error!r}"
    assert killed and killed[0] != 0, f"no backend to kill: {killed}"
    counts = pg_db.counts(job.name)
    detail = report(pg_db, job.name, key, logs)
    assert counts.get("executed", 0) + counts.get("resumed", 0) == 1 and counts.get("replayed") == 1, detail
    assert counts.get("failed", 0) == 0, detail
    assert pg_db.rows(effects_table, key) == 1, detail


# -- a versioned event's version check -----------------------------------------------------------------------


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
