"""OpenTelemetry's SDK in a benchmark worker's pool processes (BENCH_OTEL=1, bench/otel_overhead.py).

What an application installs at `worker_process_init`: a TracerProvider with a BatchSpanProcessor and a MeterProvider
with a PeriodicExportingMetricReader. Their exporters drop what they are given, so the figure is Oncelery's spans and
points through the SDK (creation, attributes, batching, aggregation), not a collector's network or CPU. The spans
exporter counts what it drops in the stats Redis (SPANS_KEY), one INCRBY per batch, to show the spans were made.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import redis
from celery import Celery, signals

EXPORT_INTERVAL_MS = 5000
SPANS_KEY = "bench:otel:spans"  # in the stats Redis: the spans the pool processes exported (and dropped)


def trace_in_pool_processes(app: Celery) -> None:
    """Switch Oncelery's tracing on for `app` and install the SDK in each pool process as it starts."""
    app.conf.oncelery_otel = True
    signals.worker_process_init.connect(_install, weak=False)


def _install(**_: Any) -> None:
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, PeriodicExportingMetricReader
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    stats = redis.Redis.from_url(os.environ.get("BENCH_STATS_URL") or "redis://127.0.0.1:6379/13")

    class DropSpans(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            stats.incrby(SPANS_KEY, len(spans))  # one command per batch (up to 512 spans): proof they were made
            return SpanExportResult.SUCCESS

    class DropPoints(MetricExporter):
        def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return True

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
            return None

    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(DropSpans()))
    trace.set_tracer_provider(tracer_provider)
    reader = PeriodicExportingMetricReader(DropPoints(), export_interval_millis=EXPORT_INTERVAL_MS)
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
