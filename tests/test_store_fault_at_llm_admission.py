"""A store fault right where a model call is admitted by its limiters and reserves in its budgets (the intent's
prepared transaction): every PostgreSQL backend killed, the server restarted, or (SQLite) another connection
holding the write lock past busy_timeout. Fail closed: nothing is sent unadmitted, the delivery is re-sent, and
the job ends once with one call at the provider, one admission, and a budget whose spent equals the ledger's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import func, select

from oncelery import IdempotentTask, RunStatus, output_text
from oncelery.fake_provider import FakeProvider, Knobs, count_tokens
from oncelery.llm.adapters.openai_responses import OpenAIResponses
from oncelery.runs.faults import fault_injected
from oncelery.store.database import get_engine
from oncelery.store.tables import BUDGETS, CALLS, LIMITERS
from oncelery.testing import in_process_worker
from tests.services import wait_for
from tests.store_faults import JOB_TIMEOUT, Db, LogLines, Once, fault_of
from tests.test_store_fault_with_lock_held import WriteLock, short_lock

__all__ = ["short_lock"]  # the fixture, used by name

TEXT = "The harbour reopened after the storm, the port authority said on Monday."
OUT = 8


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """A fake provider answering at once."""
    with FakeProvider(Knobs(poll_after_ms=5, generation_s=0.0)) as provider:
        yield provider


@pytest.fixture
def adapter(fake: FakeProvider) -> Iterator[OpenAIResponses]:
    """An OpenAI Responses adapter on the fake (closed after the test)."""
    with OpenAIResponses(fake.openai_base_url, "sk") as responses:
        yield responses


def limited_job(app: Celery, adapter: OpenAIResponses) -> Any:
    app.conf.oncelery_prices = {"gpt-test": {"input": 1000, "output": 1000}}
    app.conf.oncelery_limits = {"openai:gpt-test": {"rpm": 6000}}
    app.conf.oncelery_budgets = {"global": {"day": 100}}

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_admitted", idempotency_key="d:{doc}")
    def job(self: IdempotentTask, doc: str) -> str:
        return output_text(self.llm("s", adapter=adapter, model="gpt-test", input=TEXT, max_output_tokens=OUT))

    return job


def assert_admitted_once(db: Db, fake: FakeProvider, job: Any, result: Any) -> None:
    assert result.get(timeout=JOB_TIMEOUT)
    wait_for(lambda: db.completed(job.name, "d:x"), timeout=JOB_TIMEOUT, what="the run to complete")
    run = db.run(job.name, "d:x")
    assert run is not None and run.status is RunStatus.COMPLETED
    assert sum(fake.stats()["creates_by_intent"].values()) == 1, fake.stats()
    engine = get_engine(db.url)
    with engine.connect() as conn:
        admitted = conn.execute(select(LIMITERS.c.admitted)).scalar_one()
        spent, reserved = conn.execute(select(BUDGETS.c.spent_micros, BUDGETS.c.reserved_micros)).one()
        ledger = conn.execute(select(func.sum(CALLS.c.cost_micros))).scalar_one()
    assert admitted == 1, "the failed transaction's admission rolled back with it"
    assert reserved == 0 and spent == ledger == (count_tokens(TEXT) + OUT) * 1000, (spent, reserved, ledger)
    counts = db.counts(job.name)
    assert counts.get("executed", 0) + counts.get("resumed", 0) == 1 and counts.get("failed", 0) == 0, counts


@pytest.mark.parametrize("fault", ["terminate", "restart"])
def test_a_store_fault_at_the_admission_fails_closed_and_the_job_ends_once(
    fault: str, pg_db: Db, pg_app: Celery, logs: LogLines, fake: FakeProvider, adapter: OpenAIResponses
) -> None:
    job = limited_job(pg_app, adapter)
    killed: list[int] = []
    hook = Once(fault_of(fault, pg_db, killed), key="d:x")
    with in_process_worker(pg_app, concurrency=2), fault_injected("llm_prepare", hook):
        result = job.delay("x")
        wait_for(hook.injected.is_set, timeout=JOB_TIMEOUT, what="the fault at the admission")
        assert_admitted_once(pg_db, fake, job, result)
    assert hook.error is None and killed and killed[0] != 0, (hook.error, killed)


@pytest.mark.timeout(180)
def test_the_sqlite_write_lock_held_at_the_admission_fails_closed_and_the_job_ends_once(
    sqlite_db: Db,
    sqlite_app: Celery,
    logs: LogLines,
    short_lock: WriteLock,
    fake: FakeProvider,
    adapter: OpenAIResponses,
) -> None:
    job = limited_job(sqlite_app, adapter)
    hook = Once(short_lock.hold, key="d:x")
    with in_process_worker(sqlite_app, concurrency=2), fault_injected("llm_prepare", hook):
        result = job.delay("x")
        wait_for(hook.injected.is_set, timeout=JOB_TIMEOUT, what="the lock taken at the admission")
        wait_for(lambda: logs.has("claims database failed", "d:x"), timeout=JOB_TIMEOUT, what="the delivery to give up")
        assert fake.stats()["creates_by_intent"] == {}, "nothing was sent unadmitted"
        short_lock.release()
        assert_admitted_once(sqlite_db, fake, job, result)
    assert hook.error is None
