"""A job is one run whatever door it comes in by: a pipeline link keyed by its task is `.delay()`'s run too.

`pipeline()` keys a link by the pipeline key only where the link has no key of its own; a task with a key template
keeps it, so the same document sent through `pipeline()` and through `.delay()` (either order) makes one paid call,
and the second is answered as replayed. A run stored by the code before, under the pipeline-derived key, is still
found by the same pipeline enqueued again (a legacy lookup), and replayed, not paid again. Real worker, both stores,
the fake provider's count of creates as the oracle.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from oncelery import IdempotentTask, Outcome, outcome_of, output_text, pipeline
from oncelery.fake_provider import FakeProvider, Knobs, generate_text
from oncelery.llm.adapters.openai_responses import OpenAIResponses
from oncelery.models import RunStatus
from oncelery.runs.claims import RunStore
from tests.stored_before import BeforeUpgrade, old_link_key

TEXT = "The council approved the new library budget on Tuesday."
JOB = 60.0


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """A fake provider in a thread of the test (workers reach it over HTTP on 127.0.0.1)."""
    with FakeProvider(Knobs(poll_after_ms=5, generation_s=0.05)) as provider:
        yield provider


def jobs(app: Celery, adapter: OpenAIResponses) -> tuple[Any, Any]:
    """A paid summary keyed by its document, and a keyless link after it (scoped by the pipeline key)."""

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_door_summary", idempotency_key="doc:{doc}")
    def summarize(self: IdempotentTask, doc: str, text: str) -> str:
        return output_text(self.llm("summary", adapter=adapter, model="gpt-test", input=text, max_output_tokens=60))

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_door_words")
    def words(self: IdempotentTask, summary: str) -> int:
        return len(summary.split())

    return summarize, words


def creates(fake: FakeProvider) -> int:
    return sum(fake.stats()["creates_by_intent"].values())


def test_the_same_document_through_pipeline_and_delay_is_paid_once(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    summarize, words = jobs(app, responses)
    summary = generate_text("gpt-test", TEXT)
    with worker_factory(app):
        # pipeline() first, then .delay()
        flow = pipeline("batch:1", summarize.s("d1", TEXT), words.s()).delay()
        assert flow.get(timeout=JOB) == len(summary.split())
        direct = summarize.delay("d1", TEXT)
        assert direct.get(timeout=JOB) == summary
        assert outcome_of(direct) is Outcome.REPLAYED
        assert creates(fake) == 1, "the same document was paid twice (pipeline, then .delay())"
        # .delay() first, then pipeline()
        assert summarize.delay("d2", TEXT).get(timeout=JOB) == summary
        again = pipeline("batch:2", summarize.s("d2", TEXT), words.s()).delay()
        assert again.get(timeout=JOB) == len(summary.split())
        assert outcome_of(again.parent) is Outcome.REPLAYED
        assert creates(fake) == 2, "the same document was paid twice (.delay(), then pipeline)"
    store = RunStore(db_url)
    for doc in ("d1", "d2"):
        run = store.get(summarize.name, f"doc:{doc}")
        assert run is not None and run.status is RunStatus.COMPLETED, doc
    # A link with no key of its own is the pipeline's: scoped by the pipeline key and its position.
    for batch in ("batch:1", "batch:2"):
        run = store.get(words.name, f"{batch}/1:{words.name}")
        assert run is not None and run.status is RunStatus.COMPLETED, batch
    assert summarize.outcome_counts() == {"executed": 2, "replayed": 2}


def test_a_link_stored_under_its_pipeline_key_before_the_upgrade_is_replayed(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    summarize, words = jobs(app, responses)
    old_key = old_link_key("batch:7", 0, summarize.name)
    # As the code before stored the link: under the pipeline-derived key, the payload fingerprinted as today.
    fingerprint = summarize.identity_of(("d7", TEXT), {}).fingerprint
    BeforeUpgrade(db_url).run(summarize.name, old_key, fingerprint, result="summary stored before")
    with worker_factory(app):
        flow = pipeline("batch:7", summarize.s("d7", TEXT), words.s()).delay()
        assert flow.get(timeout=JOB) == 3
        assert outcome_of(flow.parent) is Outcome.REPLAYED
    assert creates(fake) == 0, "a run stored before the upgrade was paid again"
    store = RunStore(db_url)
    assert store.get(summarize.name, "doc:d7") is None, "a second run was made beside the one stored before"
    assert summarize.outcome_counts() == {"replayed": 1}


def test_the_pipeline_key_scopes_only_links_without_a_key_of_their_own(app: Celery, responses: OpenAIResponses) -> None:
    """What each link carries (no worker): its task's key, a per-call key, or the pipeline's; always the pipeline."""
    summarize, words = jobs(app, responses)
    by_name = app.signature("oncelery.t_door_elsewhere")  # a task only the workers know: keyed as before
    flow = pipeline("batch:9", summarize.s("d9", TEXT), words.s(), words.s().set(idempotency_key="mine"), by_name)
    headers = [link.options["headers"] for link in flow.tasks]
    assert [h["oncelery_pipeline"] for h in headers] == ["batch:9"] * 4
    assert [h.get("oncelery_key") for h in headers] == [
        None,
        f"batch:9/1:{words.name}",
        None,
        "batch:9/3:oncelery.t_door_elsewhere",
    ]
    assert [h.get("oncelery_pipeline_link") for h in headers] == [0, None, None, None]
