"""The worker's startup check: a worker whose app has idempotent tasks refuses to start, before consuming
a single message, when it has no claims database or that database's schema is missing or behind the code.

Without it such a worker would take jobs and fail every one of them; refusing leaves them in the broker.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import signals

from oncelery.errors import OnceleryError
from oncelery.schema import check_schema
from oncelery.settings import require_database_url

logger = logging.getLogger(__name__)


def check_worker_app(app: Any) -> str | None:
    """Return the schema revision the app's idempotent tasks will use, or raise the error that stops them."""
    from oncelery.task import IdempotentTask  # the task module imports this one

    if app is None or not any(isinstance(t, IdempotentTask) for t in app.tasks.values()):
        return None  # no Oncelery task in this worker: nothing to check
    url = require_database_url(app.conf, "This worker")
    return check_schema(url)


def _refuse_to_start_unless_ready(sender: Any = None, **_: Any) -> None:
    # worker_init runs after the app's task modules are imported and before any consumer starts.
    # SystemExit passes through Celery's signal dispatch (it catches Exception), so the worker exits 1.
    try:
        revision = check_worker_app(getattr(sender, "app", None))
    except OnceleryError as exc:
        raise SystemExit(f"oncelery: this worker refuses to start: {exc}") from None
    if revision is not None:
        logger.info("oncelery: claims database schema at revision %s", revision)


signals.worker_init.connect(_refuse_to_start_unless_ready, weak=False, dispatch_uid="oncelery.startup")
