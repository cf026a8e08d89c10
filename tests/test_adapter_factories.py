"""A task's provider adapters given as factories, in docs/batches.md's form (`llm_adapter=lambda: OpenAIResponses()`):
made with no argument although Celery hands the function back bound to the task, by the worker's `self.llm`, by a
revoke's cancel, and by the relay's batcher; real workers, the relay loop and the fake provider as a server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from oncelery import BatchPolicy, IdempotentTask, output_text
from oncelery.basetask.llm_step import resolve_adapter
from oncelery.fake_provider import FakeProvider, Knobs, generate_text
from oncelery.llm.adapters.batch import OpenAIBatches
from oncelery.llm.adapters.openai_responses import OpenAIResponses
from oncelery.llm.cancel import adapter_of
from oncelery.testing import relay_running
from tests.conftest import offline_job

TEXT = "The council approved the new library budget on Tuesday."
JOB = 60.0
OUT = 8
PRICE = {"gpt-test": {"input": 1000, "output": 1000}}


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """A fake provider answering at once, whose batches end after two polls."""
    with FakeProvider(Knobs(poll_after_ms=5, generation_s=0.0, batch_polls=2)) as provider:
        yield provider


def test_a_background_call_through_the_documented_factory_form_in_a_worker(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider
) -> None:
    base = fake.openai_base_url

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_factory_call",
              idempotency_key="doc:{doc_id}",
              llm_adapter=lambda: OpenAIResponses(base, "sk"))  # fmt: skip
    def summarize(self: IdempotentTask, doc_id: str, text: str) -> str:
        return output_text(self.llm("summarize", model="gpt-test", input=text, max_output_tokens=OUT))

    try:
        with worker_factory(app, concurrency=2):
            assert summarize.delay("d1", TEXT).get(timeout=JOB) == generate_text("gpt-test", TEXT, OUT)
            assert summarize.delay("d2", TEXT + " Again.").get(timeout=JOB)
        assert len(fake.stats()["creates_by_intent"]) == 2
        # A revoke cancels with the same adapter; a worker makes the factory's adapter once, not once per call.
        made = resolve_adapter(summarize, None)
        assert isinstance(made, OpenAIResponses) and adapter_of(summarize) is made
    finally:
        resolve_adapter(summarize, None).close()


def test_a_batch_step_through_the_documented_factory_forms_in_the_worker_and_the_relays_batcher(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider
) -> None:
    app.conf.oncelery_prices = PRICE
    base = fake.openai_base_url

    # docs/batches.md's form: the synchronous API (usage, and any fallback), and the batch API the batcher uses.
    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_factory_batch",
              idempotency_key="doc:{doc_id}",
              llm_adapter=lambda: OpenAIResponses(base, "sk"),
              llm_batch_adapter=lambda: OpenAIBatches(base, "sk"))  # fmt: skip
    def score(self: IdempotentTask, doc_id: str, text: str) -> str:
        verdict = self.llm("score", model="gpt-test", input=text, max_output_tokens=OUT, mode="batch",
                           batch=BatchPolicy(max_items=1, max_wait_s=30))  # fmt: skip
        return output_text(verdict)

    relay = None
    try:
        with worker_factory(app, concurrency=2), relay_running(app, db_url, batch_poll_s=0.05) as relay:
            assert score.delay("d1", TEXT).get(timeout=JOB) == generate_text("gpt-test", TEXT, OUT)
        stats = fake.stats()
        assert stats["batches_created"] == {"openai": 1} and stats["creates_by_intent"] == {}, stats
        assert relay.batcher is not None and isinstance(relay.batcher.adapters["openai"], OpenAIBatches)
    finally:
        resolve_adapter(score, None).close()
        if relay is not None and relay.batcher is not None:
            relay.batcher.adapters["openai"].close()


def test_a_factory_may_take_the_task_and_an_adapter_given_as_such_is_used_as_it_is() -> None:
    app = Celery("factories", set_as_current=False)
    seen: list[Any] = []

    def made_for(task: Any) -> OpenAIResponses:
        seen.append(task)
        return OpenAIResponses("http://127.0.0.1:9/v1", "sk")

    task = offline_job(app, "oncelery.t_factory_of_task", llm_adapter=made_for)
    with resolve_adapter(task, None) as made:
        assert isinstance(made, OpenAIResponses) and seen == [task]
        assert adapter_of(task) is made and seen == [task]  # made once per task
    with OpenAIResponses("http://127.0.0.1:9/v1", "sk") as given:
        same = offline_job(app, "oncelery.t_factory_given", llm_adapter=given)
        assert resolve_adapter(same, None) is given and adapter_of(same) is given
        assert resolve_adapter(same, lambda: given) is given  # a per-call factory, made with no argument
