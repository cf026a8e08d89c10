"""The labels app's celeryconfig.py, as a user writes one from the README: its own claims database (a
developer's database, which the test kit must never touch), Redis with a long visibility timeout and a key
prefix of its own, and no lease (Oncelery's default: 60 s).

Configured from the environment (the tests set it; a subprocess worker inherits it): LABELS_BROKER_URL,
LABELS_QUEUE and LABELS_DATABASE_URL (the developer's database).
"""

from __future__ import annotations

import os

from oncelery import CELERY_DELIVERY_DEFAULTS

broker_url = os.environ.get("LABELS_BROKER_URL", "redis://127.0.0.1:6379/0")
result_backend = broker_url
task_default_queue = os.environ.get("LABELS_QUEUE", "labels")
broker_transport_options = {"visibility_timeout": 3600, "global_keyprefix": "labels:"}
oncelery_database_url = os.environ.get("LABELS_DATABASE_URL", "sqlite:///labels-dev.db")
worker_hijack_root_logger = False
broker_connection_retry_on_startup = True

globals().update(CELERY_DELIVERY_DEFAULTS)  # acks late, requeue on a lost worker, prefetch 1, JSON only
