"""The ledger rule on every path: a create that may have happened has exactly one ledger row, charged.

Each path that ends a model call's intent any way but `done` — a lost response dead-lettered, a response lost
twice, a revoke whose provider cancel fails, a parked run settled stale at its wake, a budget refusal after a
create of unknown outcome — leaves the fake provider's creates (the oracle: what a provider bills) covered by
ledger rows, each labelled, its budget charged (not released), and no reservation held. Real in-process workers,
the real relay loop, the fake provider as an HTTP server, both stores.
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import select, update

from oncelery import IdempotentTask, output_text
from oncelery.fake_provider import FakeProvider, Knobs
from oncelery.llm.adapters.openai_responses import OpenAIResponses
from oncelery.llm.tokens import estimate_tokens
from oncelery.models import IntentState, RunStatus
from oncelery.relay.loop import Relay
from oncelery.relay.retention import purge
from oncelery.runs.faults import fault_injected
from oncelery.store.database import Database, get_engine
from oncelery.store.tables import BUDGETS, CALLS, INTENTS, LETTERS, RUNS, TOTALS
from oncelery.testing import relay_running, wait_until
from tests.test_llm_steps import boom, once

TEXT = "The council approved the new library budget on Tuesday."
JOB = 60.0
PRICE = {"gpt-test": {"input": 1000, "output": 1000}}  # USD per 1M tokens: 1,000 micro-USD per token
BUDGET = {"global": {"usd_per_day": 100}}


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """A fake provider whose background calls take 30 s (they run until a test forgets or cancels them)."""
    with FakeProvider(Knobs(poll_after_ms=20, generation_s=30.0)) as provider:
        yield provider


def summarizer(app: Celery, adapter: Any, **options: Any) -> Any:
    """A one-call task with a global budget and a price; its call polls inline for up to `llm_inline_wait`."""
    app.conf.oncelery_prices = PRICE
    app.conf.oncelery_budgets = BUDGET
    options = {"idempotency_key": "doc:{doc}", "max_retries": 0, "llm_inline_wait": 20.0, **options}

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_paid", **options)
    def summarize(self: IdempotentTask, doc: str, text: str, version: int = 1) -> str:
        return output_text(self.llm("summary", adapter=adapter, model="gpt-test", input=text, max_output_tokens=40))

    return summarize


def rows(db_url: str, which: Any) -> list[dict[str, Any]]:
    with get_engine(db_url).connect() as conn:
        return [dict(r._mapping) for r in conn.execute(select(which))]


def intents(db_url: str) -> list[dict[str, Any]]:
    return sorted(rows(db_url, INTENTS), key=lambda i: i["id"])


def assert_on_the_books(db_url: str, fake: FakeProvider, labels: dict[str, str]) -> None:
    """Every create the provider saw has its one ledger row, labelled as `labels` says (public id -> reason);
    each estimated row carries its intent's estimate; the budget spent is the ledger's sum; nothing is reserved."""
    creates = fake.stats()["creates_by_intent"]
    calls = {r["call_id"]: r for r in rows(db_url, CALLS)}
    assert set(creates) <= set(calls), "provider creates <= ledger rows: no hidden spend"
    assert {cid: r["reason"] for cid, r in calls.items()} == labels
    for intent in intents(db_url):
        row = calls.get(intent["public_id"])
        if row is not None and row["reason"] in ("unknown_outcome", "run_revoked"):
            assert not row["ok"] and "estimated" in row["error"]
            assert (row["input_tokens"], row["output_tokens"], row["cost_micros"]) == (
                intent["estimated_input_tokens"], intent["estimated_output_tokens"], intent["estimated_cost_micros"],
            ) and row["output_tokens"] == 40  # fmt: skip
        assert intent["state"] not in (IntentState.PREPARED, IntentState.SENT), "no intent left open"
        assert intent["released_at"] is not None, "its reservation settled"
    [budget] = rows(db_url, BUDGETS)
    assert budget["reserved_micros"] == 0, "no reservation left held"
    assert budget["spent_micros"] == sum(r["cost_micros"] for r in calls.values()) > 0, "charged, not released"


def status(db_url: str) -> RunStatus | None:
    """The first run's status (None: no run yet)."""
    found = sorted(rows(db_url, RUNS), key=lambda r: r["id"])
    return found[0]["status"] if found else None


def sent(db_url: str, attempt: int = 1) -> dict[str, Any] | None:
    """The step's intent of `attempt` once it is `sent` (the provider has the call), else None."""
    found = [i for i in intents(db_url) if i["attempt"] == attempt and i["state"] is IntentState.SENT]
    return found[0] if found else None


def test_a_lost_response_dead_lettered_is_on_the_books_and_charged(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    task = summarizer(app, responses, llm_on_lost="dead_letter")
    with worker_factory(app):
        result = task.delay("lost", TEXT)
        wait_until(lambda: sent(db_url) is not None, timeout=JOB, what="the call sent")
        call = sent(db_url)
        assert call is not None and fake.forget(call["reference"]) == 1  # the provider forgets it mid-poll
        with pytest.raises(Exception, match="lost"):
            result.get(timeout=JOB)
    [run] = rows(db_url, RUNS)
    assert run["status"] is RunStatus.DEAD
    assert len(rows(db_url, LETTERS)) == 1
    [intent] = intents(db_url)
    assert intent["state"] is IntentState.LOST
    assert fake.stats()["creates_by_intent"] == {intent["public_id"]: 1}
    assert_on_the_books(db_url, fake, {intent["public_id"]: "unknown_outcome"})


def test_a_response_lost_twice_has_a_row_for_each_create(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    task = summarizer(app, responses)  # on_lost="recall": once re-sent, lost again -> a person decides
    with worker_factory(app):
        result = task.delay("twice", TEXT)
        for attempt in (1, 2):
            wait_until(lambda a=attempt: sent(db_url, a) is not None, timeout=JOB, what=f"attempt {attempt} sent")
            call = sent(db_url, attempt)
            assert call is not None and fake.forget(call["reference"]) == 1
        with pytest.raises(Exception, match="lost"):
            result.get(timeout=JOB)
    first, second = intents(db_url)
    assert (first["state"], second["state"]) == (IntentState.LOST, IntentState.LOST)
    assert second["repeat_reason"].value == "lost"
    creates = fake.stats()["creates_by_intent"]
    assert creates == {first["public_id"]: 1, second["public_id"]: 1}
    labels = {first["public_id"]: "unknown_outcome", second["public_id"]: "unknown_outcome"}
    assert_on_the_books(db_url, fake, labels)


@pytest.mark.parametrize(
    ("db_url", "cancel_status"),
    [("sqlite", 500), ("postgresql", 404)],
    indirect=["db_url"],
    ids=["sqlite-5xx", "pg-404"],
)
def test_a_revoked_run_whose_provider_cancel_fails_is_on_the_books_and_releases_nothing_held(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses, cancel_status: int
) -> None:
    task = summarizer(app, None, llm_adapter=responses, llm_inline_wait=0.1)  # parks at once
    fake.set_knobs(poll_after_ms=3000, cancel_status=cancel_status)  # the wake comes 3 s out; every cancel fails
    with worker_factory(app), relay_running(app, db_url):
        first = task.delay("revoked", TEXT)
        wait_until(lambda: status(db_url) is RunStatus.WAITING, timeout=JOB, what="parked")
        first.revoke()
        wait_until(lambda: status(db_url) is RunStatus.DEAD, timeout=JOB, what="the run revoked")
        wait_until(lambda: fake.stats()["cancels_refused"] == 1, timeout=JOB, what="the cancel asked and refused")
    assert fake.stats()["cancels"] == 0
    [intent] = intents(db_url)
    assert intent["state"] is IntentState.ABANDONED, "a failed cancel changes nothing: the call is on the books"
    assert_on_the_books(db_url, fake, {intent["public_id"]: "run_revoked"})


def test_a_parked_run_settled_stale_at_its_wake_cancels_and_records_its_call_and_purge_keeps_the_books(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    task = summarizer(
        app, None, llm_adapter=responses, llm_inline_wait=0.1, idempotency_key="doc:{doc}:v{version}",
        entity="e:{doc}", entity_version="version",
    )  # fmt: skip
    fake.set_knobs(poll_after_ms=1500)  # v1's wake comes 1.5 s out: after v2 is applied
    with worker_factory(app), relay_running(app, db_url):
        old = task.delay("e", TEXT, 1)
        wait_until(lambda: sent(db_url) is not None and status(db_url) is RunStatus.WAITING,
                   timeout=JOB, what="v1 parked with its call at the provider")  # fmt: skip
        fake.set_knobs(generation_s=0.0)  # v2's call answers at once
        assert task.delay("e", TEXT + " Updated.", 2).get(timeout=JOB)
        assert old.get(timeout=JOB) is None  # v1's wake is stale: settled with no result
        wait_until(lambda: fake.stats()["cancels"] == 1, timeout=JOB, what="v1's call cancelled at the provider")
    v1, v2 = sorted(rows(db_url, RUNS), key=lambda r: r["id"])
    assert (v1["status"], v1["result"], v2["status"]) == (RunStatus.COMPLETED, None, RunStatus.COMPLETED)
    first, second = intents(db_url)
    assert (first["state"], second["state"]) == (IntentState.CANCELLED, IntentState.DONE)
    labels = {first["public_id"]: "unknown_outcome", second["public_id"]: None}
    assert_on_the_books(db_url, fake, labels)
    # Retention deletes both finished runs with their intents: the spend stays in the totals, nothing held.
    assert purge(Database(db_url), 0).intents == 2 and intents(db_url) == []
    [total] = rows(db_url, TOTALS)
    assert total["calls"] == 2 and rows(db_url, BUDGETS)[0]["reserved_micros"] == 0


def test_a_budget_refusal_after_a_create_of_unknown_outcome_keeps_that_create_on_the_books(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    fake.set_knobs(generation_s=0.0)
    # The job's budget fits one call's estimate and a half: the re-send after the create window cannot fit.
    estimate = (estimate_tokens(TEXT) + 40) * 1000
    task = summarizer(
        app, responses, autoretry_for=(RuntimeError,), retry_kwargs={"countdown": 0}, max_retries=3,
        max_cost_usd=Decimal(estimate * 3) / 2 / 1_000_000,
    )  # fmt: skip
    app.conf.oncelery_budgets = None  # the job's budget only
    refusal = "attempt 1 of this step may have been made"
    with (
        fault_injected("llm_created", once(boom)),
        worker_factory(app),
        pytest.raises(Exception, match=refusal) as refused,
    ):
        task.delay("refused", TEXT).get(timeout=JOB)
    assert "this call was not sent" in str(refused.value) and "nothing was sent" not in str(refused.value)
    [run] = rows(db_url, RUNS)
    assert run["status"] is RunStatus.DEAD
    [letter] = rows(db_url, LETTERS)
    assert letter["reason"] == "budget_exceeded"
    [intent] = intents(db_url)  # the re-send was refused before it was prepared
    assert intent["state"] is IntentState.LOST and intent["reference"] is None
    assert fake.stats()["creates_by_intent"] == {intent["public_id"]: 1}
    assert_on_the_books(db_url, fake, {intent["public_id"]: "unknown_outcome"})


def test_a_run_failed_for_good_puts_its_open_call_on_the_books_and_a_later_send_pays_on_the_books_too(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    fake.set_knobs(generation_s=0.0)
    # Celery's default: a plain exception is not retried (no autoretry), so the run is FAILED for good with its
    # call open in the create window, and nothing will hold it again unless the job is sent again.
    task = summarizer(app, responses, max_retries=3)
    with (
        fault_injected("llm_created", once(boom)),
        worker_factory(app),
        pytest.raises(Exception, match="the worker died here"),
    ):
        task.delay("failed", TEXT).get(timeout=JOB)
    [run] = rows(db_url, RUNS)
    assert run["status"] is RunStatus.FAILED and run["not_before"] is None, "failed for good: no retry is coming"
    [intent] = intents(db_url)
    assert intent["state"] is IntentState.ABANDONED, "the run's end ends its open call"
    assert fake.stats()["creates_by_intent"] == {intent["public_id"]: 1}
    assert_on_the_books(db_url, fake, {intent["public_id"]: "unknown_outcome"})
    # The job sent again takes the run over and calls again: both creates on the books, the second labelled.
    with worker_factory(app):
        assert task.delay("failed", TEXT).get(timeout=JOB)
    first, second = intents(db_url)
    assert (first["state"], second["state"]) == (IntentState.ABANDONED, IntentState.DONE)
    assert set(fake.stats()["creates_by_intent"]) == {first["public_id"], second["public_id"]}
    calls = {r["call_id"]: r for r in rows(db_url, CALLS)}
    assert calls[second["public_id"]]["ok"] and calls[first["public_id"]]["reason"] == "unknown_outcome"


def test_the_relay_sweep_records_a_call_a_finished_run_left_open(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    fake.set_knobs(generation_s=0.0)
    app.conf.oncelery_prices = PRICE
    app.conf.oncelery_budgets = BUDGET

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_caught", idempotency_key="doc:{doc}")
    def caught(self: IdempotentTask, doc: str, text: str) -> str:
        try:  # a body that catches its call's failure and completes anyway: the call stays open (create window)
            return output_text(self.llm("summary", adapter=responses, model="gpt-test", input=text,
                                        max_output_tokens=40))  # fmt: skip
        except RuntimeError:
            return "fallback"

    with fault_injected("llm_created", once(boom)), worker_factory(app):
        assert caught.delay("caught", TEXT).get(timeout=JOB) == "fallback"
    [intent] = intents(db_url)
    assert intent["state"] is IntentState.PREPARED and rows(db_url, CALLS) == []
    with relay_running(app, db_url):
        wait_until(lambda: len(rows(db_url, CALLS)) == 1, timeout=JOB, what="the sweep recorded the open call")
    [intent] = intents(db_url)
    assert intent["state"] is IntentState.ABANDONED
    assert_on_the_books(db_url, fake, {intent["public_id"]: "unknown_outcome"})


def test_the_relay_sweep_records_a_call_a_run_failed_for_good_by_an_earlier_release_left_open(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    fake.set_knobs(generation_s=0.0)
    # A retry an hour away: the run is FAILED with its call open in the create window, for the next holder.
    task = summarizer(app, responses, autoretry_for=(RuntimeError,), retry_kwargs={"countdown": 3600}, max_retries=3)
    with fault_injected("llm_created", once(boom)), worker_factory(app):
        task.delay("legacy", TEXT)
        wait_until(lambda: status(db_url) is RunStatus.FAILED, timeout=JOB, what="the run failed, its retry pending")
    relay = Relay(app, db_url, sweep_interval=None)
    relay.run_once()
    [intent] = intents(db_url)
    assert intent["state"] is IntentState.PREPARED and rows(db_url, CALLS) == [], "a pending retry keeps its call"
    # What a release before this rule left when a run failed for good: the same row with no retry coming.
    with get_engine(db_url).begin() as conn:
        conn.execute(update(RUNS).values(not_before=None))
    relay.run_once()
    [intent] = intents(db_url)
    assert intent["state"] is IntentState.ABANDONED
    assert_on_the_books(db_url, fake, {intent["public_id"]: "unknown_outcome"})


def test_a_holder_fenced_out_before_it_saved_its_call_cancels_that_call_nobody_can_find_again(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    task = summarizer(app, responses)
    engine = get_engine(db_url)

    def taken_over() -> None:  # another holder takes the run over in the create window (the token moves on)
        with engine.begin() as conn:
            conn.execute(update(RUNS).values(fencing_token=RUNS.c.fencing_token + 1))

    with fault_injected("llm_created", once(taken_over)), worker_factory(app):
        task.delay("fenced", TEXT)  # its holder then waits out the taker's lease: the test ends before
        wait_until(lambda: fake.stats()["cancels"] == 1, timeout=JOB, what="the unrecorded call cancelled")
    first = intents(db_url)[0]
    assert first["reference"] is None, "its reference was never saved: only its own holder could cancel it"
    assert fake.stats()["creates_by_intent"][first["public_id"]] == 1
