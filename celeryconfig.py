"""Celery configuration of Oncelery's demo app (installed as `oncelery.celeryconfig`): every setting from
an environment variable.

With no broker or result backend configured it needs no server: kombu's filesystem transport (through
oncelery.embedded_broker, `oncelery-fs://`) as the broker
and a SQLite result backend under ./.oncelery. The claims database is set only from ONCELERY_DATABASE_URL:
the demo app (`oncelery.tasks.app`) falls back to its embedded SQLite file itself, and any other app that
loads this module must configure one. Production sets ONCELERY_BROKER_URL=redis://... and
ONCELERY_DATABASE_URL=postgresql://... (see README).
"""

from __future__ import annotations

from pathlib import Path as _Path
from typing import Any as _Any

from oncelery import embedded_broker as _embedded_broker
from oncelery import settings as _settings
from oncelery.settings_files import env_value as _env

_float = _settings.env_seconds  # a bad value is one line naming the variable, not a traceback at import


# Each also from a file: ONCELERY_BROKER_URL_FILE etc. (Docker/Kubernetes secrets; oncelery.settings_files).
_broker = (_env(_settings.ENV_BROKER_URL) or "").strip()
_backend = (_env(_settings.ENV_RESULT_BACKEND) or "").strip()
_database = _env(_settings.ENV_DATABASE_URL)

# -- the claims database (read by IdempotentTask from the app's conf; no default here) --------------
if _database:
    oncelery_database_url = _database

# -- broker ------------------------------------------------------------------------------------
if _broker:
    broker_url = _broker
    # Redis/SQS redeliver an unacked message after the visibility timeout. Keep it >= the longest
    # task lease: an earlier redelivery of a running job is absorbed by the claim (it waits), but
    # wastes a delivery. After a worker crash the job comes back after this many seconds.
    broker_transport_options: dict[str, _Any] = {
        "visibility_timeout": _float("ONCELERY_VISIBILITY_TIMEOUT", 120.0),
        "unacked_restore_interval": _float("ONCELERY_UNACKED_RESTORE_INTERVAL", 5.0),
        "unacked_restore_throttle": 1,
    }
else:
    _spool = _Path(_settings.data_dir()) / "broker"
    _queue_dir = _spool / "queue"
    _queue_dir.mkdir(parents=True, exist_ok=True)
    # kombu's filesystem transport, whose drain loop wakes when a child acks instead of sleeping a whole
    # polling_interval with the prefetch window full, and lists the folder once for many messages.
    broker_url = _embedded_broker.URL
    broker_transport_options = {
        "data_folder_in": str(_queue_dir),
        "data_folder_out": str(_queue_dir),
        "store_processed": False,
        # Fanout bindings (worker control, events) — kombu's default is ./control in the working directory.
        "control_folder": str(_spool / "control"),
        # kombu's virtual transport sleeps this long whenever the worker's prefetch window is full, so
        # with prefetch 1 it caps throughput at concurrency/interval: the 1.0 s default gave ~2 jobs/s.
        "polling_interval": 0.1,
    }
    # A worker on a polling transport (this one) runs its timer (heartbeats, countdowns) in a thread that sleeps
    # up to this long between looks at its schedule, and a warm shutdown joins that thread (`Timer.stop`): the
    # 1.0 s default added up to a second to every stop. At 0.1 s (ten cheap wake-ups a second) only an empty
    # schedule still waits out Celery's own fixed 1 s. (An evented transport like Redis has no timer thread.)
    worker_timer_precision = 0.1

# -- results -----------------------------------------------------------------------------------
result_backend = _backend or f"db+sqlite:///{_Path(_settings.data_dir()) / 'results.db'}"
result_extended = True

# -- delivery semantics (at-least-once, which the claims turn into exactly-once effects) and JSON only:
# written once, in oncelery.settings.CELERY_DELIVERY_DEFAULTS.
globals().update(_settings.CELERY_DELIVERY_DEFAULTS)

# -- Flower: task events on ------------------------------------------------------------------------
worker_send_task_events = True
task_send_sent_event = True
task_track_started = True

# -- the demo model's price (USD per 1M tokens): the local model is free, these are a small hosted model's list
# prices, so `oncelery costs` and `oncelery process --batch` show money. A real app prices its own models.
oncelery_prices = {"local-extractive": {"input": 0.15, "output": 0.60}}

broker_connection_retry_on_startup = True
timezone = "UTC"
enable_utc = True
