"""The worker's startup check: a worker whose app has idempotent tasks refuses to start, before consuming
a single message, when it has no claims database or that database's schema is missing or behind the code.

Without it such a worker would take jobs and fail every one of them; refusing leaves them in the broker.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import UTC, datetime
from typing import Any

from celery import signals

from oncelery.errors import OnceleryError
from oncelery.settings import ENV_PASS_THROUGH, PASS_THROUGH_SEEN, check_settings, pass_through, require_database_url
from oncelery.store.database import Database
from oncelery.store.schema import check_schema
from oncelery.store.tables import SECRETS

__all__ = [
    "check_worker_app",
    "note_pass_through",
    "watch_worker_start",
]

logger = logging.getLogger("oncelery.startup")  # a stable name (users filter on it)


def check_worker_app(app: Any, task_class: type) -> str | None:
    """Return the schema revision the app's idempotent tasks will use, or raise the error that stops them."""
    if app is None or not any(isinstance(t, task_class) for t in app.tasks.values()):
        return None  # no Oncelery task in this worker: nothing to check
    check_settings(app.conf)  # a misspelt oncelery_* setting stops the worker here, not at the first job
    url = require_database_url(app.conf, "This worker")
    return check_schema(url)


def note_pass_through(url: str, where: str) -> None:
    """Record in the claims database that a worker started with the claim switched off (`oncelery runs`)."""
    db = Database(url)
    seen = f"{datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC on {where}"
    stmt = db.dialect.insert(SECRETS).values(name=PASS_THROUGH_SEEN, value=seen)
    stmt = stmt.on_conflict_do_update(index_elements=["name"], set_={"value": seen})
    with db.begin() as conn:
        conn.execute(stmt)


def watch_worker_start(task_class: type) -> None:
    """Make every worker whose app has tasks of `task_class` refuse to start unless its claims database is ready.

    Called once by the task module with `IdempotentTask` (this module cannot import the class it checks for).
    """

    def refuse(sender: Any = None, **_: Any) -> None:
        _refuse_to_start_unless_ready(task_class, sender)

    signals.worker_init.connect(refuse, weak=False, dispatch_uid="oncelery.startup")


def _refuse_to_start_unless_ready(task_class: type, sender: Any) -> None:
    # worker_init runs after the app's task modules are imported and before any consumer starts.
    # SystemExit passes through Celery's signal dispatch (it catches Exception), so the worker exits 1.
    app = getattr(sender, "app", None)
    try:
        revision = check_worker_app(app, task_class)
        passing = revision is not None and pass_through()
    except OnceleryError as exc:
        raise SystemExit(f"oncelery: this worker refuses to start: {exc}") from None
    if revision is not None:
        logger.info("oncelery: claims database schema at revision %s", revision)
    if passing and app is not None:
        where = f"{getattr(sender, 'hostname', None) or socket.gethostname()} (pid {os.getpid()})"
        logger.warning(
            "oncelery: %s is on: every idempotent task runs UNCLAIMED (no dedup, no lease, no stored result); "
            "unit tests only, never in production",
            ENV_PASS_THROUGH,
        )
        note_pass_through(require_database_url(app.conf), where)
