"""The notes app's celeryconfig.py, as a developer writes one: Redis for jobs and results, two queues (the
digests routed to a queue of their own), and the developer's own claims database, where a `celery worker` of
theirs runs beside the tests. The test kit must never write there, nor send a job where that worker takes it.

Configured from the environment (the tests set it; subprocess workers inherit it): NOTES_BROKER_URL,
NOTES_QUEUE (the default queue; the digests' is `<it>.digests`) and NOTES_DATABASE_URL (the developer's database).
"""

from __future__ import annotations

import os

from kombu import Exchange, Queue

from oncelery import CELERY_DELIVERY_DEFAULTS

broker_url = os.environ.get("NOTES_BROKER_URL", "redis://127.0.0.1:6379/0")
result_backend = broker_url
task_default_queue = os.environ.get("NOTES_QUEUE", "notes")
DIGESTS = f"{task_default_queue}.digests"
task_queues = (
    Queue(task_default_queue, Exchange(task_default_queue), routing_key=task_default_queue),
    Queue(DIGESTS, Exchange(DIGESTS), routing_key=DIGESTS),
)
task_routes = {"notes.digest": {"queue": DIGESTS}}
oncelery_database_url = os.environ.get("NOTES_DATABASE_URL", "sqlite:///notes-dev.db")
worker_hijack_root_logger = False
broker_connection_retry_on_startup = True

globals().update(CELERY_DELIVERY_DEFAULTS)  # acks late, requeue on a lost worker, prefetch 1, JSON only
