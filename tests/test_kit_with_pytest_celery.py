"""oncelery.testing together with pytest-celery: its `celery_app` (configured by `celery_config`) is the app
under test when a project does not override `oncelery_app`; the task is defined on it in the test.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from typing import Any

import pytest

from oncelery import CELERY_DELIVERY_DEFAULTS, IdempotentTask, Outcome, outcome_of
from oncelery.testing import OnceleryDb, assert_outcomes, assert_ran_once, deliver_concurrently, running_worker

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
