"""Producer dedupe: `.delay()` of a duplicate asks the claims database first and publishes nothing it answers.

A real in-process worker on the real Redis broker, over SQLite and PostgreSQL. What was published is read from
Celery's before_task_publish signal (`published`); what was counted, from the database. The failure paths make the
check fail right there (a held row or write lock: its timeout; a killed connection; a fault at its point), and
the call then publishes, and the job still ends exactly once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from oncelery import IdempotencyConflict, IdempotentTask, ProducerReplay, outbox, outcome_of, pipeline
from oncelery.basetask import producer
from oncelery.errors import StoreUnavailable
from oncelery.models import RunStatus
from oncelery.relay.loop import Relay
from oncelery.runs.claims import RunStore
from oncelery.runs.faults import fault_injected
from oncelery.store.database import Database
from oncelery.testing.faults import wait_until
from tests.conftest import running_worker
from tests.store_faults import FAULTS, JOB_TIMEOUT, Db, LogLines, assert_once, define_job, expected, fault_of
from tests.test_metrics import scrape

TIMEOUT = 60


@pytest.fixture
def app(app: Celery) -> Celery:
    """The suite's app with the product's default: producer dedupe on (the suite's `app` turns it off)."""
    app.conf.oncelery_producer_dedupe = None
    return app


@pytest.fixture(autouse=True)
def no_cooldown() -> Iterator[None]:
    """No test meets the cooldown a test whose check failed on purpose left behind."""
    producer._cooldown.clear()
    yield
    producer._cooldown.clear()


def at_producer(db_url: str, task_name: str) -> int:
    """The exporter's count of the task's calls answered at the producer (oncelery_producer_answers_total)."""
    got = scrape(db_url)
    return int(got.get(("oncelery_producer_answers_total", (("name", task_name), ("tenant", "")))) or 0)


def summary_job(app: Celery, name: str, **options: Any) -> tuple[Any, list[int]]:
    """An idempotent task keyed by doc id, and the doc ids its body ran for."""
    calls: list[int] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name=name, idempotency_key="doc:{doc_id}", **options)
    def summarize(self: IdempotentTask, doc_id: int, text: str) -> dict[str, Any]:
        calls.append(doc_id)
        return {"doc": doc_id, "words": len(text.split())}

    return summarize, calls


def test_a_duplicate_of_a_finished_run_is_answered_at_the_producer_and_never_published(
    app: Celery, worker_factory: Any, db_url: str, published: list[str]
) -> None:
    job, calls = summary_job(app, "oncelery.t_prod_dup")
    with worker_factory(app, concurrency=2):
        first = job.delay(1, "one two three").get(timeout=TIMEOUT)
        published.clear()
        dup = job.delay(1, "one two three")
        assert isinstance(dup, ProducerReplay)
        assert published == [], "a duplicate answered at the producer is not published"
        assert dup.get(timeout=1) == first
        assert outcome_of(dup).value == "replayed"
        # The answer is in the result backend under the handle's id too: a poller elsewhere sees it.
        assert app.AsyncResult(dup.id).get(timeout=TIMEOUT) == first
        # Off for one call: published, and the worker answers it from the stored result.
        sent = job.apply_async((1, "one two three"), producer_dedupe=False)
        assert not isinstance(sent, ProducerReplay)
        assert sent.get(timeout=TIMEOUT) == first
        assert published == [job.name]

    assert calls == [1]
    assert job.outcome_counts() == {"executed": 1, "replayed": 2}
    assert at_producer(db_url, job.name) == 1
    run = RunStore(db_url).get(job.name, "doc:1")
    assert run is not None and run.status is RunStatus.COMPLETED and run.replays == 2


def test_off_per_task_and_per_app_publishes_every_duplicate(
    app: Celery, worker_factory: Any, db_url: str, published: list[str]
) -> None:
    job, calls = summary_job(app, "oncelery.t_prod_off_task", producer_dedupe=False)
    other, other_calls = summary_job(app, "oncelery.t_prod_off_app")
    app.conf.oncelery_producer_dedupe = False
    with worker_factory(app, concurrency=2):
        results = [job.delay(2, "a b").get(timeout=TIMEOUT) for _ in range(2)]
        results += [other.delay(2, "a b").get(timeout=TIMEOUT) for _ in range(2)]
        # The call's option wins over the app's.
        assert isinstance(other.apply_async((2, "a b"), producer_dedupe=True), ProducerReplay)
    assert published == [job.name, job.name, other.name, other.name]
    assert results == [{"doc": 2, "words": 2}] * 4
    assert calls == other_calls == [2]
    assert job.outcome_counts() == {"executed": 1, "replayed": 1}
    assert at_producer(db_url, other.name) == 1


def test_a_conflict_is_raised_at_the_caller_naming_the_field(
    app: Celery, worker_factory: Any, db_url: str, published: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ONCELERY_DIGEST_KEY", "test-digest-key")
    job, calls = summary_job(app, "oncelery.t_prod_conflict")
    with worker_factory(app, concurrency=2):
        job.delay(3, "first text").get(timeout=TIMEOUT)
        published.clear()
        with pytest.raises(IdempotencyConflict) as raised:
            job.delay(3, "another text")
        assert published == []
    assert raised.value.fields == ["text"]
    assert calls == [3]
    assert job.outcome_counts() == {"executed": 1, "conflict": 1}


def test_a_run_in_progress_that_keeps_its_message_returns_its_own_result(
    app: Celery, worker_factory: Any, db_url: str, published: list[str]
) -> None:
    gate, started = threading.Event(), threading.Event()
    calls: list[int] = []

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_prod_running",
        idempotency_key="r:{n}",
        store_message=True,
    )
    def slow(self: IdempotentTask, n: int) -> int:
        calls.append(n)
        started.set()
        assert gate.wait(TIMEOUT)
        return n * 10

    with worker_factory(app, concurrency=2):
        first = slow.delay(4)
        assert started.wait(TIMEOUT)
        published.clear()
        dup = slow.delay(4)
        assert dup.id == first.id, "the run's own task id: its result is this call's"
        assert published == []
        gate.set()
        assert dup.get(timeout=TIMEOUT) == 40
    assert calls == [4]
    assert slow.outcome_counts() == {"executed": 1}


def test_a_run_in_progress_that_only_its_message_would_restart_is_published(
    app: Celery, worker_factory: Any, db_url: str, published: list[str]
) -> None:
    gate, started = threading.Event(), threading.Event()
    calls: list[int] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_prod_unkept", idempotency_key="u:{n}")
    def slow(self: IdempotentTask, n: int) -> int:
        calls.append(n)
        started.set()
        assert gate.wait(TIMEOUT)
        return n + 1

    with worker_factory(app, concurrency=2):
        first = slow.delay(5)
        assert started.wait(TIMEOUT)
        published.clear()
        dup = slow.delay(5)  # no stored message, no outbox row: if the broker lost the first, this one runs it
        assert dup.id != first.id and not isinstance(dup, ProducerReplay)
        assert published == [slow.name]
        gate.set()
        assert first.get(timeout=TIMEOUT) == dup.get(timeout=TIMEOUT) == 6
    assert calls == [5]


def test_a_finished_pipeline_enqueued_again_publishes_nothing_and_a_failed_one_resumes(
    app: Celery, worker_factory: Any, db_url: str, published: list[str]
) -> None:
    ran: list[str] = []
    fail = {"second": True}

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_prod_p1")
    def first(self: IdempotentTask, text: str) -> str:
        ran.append("first")
        return text.upper()

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_prod_p2")
    def second(self: IdempotentTask, text: str) -> str:
        ran.append("second")
        if fail["second"]:
            raise ValueError("a flaky link")
        return text + "!"

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_prod_p3")
    def third(self: IdempotentTask, text: str) -> int:
        ran.append("third")
        return len(text)

    flow = pipeline("doc:7", first.s("abc"), second.s(), third.s())
    with worker_factory(app, concurrency=2):
        with pytest.raises(ValueError, match="a flaky link"):
            flow.delay().get(timeout=TIMEOUT)
        fail["second"] = False
        published.clear()
        # The first link is answered at the producer and the next link is sent with its result.
        assert flow.delay().get(timeout=TIMEOUT) == 4
        assert published == [second.name, third.name]
        published.clear()
        assert flow.delay().get(timeout=TIMEOUT) == 4  # every link answered where it is sent
        assert published == []
    assert ran == ["first", "second", "second", "third"]
    assert first.outcome_counts() == {"executed": 1, "replayed": 2}
    assert third.outcome_counts() == {"executed": 1, "replayed": 1}


def test_a_held_lock_times_the_check_out_and_the_call_publishes(
    app: Celery, worker_factory: Any, db_url: str, published: list[str]
) -> None:
    """The check waits for no lock longer than its timeout: the call publishes, and the job ends once."""
    job, calls = summary_job(app, "oncelery.t_prod_locked")
    app.conf.oncelery_producer_timeout = 0.2
    holder = create_engine(db_url, poolclass=NullPool)
    with worker_factory(app, concurrency=2):
        first = job.delay(8, "x y").get(timeout=TIMEOUT)
        published.clear()
        with holder.connect() as conn:
            if db_url.startswith("sqlite"):
                conn.exec_driver_sql("BEGIN IMMEDIATE")  # the file's write lock: the producer's count waits
            else:
                conn.execute(text("BEGIN"))
                conn.execute(text("SELECT id FROM task_runs WHERE idempotency_key = 'doc:8' FOR UPDATE"))
            t0 = time.monotonic()
            sent = job.delay(8, "x y")
            waited = time.monotonic() - t0
            assert not isinstance(sent, ProducerReplay)
            assert published == [job.name]
            # Within the cooldown the producer publishes without asking (a down database costs one timeout).
            again = job.delay(8, "x y")
            assert not isinstance(again, ProducerReplay)
            conn.rollback()
        assert sent.get(timeout=TIMEOUT) == again.get(timeout=TIMEOUT) == first
    holder.dispose()
    assert waited < 10, "bounded by the check's timeout, not by the lock"
    assert calls == [8]
    # The timed-out check counted nothing: both duplicates were counted by the worker that answered them.
    assert job.outcome_counts() == {"executed": 1, "replayed": 2}
    assert at_producer(db_url, job.name) == 0


def test_a_database_fault_at_the_check_fails_open_and_the_job_ends_once(
    app: Celery, worker_factory: Any, db_url: str, published: list[str]
) -> None:
    job, calls = summary_job(app, "oncelery.t_prod_fault")

    def refuse(_name: str, _context: dict[str, Any]) -> None:
        raise StoreUnavailable("the claims database went away (injected)")

    with worker_factory(app, concurrency=2):
        with fault_injected("producer_find", refuse):
            first = job.delay(9, "p q")  # a new key: published either way
            repeat = job.delay(9, "p q")
        assert not isinstance(repeat, ProducerReplay)
        assert first.get(timeout=TIMEOUT) == repeat.get(timeout=TIMEOUT) == {"doc": 9, "words": 2}
        # Both calls were published (a worker's in-progress wait re-sends in this process too: at least 2).
        assert published.count(job.name) >= 2
    assert calls == [9]
    assert wait_until(
        lambda: job.outcome_counts().get("replayed", 0) + job.outcome_counts().get("in_progress", 0) >= 1, 10
    )
    assert job.outcome_counts()["executed"] == 1


@pytest.mark.parametrize("fault", FAULTS)
def test_a_killed_connection_or_a_restarted_server_at_the_check_fails_open_and_the_job_ends_once(
    fault: str, pg_db: Db, pg_app: Celery, logs: LogLines, published: list[str]
) -> None:
    """PostgreSQL, a cluster of the test's own: the producer's pooled connection dies right at its check."""
    pg_app.conf.oncelery_producer_dedupe = None
    n = 11
    job = define_job(pg_app, pg_db, f"oncelery.t_prod_{fault}")
    killed: list[int] = []
    with running_worker(pg_app, concurrency=2):
        first = job.delay(n)
        assert first.get(timeout=JOB_TIMEOUT) == expected(n)
        assert isinstance(job.delay(n), ProducerReplay)  # the producer's pool now holds a connection
        published.clear()
        with fault_injected("producer_find", only_once(fault_of(fault, pg_db, killed))):
            again = job.delay(n)
        assert not isinstance(again, ProducerReplay), "a dead connection: the call publishes"
        assert published == [job.name]
        assert_once(pg_db, job, n, again, logs)
    assert killed
    counts = pg_db.counts(job.name)
    assert counts.get("replayed") == 2, counts  # one at the producer, one by the worker after the fault


def only_once(fault: Callable[[], None]) -> Callable[[str, dict[str, Any]], None]:
    """A fault hook that strikes at the first call only."""
    done: list[bool] = []

    def hook(_name: str, _context: dict[str, Any]) -> None:
        if not done:
            done.append(True)
            fault()

    return hook


def test_an_outbox_job_in_progress_is_answered_with_its_own_id_and_tenants_never_answer_each_other(
    app: Celery, worker_factory: Any, db_url: str, published: list[str]
) -> None:
    """The outbox row the relay would re-publish makes a running job recoverable without the call (its task id
    is returned); the same key under another tenant is another run: published, and run."""
    gate, started = threading.Event(), threading.Event()
    calls: list[tuple[str, int]] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_prod_outbox", idempotency_key="o:{n}")
    def slow(self: IdempotentTask, n: int) -> int:
        calls.append((self.request.headers.get("oncelery_tenant") or "", n))
        started.set()
        assert gate.wait(TIMEOUT)
        return n + 100

    with worker_factory(app, concurrency=2):
        with Database(db_url).begin() as conn:
            task_id = outbox.enqueue(conn, slow.s().set(tenant="acme"), 12)
        assert Relay(app, db_url, sweep_interval=None).run_once().published == 1
        assert started.wait(TIMEOUT)
        published.clear()
        dup = slow.apply_async((12,), tenant="acme")
        assert dup.id == task_id, "the outbox row re-sends the job: the call gets the run's own result"
        other = slow.apply_async((12,), tenant="globex")  # same key, another tenant: not this run
        assert other.id != task_id and published == [slow.name]
        gate.set()
        assert dup.get(timeout=TIMEOUT) == other.get(timeout=TIMEOUT) == 112
    assert sorted(calls) == [("acme", 12), ("globex", 12)]
