"""A tenant is resolved once, where a job enters, and every re-send carries it: one tenant never reads another's.

The app-wide resolver (`app.conf.oncelery_tenant`) reads who is calling from the caller's context (here a
ContextVar, as a web request would set it). Each door a job enters by resolves it there, in this order: the
per-call option, the task's own option, the resolver: `apply_async`, `oncelery.outbox.enqueue` (its row keeps the
tenant the relay then sends) and `pipeline()` (every link carries the tenant resolved for the first, since the
later links are sent by a worker, which has no caller's context). Two tenants enqueue the same key through each
door: each gets a run and a result of its own. Over SQLite and PostgreSQL (the `db_url` fixture).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import pytest
from celery import Celery
from sqlalchemy.orm import Session

from oncelery import DeadLetters, IdempotentTask, Relay, Runs, RunStatus, outbox, pipeline
from oncelery.store.database import get_engine
from tests.services import wait_for

TIMEOUT = 60.0
# Who is calling: set by the test around each enqueue, unset in the worker (as in production).
customer: ContextVar[str | None] = ContextVar("customer", default=None)


@pytest.fixture
def resolved(app: Celery) -> Iterator[list[tuple[str, str | None]]]:
    """Install the app-wide resolver (the calling customer); yields the (task, tenant) of every call it answered."""
    calls: list[tuple[str, str | None]] = []

    def tenant_of(task_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        calls.append((task_name, customer.get()))
        return customer.get()

    app.conf.oncelery_tenant = tenant_of
    yield calls


def as_customer(name: str) -> Any:
    """Run the enclosed calls as customer `name` (the ContextVar the resolver reads)."""

    class _As:
        def __enter__(self) -> None:
            self.token = customer.set(name)

        def __exit__(self, *_: Any) -> None:
            customer.reset(self.token)

    return _As()


def report_task(app: Celery, name: str) -> Any:
    """A confidential report keyed by the report id only: the tenant is all that tells two customers apart."""

    @app.task(shared=False, base=IdempotentTask, bind=True, name=name, idempotency_key="report:{report_id}")
    def report(self: IdempotentTask, report_id: int) -> dict[str, Any]:
        return {"report": report_id, "run_id": self.run_id}

    app.finalize()
    return report


def assert_one_run_each(db_url: str, task_name: str, key: str, results: dict[str, Any]) -> None:
    """Each customer's result is its own run's, stored under its tenant; nothing ran without a tenant."""
    runs = Runs(db_url)
    ids = set()
    for tenant, result in results.items():
        run = runs.get(task_name, key, tenant)
        assert run is not None and run.status is RunStatus.COMPLETED, (tenant, run)
        assert run.result == result and run.run_id == result["run_id"], (tenant, run.result, result)
        ids.add(run.run_id)
    assert len(ids) == len(results), f"one run answered two tenants: {results}"
    assert runs.get(task_name, key) is None, "a run in tenant '' answered a customer"


def test_apply_async_resolves_the_tenant_once_in_the_caller(
    app: Celery, worker_factory: Any, db_url: str, resolved: list[tuple[str, str | None]]
) -> None:
    """`.delay()` as acme then as globex: two runs; the resolver ran in the caller only, once per call."""
    report = report_task(app, "oncelery.t_door_delay")
    results = {}
    with worker_factory(app):
        for name in ("acme", "globex"):
            with as_customer(name):
                results[name] = report.delay(7).get(timeout=TIMEOUT)
    assert_one_run_each(db_url, report.name, "report:7", results)
    assert resolved == [(report.name, "acme"), (report.name, "globex")]


def test_outbox_enqueue_resolves_the_tenant_and_the_relay_sends_the_stored_one(
    app: Celery, worker_factory: Any, db_url: str, resolved: list[tuple[str, str | None]]
) -> None:
    """`outbox.enqueue` as acme then as globex: each row keeps its customer, the relay (no caller context)
    sends it, and globex never receives acme's report."""
    report = report_task(app, "oncelery.t_door_outbox")
    relay = Relay(app, db_url, sweep_interval=None)
    task_ids = {}
    for name in ("acme", "globex"):
        with as_customer(name), Session(get_engine(db_url)) as session, session.begin():
            task_ids[name] = outbox.enqueue(session, report, 7)
    assert resolved == [(report.name, "acme"), (report.name, "globex")]
    assert relay.run_once(republish=False).published == 2
    with worker_factory(app):
        results = {name: app.AsyncResult(task_id).get(timeout=TIMEOUT) for name, task_id in task_ids.items()}
    assert_one_run_each(db_url, report.name, "report:7", results)
    assert len(resolved) == 2, f"the resolver ran again outside the caller: {resolved[2:]}"


def test_a_pipeline_carries_the_tenant_resolved_for_its_first_link_to_every_link(
    app: Celery, worker_factory: Any, db_url: str, resolved: list[tuple[str, str | None]]
) -> None:
    """A two-link pipeline as acme then as globex: the second link, sent by a worker, runs in the customer's
    tenant too (one run per link per customer), and the resolver ran once per pipeline, in the caller."""

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_door_draft")
    def draft(self: IdempotentTask, report_id: int) -> dict[str, Any]:
        return {"draft": report_id, "run_id": self.run_id}

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_door_final")
    def final(self: IdempotentTask, drafted: dict[str, Any]) -> dict[str, Any]:
        return {"final": drafted["draft"], "draft_run": drafted["run_id"], "run_id": self.run_id}

    results = {}
    with worker_factory(app):
        for name in ("acme", "globex"):
            with as_customer(name):
                results[name] = pipeline("reports:7", draft.s(7), final.s()).delay().get(timeout=TIMEOUT)
    assert resolved == [(draft.name, "acme"), (draft.name, "globex")]
    runs = Runs(db_url)
    for name, result in results.items():
        first = runs.get(draft.name, f"reports:7/0:{draft.name}", name)
        second = runs.get(final.name, f"reports:7/1:{final.name}", name)
        assert first is not None and second is not None, (name, first, second)
        assert result == second.result and result["draft_run"] == first.run_id, (name, result)
    assert results["acme"]["run_id"] != results["globex"]["run_id"]
    assert runs.get(final.name, f"reports:7/1:{final.name}") is None, "a link ran without the customer's tenant"


def test_re_sends_carry_the_resolved_tenant_and_never_ask_the_resolver_again(
    app: Celery, worker_factory: Any, db_url: str, resolved: list[tuple[str, str | None]]
) -> None:
    """A call that resolved to no tenant (a public report) keeps "no tenant" through a retry (sent by the worker)
    and a dead-letter replay (sent by an operator who is logged in as a customer): the resolver answered once,
    at the door, and every run of the key is in tenant ''."""
    tries: list[int] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_door_resend", dead_on=(KeyError,))
    def public(self: IdempotentTask, report_id: int) -> int:
        tries.append(report_id)
        if len(tries) == 1:
            raise self.retry(countdown=0)
        if len(tries) == 2:
            raise KeyError("dead on purpose: replayed below")
        return report_id

    app.finalize()
    with worker_factory(app):
        with pytest.raises(KeyError):
            public.delay(5).get(timeout=TIMEOUT)
        assert resolved == [(public.name, None)], "the retry asked the resolver again"
        letters = DeadLetters(db_url).list(task_name=public.name, limit=None)
        assert [letter.tenant for letter in letters] == [""]
        with as_customer("mallory"):  # the operator's own context must not leak into the replayed job
            assert len(DeadLetters(db_url).replay(app, letters).replayed) == 1
        # Until the replayed run's completion committed, not just its body called: the worker stops below.
        wait_for(
            lambda: (
                len(tries) == 3
                and [r.status for r in Runs(db_url).list(task_name=public.name)] == [RunStatus.COMPLETED]
            ),
            timeout=TIMEOUT,
            what="the replayed job completed",
        )
    assert resolved == [(public.name, None)], f"a re-send asked the resolver again: {resolved[1:]}"
    runs = Runs(db_url).list(task_name=public.name)
    assert [(r.tenant, r.status) for r in runs] == [("", RunStatus.COMPLETED)], runs
