"""The embedded default's transport (oncelery.embedded_broker): a freed prefetch slot wakes the drain loop.

kombu's stock filesystem transport sleeps a whole polling_interval when the prefetch window is full, however
soon the message is acked. Here the interval is 60 s and the drain's own timeout 30 s: the stock transport
returns nothing (socket.timeout after 30 s) where the embedded default's takes the next message at the ack.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.worker import state as worker_state
from kombu import Connection, Consumer, Exchange, Queue

from oncelery.embedded_broker import URL, Transport

WAIT = 20.0  # generous: the delivery follows the ack by milliseconds; the stock transport needs 30 s and fails


def _queue(name: str) -> Queue:
    """A queue of a name no other test uses: kombu's virtual transports keep bindings per process, not per folder."""
    unique = f"{name}-{uuid.uuid4().hex[:8]}"
    return Queue(unique, Exchange(unique, type="direct"), routing_key=unique)


def _connection(folder: Path, polling: float = 0.05) -> Connection:
    return Connection(
        URL,
        transport_options={
            "data_folder_in": str(folder),
            "data_folder_out": str(folder),
            "control_folder": str(folder / "control"),
            "polling_interval": polling,
        },
    )


def test_an_ack_wakes_a_drain_waiting_on_a_full_prefetch_window(tmp_path: Path) -> None:
    queue = _queue("jobs")
    got: list[tuple[Any, Any]] = []
    with _connection(tmp_path, polling=60.0) as conn:
        producer = conn.Producer(serializer="json")
        for n in (1, 2):
            producer.publish({"n": n}, exchange=queue.exchange, routing_key=queue.routing_key, declare=[queue])
        channel = conn.channel()
        consumer = Consumer(channel, [queue], callbacks=[lambda body, msg: got.append((body, msg))], accept=["json"])
        consumer.qos(prefetch_count=1)
        consumer.consume()
        conn.drain_events(timeout=WAIT)
        # One message only: the window holds one; the first sent.
        assert len(got) == 1 and got[0][0] == {"n": 1}

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
        assert sorted(body["n"] for body, _ in got) == [1, 2]
        got[1][1].ack()


def _consume(conn: Connection, queue: Queue, got: list[Any], prefetch: int = 1) -> Consumer:
    def on_message(body: Any, message: Any) -> None:
        got.append(body["n"])
        message.ack()

    consumer = Consumer(conn.channel(), [queue], callbacks=[on_message], accept=["json"])
    consumer.qos(prefetch_count=prefetch)
    consumer.consume()
    return consumer


def _publish(conn: Connection, queue: Queue, numbers: range) -> None:
    producer = conn.Producer(serializer="json")
    for n in numbers:
        producer.publish({"n": n}, exchange=queue.exchange, routing_key=queue.routing_key, declare=[queue])


def test_messages_sent_after_a_listing_are_taken_too(tmp_path: Path) -> None:
    """A fetch serves from the last listing; what arrives meanwhile is taken once that listing is used up."""
    queue = _queue("fifo")
    got: list[int] = []
    with _connection(tmp_path) as conn:
        _publish(conn, queue, range(3))
        _consume(conn, queue, got)
        conn.drain_events(timeout=WAIT)  # lists 3 files, takes the first
        _publish(conn, queue, range(3, 6))
        while len(got) < 6:
            conn.drain_events(timeout=WAIT)
    assert got == [0, 1, 2, 3, 4, 5]  # one producer's messages, in the order sent
    assert not [name for name in tmp_path.iterdir() if name.suffix == ".msg"]


def test_two_consumers_racing_on_one_folder_take_each_message_once(tmp_path: Path) -> None:
    """Two workers' listings overlap: a file the other took is skipped, none is lost or taken twice."""
    queue = _queue("race")
    total = 400
    with _connection(tmp_path) as conn:
        _publish(conn, queue, range(total))
    taken: list[list[int]] = [[], []]
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def worker(got: list[int]) -> None:
        try:
            with _connection(tmp_path) as conn:
                _consume(conn, queue, got)
                start.wait(WAIT)
                while sum(map(len, taken)) < total:
                    try:
                        conn.drain_events(timeout=1.0)
                    except TimeoutError:
                        continue
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(got,), daemon=True) for got in taken]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads), f"drained {sum(map(len, taken))} of {total}"
    assert errors == []
    assert sorted(taken[0] + taken[1]) == list(range(total))


def test_files_another_consumer_took_are_skipped_not_delivered_twice(tmp_path: Path) -> None:
    """A's listing holds files that B then takes: A skips every one of them and lists again."""
    queue = _queue("skip")
    got_a: list[int] = []
    got_b: list[int] = []
    with _connection(tmp_path) as a, _connection(tmp_path) as b:
        _publish(a, queue, range(50))
        _consume(a, queue, got_a)
        a.drain_events(timeout=WAIT)  # A lists all 50 files and takes the first
        _consume(b, queue, got_b)
        while len(got_b) < 49:
            b.drain_events(timeout=WAIT)
        with pytest.raises(TimeoutError):
            a.drain_events(timeout=0.5)  # its 49 listed files are gone: skipped, and the new listing is empty
        _publish(b, queue, range(50, 51))
        a.drain_events(timeout=WAIT)
    assert len(got_a) == 2 and got_a[1] == 50
    assert sorted(got_a[:1] + got_b) == list(range(50))


def test_a_backlog_is_drained_from_one_listing_for_every_queue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """200 messages over two queues, consumed together: one listing of the folder serves every fetch.

    kombu's channel lists (and sorts) the whole folder for every fetch and every empty poll: 200+ listings.
    """
    jobs = _queue("jobs")
    idle = _queue("idle")
    got: list[int] = []
    listings = 0
    real_listdir = os.listdir

    def counting_listdir(path: Any) -> list[str]:
        nonlocal listings
        listings += 1
        return real_listdir(path)

    with _connection(tmp_path, polling=60.0) as conn:
        _publish(conn, jobs, range(200))
        _publish(conn, idle, range(0))  # declared, never sent to: polled empty alongside
        consumer = Consumer(
            conn.channel(),
            [jobs, idle],
            callbacks=[lambda body, message: (got.append(body["n"]), message.ack())],
            accept=["json"],
        )
        consumer.qos(prefetch_count=1)
        consumer.consume()
        monkeypatch.setattr(os, "listdir", counting_listdir)
        while len(got) < 200:
            conn.drain_events(timeout=WAIT)
    assert got == list(range(200))
    assert listings == 1


def _produce(folder: str, queue_name: str, total: int) -> None:
    """In a child process: publish `total` messages of ~20 kB each (a file takes a while to write)."""
    queue = Queue(queue_name, Exchange(queue_name, type="direct"), routing_key=queue_name)
    with _connection(Path(folder)) as conn:
        producer = conn.Producer(serializer="json")
        for n in range(total):
            body = {"n": n, "pad": "x" * 20_000}
            producer.publish(body, exchange=queue.exchange, routing_key=queue.routing_key, declare=[queue])


def test_a_consumer_racing_a_producer_takes_whole_messages_only(tmp_path: Path) -> None:
    """A worker draining while a client sends: every message arrives whole, once, in the order sent.

    kombu's transport creates the file under its final name, then writes it: a listing in between takes an
    empty file, fails to decode it, and has already removed it (this test lost all but 2 of 5 000 that way).
    """
    queue = _queue("live")
    total = 2000
    got: list[int] = []
    errors: list[BaseException] = []
    producer = multiprocessing.get_context("fork").Process(target=_produce, args=(str(tmp_path), queue.name, total))
    with _connection(tmp_path, polling=0.0) as conn:
        _publish(conn, queue, range(0))  # declared before the producer sends
        _consume(conn, queue, got, prefetch=100)
        producer.start()
        try:
            deadline = time.monotonic() + 120
            while len(got) < total and time.monotonic() < deadline and len(errors) < 5:
                try:
                    conn.drain_events(timeout=1.0)
                except TimeoutError:
                    continue
                except Exception as exc:  # a message that was not whole: what this test is about
                    errors.append(exc)
        finally:
            producer.join(60)
            if producer.is_alive():
                producer.kill()
                producer.join(10)
    assert producer.exitcode == 0
    assert errors == []
    assert got == list(range(total))
    assert not [p.name for p in tmp_path.iterdir() if p.is_file()], "a message file was left behind"


def test_a_file_that_is_not_a_message_is_kept_and_the_next_is_delivered(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A malformed message file is not lost: kept as `.malformed`, logged with what to do; the queue goes on."""
    queue = _queue("bad")
    got: list[int] = []
    with _connection(tmp_path) as conn:
        _publish(conn, queue, range(0))
        bad = tmp_path / f"{'0' * 20}_not-json.{queue.name}.msg"  # sorts first
        bad.write_bytes(b"{not json")
        _publish(conn, queue, range(2))
        _consume(conn, queue, got)
        with caplog.at_level(logging.ERROR, logger="oncelery.embedded_broker"):
            while len(got) < 2:
                conn.drain_events(timeout=WAIT)
    assert got == [0, 1]
    kept = tmp_path / f"{bad.name}.malformed"
    assert kept.read_bytes() == b"{not json" and not bad.exists()
    assert any(bad.name in r.getMessage() and "rename it back" in r.getMessage() for r in caplog.records)


def test_an_empty_queue_still_times_out(tmp_path: Path) -> None:
    """With nothing to take and no ack, drain_events honours its timeout (the worker's loop relies on it)."""
    queue = _queue("idle")
    with _connection(tmp_path) as conn:
        consumer = Consumer(conn.channel(), [queue], callbacks=[lambda body, msg: None], accept=["json"])
        consumer.consume()
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.2)


@pytest.mark.parametrize("flag", ["should_stop", "should_terminate"])
def test_a_worker_told_to_stop_takes_no_message_and_its_drain_returns_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: str
) -> None:
    """Once Celery's SIGTERM/SIGQUIT handler has set its flag (0, EX_OK, for a warm stop), a drain answers
    "nothing" at once instead of polling out its timeout, and leaves the queued message for the next worker."""
    queue = _queue("stopping")
    got: list[int] = []
    with _connection(tmp_path) as conn:
        _publish(conn, queue, range(1))
        _consume(conn, queue, got)
        monkeypatch.setattr(worker_state, flag, 0)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=WAIT)
        assert time.monotonic() - started < WAIT / 2
        assert got == [] and len([p for p in tmp_path.iterdir() if p.suffix == ".msg"]) == 1
        monkeypatch.setattr(worker_state, flag, None)
        conn.drain_events(timeout=WAIT)
    assert got == [0]


def test_the_embedded_default_selects_it_and_a_url_given_later_wins() -> None:
    """oncelery.celeryconfig's embedded default is `oncelery-fs://`; a broker URL set afterwards is used as given.

    (With Celery's `broker_transport` setting instead, `celery --broker=redis://... flower` run next to the
    config read the spool folder and never saw an event.)
    """
    app = Celery("t-embedded-config")
    app.config_from_object("oncelery.celeryconfig")
    if not os.environ.get("ONCELERY_BROKER_URL"):
        assert app.conf.broker_url == URL
        with app.connection_for_write() as conn:
            assert isinstance(conn.transport, Transport)
    app.conf.broker_url = "redis://127.0.0.1:6379/0"
    with app.connection_for_write() as conn:
        assert type(conn.transport).__module__ == "kombu.transport.redis"


def test_an_exchange_table_being_created_reads_as_no_bindings(tmp_path: Path) -> None:
    """kombu creates an exchange's table file empty, then locks and writes it: a fanout publish that reads it
    in between finds no bindings (as before the bind), instead of failing on the empty file."""
    exchange = f"fan-{uuid.uuid4().hex[:8]}"
    with _connection(tmp_path) as conn:
        channel = conn.channel()
        (tmp_path / "control").mkdir(exist_ok=True)
        table = tmp_path / "control" / f"{exchange}.exchange"
        table.write_bytes(b"")
        assert channel.get_table(exchange) == []
        table.write_bytes(b"[not json")
        with pytest.raises(ValueError):
            channel.get_table(exchange)  # a broken table is not mistaken for an empty one
        table.unlink()
        queue = Queue(f"{exchange}-q", Exchange(exchange, type="fanout"))
        queue(channel).declare()
        assert [binding.queue for binding in channel.get_table(exchange)] == [queue.name]
