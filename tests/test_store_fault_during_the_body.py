"""A store fault at the writes a running body makes beside its checkpoints: lease renewals, the ledger.

The heartbeat keeps trying past a failed renewal and the job completes once, never taken over; a model call's
ledger row is written once, on a fresh connection, with its running totals. The job, the faults and the
checks: tests/store_faults.py.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import insert, text

from oncelery import IdempotentTask, RunStatus, model_call
from oncelery.runs.faults import fault_injected
from tests.conftest import running_worker
from tests.services import effects_table
from tests.store_faults import (
    FAULTS,
    JOB_TIMEOUT,
    LEASE,
    Db,
    LogLines,
    Once,
    define_renewal_job,
    expected,
    fault_of,
    job_key,
    report,
    retrying,
)

# -- the lease renewal ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", FAULTS)
def test_a_store_fault_renewing_the_lease_ends_once(fault: str, pg_db: Db, pg_app: Celery, logs: LogLines) -> None:
    """The holder's lease renewal meets killed backends (or a restart) while the body runs: the heartbeat
    keeps trying, a later renewal lands, and the job completes once, never taken over or fenced."""
    n = 12
    key = job_key(n)
    name = f"oncelery.t_fault_heartbeat_{fault}"
    hook = Once(fault_of(fault, pg_db, killed := []), key)
    seen: list[Any] = []

    def renewed_after_the_fault() -> bool:
        run = pg_db.run(name, key)
        if run is None or not hook.injected.is_set():
            return False
        seen.append(run.lease_expires_at)
        return len(seen) > 1 and seen[-1] > seen[0]

    job = define_renewal_job(pg_app, name, LEASE, renewed_after_the_fault)

    with running_worker(pg_app, concurrency=4), fault_injected("heartbeat", hook):
        assert job.delay(n).get(timeout=JOB_TIMEOUT) == expected(n), report(pg_db, name, key, logs)
    assert hook.error is None and hook.injected.is_set(), f"the fault was not injected: {hook.error!r}"
    assert killed and killed[0] != 0, f"no backend to kill: {killed}"
    detail = report(pg_db, name, key, logs)
    assert pg_db.rows(effects_table, key) == 1, detail
    run = pg_db.run(name, key)
    assert run is not None and run.status is RunStatus.COMPLETED and run.token == 1, detail
    assert pg_db.counts(name) == {"executed": 1}, detail


# -- the model call's ledger row -----------------------------------------------------------------------------


@pytest.mark.parametrize("fault", FAULTS)
def test_a_store_fault_writing_a_model_calls_ledger_row_loses_no_row(
    fault: str, pg_db: Db, pg_app: Celery, logs: LogLines
) -> None:
    """The ledger row of a model call meets a killed pooled connection (or a restart) as it is written: it is
    written once, on a fresh connection, with its running totals; the job ends once."""
    n = 11
    key = job_key(n)
    name = f"oncelery.t_fault_ledger_{fault}"

    @pg_app.task(shared=False, base=IdempotentTask, bind=True, name=name, idempotency_key="fault:{n}", lease=LEASE)
    def job(self: IdempotentTask, n: int) -> dict[str, int]:
        def ask() -> int:
            with model_call("fake-llm", prompt="draft") as call:
                call.tokens(12, 3)
            return 2 * n

        self.step("first", ask)
        with self.effects() as session:
            session.execute(insert(effects_table).values(key=job_key(n), pid=os.getpid()))
        return expected(n)

    killed: list[int] = []
    hook = Once(fault_of(fault, pg_db, killed), key)
    with running_worker(pg_app, concurrency=4), fault_injected("ledger_write", hook):
        assert job.delay(n).get(timeout=JOB_TIMEOUT) == expected(n), report(pg_db, name, key, logs)
    assert hook.error is None and hook.injected.is_set(), f"the fault was not injected: {hook.error!r}"
    assert killed and killed[0] != 0, f"no backend to kill: {killed}"
    detail = report(pg_db, name, key, logs)
    assert pg_db.rows(effects_table, key) == 1, detail
    assert not logs.has("could not record model call"), detail
    run = pg_db.run(name, key)
    assert run is not None
    calls = retrying(lambda: query_ledger(pg_db, name), "reading the ledger")
    assert calls == [(run.run_id, "fake-llm", 12, 3)], detail


def query_ledger(db: Db, task_name: str) -> list[tuple[Any, ...]]:
    """The model_calls rows of a task, and a check that ledger_totals agrees with them."""
    with db.observer.connect() as conn:
        rows = conn.execute(
            text("SELECT run_id, model, input_tokens, output_tokens FROM model_calls WHERE task_name = :t"),
            {"t": task_name},
        ).all()
        totals = conn.execute(text("SELECT calls FROM ledger_totals WHERE task_name = :t"), {"t": task_name}).all()
    assert [tuple(t) for t in totals] == [(len(rows),)], totals
    return [tuple(r) for r in rows]
