"""The embedded default's transport (oncelery.embedded_broker): a freed prefetch slot wakes the drain loop.

kombu's stock filesystem transport sleeps a whole polling_interval when the prefetch window is full, however
soon the message is acked. Here the interval is 60 s and the drain's own timeout 30 s: the stock transport
returns nothing (socket.timeout after 30 s) where the embedded default's takes the next message at the ack.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection, Consumer, Exchange, Queue

from oncelery import celeryconfig
from oncelery.embedded_broker import TRANSPORT

WAIT = 20.0  # generous: the delivery follows the ack by milliseconds; the stock transport needs 30 s and fails


def _connection(folder: Path) -> Connection:
    return Connection(
        "filesystem://",
        transport=TRANSPORT,
        transport_options={
            "data_folder_in": str(folder),
            "data_folder_out": str(folder),
            "control_folder": str(folder / "control"),
            "polling_interval": 60.0,
        },
    )


def test_an_ack_wakes_a_drain_waiting_on_a_full_prefetch_window(tmp_path: Path) -> None:
    queue = Queue("jobs", Exchange("jobs", type="direct"), routing_key="jobs")
    got: list[tuple[Any, Any]] = []
    with _connection(tmp_path) as conn:
        producer = conn.Producer(serializer="json")
        for n in (1, 2):
            producer.publish({"n": n}, exchange=queue.exchange, routing_key="jobs", declare=[queue])
        channel = conn.channel()
        consumer = Consumer(channel, [queue], callbacks=[lambda body, msg: got.append((body, msg))], accept=["json"])
        consumer.qos(prefetch_count=1)
        consumer.consume()
        conn.drain_events(timeout=WAIT)
        assert [body for body, _ in got] == [{"n": 1}]

        # Count the window's refusals, to ack only once the drain below has found the window full.
        refused = threading.Semaphore(0)
        can_consume = channel.qos.can_consume

        def counting() -> bool:
            ok: bool = can_consume()
            if not ok:
                refused.release()
            return ok

        channel.qos.can_consume = counting
        failure: list[BaseException] = []

        def drain() -> None:
            try:
                conn.drain_events(timeout=30.0)
            except BaseException as exc:  # socket.timeout on the stock transport: reported by the assert below
                failure.append(exc)

        drainer = threading.Thread(target=drain, daemon=True)
        drainer.start()
        assert refused.acquire(timeout=WAIT), "the drain never looked at the prefetch window"
        got[0][1].ack()
        drainer.join(WAIT)
        assert not drainer.is_alive(), "the ack did not wake the drain: it still sleeps its polling_interval"
        assert failure == []
        assert [body for body, _ in got] == [{"n": 1}, {"n": 2}]
        got[1][1].ack()


def test_an_empty_queue_still_times_out(tmp_path: Path) -> None:
    """With nothing to take and no ack, drain_events honours its timeout (the worker's loop relies on it)."""
    queue = Queue("idle", Exchange("idle", type="direct"), routing_key="idle")
    with _connection(tmp_path) as conn:
        consumer = Consumer(conn.channel(), [queue], callbacks=[lambda body, msg: None], accept=["json"])
        consumer.consume()
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.2)


def test_the_embedded_default_selects_it() -> None:
    """oncelery.celeryconfig (no ONCELERY_BROKER_URL in the tests' environment) uses it on filesystem://."""
    if celeryconfig.broker_url != "filesystem://":
        pytest.skip("ONCELERY_BROKER_URL is set: celeryconfig is not on the embedded default")
    assert celeryconfig.broker_transport == TRANSPORT
