"""A Celery app for the outbox tests' relay subprocesses, configured only from the environment.

The test that starts a relay (`oncelery relay --app tests.apps.outbox_app:app`, or this module run with
`python -m tests.apps.outbox_app crash-relay`) sets:

    ONCELERY_DATABASE_URL     the claims database (a SQLite file or the PostgreSQL test database)
    ONCELERY_BROKER_URL       the Redis broker (the test Redis database)
    ONCELERY_RESULT_BACKEND   the Redis result backend
    ONCELERY_OUTBOX_QUEUE     the queue the relay publishes to, unique per test (tests.services.unique_queue())

The relay publishes by task name, so the app registers no task: the test's in-process worker runs the bodies.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping
from typing import Any

from celery import Celery

from oncelery import CELERY_DELIVERY_DEFAULTS, ConfigurationError, Relay
from oncelery.runs.faults import fault_injected

ENV_DATABASE_URL = "ONCELERY_DATABASE_URL"
ENV_BROKER_URL = "ONCELERY_BROKER_URL"
ENV_RESULT_BACKEND = "ONCELERY_RESULT_BACKEND"
ENV_QUEUE = "ONCELERY_OUTBOX_QUEUE"
REQUIRED = (ENV_DATABASE_URL, ENV_BROKER_URL, ENV_RESULT_BACKEND, ENV_QUEUE)
CRASH_RELAY = "crash-relay"


def create_app(environ: Mapping[str, str]) -> Celery:
    """Build the relay's app from `environ`, raising ConfigurationError naming any missing variable."""
    missing = [name for name in REQUIRED if not environ.get(name)]
    if missing:
        raise ConfigurationError(f"tests.apps.outbox_app needs the environment variables {', '.join(missing)}")
    app = Celery("oncelery-outbox")
    app.conf.update(
        **CELERY_DELIVERY_DEFAULTS,
        broker_url=environ[ENV_BROKER_URL],
        result_backend=environ[ENV_RESULT_BACKEND],
        oncelery_database_url=environ[ENV_DATABASE_URL],
        task_default_queue=environ[ENV_QUEUE],
        broker_connection_retry_on_startup=True,
        timezone="UTC",
        enable_utc=True,
    )
    return app


app = create_app(os.environ)


def _die(_name: str, _context: dict[str, Any]) -> None:
    """The relay crashes right here: after it published its batch, before it marked the rows SENT."""
    os.kill(os.getpid(), signal.SIGKILL)


def crash_relay() -> None:
    """Run one relay round that is SIGKILLed at the fault point `relay_published` (exit status -9)."""
    with fault_injected("relay_published", _die):
        done = Relay(app, os.environ[ENV_DATABASE_URL], sweep_interval=None).run_once()
    # Only reached if the round never got to the fault point: the test sees exit status 3, not -9.
    print(f"the relay round ended without reaching relay_published: {done}", flush=True)
    sys.exit(3)


if __name__ == "__main__":
    if sys.argv[1:] != [CRASH_RELAY]:
        sys.exit(f"usage: python -m tests.apps.outbox_app {CRASH_RELAY}")
    crash_relay()
