"""RabbitMQ quorum queues on a topic exchange (Celery's native delayed delivery): a waiting duplicate is sent again.

Celery routes a countdown on such queues through RabbitMQ's delayed-delivery exchanges, in whole seconds, and
kombu refuses a countdown of 0: the first waits of a duplicate (0.25-1 s of backoff) used to raise there, and
the delivery that should have been sent again was acked as a failure. A real in-process worker on the machine's
RabbitMQ (a quorum queue of the test's own, deleted at the end), over SQLite.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kombu import Exchange, Queue

from oncelery import IdempotentTask
from tests import services
from tests.conftest import running_worker
from tests.store_faults import migrate

BROKER = "amqp://guest:guest@127.0.0.1:5672//"
TIMEOUT = 60


@pytest.fixture
def quorum_app(tmp_path: Path) -> Iterator[Celery]:
    """An app whose only queue is a quorum queue on a topic exchange, as Celery's docs configure them."""
    services.need("RabbitMQ", services.port_open("127.0.0.1", 5672), "start RabbitMQ on 127.0.0.1:5672 (user guest)")
    url = f"sqlite:///{tmp_path / 'claims.db'}"
    migrate(url).dispose()
    name = f"oncelery-quorum-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name, type="topic"), routing_key=name, queue_arguments={"x-queue-type": "quorum"})
    app = Celery("quorum")
    app.conf.update(
        broker_url=BROKER,
        broker_transport_options={"confirm_publish": True},
        result_backend=f"file://{tmp_path / 'results'}",
        task_queues=[queue],
        task_default_queue=name,
        task_default_exchange=name,
        task_default_exchange_type="topic",
        task_default_routing_key=name,
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        oncelery_database_url=url,
        oncelery_producer_dedupe=False,  # the duplicate must reach a worker and wait there
        worker_hijack_root_logger=False,
    )
    (tmp_path / "results").mkdir()
    try:
        yield app
    finally:
        with app.connection_for_write() as conn:
            queue.bind(conn.default_channel).delete()
        services.close_app(app)


def test_a_duplicate_waiting_on_a_quorum_queue_is_sent_again_not_acked_as_failed(quorum_app: Celery) -> None:
    gate, started = threading.Event(), threading.Event()
    calls: list[int] = []

    @quorum_app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_quorum", idempotency_key="q:{n}")
    def slow(self: IdempotentTask, n: int) -> int:
        calls.append(n)
        started.set()
        assert gate.wait(TIMEOUT)
        return n * 2

    with running_worker(quorum_app, concurrency=2):
        first = slow.delay(21)
        assert started.wait(TIMEOUT)
        duplicate = slow.delay(21)  # finds the run held: waits, sent again with a countdown under a second
        # The duplicate's delivery must be re-sent (its state never FAILURE) while the holder runs.
        assert services_wait(lambda: slow.outcome_counts().get("in_progress", 0) >= 1)
        gate.set()
        assert first.get(timeout=TIMEOUT) == 42
        assert duplicate.get(timeout=TIMEOUT) == 42
    assert calls == [21]
    counts = slow.outcome_counts()
    assert counts["executed"] == 1 and counts["replayed"] == 1, counts


def services_wait(condition: Any, timeout: float = TIMEOUT) -> bool:
    """Whether `condition()` became true within `timeout` seconds (polled)."""
    from oncelery.testing.faults import wait_until

    return bool(wait_until(condition, timeout))
