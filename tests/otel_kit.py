"""OpenTelemetry for the tests: the process's SDK providers on an in-memory exporter and reader (set once, as an
application would), the sums read back from them, and a provider instrumentation of our own.

`InstrumentedResponses` is what OpenLLMetry is to the OpenAI SDK: it wraps the provider client's calls (create,
poll) in a `gen_ai` client span, and records the token usage of the look that saw the call done. The calls still
go to the fake provider over HTTP: nothing is mocked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from oncelery.llm.adapters.base import CallState, Observed
from oncelery.llm.adapters.openai_responses import OpenAIResponses

TOKEN_USAGE = "gen_ai.client.token.usage"


@dataclass
class Sdk:
    """The process's SDK providers and where the tests read what they got."""

    spans: InMemorySpanExporter
    reader: InMemoryMetricReader
    tracer_provider: TracerProvider
    meter_provider: MeterProvider


_SDK: list[Sdk] = []


def sdk() -> Sdk:
    """Install the SDK providers once per process (OpenTelemetry allows one global provider of each kind)."""
    if _SDK:
        return _SDK[0]
    spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    meter_provider = MeterProvider(metric_readers=[reader])
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(meter_provider)
    if trace.get_tracer_provider() is not tracer_provider or metrics.get_meter_provider() is not meter_provider:
        raise RuntimeError("another OpenTelemetry provider was installed first in this process")
    _SDK.append(Sdk(spans, reader, tracer_provider, meter_provider))
    return _SDK[0]


def sums(reader: InMemoryMetricReader) -> dict[tuple[str, str], int]:
    """{(metric, token type): sum} over every scope (ours and the provider instrumentation's); `count` for points."""
    got: dict[tuple[str, str], int] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data is not None else []:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    kind = str((point.attributes or {}).get("gen_ai.token.type", ""))
                    value = getattr(point, "sum", None)
                    value = point.value if value is None else value  # type: ignore[attr-defined]
                    got[metric.name, kind] = got.get((metric.name, kind), 0) + int(value)
                    if metric.name == TOKEN_USAGE:
                        got["points", kind] = got.get(("points", kind), 0) + int(point.count)  # type: ignore[attr-defined]
    return got


def delta(after: Mapping[tuple[str, str], int], before: Mapping[tuple[str, str], int]) -> dict[tuple[str, str], int]:
    """What was added between two `sums` (cumulative temporality), zeros left out."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def spans_named(spans: list[ReadableSpan], prefix: str) -> list[ReadableSpan]:
    """The finished spans whose name starts with `prefix`."""
    return [s for s in spans if s.name.startswith(prefix)]


class InstrumentedResponses(OpenAIResponses):
    """The Responses adapter with a provider instrumentation around its client calls (a test-side OpenLLMetry).

    `sees_answers=False`: an instrumentation that wraps the calls but never sees an answer's usage (as one of only
    the create of a background call would): its spans carry no `gen_ai.usage.*` and it records no tokens.
    """

    def __init__(self, *args: Any, sees_answers: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sees_answers = sees_answers
        self.tracer = trace.get_tracer("tests.provider-instrumentation")
        self.usage_histogram = metrics.get_meter("tests.provider-instrumentation").create_histogram(
            TOKEN_USAGE, unit="{token}"
        )

    def create(self, request: Mapping[str, Any], intent_id: str, *, background: bool) -> Observed:
        """The create, inside a `chat {model}` client span."""
        model = str(request.get("model", ""))
        with self._span(model) as span:
            return self._seen(span, model, super().create(request, intent_id, background=background))

    def poll(self, reference: str) -> Observed:
        """A poll, inside a client span of its own (as an instrumentation of `responses.retrieve` makes)."""
        with self._span("") as span:
            look = super().poll(reference)
            return self._seen(span, str(look.response.get("model", "")), look)

    def _span(self, model: str) -> Any:
        return self.tracer.start_as_current_span(
            f"chat {model}".strip(),
            kind=trace.SpanKind.CLIENT,
            attributes={"gen_ai.operation.name": "chat", "gen_ai.system": "openai", "gen_ai.request.model": model},
        )

    def _seen(self, span: Any, model: str, look: Observed) -> Observed:
        if look.state is CallState.DONE and self.sees_answers:
            usage = self.usage(look.response)
            span.set_attributes(
                {"gen_ai.usage.input_tokens": usage.input_tokens, "gen_ai.usage.output_tokens": usage.output_tokens}
            )
            labels = {"gen_ai.operation.name": "chat", "gen_ai.system": "openai", "gen_ai.request.model": model}
            self.usage_histogram.record(usage.input_tokens, {**labels, "gen_ai.token.type": "input"})
            self.usage_histogram.record(usage.output_tokens, {**labels, "gen_ai.token.type": "output"})
        return look
