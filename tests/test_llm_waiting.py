"""A background model call past its inline wait parks its run WAITING: no worker slot, woken by the relay.

Real in-process workers, the real relay loop (in a thread) and the fake provider, whose counters are the oracle:
`max_in_flight` above the worker's slots proves the slot was let go while the provider worked, and one create
per intent proves that every wake re-attached instead of paying again.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import func, select

from oncelery import IdempotentTask, output_text
from oncelery.errors import StoreUnavailable
from oncelery.fake_provider import FakeProvider, Knobs, generate_text
from oncelery.llm.adapters.openai_responses import OpenAIResponses
from oncelery.models import IntentState, RunStatus
from oncelery.relay.retention import purge
from oncelery.runs.faults import fault_injected
from oncelery.store.database import Database, get_engine
from oncelery.store.tables import CALLS, INTENTS, LETTERS, RUNS
from oncelery.testing import relay_running, wait_until
from tests.conftest import ON_POSTGRESQL, ON_SQLITE
from tests.test_llm_steps import once
from tests.test_metrics import scrape

TEXT = "The council approved the new library budget on Tuesday."
JOB = 60.0
GENERATION_S = 1.2  # each call's time at the provider: far above the inline wait, so every run parks


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """A fake provider whose background calls take GENERATION_S, hinting a poll every 20 ms."""
    with FakeProvider(Knobs(poll_after_ms=20, generation_s=GENERATION_S)) as provider:
        yield provider


def summarizer(app: Celery, adapter: Any, **options: Any) -> Any:
    """A one-call task that parks after 0.1 s of polling, and may not retry at all (a park is not a retry)."""

    @app.task(
        shared=False, base=IdempotentTask, bind=True, name="oncelery.t_wait", idempotency_key="doc:{doc}",
        llm_inline_wait=0.1, max_retries=0, **options,
    )  # fmt: skip
    def summarize(self: IdempotentTask, doc: str, text: str) -> str:
        return output_text(self.llm("summary", adapter=adapter, model="gpt-test", input=text, max_output_tokens=40))

    return summarize


def runs(db_url: str) -> list[dict[str, Any]]:
    with get_engine(db_url).connect() as conn:
        return [dict(r._mapping) for r in conn.execute(select(RUNS).order_by(RUNS.c.id))]


def table(db_url: str, which: Any) -> list[dict[str, Any]]:
    with get_engine(db_url).connect() as conn:
        return [dict(r._mapping) for r in conn.execute(select(which))]


def waiting(db_url: str) -> int:
    return sum(1 for r in runs(db_url) if r["status"] is RunStatus.WAITING)


@ON_SQLITE
def test_four_calls_on_one_slot_all_wait_at_the_provider_at_once(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    task = summarizer(app, responses)
    fake.set_knobs(generation_s=2.5)  # the four creates must all come before the first call ends, even when slow
    texts = [f"{TEXT} Item {i}." for i in range(4)]
    with worker_factory(app, concurrency=1), relay_running(app, db_url):
        pending = [task.delay(f"w{i}", t) for i, t in enumerate(texts)]
        got = [p.get(timeout=JOB) for p in pending]
    assert got == [generate_text("gpt-test", t) for t in texts]
    stats = fake.stats()
    # One worker slot, yet four calls generating at once: each run let its slot go while the provider worked.
    assert stats["max_in_flight"] == 4, stats
    assert len(stats["creates_by_intent"]) == 4 and set(stats["creates_by_intent"].values()) == {1}
    counts = task.outcome_counts()
    assert counts["executed"] == 4 and counts["waiting"] >= 4, counts
    assert set(counts) <= {"executed", "waiting"}, counts
    for run in runs(db_url):
        assert run["status"] is RunStatus.COMPLETED and run["retries"] == 0, run  # waiting spent no retry
        assert run["message"] is None and run["not_before"] is None and run["lease_expires_at"] is None
    assert {i["state"] for i in table(db_url, INTENTS)} == {IntentState.DONE}
    rows = table(db_url, CALLS)
    # Each call answered once, to a later delivery than the one that sent it: re-attached, never repeated.
    assert [(r["ok"], r["reason"], r["reattached"]) for r in rows] == [(True, None, True)] * 4


@ON_POSTGRESQL
def test_a_duplicate_of_a_waiting_run_waits_and_replays_the_one_result(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    task = summarizer(app, responses)
    with worker_factory(app, concurrency=2), relay_running(app, db_url):
        first = task.delay("d", TEXT)
        wait_until(lambda: waiting(db_url) == 1, timeout=JOB, what="the run parked")
        duplicate = task.delay("d", TEXT)
        try:
            assert first.get(timeout=JOB) == duplicate.get(timeout=JOB) == generate_text("gpt-test", TEXT)
        except BaseException:  # what the database says, for the failure's report
            print("runs:", runs(db_url), "\nintents:", table(db_url, INTENTS), "\noutcomes:", task.outcome_counts())
            print("first:", first.id, first.state, "duplicate:", duplicate.id, duplicate.state)
            raise
    assert sum(fake.stats()["creates_by_intent"].values()) == 1
    counts = task.outcome_counts()
    # One execution, one replay to the duplicate; the duplicate was answered "in progress" at least once while
    # the run waited (more often when its re-check came before the provider finished: timing, not a defect).
    assert (counts["executed"], counts["replayed"]) == (1, 1) and counts["in_progress"] >= 1, counts
    assert set(counts) <= {"executed", "in_progress", "replayed", "waiting"}, counts


@ON_SQLITE
def test_a_duplicate_after_the_wake_time_waits_for_the_wake_so_the_first_caller_gets_the_result(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    """The race a duplicate may win: it arrives after the parked run's wake time, before the waker sent the wake.
    Had it taken the run over, it would complete it under its own task id, the waker would see no WAITING run, and
    the first caller (whose message was acked at the park) would never get its result. It waits instead."""
    task = summarizer(app, responses)
    with worker_factory(app, concurrency=2):
        first = task.delay("r", TEXT)
        wait_until(lambda: waiting(db_url) == 1, timeout=JOB, what="the run parked")
        db = Database(db_url)

        def wake_due() -> bool:  # on the database clock, as the claim reads it
            due = RUNS.c.not_before <= db.dialect.now()
            with db.read() as conn:
                return bool(conn.execute(select(func.count()).select_from(RUNS).where(due)).scalar_one() == 1)

        wait_until(wake_due, timeout=JOB, what="the parked run's wake time")  # no relay: nobody woke it yet
        duplicate = task.delay("r", TEXT)
        wait_until(lambda: task.outcome_counts().get("in_progress", 0) >= 1, timeout=JOB, what="the duplicate waits")
        assert waiting(db_url) == 1, runs(db_url)  # still parked: the duplicate did not take it over
        with relay_running(app, db_url):  # the wake: the run's own message
            assert first.get(timeout=JOB) == duplicate.get(timeout=JOB) == generate_text("gpt-test", TEXT)
    assert sum(fake.stats()["creates_by_intent"].values()) == 1
    counts = task.outcome_counts()
    assert (counts["executed"], counts["replayed"]) == (1, 1), counts


@ON_SQLITE
def test_a_copy_of_a_parked_run_s_own_message_is_dropped_and_the_caller_still_gets_the_result(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    task = summarizer(app, responses)
    fake.set_knobs(poll_after_ms=3000)  # the provider's hint puts the wake 3 s out: the copy comes well before it
    with worker_factory(app):
        first = task.delay("c", TEXT)
        wait_until(lambda: waiting(db_url) == 1, timeout=JOB, what="the run parked")
        # A wake sent twice, or the broker redelivering the parked message: the same task id, before the wake.
        app.send_task(task.name, args=["c", TEXT], task_id=first.id)
        wait_until(lambda: task.outcome_counts().get("in_progress") == 1, timeout=JOB, what="the copy counted")
        assert waiting(db_url) == 1, "the copy neither took the run over nor woke it early"
        with relay_running(app, db_url):
            # Acked without a result: the caller's result is the run's, stored when the woken delivery completes.
            assert first.get(timeout=JOB) == generate_text("gpt-test", TEXT)
    assert sum(fake.stats()["creates_by_intent"].values()) == 1
    counts = task.outcome_counts()
    assert (counts["executed"], counts["in_progress"]) == (1, 1) and "replayed" not in counts, counts


@ON_POSTGRESQL
def test_a_store_fault_while_parking_resends_and_the_call_is_still_made_once(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    task = summarizer(app, responses)

    def fault() -> None:
        raise StoreUnavailable("injected: the claims database went away while parking")

    with fault_injected("park", once(fault)), worker_factory(app), relay_running(app, db_url):
        assert task.delay("f", TEXT).get(timeout=JOB) == generate_text("gpt-test", TEXT)
    # The re-sent message took its own run over at once (not a lost holder), re-attached and parked or finished.
    assert sum(fake.stats()["creates_by_intent"].values()) == 1
    [run] = runs(db_url)
    assert (run["status"], run["lost"], run["retries"]) == (RunStatus.COMPLETED, 0, 0)
    assert task.outcome_counts()["executed"] == 1


@ON_POSTGRESQL
def test_without_a_relay_a_waiting_run_stays_parked_is_reported_overdue_and_kept(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    task = summarizer(app, responses)
    with worker_factory(app):
        pending = task.delay("n", TEXT)
        wait_until(lambda: waiting(db_url) == 1, timeout=JOB, what="the run parked")
        # No relay: nothing wakes it. Its wake time passes, and the exporter says how late it is.
        wait_until(
            lambda: scrape(db_url).get(("oncelery_oldest_overdue_wake_seconds", (("name", task.name),)), 0) > 0.5,
            timeout=JOB,
            what="the wake reported overdue",
        )
        assert scrape(db_url)[("oncelery_runs", (("name", task.name), ("status", "WAITING")))] == 1
        # Retention keeps a parked run and its intent: it has not finished.
        report = purge(Database(db_url), 0)
        assert (report.runs, report.intents) == (0, 0) and waiting(db_url) == 1
        with relay_running(app, db_url):
            assert pending.get(timeout=JOB) == generate_text("gpt-test", TEXT)
    assert sum(fake.stats()["creates_by_intent"].values()) == 1


@ON_POSTGRESQL
def test_revoking_a_parked_run_cancels_it_and_its_call_at_the_provider(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    task = summarizer(app, None, llm_adapter=responses)  # the task's adapter: the one a revoke cancels with
    fake.set_knobs(poll_after_ms=3000, generation_s=30)  # the wake comes 3 s out, long after the revoke
    with worker_factory(app), relay_running(app, db_url):
        first = task.delay("r", TEXT)
        wait_until(lambda: waiting(db_url) == 1, timeout=JOB, what="the run parked")
        first.revoke()
        # The wake arrives, the worker discards it (revoked), and the run is cancelled with its call.
        wait_until(lambda: runs(db_url)[0]["status"] is RunStatus.DEAD, timeout=JOB, what="the run cancelled")
        wait_until(lambda: fake.stats()["cancels"] == 1, timeout=JOB, what="the call cancelled at the provider")
        wait_until(
            lambda: table(db_url, INTENTS)[0]["state"] is IntentState.CANCELLED, timeout=JOB, what="intent ended"
        )
    assert first.state == "REVOKED"
    [run] = runs(db_url)
    assert "revoked" in run["error"] and run["message"] is not None  # kept for `oncelery dlq replay`
    [letter] = table(db_url, LETTERS)
    assert letter["reason"] == "revoked" and letter["run_id"] == run["id"]
    assert sum(fake.stats()["creates_by_intent"].values()) == 1
    # The cancelled call may still be billed (a cancel is best effort): its row is in the ledger, labelled.
    [row] = table(db_url, CALLS)
    assert row["reason"] == "run_revoked" and not row["ok"] and row["run_id"] == run["id"]
    assert row["call_id"] == table(db_url, INTENTS)[0]["public_id"]
    assert task.outcome_counts()["dead"] == 1


@ON_SQLITE
def test_a_direct_call_blocks_on_its_model_call_instead_of_parking(
    app: Celery, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    task = summarizer(app, responses)
    # .apply() has no broker to wake a parked run through: the call is polled to its end, holding the caller.
    assert task.apply(("a", TEXT)).get(timeout=JOB) == generate_text("gpt-test", TEXT)
    [run] = runs(db_url)
    assert run["status"] is RunStatus.COMPLETED
    assert "waiting" not in task.outcome_counts()
