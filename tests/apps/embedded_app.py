"""A Celery app on the embedded default (no server at all) for the tests' `celery worker` subprocesses.

Configured by `oncelery.celeryconfig` as the demo app is: with no ONCELERY_BROKER_URL the broker is kombu's
filesystem transport under $ONCELERY_DATA_DIR/broker, the results a SQLite file there. The test that starts
a worker sets:

    ONCELERY_DATA_DIR          the embedded broker's folder (a tmp folder per test)
    ONCELERY_DATABASE_URL      the claims database (a SQLite file in that tmp folder)
    ONCELERY_EMBEDDED_QUEUE    the queue, unique per test (tests.services.unique_queue())
    ONCELERY_EMBEDDED_LEASE    the task's lease in seconds (default 60)
    ONCELERY_EMBEDDED_RELEASE  the file whose existence releases the waiting bodies
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from celery import Celery
from sqlalchemy import insert

from oncelery import ConfigurationError, IdempotentTask
from oncelery.store.database import get_engine
from tests.services import effects_table, executions_table

ENV_QUEUE = "ONCELERY_EMBEDDED_QUEUE"
ENV_LEASE = "ONCELERY_EMBEDDED_LEASE"
ENV_RELEASE = "ONCELERY_EMBEDDED_RELEASE"
REQUIRED = ("ONCELERY_DATA_DIR", "ONCELERY_DATABASE_URL", ENV_QUEUE, ENV_RELEASE)
RELEASE_TIMEOUT = 300.0  # a body never waits longer than this for its release file
logger = logging.getLogger(__name__)

missing = [name for name in REQUIRED if not os.environ.get(name)]
if missing:
    raise ConfigurationError(f"tests.apps.embedded_app needs the environment variables {', '.join(missing)}")

app = Celery("oncelery-embedded")
app.config_from_object("oncelery.celeryconfig")
app.conf.task_default_queue = os.environ[ENV_QUEUE]
DATABASE_URL = os.environ["ONCELERY_DATABASE_URL"]
RELEASE = Path(os.environ[ENV_RELEASE])
LEASE = float(os.environ.get(ENV_LEASE) or 60)


def record_execution(key: str) -> None:
    """Count one execution of a body in its own committed transaction (it survives the run's rollback)."""
    with get_engine(DATABASE_URL).begin() as conn:
        conn.execute(insert(executions_table).values(key=key, pid=os.getpid()))
    logger.info("executing %s in pid %d", key, os.getpid())


def wait_for_release() -> None:
    """Block until the release file exists (bounded)."""
    deadline = time.monotonic() + RELEASE_TIMEOUT
    while not RELEASE.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{RELEASE} never appeared")
        time.sleep(0.05)


@app.task(base=IdempotentTask, bind=True, name="oncelery.embedded_wait", idempotency_key="lost:{key}", lease=LEASE)
def embedded_wait(self: IdempotentTask, key: str) -> dict[str, Any]:
    """Count the execution, wait until released, then write one effect."""
    record_execution(key)
    wait_for_release()
    with self.effects() as session:
        session.execute(insert(effects_table).values(key=key, pid=os.getpid()))
    return {"key": key, "pid": os.getpid()}
