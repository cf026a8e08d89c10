"""oncelery.testing together with pytest-celery: its `celery_app` (configured by `celery_config`) is the app
under test when a project does not override `oncelery_app`; the task is defined on it in the test.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Mapping
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from oncelery import CELERY_DELIVERY_DEFAULTS, IdempotentTask, Outcome, outcome_of
from oncelery.testing import (
    TEST_WORKER_POLL,
    OnceleryDb,
    assert_outcomes,
    assert_ran_once,
    deliver_concurrently,
    in_process_worker,
    running_worker,
)
from tests.services import PG_ADMIN_URL

REDIS = os.environ.get("ONCELERY_TEST_REDIS_URL", "redis://127.0.0.1:6379/11")


@pytest.fixture(scope="session")
def celery_config() -> Mapping[str, Any]:
    """pytest-celery's hook for the test app's configuration: Redis, a queue of its own, delivery defaults."""
    return {
        "broker_url": REDIS,
        "result_backend": REDIS,
        "task_default_queue": f"kit-{uuid.uuid4().hex[:10]}",
        "worker_hijack_root_logger": False,
        **CELERY_DELIVERY_DEFAULTS,
    }


def test_pytest_celery_app_with_the_kit_worker(celery_app: Any, oncelery_db: OnceleryDb) -> None:
    ran: list[int] = []

    @celery_app.task(base=IdempotentTask, bind=True, name="kit.square", idempotency_key="square:{n}")
    def square(self: IdempotentTask, n: int) -> int:
        ran.append(n)
        return n * n

    # The kit's worker, started after the task exists (pytest-celery's app is created per test).
    with running_worker(celery_app, oncelery_db):
        results = deliver_concurrently(square, 7, times=5)
        assert [r.get(timeout=60) for r in results] == [49] * 5
    assert ran == [7]
    assert_ran_once(oncelery_db, square, "square:7")
    assert sum(outcome_of(r) is Outcome.EXECUTED for r in results) == 1
    counts = oncelery_db.outcome_counts(square)
    assert counts["executed"] == 1 and counts["replayed"] == 4
    assert_outcomes(oncelery_db, square, **counts)


def test_the_in_process_worker_polls_redis_briefly_and_leaves_the_config_as_it_was(
    celery_app: Any, oncelery_db: OnceleryDb
) -> None:
    """On Redis the kit's worker asks for messages with a 0.1 s BRPOP timeout (kombu's 1 s is what a stopping
    consumer waits out), unless the app set its own polling_interval; the app's options are restored after."""
    celery_app.conf.broker_transport_options = {"visibility_timeout": 3600}
    # Shared tasks of other tests (IdempotentTasks) join every app: the worker's startup check wants a database.
    celery_app.conf.oncelery_database_url = oncelery_db.url

    @celery_app.task(shared=False, name="kit.ping")
    def ping() -> str:
        return "pong"

    with in_process_worker(celery_app) as worker:
        assert ping.delay().get(timeout=60) == "pong"
        channel = worker.consumer.connection.default_channel
        assert channel.brpop_timeout == TEST_WORKER_POLL
        assert celery_app.conf.broker_transport_options == {"visibility_timeout": 3600, "polling_interval": 0.1}
    assert celery_app.conf.broker_transport_options == {"visibility_timeout": 3600}

    celery_app.conf.broker_transport_options = {"polling_interval": 0.5}
    with in_process_worker(celery_app) as worker:
        assert ping.delay().get(timeout=60) == "pong"
        assert worker.consumer.connection.default_channel.brpop_timeout == 0.5  # the app's own, untouched
    assert celery_app.conf.broker_transport_options == {"polling_interval": 0.5}


def test_the_plugin_gives_each_test_a_fresh_postgresql_database_dropped_after(pytester: pytest.Pytester) -> None:
    """A user's pytest run, in a subprocess, with the plugin asked for (`-p oncelery.testing`): with
    --oncelery-db-url each test gets a database of its own on that server, migrated, named with
    --oncelery-db-prefix, and dropped afterwards, as is the session's template it was copied from."""
    pytester.makepyfile(
        test_user="""
        from sqlalchemy import create_engine, inspect

        def test_a(oncelery_db):
            assert oncelery_db.url.startswith("postgresql") and "/kit_prefix_" in oncelery_db.url
            engine = create_engine(oncelery_db.url)
            assert {"task_runs", "step_results", "model_calls"} <= set(inspect(engine).get_table_names())
            engine.dispose()
            print("DB", oncelery_db.url.rsplit("/", 1)[1])
        """
    )
    prefix = f"kit_prefix_{uuid.uuid4().hex[:6]}_"
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "-p",
        "oncelery.testing",
        "-s",
        f"--oncelery-db-url={PG_ADMIN_URL}",
        f"--oncelery-db-prefix={prefix}",
    )
    result.assert_outcomes(passed=1)
    found = re.search(rf"DB ({prefix}\w+)", result.stdout.str())
    assert found, result.stdout.str()
    name = found.group(1)
    engine = create_engine(PG_ADMIN_URL)
    with engine.connect() as conn:
        left = conn.execute(text("SELECT count(*) FROM pg_database WHERE datname = :n"), {"n": name}).scalar_one()
        # The session's template (<prefix>template_...) is gone too: nothing of the run is left on the server.
        leftovers = conn.execute(text("SELECT datname FROM pg_database WHERE starts_with(datname, :p)"), {"p": prefix})
        others = [row[0] for row in leftovers]
    engine.dispose()
    assert left == 0, f"the test database {name} was not dropped"
    assert others == [], others
