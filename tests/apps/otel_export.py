"""Metrics of a `celery worker`'s pool processes, exported to files the test reads back (tests/apps/crash_app.py).

Each pool process installs its own SDK MeterProvider with a periodic reader (as an application does at
`worker_process_init`) whose exporter appends one JSON line per export to `metrics-<pid>.jsonl`. A process that is
SIGKILLed loses what it recorded after its last export: that is the loss the test bounds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from celery import Celery, signals

INTERVAL_MS = int(os.environ.get("ONCELERY_CRASH_OTEL_INTERVAL_MS") or 1000)


def export_metrics_from_pool_processes(app: Celery, folder: Path) -> None:
    """Switch tracing on for `app`, and make each pool process export its metrics to `folder`."""
    app.conf.oncelery_otel = True

    def install(**_: Any) -> None:
        from opentelemetry import metrics
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader

        out = (folder / f"metrics-{os.getpid()}.jsonl").open("a", buffering=1)  # a line per export, flushed
        exporter = ConsoleMetricExporter(out=out, formatter=lambda data: json.dumps(json.loads(data.to_json())) + "\n")
        reader = PeriodicExportingMetricReader(exporter, export_interval_millis=INTERVAL_MS)
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))

    signals.worker_process_init.connect(install, weak=False)
