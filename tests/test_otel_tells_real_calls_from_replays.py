"""OpenTelemetry's token totals equal the ledger's, and the spans say which call was real and which a replay.

The matrix, with real in-process workers on the real Redis broker and the fake provider over HTTP; one test per
column, each on one store:

    | job (fault forced once)          | what the ledger says             | OTel                                    |
    |----------------------------------|----------------------------------|-----------------------------------------|
    | 2 calls, dies in a later step    | 2 real rows; retry replays both  | 4 points, then 0 (fully replayed)       |
    | dies at its first `llm_poll`     | 1 row, reattached                | the client span says reattached         |
    | dies in the create window        | unknown_outcome + create_window  | estimate counted apart; 1 real call     |

    | column                | who records gen_ai.client.token.usage | client spans                          |
    |-----------------------|---------------------------------------|---------------------------------------|
    | no provider span      | Oncelery                              | Oncelery's `chat gpt-test`            |
    | provider span         | the provider instrumentation only     | the provider's, enriched by Oncelery  |

Either way the sum of `gen_ai.client.token.usage` equals the ledger rows that are not unknown_outcome estimates.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from opentelemetry.trace import SpanKind, StatusCode
from sqlalchemy import select

from oncelery import IdempotentTask, output_text
from oncelery.fake_provider import FakeProvider, Knobs
from oncelery.llm.adapters.openai_responses import OpenAIResponses
from oncelery.runs.faults import fault_injected
from oncelery.store.database import get_engine
from oncelery.store.tables import CALLS
from tests.conftest import ON_POSTGRESQL, ON_SQLITE
from tests.otel_kit import TOKEN_USAGE, InstrumentedResponses, Sdk, delta, sdk, spans_named, sums

TEXT = "The harbour authority closed the north pier for repairs until March."
JOB = 60.0
KEYS = ("replayed", "reattached", "repeated")


@pytest.fixture
def otel() -> Iterator[Sdk]:
    """The process's SDK providers, with the spans of earlier tests forgotten."""
    kit = sdk()
    kit.spans.clear()
    yield kit
    kit.spans.clear()


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """A fake provider in a thread of the test; its calls run in the background for 0.05 s."""
    with FakeProvider(Knobs(poll_after_ms=5, generation_s=0.05)) as provider:
        yield provider


def jobs(app: Celery, adapter: Any, publish: Callable[[], str]) -> Any:
    """The task: one model call, or two and a step `publish` (key `replayed`), traced (`oncelery_otel`), priced."""
    app.conf.oncelery_otel = True
    app.conf.oncelery_prices = {"gpt-test": {"input": 1, "output": 4}}

    @app.task(
        shared=False, base=IdempotentTask, bind=True, name="oncelery.t_otel", idempotency_key="doc:{doc}",
        autoretry_for=(RuntimeError,), retry_kwargs={"countdown": 0},
    )  # fmt: skip
    def summarize(self: IdempotentTask, doc: str, text: str) -> str:
        first = output_text(self.llm("summary", adapter=adapter, model="gpt-test", input=text, max_output_tokens=40))
        if doc != "replayed":
            return first
        second = self.llm("title", adapter=adapter, model="gpt-test", input=first, max_output_tokens=12)
        return first + " / " + output_text(second) + self.step("publish", publish)

    return summarize


def once_for(key: str, effect: Callable[[], None]) -> Callable[[str, dict[str, Any]], None]:
    """A fault hook that does `effect` (then dies) the first time the job of `key` reaches its point."""
    fired: list[bool] = []
    lock = threading.Lock()

    def hook(_name: str, context: dict[str, Any]) -> None:
        with lock:
            if context.get("key") != f"doc:{key}" or fired:
                return
            fired.append(True)
        effect()
        raise RuntimeError("the worker died here")

    return hook


def run_matrix(app: Celery, adapter: Any, otel: Sdk, worker_factory: Any) -> dict[str, Any]:
    """Run the three jobs; return the sums before, after the first attempt of `replayed`, after it, and at the end."""
    seen: dict[str, Any] = {"before": sums(otel.reader)}

    def publish() -> str:
        """Dies the first time: both calls are checkpointed, and the retry replays them."""
        if "first_attempt" not in seen:
            seen["first_attempt"] = sums(otel.reader)
            raise RuntimeError("the worker died here")
        return ""

    task = jobs(app, adapter, publish)
    with worker_factory(app):
        task.delay("replayed", TEXT).get(timeout=JOB)
        seen["replayed"] = sums(otel.reader)
        with (
            fault_injected("llm_poll", once_for("reattached", lambda: None)),
            fault_injected("llm_created", once_for("repeated", lambda: None)),
        ):
            results = [task.delay(key, TEXT) for key in KEYS[1:]]
            for result in results:
                result.get(timeout=JOB)
    seen["after"] = sums(otel.reader)
    return seen


def ledger(db_url: str) -> list[dict[str, Any]]:
    with get_engine(db_url).connect() as conn:
        return [dict(r._mapping) for r in conn.execute(select(CALLS).order_by(CALLS.c.id))]


def tokens(rows: list[dict[str, Any]]) -> dict[str, int]:
    return {
        "input": sum(int(r["input_tokens"]) for r in rows),
        "output": sum(int(r["output_tokens"]) for r in rows),
    }


def check_totals(seen: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Token points equal the ledger exactly; a fully replayed attempt adds none; estimates and savings apart."""
    real = [r for r in rows if r["reason"] != "unknown_outcome"]
    unknown = [r for r in rows if r["reason"] == "unknown_outcome"]
    added = delta(seen["after"], seen["before"])
    assert {kind: added.get((TOKEN_USAGE, kind), 0) for kind in ("input", "output")} == tokens(real)
    assert {kind: added.get(("points", kind), 0) for kind in ("input", "output")} == {"input": 4, "output": 4}
    assert [r["reason"] for r in rows].count("create_window") == 1 and len(unknown) == 1
    assert {k: added.get(("oncelery.llm.token.estimated", k), 0) for k in ("input", "output")} == tokens(unknown)
    replayed = [r for r in rows if r["idempotency_key"] == "doc:replayed"]
    assert len(replayed) == 2
    assert {k: added.get(("oncelery.llm.token.saved", k), 0) for k in ("input", "output")} == tokens(replayed)
    # The attempt that replayed both calls recorded no token-usage point at all.
    replaying = delta(seen["replayed"], seen["first_attempt"])
    assert {k: v for k, v in replaying.items() if k[0] in (TOKEN_USAGE, "points")} == {}


def check_spans(otel: Sdk, rows: list[dict[str, Any]]) -> list[Any]:
    """Step spans say replayed or not; no raw key or prompt anywhere. Return the finished spans."""
    spans = list(otel.spans.get_finished_spans())
    run_of = {r["idempotency_key"]: r["run_id"] for r in rows}
    steps = [
        s for s in spans
        if s.name == "oncelery.step" and s.attributes.get("oncelery.run_id") == run_of["doc:replayed"]
        and s.attributes.get("oncelery.step.kind") == "llm"
    ]  # fmt: skip
    assert sorted((s.attributes["oncelery.step.name"], s.attributes["oncelery.step.replayed"]) for s in steps) == [
        ("summary", False), ("summary", True), ("title", False), ("title", True),
    ]  # fmt: skip
    runs = spans_named(spans, "oncelery.run oncelery.t_otel")
    attempts = sorted(
        (r.attributes["oncelery.run_id"], r.attributes["oncelery.run.attempt"])
        for r in runs
        if "oncelery.run_id" in r.attributes
    )
    assert attempts == sorted((run, n) for run in run_of.values() for n in (1, 2)), "each job's two attempts"
    assert all(r.status.status_code is StatusCode.UNSET for r in runs), "retries and re-sends are not errors"
    finished = sorted(
        r.attributes.get("oncelery.delivery.outcome", "") for r in runs if "oncelery.run_id" in r.attributes
    )
    assert finished == ["", "", "", "executed", "executed", "resumed"], "first attempts retried; the replay resumed"
    for span in spans:
        for value in (span.attributes or {}).values():
            assert "doc:" not in str(value) and TEXT[:20] not in str(value), (span.name, value)
    return spans


@ON_SQLITE
def test_without_a_provider_span_oncelery_records_the_calls(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, otel: Sdk
) -> None:
    with OpenAIResponses(fake.openai_base_url, "sk") as adapter:
        seen = run_matrix(app, adapter, otel, worker_factory)
    rows = ledger(db_url)
    check_totals(seen, rows)
    spans = check_spans(otel, rows)
    calls = [s for s in spans if s.name == "chat gpt-test"]
    assert all(s.kind is SpanKind.CLIENT and s.instrumentation_scope.name == "oncelery" for s in calls)
    by_call = {s.attributes["oncelery.llm.call_id"]: s for s in calls}
    real = [r for r in rows if r["reason"] != "unknown_outcome"]
    assert sorted(by_call) == sorted(r["call_id"] for r in real), "one client span per real call, none per estimate"
    for row in real:
        span = by_call[row["call_id"]]
        assert span.attributes["gen_ai.usage.input_tokens"] == row["input_tokens"]
        assert span.attributes["gen_ai.usage.output_tokens"] == row["output_tokens"]
        assert span.attributes["oncelery.llm.reattached"] is row["reattached"]
        assert span.attributes.get("oncelery.llm.repeated_reason") == row["reason"]
        assert span.attributes["oncelery.llm.cost_usd"] == pytest.approx(row["cost_micros"] / 1_000_000)
        assert span.attributes["gen_ai.system"] == "openai" and span.attributes["oncelery.llm.mode"] == "background"
    assert [r["reattached"] for r in real].count(True) == 1


@ON_POSTGRESQL
def test_with_a_provider_span_only_the_provider_records_the_calls(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, otel: Sdk
) -> None:
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    instrumentor = CeleryInstrumentor()
    instrumentor.instrument()
    try:
        with InstrumentedResponses(fake.openai_base_url, "sk") as adapter:
            seen = run_matrix(app, adapter, otel, worker_factory)
    finally:
        instrumentor.uninstrument()
    rows = ledger(db_url)
    check_totals(seen, rows)
    spans = check_spans(otel, rows)
    assert [s for s in spans if s.instrumentation_scope.name == "oncelery" and s.kind is SpanKind.CLIENT] == []
    provider = [s for s in spans if s.instrumentation_scope.name == "tests.provider-instrumentation"]
    assert provider and all("oncelery.run_id" in s.attributes for s in provider), "every provider span enriched"
    done = [s for s in provider if "gen_ai.usage.input_tokens" in s.attributes]
    assert len(done) == 4
    assert sorted(str(s.attributes.get("oncelery.llm.repeated_reason")) for s in done).count("create_window") == 1
    assert [s.attributes["oncelery.llm.reattached"] for s in done].count(True) == 1
    # The run attempt's span is a child of Celery's task span (opentelemetry-instrumentation-celery made it).
    by_id = {s.context.span_id: s for s in spans}
    for run in spans_named(spans, "oncelery.run "):
        assert run.parent is not None and by_id[run.parent.span_id].name == "run/oncelery.t_otel"


@ON_SQLITE
def test_a_provider_span_that_saw_no_usage_leaves_the_tokens_to_oncelery(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, otel: Sdk
) -> None:
    before = sums(otel.reader)
    with InstrumentedResponses(fake.openai_base_url, "sk", sees_answers=False) as adapter:
        task = jobs(app, adapter, lambda: "")
        with worker_factory(app):
            task.delay("single", TEXT).get(timeout=JOB)
    added = delta(sums(otel.reader), before)
    [row] = ledger(db_url)
    assert {k: added.get((TOKEN_USAGE, k), 0) for k in ("input", "output")} == tokens([row])
    spans = list(otel.spans.get_finished_spans())
    assert [s for s in spans if s.instrumentation_scope.name == "oncelery" and s.kind is SpanKind.CLIENT] == []
    provider = [s for s in spans if s.instrumentation_scope.name == "tests.provider-instrumentation"]
    assert provider and all(s.attributes["oncelery.run_id"] == row["run_id"] for s in provider)
