"""Runnable example: OpenTelemetry traces and token metrics that tell a real model call from a replay.

    pip install 'oncelery[otel]' opentelemetry-sdk
    python examples/trace_a_run.py     # SQLite file ./oncelery-trace-example.db, the embedded broker, no server

A job makes two model calls (on a fake provider: a real HTTP server on 127.0.0.1), then its `publish` step fails
once. The retry replays both calls from their checkpoints. The spans say so (`oncelery.step.replayed`), the
`gen_ai.client.token.usage` histogram counts the two real calls only, equal to the ledger, and
`oncelery.llm.token.saved` counts what the replay did not pay. An application sends the same spans and points to its
backend with an OTLP exporter instead of the in-memory ones used here to print them.
"""

from __future__ import annotations

import time
from pathlib import Path

from celery import Celery
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import func, select

from oncelery import (
    CELERY_DELIVERY_DEFAULTS,
    FakeProvider,
    IdempotentTask,
    OpenAIResponses,
    output_text,
    upgrade_schema,
)
from oncelery.embedded_broker import URL as EMBEDDED_BROKER
from oncelery.models.ledger import ModelCall
from oncelery.store.database import get_engine
from oncelery.testing import in_process_worker

# 1. The application's OpenTelemetry set-up (here: in memory, to print what was recorded).
spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
tracer_provider = TracerProvider()
tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
trace.set_tracer_provider(tracer_provider)
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))

# 2. Oncelery's tracing: one setting (or ONCELERY_OTEL=1).
HERE = Path("oncelery-trace-example").resolve()
DB = f"sqlite:///{HERE}.db"
app = Celery("trace-example")
app.conf.update(
    **CELERY_DELIVERY_DEFAULTS,
    broker_url=EMBEDDED_BROKER,
    broker_transport_options={"data_folder_in": f"{HERE}-broker", "data_folder_out": f"{HERE}-broker"},
    result_backend=f"db+sqlite:///{HERE}-results.db",
    oncelery_database_url=DB,
    oncelery_prices={"small": {"input": 0.15, "output": 0.60}},
    oncelery_otel=True,
)
provider = FakeProvider().start()
adapter = OpenAIResponses(provider.openai_base_url, "sk-example")
failures = {"left": 1}


def publish(title: str) -> str:
    """A flaky last step: it fails the first time, so the retry replays the two calls before it."""
    if failures["left"]:
        failures["left"] -= 1
        raise RuntimeError("the publishing service is down")
    return title


@app.task(base=IdempotentTask, bind=True, name="oncelery.example_trace", idempotency_key="article:{doc}",
          autoretry_for=(RuntimeError,), retry_kwargs={"countdown": 0})  # fmt: skip
def article(self: IdempotentTask, doc: str, text: str) -> str:
    """summarize -> title (model calls), then publish (fails once)."""
    summary = output_text(self.llm("summarize", adapter=adapter, model="small", input=text, max_output_tokens=60))
    title = output_text(self.llm("title", adapter=adapter, model="small", input=summary, max_output_tokens=12))
    return str(self.step("publish", publish, title))


def token_sums() -> dict[str, int]:
    """{metric [token type]: sum} of the token metrics recorded so far."""
    got: dict[str, int] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data is not None else []:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    name = f"{metric.name} [{(point.attributes or {}).get('gen_ai.token.type')}]"
                    got[name] = got.get(name, 0) + int(getattr(point, "sum", None) or getattr(point, "value", 0))
    return got


if __name__ == "__main__":
    Path(f"{HERE}-broker").mkdir(exist_ok=True)
    upgrade_schema(DB)
    doc = f"doc-{time.time_ns()}"
    with in_process_worker(app, concurrency=1):
        text = "Celery delivers at least once; Oncelery makes effects happen once."
        print("result:", article.delay(doc, text).get(timeout=60))
    for span in sorted(spans.get_finished_spans(), key=lambda s: s.start_time or 0):
        a = span.attributes or {}
        what = {k: a[k] for k in ("oncelery.step.name", "oncelery.step.replayed", "oncelery.run.attempt",
                                  "oncelery.llm.reattached", "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens",
                                  "oncelery.llm.cost_usd") if k in a}  # fmt: skip
        print(f"{span.name:38} {what}")
    for name, total in sorted(token_sums().items()):
        if "token" in name:
            print(f"{name:48} {total}")
    with get_engine(DB).connect() as conn:
        ledger = conn.execute(
            select(func.sum(ModelCall.input_tokens), func.sum(ModelCall.output_tokens)).where(
                ModelCall.idempotency_key == f"article:{doc}"
            )
        ).one()
    print("ledger (model_calls) input, output tokens:", tuple(ledger))
    adapter.close()
    provider.stop()
