"""The worker's startup check: a worker whose app has idempotent tasks refuses to start, before consuming
a single message, when it has no claims database or that database's schema is missing or behind the code.

Without it such a worker would take jobs and fail every one of them; refusing leaves them in the broker.
A database that does not answer yet (a container still starting) is waited for, with backoff, for at most
oncelery_startup_wait_s ($ONCELERY_STARTUP_WAIT_S, default 60 s), one log line per retry; a database that
answers and is wrong (schema behind, no such database, a bad password) is refused at once: waiting cannot fix
it. Then the broker's visibility timeout is settled against the tasks' leases (basetask/visibility.py).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from datetime import UTC, datetime
from typing import Any

from celery import signals
from sqlalchemy.exc import DBAPIError

from oncelery.basetask.visibility import settle_visibility
from oncelery.errors import ConfigurationError, OnceleryError, StoreUnavailable
from oncelery.ledger.prices import price_for, price_table
from oncelery.ledger.spool_files import replay_at_worker_start
from oncelery.llm.budgets import parse_budgets
from oncelery.llm.limits import parse_limits
from oncelery.settings import (
    CONF_BUDGETS,
    CONF_LIMITS,
    CONF_PRICE_FILE,
    CONF_PRICES,
    CONF_STARTUP_WAIT,
    ENV_PASS_THROUGH,
    ENV_STARTUP_WAIT,
    PASS_THROUGH_SEEN,
    STARTUP_RETRY_CAP,
    WAIT_BACKOFF_BASE,
    check_settings,
    pass_through,
    require_database_url,
    startup_wait_seconds,
)
from oncelery.store.database import Database, is_unreachable
from oncelery.store.schema import check_schema
from oncelery.store.tables import SECRETS
from oncelery.tracing.otel import Telemetry, otel_enabled

__all__ = [
    "check_worker_app",
    "note_pass_through",
    "wait_for_database",
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


def wait_for_database(app: Any, task_class: type) -> str | None:
    """Return check_worker_app's revision, trying again with backoff while the claims database does not answer,
    for at most oncelery_startup_wait_s; any other refusal (schema behind, misconfiguration) is raised at once."""
    attempt, deadline, bound = 0, 0.0, 0.0
    while True:
        try:
            return check_worker_app(app, task_class)
        except StoreUnavailable as exc:
            if not _unreachable(exc):
                raise
            if attempt == 0:  # read here: a worker whose database answers never needs the setting
                bound = startup_wait_seconds(app.conf)
                deadline = time.monotonic() + bound
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreUnavailable(
                    f"{_one_line(exc)} (waited {bound:g} s: raise {ENV_STARTUP_WAIT} or app.conf.{CONF_STARTUP_WAIT})",
                    url=getattr(exc, "url", None),
                ) from exc
            attempt += 1
            pause = min(WAIT_BACKOFF_BASE * 2 ** (attempt - 1), STARTUP_RETRY_CAP, left)
            logger.warning(
                "oncelery: claims database %s not reachable (%s); retry %d in %.1f s, waiting up to %g s (%s)",
                getattr(exc, "url", "?"),
                _reason(exc),
                attempt,
                pause,
                bound,
                ENV_STARTUP_WAIT,
            )
            time.sleep(pause)


def _unreachable(exc: StoreUnavailable) -> bool:
    # The driver's own error says whether any server answered; the typed error's message is ours.
    cause = exc.__cause__
    return isinstance(cause, DBAPIError) and is_unreachable(cause)


def _reason(exc: StoreUnavailable) -> str:
    # The driver's own words, shortest form: 'connection failed: ... port 5432 failed: Connection refused' (and a
    # hint on the next line) -> 'Connection refused'; 'the database system is starting up'.
    cause = exc.__cause__
    text = str(getattr(cause, "orig", None) or cause or exc).strip()
    first = text.splitlines()[0] if text else "no answer"
    return first.rsplit(": ", 1)[-1].strip() or first


def _one_line(exc: BaseException) -> str:
    # Drivers add hints on further lines ("Is the server running on that host...?"): kept, on the one line.
    return " ".join(str(exc).split())


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


def check_spending_settings(app: Any, task_class: type) -> None:
    """Refuse (ConfigurationError) a bad `oncelery_limits`, `oncelery_budgets` or `oncelery_price_file`, and under a
    budget a model without a price: every model named in `oncelery_limits` and in a task's `llm_models` must have
    one (`oncelery_prices`, else the price file), or its calls could not be reserved for."""
    if app.conf.get(CONF_PRICE_FILE, None) is not None:
        price_table(app.conf)  # a price file the app names that cannot be read refuses here, not at its first call
    rules = parse_limits(app.conf.get(CONF_LIMITS), CONF_LIMITS)
    budgets = parse_budgets(app.conf.get(CONF_BUDGETS), CONF_BUDGETS)
    ours = [task for task in app.tasks.values() if isinstance(task, task_class)]
    if not budgets and all(getattr(task, "max_cost_usd", None) is None for task in ours):
        return
    models = {rule.scope.split(":", 1)[1] for rule in rules if not rule.scope.startswith(("tenant:", "task:"))}
    models |= {str(m) for task in ours for m in getattr(task, "llm_models", None) or ()}
    missing = sorted(m for m in models - {"*"} if price_for(m, app.conf) is None)
    if missing:
        raise ConfigurationError(
            f"a budget applies, and these models have no price in {CONF_PRICES}: {', '.join(missing)} (nor in the "
            f"price file, {CONF_PRICE_FILE}); add {{'<model>': {{'input': usd_per_1M, 'output': usd_per_1M}}}} for each"
        )


def _refuse_to_start_unless_ready(task_class: type, sender: Any) -> None:
    # worker_init runs after the app's task modules are imported and before any consumer starts (Celery makes
    # the consumer's broker connection after it, from app.conf: the settled visibility timeout reaches kombu).
    # SystemExit passes through Celery's signal dispatch (it catches Exception), so the worker exits 1.
    app = getattr(sender, "app", None)
    try:
        if app is not None:
            check_spending_settings(app, task_class)  # a bad limit or budget table refuses here, in one line
            if otel_enabled(app.conf):
                Telemetry.of_process()  # tracing on without oncelery[otel]: refused here, naming the extra
        revision = wait_for_database(app, task_class)
        passing = revision is not None and pass_through()
        if revision is not None and app is not None:
            settle_visibility(app, [task for task in app.tasks.values() if isinstance(task, task_class)])
    except OnceleryError as exc:
        raise SystemExit(f"oncelery: this worker refuses to start: {_one_line(exc)}") from None
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


def _replay_ledger_spool(sender: Any = None, **_: Any) -> None:
    # worker_init, in the worker's main process before its pool starts: a ledger row a dead process left in its
    # spool file is written before this worker takes a job (the ledger room knows no Celery, so it is hooked here).
    replay_at_worker_start(getattr(getattr(sender, "app", None), "conf", None))


# At import (oncelery imports this module), so it runs before the startup checks that watch_worker_start connects.
signals.worker_init.connect(_replay_ledger_spool, weak=False, dispatch_uid="oncelery.ledger_spool")
