"""The replay cache: duplicates of finished runs answered from Redis, never deciding a claim.

A real in-process worker on the real Redis broker; the cache is a redis-server of the test's own (started and
stopped by its PID), so flushing or killing it touches nobody else. Over SQLite and PostgreSQL.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from sqlalchemy import event
from sqlalchemy.engine import Engine

from oncelery import ConfigurationError, IdempotencyConflict, IdempotentTask
from oncelery.cli import oncelery as oncelery_cli
from oncelery.models import RunStatus
from oncelery.relay.retention import purge
from oncelery.runs.claims import RunStore
from oncelery.runs.faults import fault_injected
from oncelery.runs.outcomes import flush_replays
from oncelery.store.database import Database
from oncelery.store.dialects import PostgreSQL
from oncelery.store.driver import statement_listeners
from oncelery.testing.faults import wait_until
from tests.chaos.procs import RedisServer, Sessions
from tests.conftest import ON_POSTGRESQL, running_worker
from tests.services import stop_sessions
from tests.store_faults import Db, app_on, fault_of
from tests.test_crash import EFFECT_TASK, JOB_TIMEOUT, STOP_GRACE, cluster, run_key

TIMEOUT = 60


@pytest.fixture
def cache_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own for the cache, stopped by its PID after the test."""
    sessions = Sessions()
    server = RedisServer(sessions, tmp_path)
    try:
        assert server.wait_ready(), "the cache's redis-server did not start"
        yield server
    finally:
        sessions.stop_all()


@pytest.fixture(autouse=True)
def counts_written() -> Iterator[None]:
    """No test leaves replay counts in memory for the flusher to write into the next test's database."""
    yield
    flush_replays()


class Statements:
    """Counts the SQL statements this process sends (SQLAlchemy's and the driver path's) while active, but the
    reads of the database's identity: at most one per process every few seconds, never one per delivery."""

    def __init__(self) -> None:
        self.n = 0
        self.lock = threading.Lock()

    def _count(self, statement: str) -> None:
        if statement not in PostgreSQL.identity_queries:
            with self.lock:
                self.n += 1

    def _on_engine(self, _conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        self._count(statement)

    def _on_driver(self, statement: str, _params: Any) -> None:
        self._count(statement)

    def __enter__(self) -> Statements:
        event.listen(Engine, "before_cursor_execute", self._on_engine)
        statement_listeners.append(self._on_driver)
        return self

    def __exit__(self, *_exc: object) -> None:
        event.remove(Engine, "before_cursor_execute", self._on_engine)
        statement_listeners.remove(self._on_driver)


def cached_job(app: Celery, server: RedisServer, name: str) -> tuple[Any, list[int]]:
    """A task on `app` with the replay cache on `server`, and the list of the doc ids its body ran for."""
    app.conf.oncelery_replay_cache = server.url
    calls: list[int] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name=name, idempotency_key="doc:{doc_id}")
    def summarize(self: IdempotentTask, doc_id: int, text: str) -> dict[str, Any]:
        calls.append(doc_id)
        return {"doc": doc_id, "words": len(text.split())}

    return summarize, calls


def entry_exists(server: RedisServer, task: Any, key: str) -> bool:
    cache = task.replay_cache()
    assert cache is not None
    with server.client() as client:
        return bool(client.exists(cache.entry_name(task.name, "", key)))


def test_duplicates_are_answered_from_the_cache_with_no_statement_and_counted_exactly(
    app: Celery, worker_factory: Any, db_url: str, cache_redis: RedisServer
) -> None:
    job, calls = cached_job(app, cache_redis, "oncelery.t_cache")
    with worker_factory(app, concurrency=4):
        first = job.delay(1, "one two three").get(timeout=TIMEOUT)
        assert entry_exists(cache_redis, job, "doc:1")  # written once the completion committed
        with Statements() as statements:
            answers = [r.get(timeout=TIMEOUT) for r in [job.delay(1, "one two three") for _ in range(8)]]
        assert statements.n == 0, "a cached duplicate must not touch the database"

    assert first == {"doc": 1, "words": 3}
    assert answers == [first] * 8
    assert calls == [1]
    counts = job.outcome_counts()  # writes this process's pending replay counts first
    assert counts == {"executed": 1, "replayed": 8}
    run = RunStore(db_url).get(job.name, "doc:1")
    assert run is not None and run.status is RunStatus.COMPLETED and run.replays == 8


def test_a_flushed_cache_is_refilled_by_the_database_and_nothing_runs_twice(
    app: Celery, worker_factory: Any, db_url: str, cache_redis: RedisServer
) -> None:
    job, calls = cached_job(app, cache_redis, "oncelery.t_cache_flush")
    with worker_factory(app, concurrency=2):
        first = job.delay(2, "a b").get(timeout=TIMEOUT)
        cache_redis.flushall()  # Redis loses its state
        assert not entry_exists(cache_redis, job, "doc:2")
        with Statements() as statements:
            again = job.delay(2, "a b").get(timeout=TIMEOUT)
        assert statements.n >= 1, "with its entry gone, the database answers"
        assert entry_exists(cache_redis, job, "doc:2"), "the database's answer is written back"
        with Statements() as statements:
            third = job.delay(2, "a b").get(timeout=TIMEOUT)
        assert statements.n == 0

    assert calls == [2]
    assert first == again == third == {"doc": 2, "words": 2}
    assert job.outcome_counts() == {"executed": 1, "replayed": 2}


def test_a_dead_cache_costs_nothing_but_speed(
    app: Celery, worker_factory: Any, db_url: str, cache_redis: RedisServer
) -> None:
    job, calls = cached_job(app, cache_redis, "oncelery.t_cache_dead")
    with worker_factory(app, concurrency=4):
        first = job.delay(3, "x").get(timeout=TIMEOUT)
        cache_redis.proc.kill()  # SIGKILL: the cache's server is gone mid-run
        cache_redis.proc.wait(timeout=TIMEOUT)
        answers = [r.get(timeout=TIMEOUT) for r in [job.delay(3, "x") for _ in range(5)]]
        fresh = job.delay(4, "y z").get(timeout=TIMEOUT)  # a new key still runs, and completes

    assert answers == [first] * 5
    assert fresh == {"doc": 4, "words": 2}
    assert sorted(calls) == [3, 4]
    assert job.outcome_counts() == {"executed": 2, "replayed": 5}


def test_a_different_payload_under_a_cached_key_is_still_a_conflict(
    app: Celery, worker_factory: Any, db_url: str, cache_redis: RedisServer
) -> None:
    job, calls = cached_job(app, cache_redis, "oncelery.t_cache_conflict")
    with worker_factory(app, concurrency=2):
        first = job.delay(5, "first text").get(timeout=TIMEOUT)
        with pytest.raises(IdempotencyConflict):
            job.delay(5, "another text").get(timeout=TIMEOUT)
        again = job.delay(5, "first text").get(timeout=TIMEOUT)

    assert calls == [5]
    assert again == first
    assert job.outcome_counts() == {"executed": 1, "conflict": 1, "replayed": 1}


def test_threads_racing_on_one_key_run_it_once_and_count_every_delivery(
    app: Celery, db_url: str, cache_redis: RedisServer
) -> None:
    app.conf.oncelery_replay_cache = cache_redis.url
    calls: list[int] = []
    started = threading.Event()
    gate = threading.Event()

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_cache_race", idempotency_key="r:{n}")
    def slow(self: IdempotentTask, n: int) -> int:
        calls.append(n)
        started.set()
        assert gate.wait(TIMEOUT)
        return n * 10

    results: list[Any] = []
    lock = threading.Lock()

    def call() -> None:
        value = slow(7)  # a direct call: claims, replays or waits for the holder like a delivery
        with lock:
            results.append(value)

    holder = threading.Thread(target=call)
    holder.start()
    assert started.wait(TIMEOUT)
    racers = [threading.Thread(target=call) for _ in range(20)]
    for t in racers:
        t.start()
    gate.set()  # the holder completes while the racers wait on it, or read its cached answer
    for t in [holder, *racers]:
        t.join(TIMEOUT)
    assert results == [70] * 21
    assert calls == [7]
    counts = slow.outcome_counts()
    assert counts.get("executed") == 1 and counts.get("replayed") == 20, counts


def test_purge_forgets_the_cached_entries_of_the_runs_it_deletes(
    app: Celery, worker_factory: Any, db_url: str, cache_redis: RedisServer
) -> None:
    job, calls = cached_job(app, cache_redis, "oncelery.t_cache_purge")
    with worker_factory(app, concurrency=2):
        job.delay(6, "old").get(timeout=TIMEOUT)
        assert entry_exists(cache_redis, job, "doc:6")
        cache = job.replay_cache()
        # Finished "more than 0 s ago" by the database clock: polled, the clock may not have ticked yet.
        wait_until(lambda: purge(Database(db_url), 0.0, forget=cache.forget).runs == 1, TIMEOUT, what="the purge")
        assert not entry_exists(cache_redis, job, "doc:6")
        # Forgotten everywhere: the key runs again, as it would without the cache.
        job.delay(6, "old").get(timeout=TIMEOUT)
    assert calls == [6, 6]


def test_the_purge_command_forgets_the_cached_entries_of_the_runs_it_deletes(
    app: Celery, worker_factory: Any, db_url: str, cache_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`oncelery purge` run as an operator runs it: the cache named by ONCELERY_REPLAY_CACHE, no Celery app."""
    job, calls = cached_job(app, cache_redis, "oncelery.t_cache_purge_cli")
    monkeypatch.setenv("ONCELERY_REPLAY_CACHE", cache_redis.url)
    with worker_factory(app, concurrency=2):
        job.delay(7, "old").get(timeout=TIMEOUT)
        assert entry_exists(cache_redis, job, "doc:7")

        def purged() -> bool:
            out = CliRunner().invoke(oncelery_cli, ["--database-url", db_url, "purge", "--older-than", "0s"])
            assert out.exit_code == 0, out.output
            return out.output.startswith("purged 1 runs")

        wait_until(purged, TIMEOUT, what="the purge command")
        assert not entry_exists(cache_redis, job, "doc:7")
        job.delay(7, "old").get(timeout=TIMEOUT)  # forgotten by the cache too: the key runs again
    assert calls == [7, 7]


@ON_POSTGRESQL
def test_a_bad_cache_setting_is_refused_with_what_to_give(app: Celery, db_url: str) -> None:
    app.conf.oncelery_replay_cache = "http://not-redis"

    @app.task(shared=False, base=IdempotentTask, name="oncelery.t_cache_bad", idempotency_key="b:{n}")
    def job(n: int) -> int:
        return n

    with pytest.raises(ConfigurationError, match="give a Redis URL"):
        job(1)


# -- the database fails where the cached replays are written ---------------------------------------------


@pytest.mark.parametrize("fault", ["terminate", "restart"])
def test_replay_counts_survive_a_database_fault_at_their_flush(
    pg_db: Db,
    redis_url: str,
    cache_redis: RedisServer,
    fault: str,
) -> None:
    killed: list[int] = []
    with app_on(pg_db, redis_url) as app:
        job, calls = cached_job(app, cache_redis, "oncelery.t_cache_fault")
        with running_worker(app, concurrency=2):
            first = job.delay(8, "p q").get(timeout=TIMEOUT)
            hit = threading.Event()
            broke = fault_of(fault, pg_db, killed)

            def at_flush(_point: str, _ctx: dict[str, Any]) -> None:
                if not hit.is_set():
                    hit.set()
                    broke()  # the server kills this flush's connection (or restarts) right here

            with fault_injected("flush_replays", at_flush):
                answers = [r.get(timeout=TIMEOUT) for r in [job.delay(8, "p q") for _ in range(6)]]
                wait_until(hit.is_set, TIMEOUT, what="the flush to meet the fault")

            # The failed flush kept its counts: the next one (the flusher's retry, or this) writes them once.
            def flushed() -> bool:
                try:
                    flush_replays()
                except Exception:
                    return False
                return True

            wait_until(flushed, TIMEOUT, what="a flush past the fault")
            counts = pg_db.counts(job.name)
            run = pg_db.run(job.name, "doc:8")
    assert killed, "the fault was not injected"
    assert answers == [first] * 6 and calls == [8]
    assert counts == {"executed": 1, "replayed": 6}
    assert run is not None and run.replays == 6


# -- real `celery worker` processes: the replays counted in a prefork child's memory reach the database -------


@ON_POSTGRESQL
def test_prefork_workers_write_their_cached_replay_counts_when_they_stop(
    tmp_path: Path, db_url: str, redis_url: str, cache_redis: RedisServer
) -> None:
    key = "cached-prefork"
    duplicates = 40
    with cluster(tmp_path, db_url, redis_url) as c:
        c.env["ONCELERY_REPLAY_CACHE"] = cache_redis.url
        # No timed write before the stop: only the children's last word (worker_process_shutdown) writes them.
        c.env["ONCELERY_REPLAY_FLUSH_INTERVAL"] = "3600"
        a, b = c.start("a", concurrency=2), c.start("b", concurrency=1)
        c.wait_ready(a, b)
        first = c.send(EFFECT_TASK, key, 0.0).get(timeout=JOB_TIMEOUT)
        answers = [r.get(timeout=JOB_TIMEOUT) for r in [c.send(EFFECT_TASK, key, 0.0) for _ in range(duplicates)]]
        # Stopped at once (SIGTERM, warm shutdown): the last replays are still only in the children's memory.
        codes = stop_sessions([w.proc for w in c.workers], grace=STOP_GRACE * 6)
        assert codes == [0, 0], f"a worker did not stop cleanly: {codes}"
        with cache_redis.client() as client:
            assert client.dbsize() == 1  # the one finished key's entry
        # Every duplicate was answered by the cache, in the children of both workers' logs together.
        assert sum(w.log().count("from the replay cache") for w in (a, b)) == duplicates
        assert answers == [first] * duplicates
        assert c.executions(key) == 1 and c.effects(key) == 1
        assert c.outcomes() == {"executed": 1, "replayed": duplicates}
        run = c.store.get(EFFECT_TASK, run_key(key))
        assert run is not None and run.replays == duplicates
