"""A store fault in the run's completing transaction: the completion rolls back and the job ends once.

The call sites: the body's first statement in effects() (the SAVEPOINT, then its INSERT), the flush at the
end of an effects() block, the completion itself, the completion of a versioned event (its entity's version
advanced with it), and the server stopped right before the completion. A holder that gives up on such a fault
did not vanish: its re-sends never make the run a poison message. The job, the faults and the checks:
tests/store_faults.py.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
from celery import Celery
from sqlalchemy import insert

from oncelery import IdempotentTask, RunStatus
from oncelery.runs.faults import fault_injected
from tests.conftest import running_worker
from tests.services import effects_table, executions_table, wait_for
from tests.store_faults import (
    FAULTS,
    JOB_TIMEOUT,
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
    letters,
    only_for,
    report,
    run_row,
    warm_up,
)

# -- the effects() block's flush and the completion ----------------------------------------------------------


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("stage", ["effects_flush", "complete"])
def test_a_store_fault_at_each_completion_stage_ends_once(
    stage: str, fault: str, pg_db: Db, pg_app: Celery, logs: LogLines
) -> None:
    fault_at_stage_ends_once(stage, fault, pg_db, pg_app, logs)


# -- the body's own first statement in effects() meets the dead connection -----------------------------------


@pytest.mark.parametrize("fault", FAULTS)
def test_a_store_fault_at_the_first_effects_statement_is_not_a_failure(
    fault: str, pg_db: Db, pg_app: Celery, logs: LogLines
) -> None:
    """effects() opens the run's transaction; the body's first statement in it (the SAVEPOINT, then its
    INSERT) is where a connection killed in between is found. No named fault point is there: the body injects
    the fault itself, once, right before that statement (the soak test found this call site).
    """
    n = 10
    killed: list[int] = []
    once = Once(fault_of(fault, pg_db, killed))
    warm = define_job(pg_app, pg_db, "oncelery.t_stmt_warmup")
    job = define_job(pg_app, pg_db, f"oncelery.t_effects_stmt_{fault}", in_effects=lambda: once("body", {}))
    with running_worker(pg_app, concurrency=4):
        assert warm.delay(1).get(timeout=JOB_TIMEOUT) == expected(1)
        result = job.delay(n)
        counts = assert_once(pg_db, job, n, result, logs)
    assert once.injected.is_set() and once.error is None and killed and killed[0] != 0
    print(f"effects-statement/{fault}: outcomes={counts} killed={killed}")


# -- the server stopped while a job completes, started again after the next claim fails ----------------------


def test_server_down_at_completion_comes_back_and_the_job_ends_once(pg_db: Db, pg_app: Celery, logs: LogLines) -> None:
    n = 8
    key = job_key(n)
    cluster = pg_db.cluster
    assert cluster is not None
    warm = define_job(pg_app, pg_db, "oncelery.t_down_warmup")
    job = define_job(pg_app, pg_db, "oncelery.t_down_complete")
    seen_claim_fail = threading.Event()
    starters: list[threading.Thread] = []

    def start_after_a_failed_claim() -> None:
        # Observable: the re-sent delivery's claim failed against the stopped server (bounded wait).
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                if logs.has("claims database failed delivering", key):
                    seen_claim_fail.set()
                    break
                time.sleep(0.02)
        finally:
            cluster.start()

    def stop_server() -> None:
        cluster.stop("fast")  # down before the completion statement runs
        starter = threading.Thread(target=start_after_a_failed_claim, name="pg-starter", daemon=True)
        starters.append(starter)
        starter.start()

    hook = Once(stop_server, key)
    try:
        with running_worker(pg_app, concurrency=4):
            assert warm.delay(1).get(timeout=JOB_TIMEOUT) == expected(1)
            with fault_injected("complete", hook):
                result = job.delay(n)
                counts = assert_once(pg_db, job, n, result, logs)
    finally:
        for starter in starters:
            starter.join(90)
        if not cluster.running():
            cluster.start()

    assert hook.error is None, f"the server could not be stopped: {hook.error!r}"
    assert seen_claim_fail.is_set(), f"the worker never tried to claim while the server was down\n{logs.text()}"
    assert logs.has("claims database failed finishing", key), logs.text()
    print(f"down-at-complete: outcomes={counts}")


# -- the versioned completion --------------------------------------------------------------------------------


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


# -- the completion faulted again and again ------------------------------------------------------------------


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
