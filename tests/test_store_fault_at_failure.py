"""A store fault where a failure is recorded: the failed attempt is sent again, and its failure counted once.

The call sites: the record of a failure that Celery retries, the record that makes the run DEAD (its retries
exhausted, its dead letter in the same transaction), and an error text that PostgreSQL cannot store (a NUL
character). The job, the faults and the checks: tests/store_faults.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from oncelery import IdempotentTask, RunStatus
from oncelery.runs.faults import fault_injected
from tests.conftest import running_worker
from tests.services import executions_table, wait_for
from tests.store_faults import (
    FAULTS,
    JOB_TIMEOUT,
    Db,
    Hook,
    LogLines,
    Once,
    define_doomed,
    expected,
    fault_at_stage_ends_once,
    fault_of,
    job_key,
    letters,
    query,
    report,
    run_row,
    warm_up,
)


def status_of(db: Db, task_name: str, key: str) -> str | None:
    rows = query(db, "SELECT status FROM task_runs WHERE task_name = :t AND idempotency_key = :k", t=task_name, k=key)
    return str(rows[0][0]) if rows else None


def on_retried_run(db: Db, task_name: str, key: str, hook: Hook) -> Hook:
    """`hook`, called only when the run has already spent a retry: its last attempt (max_retries=1)."""

    def call(name: str, ctx: dict[str, Any]) -> None:
        if ctx.get("task") != task_name or ctx.get("key") != key:
            return
        row = run_row(db, task_name, key)
        if row is not None and row.retries >= 1:
            hook(name, ctx)

    return call


# -- the failure of an attempt that Celery retries -----------------------------------------------------------


@pytest.mark.parametrize("fault", FAULTS)
def test_a_store_fault_recording_a_failure_ends_once(fault: str, pg_db: Db, pg_app: Celery, logs: LogLines) -> None:
    fault_at_stage_ends_once("record_failure", fault, pg_db, pg_app, logs)


# -- the failure that makes the run DEAD (retries exhausted) -------------------------------------------------


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
    # Celery sends attempt 1's retry (countdown 0.2 s) before attempt 1 records its failure: on a loaded machine
    # the retry can arrive first, find the run still held, and wait (`in_progress`), as any copy would. That wait
    # is the claim doing its job; anything that ran or was refused besides would be a defect.
    assert set(counts) <= {"dead", "failed", "in_progress"}, detail
    # Attempt 1, attempt 2 (its DEAD rolled back by the fault), and the taker that recorded it.
    assert pg_db.rows(executions_table, key) == 3, detail
    print(f"record_failure(dead)/{fault}: outcomes={counts} killed={killed}")


# -- an error text PostgreSQL cannot store -------------------------------------------------------------------


def test_nul_in_the_error_is_recorded_and_the_run_fails(pg_db: Db, pg_app: Celery, logs: LogLines) -> None:
    @pg_app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_nul", idempotency_key="nul:{n}")
    def broken(self: IdempotentTask, n: int) -> int:
        raise ValueError(f"model returned bytes\x00garbage {n}")

    with running_worker(pg_app, concurrency=2):
        result = broken.delay(3)
        with pytest.raises(ValueError, match="garbage"):
            result.get(timeout=JOB_TIMEOUT)

    run = pg_db.run(broken.name, "nul:3")
    detail = f"{run}\n{logs.text()}"
    assert run is not None and run.status is RunStatus.FAILED, detail
    assert run.error is not None and "\x00" not in run.error and "garbage 3" in run.error, detail
    assert pg_db.counts(broken.name) == {"failed": 1}, detail
