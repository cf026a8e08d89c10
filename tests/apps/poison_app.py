"""A Celery app for the dead-letter tests' subprocesses (`celery worker`, `oncelery dlq replay --app`).

Configured only from the environment; the test that starts a process sets:

    ONCELERY_DATABASE_URL              the claims database (a SQLite file or the PostgreSQL test database)
    ONCELERY_BROKER_URL                the Redis broker (the test Redis database)
    ONCELERY_RESULT_BACKEND            the Redis result backend (another Redis database)
    ONCELERY_POISON_QUEUE              the queue, unique per test (tests.services.unique_queue())
    ONCELERY_POISON_LEASE              the poison task's lease in seconds (default 1)

Delivery settings are oncelery.CELERY_DELIVERY_DEFAULTS: late ack, reject on worker lost, prefetch 1, JSON only.
SIGUSR2 makes any of the worker's processes (pool children inherit it) write every thread's stack to its log,
so a test that times out can show where a process was stuck.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
from collections.abc import Mapping
from typing import Any

from celery import Celery
from sqlalchemy import insert

from oncelery import CELERY_DELIVERY_DEFAULTS, ConfigurationError, IdempotentTask
from oncelery.store.database import get_engine
from tests.services import effects_table, executions_table

ENV_DATABASE_URL = "ONCELERY_DATABASE_URL"
ENV_BROKER_URL = "ONCELERY_BROKER_URL"
ENV_RESULT_BACKEND = "ONCELERY_RESULT_BACKEND"
ENV_QUEUE = "ONCELERY_POISON_QUEUE"
ENV_LEASE = "ONCELERY_POISON_LEASE"
REQUIRED = (ENV_DATABASE_URL, ENV_BROKER_URL, ENV_RESULT_BACKEND, ENV_QUEUE)
# The poison task's bound on lost deliveries (the framework's default is 5).
POISON_MAX_DELIVERIES = 3
POISON_TASK = "oncelery.poison_kill"
ORDINARY_TASK = "oncelery.poison_ordinary"
logger = logging.getLogger(__name__)


def create_app(environ: Mapping[str, str]) -> Celery:
    """Build the app from `environ`, raising ConfigurationError naming any missing variable."""
    missing = [name for name in REQUIRED if not environ.get(name)]
    if missing:
        raise ConfigurationError(f"tests.apps.poison_app needs the environment variables {', '.join(missing)}")
    queue = environ[ENV_QUEUE]
    app = Celery("oncelery-poison")
    app.conf.update(
        **CELERY_DELIVERY_DEFAULTS,
        broker_url=environ[ENV_BROKER_URL],
        result_backend=environ[ENV_RESULT_BACKEND],
        oncelery_database_url=environ[ENV_DATABASE_URL],
        broker_transport_options={
            # Unacked bookkeeping per test, so no worker restores another test's in-flight messages.
            "unacked_key": f"{queue}.unacked",
            "unacked_index_key": f"{queue}.unacked_index",
            "unacked_mutex_key": f"{queue}.unacked_mutex",
        },
        task_default_queue=queue,
        task_acks_on_failure_or_timeout=True,
        broker_connection_retry_on_startup=True,
        timezone="UTC",
        enable_utc=True,
    )
    return app


app = create_app(os.environ)
faulthandler.register(signal.SIGUSR2, all_threads=True)
DATABASE_URL = os.environ[ENV_DATABASE_URL]
LEASE = float(os.environ.get(ENV_LEASE) or 1)


def record_execution(key: str) -> None:
    """Count one start of a body in its own committed transaction (it survives the process's death)."""
    with get_engine(DATABASE_URL).begin() as conn:
        conn.execute(insert(executions_table).values(key=key, pid=os.getpid()))
    logger.info("executing %s in pid %d", key, os.getpid())


@app.task(
    base=IdempotentTask,
    bind=True,
    name=POISON_TASK,
    idempotency_key="poison:{key}",
    lease=LEASE,
    max_deliveries=POISON_MAX_DELIVERIES,
)
def poison_kill(self: IdempotentTask, key: str) -> None:
    """A poison message: count the start, then SIGKILL the pool process running it, on every delivery."""
    record_execution(key)
    os.kill(os.getpid(), signal.SIGKILL)


@app.task(base=IdempotentTask, bind=True, name=ORDINARY_TASK, idempotency_key="job:{key}")
def poison_ordinary(self: IdempotentTask, key: str) -> dict[str, Any]:
    """An ordinary job on the same queue: count the execution, write one effect, return who did it."""
    record_execution(key)
    with self.effects() as session:
        session.execute(insert(effects_table).values(key=key, pid=os.getpid()))
    return {"key": key, "pid": os.getpid()}
