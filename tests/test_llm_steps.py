"""`self.llm()`: a model call as a step, on real in-process workers, both stores, against the fake provider.

The fake provider's own count of creates per intent is the oracle: a replay makes 0 calls, a call whose holder
failed after the provider answered is re-attached (0 more creates), a call that may have been sent is sent again
only labelled (and the unknown one gets an estimated ledger row), and a request that changed, an at-most-once
call of unknown outcome or a forgotten response go to a person instead of being paid again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from sqlalchemy import select

from oncelery import IdempotentTask, output_text
from oncelery.cli import oncelery as oncelery_cli
from oncelery.fake_provider import FakeProvider, Knobs, generate_text
from oncelery.llm.adapters.openai_chat import OpenAIChat
from oncelery.llm.adapters.openai_responses import OpenAIResponses
from oncelery.llm.errors import ProviderRateLimited
from oncelery.models import IntentState, RunStatus
from oncelery.ops.costs import cost_report
from oncelery.relay.retention import purge
from oncelery.runs.claims import RunStore
from oncelery.runs.faults import fault_injected
from oncelery.store.database import Database, get_engine
from oncelery.store.tables import CALLS, INTENTS
from tests.conftest import ON_POSTGRESQL, ON_SQLITE
from tests.test_metrics import scrape

TEXT = "The council approved the new library budget on Tuesday."
JOB = 60.0


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """A fake provider in a thread of the test (workers reach it over HTTP on 127.0.0.1)."""
    with FakeProvider(Knobs(poll_after_ms=5, generation_s=0.05)) as provider:
        yield provider


def summarizer(app: Celery, adapter: Any, name: str = "oncelery.t_llm", **options: Any) -> Any:
    """A one-call task: the summary of `text`, keyed by `doc`."""

    @app.task(shared=False, base=IdempotentTask, bind=True, name=name, idempotency_key="doc:{doc}", **options)
    def summarize(self: IdempotentTask, doc: str, text: str, model: str = "gpt-test") -> str:
        return output_text(self.llm("summary", adapter=adapter, model=model, input=text, max_output_tokens=60))

    return summarize


def once(effect: Callable[[], None]) -> Callable[[str, dict[str, Any]], None]:
    """A fault hook that does `effect` the first time only."""
    fired: list[bool] = []

    def hook(_name: str, _context: dict[str, Any]) -> None:
        if not fired:
            fired.append(True)
            effect()

    return hook


def boom() -> None:
    raise RuntimeError("the worker died here")


def intents(db_url: str) -> list[dict[str, Any]]:
    with get_engine(db_url).connect() as conn:
        rows = conn.execute(select(INTENTS).order_by(INTENTS.c.attempt))
        return [dict(r._mapping) for r in rows]


def ledger(db_url: str) -> list[dict[str, Any]]:
    with get_engine(db_url).connect() as conn:
        return [dict(r._mapping) for r in conn.execute(select(CALLS).order_by(CALLS.c.id))]


def test_a_call_is_made_once_and_replayed_after(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    task = summarizer(app, responses)
    with worker_factory(app):
        first = task.delay("d1", TEXT).get(timeout=JOB)
        again = task.delay("d1", TEXT).get(timeout=JOB)
    assert first == again == generate_text("gpt-test", TEXT)
    [intent] = intents(db_url)
    assert intent["state"] is IntentState.DONE and intent["reference"] and intent["repeat_reason"] is None
    assert fake.stats()["creates_by_intent"] == {intent["public_id"]: 1}, "the replay made no call"
    [row] = ledger(db_url)
    assert (row["call_id"], row["ok"], row["reason"], row["reattached"]) == (intent["public_id"], True, None, False)
    assert (row["step"], row["run_id"], row["idempotency_key"]) == ("summary", intent["run_id"], "doc:d1")
    assert (row["input_tokens"], row["output_tokens"]) == (intent["input_tokens"], intent["output_tokens"]) != (0, 0)
    assert task.outcome_counts() == {"executed": 1, "replayed": 1}
    # Retention takes a finished run's intents with it.
    assert purge(Database(db_url), 0).intents == 1 and intents(db_url) == []


@ON_SQLITE
def test_a_failed_holder_s_call_is_re_attached_not_paid_again(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    task = summarizer(app, responses, autoretry_for=(RuntimeError,), retry_kwargs={"countdown": 0})
    with fault_injected("llm_poll", once(boom)), worker_factory(app):
        assert task.delay("d2", TEXT).get(timeout=JOB) == generate_text("gpt-test", TEXT)
    [intent] = intents(db_url)
    assert intent["state"] is IntentState.DONE and intent["attempt"] == 1
    assert sum(fake.stats()["creates_by_intent"].values()) == 1
    [row] = ledger(db_url)
    assert row["reattached"] is True and row["reason"] is None
    assert cost_report(db_url).labels == {"reattached": 1}
    key = (("model", "gpt-test"), ("name", "oncelery.t_llm"), ("tenant", ""))
    assert scrape(db_url)["oncelery_llm_reattached_calls_total", key] == 1


@ON_POSTGRESQL
def test_the_create_window_re_sends_labelled_and_records_the_unknown_call(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    task = summarizer(app, responses, autoretry_for=(RuntimeError,), retry_kwargs={"countdown": 0})
    with fault_injected("llm_created", once(boom)), worker_factory(app):
        assert task.delay("d3", TEXT).get(timeout=JOB) == generate_text("gpt-test", TEXT)
    first, second = intents(db_url)
    assert (first["state"], second["state"]) == (IntentState.LOST, IntentState.DONE)
    assert second["repeat_reason"].value == "create_window"
    creates = fake.stats()["creates_by_intent"]
    assert creates == {first["public_id"]: 1, second["public_id"]: 1}
    rows = {r["call_id"]: r for r in ledger(db_url)}
    assert len(rows) == sum(creates.values()), "provider creates <= ledger rows: no hidden spend"
    unknown, repeated = rows[first["public_id"]], rows[second["public_id"]]
    assert (unknown["reason"], unknown["ok"]) == ("unknown_outcome", False)
    assert unknown["input_tokens"] >= 9 and unknown["output_tokens"] == 60, "estimated: input + the output limit"
    assert (repeated["reason"], repeated["ok"]) == ("create_window", True)
    # The labels, counted where `oncelery costs` and the exporter read them (never model_calls).
    assert cost_report(db_url).labels == {"create_window": 1, "unknown_outcome": 1}
    got = scrape(db_url)
    key = (("model", "gpt-test"), ("name", "oncelery.t_llm"), ("tenant", ""))
    by_reason = tuple(sorted((*key, ("reason", "create_window"))))
    assert got["oncelery_llm_repeated_calls_total", by_reason] == 1
    assert got["oncelery_llm_unknown_outcome_calls_total", key] == 1
    listed = CliRunner().invoke(oncelery_cli, ["--database-url", db_url, "costs"])
    assert "repeated calls: 1 create_window; calls of unknown outcome (estimated rows): 1" in listed.output


@ON_POSTGRESQL
def test_an_at_most_once_sync_call_of_unknown_outcome_goes_to_a_person(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, request: pytest.FixtureRequest
) -> None:
    adapter = OpenAIChat(fake.openai_base_url, "sk")
    request.addfinalizer(adapter.close)

    @app.task(
        shared=False, base=IdempotentTask, bind=True, name="oncelery.t_llm_once", idempotency_key="doc:{doc}",
        llm_at_most_once=True, autoretry_for=(RuntimeError,), retry_kwargs={"countdown": 0},
    )  # fmt: skip
    def charge(self: IdempotentTask, doc: str) -> str:
        reply = self.llm("reply", adapter=adapter, model="gpt-test", messages=[{"role": "user", "content": doc}])
        return output_text(reply)

    interrupted = pytest.raises(Exception, match="at_most_once call of step 'reply' was interrupted")
    with fault_injected("llm_create", once(boom)), worker_factory(app), interrupted:
        charge.delay("d4").get(timeout=JOB)
    run = RunStore(db_url).get("oncelery.t_llm_once", "doc:d4")
    assert run is not None and run.status is RunStatus.DEAD
    assert [i["state"] for i in intents(db_url)] == [IntentState.LOST]
    assert fake.stats()["creates"] == {}, "never sent again"


@ON_SQLITE
def test_a_forgotten_response_is_called_again_labelled_or_dead_lettered(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    adapter = responses
    recall = summarizer(app, adapter)
    strict = summarizer(app, adapter, name="oncelery.t_llm_strict", llm_on_lost="dead_letter")
    with worker_factory(app):
        with fault_injected("llm_poll", once(lambda: fake.forget())):
            assert recall.delay("d5", TEXT).get(timeout=JOB) == generate_text("gpt-test", TEXT)
        gone = pytest.raises(Exception, match="no longer has the response of step 'summary'")
        with fault_injected("llm_poll", once(lambda: fake.forget())), gone:
            strict.delay("d6", TEXT).get(timeout=JOB)
    by_run: dict[int, list[Any]] = {}
    for i in intents(db_url):
        by_run.setdefault(i["run_id"], []).append((i["state"], i["repeat_reason"] and i["repeat_reason"].value))
    assert sorted(by_run.values(), key=len) == [
        [(IntentState.LOST, None)],
        [(IntentState.LOST, None), (IntentState.DONE, "lost")],
    ]
    assert RunStore(db_url).get("oncelery.t_llm_strict", "doc:d6").status is RunStatus.DEAD  # type: ignore[union-attr]
    assert fake.stats()["creates"] == {"responses": 3}


@ON_SQLITE
def test_a_changed_request_with_a_call_in_flight_is_a_step_mismatch(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    model = ["gpt-a"]
    adapter = responses

    @app.task(
        shared=False, base=IdempotentTask, bind=True, name="oncelery.t_llm_changed", idempotency_key="doc:{doc}",
        autoretry_for=(RuntimeError,), retry_kwargs={"countdown": 0},
    )  # fmt: skip
    def summarize(self: IdempotentTask, doc: str) -> str:
        return output_text(self.llm("summary", adapter=adapter, model=model[0], input=doc))

    def change_then_die() -> None:
        model[0] = "gpt-b"  # the next attempt runs other code
        boom()

    mismatch = pytest.raises(Exception, match="changed since attempt 1 was prepared")
    with fault_injected("llm_poll", once(change_then_die)), worker_factory(app), mismatch:
        summarize.delay("d7").get(timeout=JOB)
    assert RunStore(db_url).get("oncelery.t_llm_changed", "doc:d7").status is RunStatus.DEAD  # type: ignore[union-attr]
    assert sum(fake.stats()["creates_by_intent"].values()) == 1


@ON_POSTGRESQL
def test_a_429_creates_nothing_and_the_retry_is_a_new_intent(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    task = summarizer(
        app, responses, autoretry_for=(ProviderRateLimited,),
        retry_kwargs={"countdown": 0},
    )  # fmt: skip
    fake.set_knobs(fail_next=1, fail_status=429, retry_after_s=1)
    with worker_factory(app):
        assert task.delay("d8", TEXT).get(timeout=JOB) == generate_text("gpt-test", TEXT)
    first, second = intents(db_url)
    assert (first["state"], second["state"]) == (IntentState.FAILED, IntentState.DONE)
    assert second["repeat_reason"].value == "failed" and "rate-limited" in first["error"]
    stats = fake.stats()
    assert stats["errors_served"] == {"429": 1} and stats["creates_by_intent"] == {second["public_id"]: 1}
    assert [r["call_id"] for r in ledger(db_url)] == [second["public_id"]], "a refused create costs nothing"


def test_open_calls_and_those_past_the_provider_s_retention_are_gauged(db_url: str) -> None:
    now = datetime.now(UTC)
    row = {"run_id": 1, "step_name": "s", "token": 1, "provider": "p", "endpoint": "responses", "model": "m"}
    rows = [
        # sent 10 minutes ago to a provider that keeps a response 60 s: at risk
        {"position": 0, "state": IntentState.SENT, "retention_s": 60.0, "sent_at": now - timedelta(minutes=10)},
        # sent just now: not at risk
        {"position": 1, "state": IntentState.SENT, "retention_s": 60.0, "sent_at": now},
        # a synchronous call (no retention) and one not yet sent, and one that ended
        {"position": 2, "state": IntentState.SENT, "retention_s": None, "sent_at": now - timedelta(hours=1)},
        {"position": 3, "state": IntentState.PREPARED, "retention_s": 60.0, "sent_at": None},
        {"position": 4, "state": IntentState.DONE, "retention_s": 60.0, "sent_at": now - timedelta(hours=1)},
    ]
    with get_engine(db_url).begin() as conn:
        for i, extra in enumerate(rows):
            conn.execute(
                INTENTS.insert().values(
                    **row, **extra, public_id=f"i{i}", attempt=1, mode="background", request_digest="d" * 64
                )
            )
    got = scrape(db_url)
    assert got["oncelery_llm_open_calls", (("state", "sent"),)] == 3
    assert got["oncelery_llm_open_calls", (("state", "prepared"),)] == 1
    assert got["oncelery_llm_calls_at_risk", ()] == 1
