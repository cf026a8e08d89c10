"""G1/G5/G7 through a real in-process worker on a real Redis broker, over SQLite and PostgreSQL."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import insert

from oncelery import IdempotencyConflict, IdempotentTask, ResultNotJSON
from oncelery.models import RunStatus
from oncelery.runs.claims import RunStore
from tests.services import count_rows, effects_table


def test_duplicate_deliveries_run_the_body_once(app: Celery, worker_factory: Any, db_url: str) -> None:
    calls: list[int] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_dup", idempotency_key="item:{item_id}")
    def score(self: IdempotentTask, item_id: int, text: str) -> dict[str, Any]:
        calls.append(item_id)
        with self.effects() as session:
            session.execute(insert(effects_table).values(key=f"item:{item_id}", pid=0))
        return {"item": item_id, "len": len(text)}

    with worker_factory(app, concurrency=4):
        results = [score.delay(7, "hello world") for _ in range(6)]
        values = [r.get(timeout=60) for r in results]

    assert calls == [7]
    assert values == [{"item": 7, "len": 11}] * 6
    store = RunStore(db_url)
    run = store.get("oncelery.t_dup", "item:7")
    assert run is not None and run.status is RunStatus.COMPLETED and run.attempts == 1
    assert count_rows(store.engine, effects_table, "item:7") == 1
    counts = score.outcome_counts()
    assert counts.get("executed") == 1
    # Every delivery has an outcome: the other five were replays, or in-progress waits that then replayed.
    assert counts.get("replayed", 0) == 5


def test_in_flight_duplicate_waits_without_spending_retries(app: Celery, worker_factory: Any) -> None:
    started = threading.Event()
    calls: list[int] = []

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_wait",
        idempotency_key="slow:{n}",
        max_retries=0,
        lease=5,
    )
    def slow(self: IdempotentTask, n: int) -> int:
        calls.append(n)
        started.set()
        time.sleep(2.0)
        return n * 10

    with worker_factory(app, concurrency=4):
        first = slow.delay(4)
        assert started.wait(30)
        second = slow.delay(4)  # arrives while the first holds the claim
        # max_retries=0: had waiting used Celery's retry budget, the second would fail.
        assert second.get(timeout=60) == 40
        assert first.get(timeout=60) == 40

    assert calls == [4]
    counts = slow.outcome_counts()
    assert counts["executed"] == 1 and counts["in_progress"] >= 1 and counts["replayed"] == 1


def test_conflicting_payload_raises_and_first_result_stands(app: Celery, worker_factory: Any, db_url: str) -> None:
    calls: list[str] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_conflict", idempotency_key="doc:{doc_id}")
    def summarize(self: IdempotentTask, doc_id: str, text: str) -> str:
        calls.append(text)
        return text.upper()

    with worker_factory(app):
        assert summarize.delay("d1", "first").get(timeout=60) == "FIRST"
        with pytest.raises(IdempotencyConflict) as info:
            summarize.delay("d1", "second").get(timeout=60)

    assert "doc:d1" in str(info.value) and "text" in str(info.value)
    assert calls == ["first"]
    run = RunStore(db_url).get("oncelery.t_conflict", "doc:d1")
    assert run is not None and run.result == "FIRST"
    assert summarize.outcome_counts()["conflict"] == 1


def test_body_failure_is_retried_by_celery_then_completes(app: Celery, worker_factory: Any, db_url: str) -> None:
    attempts: list[int] = []

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_flaky",
        idempotency_key="flaky:{n}",
        autoretry_for=(RuntimeError,),
        retry_kwargs={"max_retries": 3, "countdown": 0.1},
    )
    def flaky(self: IdempotentTask, n: int) -> int:
        attempts.append(n)
        if len(attempts) < 3:
            raise RuntimeError("model overloaded")
        return n + 1

    with worker_factory(app):
        assert flaky.delay(1).get(timeout=60) == 2

    assert len(attempts) == 3
    run = RunStore(db_url).get("oncelery.t_flaky", "flaky:1")
    assert run is not None and run.status is RunStatus.COMPLETED and run.attempts == 3 and run.token == 3
    counts = flaky.outcome_counts()
    assert counts["failed"] == 2 and counts["executed"] == 1


def test_non_json_result_is_a_typed_error_and_nothing_commits(app: Celery, db_url: str) -> None:
    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_nonjson", idempotency_key="nj:{n}")
    def bad(self: IdempotentTask, n: int) -> Any:
        with self.effects() as session:
            session.execute(insert(effects_table).values(key="nj", pid=0))
        return {"when": object()}

    app.finalize()
    with pytest.raises(ResultNotJSON, match="not JSON-serializable"):
        bad(1)
    store = RunStore(db_url)
    run = store.get("oncelery.t_nonjson", "nj:1")
    assert run is not None and run.status is RunStatus.DEAD and "JSON" in (run.error or "")
    assert count_rows(store.engine, effects_table, "nj") == 0


def test_user_retry_marks_run_failed_so_the_retry_takes_over(app: Celery, worker_factory: Any, db_url: str) -> None:
    seen: list[int] = []

    @app.task(
        shared=False, base=IdempotentTask, bind=True, name="oncelery.t_retry", idempotency_key="r:{n}", max_retries=2
    )
    def once_retry(self: IdempotentTask, n: int) -> str:
        seen.append(self.request.retries)
        if self.request.retries == 0:
            raise self.retry(countdown=0.1)
        return "done"

    with worker_factory(app):
        assert once_retry.delay(3).get(timeout=60) == "done"
    assert seen == [0, 1]
    # self.retry() recorded the first attempt as failed; the retry took the run over (token 2) and completed it.
    run = RunStore(db_url).get("oncelery.t_retry", "r:3")
    assert run is not None and run.status is RunStatus.COMPLETED and run.attempts == 2 and run.token == 2
    assert run.result == "done"
    counts = once_retry.outcome_counts()
    # The retry may arrive a moment before the recorded countdown ends (database clock): it then waits.
    assert counts["failed"] == 1 and counts["executed"] == 1 and set(counts) <= {"failed", "executed", "in_progress"}


def test_fifty_threads_delivering_one_key_run_the_body_once(app: Celery, db_url: str) -> None:
    calls: list[int] = []
    lock = threading.Lock()

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_race", idempotency_key="race:{n}")
    def racy(self: IdempotentTask, n: int) -> dict[str, int]:
        with lock:
            calls.append(n)
        time.sleep(0.2)  # widen the window in which the other 49 arrive
        with self.effects() as session:
            session.execute(insert(effects_table).values(key=f"race:{n}", pid=0))
        return {"n": n, "calls": len(calls)}

    app.finalize()
    barrier = threading.Barrier(50)
    results: list[Any] = []

    def deliver() -> None:
        barrier.wait()
        results.append(racy(5))

    threads = [threading.Thread(target=deliver) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)

    assert calls == [5]
    assert len(results) == 50 and all(r == {"n": 5, "calls": 1} for r in results)
    assert count_rows(RunStore(db_url).engine, effects_table, "race:5") == 1
    assert racy.outcome_counts() == {"executed": 1, "replayed": 49}


def test_per_call_key_reaches_the_worker_and_survives_retry(app: Celery, worker_factory: Any, db_url: str) -> None:
    seen: list[str] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_callkey", max_retries=2)
    def charge(self: IdempotentTask, amount: int) -> int:
        seen.append(self.request.headers["oncelery_key"])
        if len(seen) == 1:
            raise self.retry(countdown=0.1)
        return amount

    with worker_factory(app):
        assert charge.apply_async((10,), idempotency_key="client-key-1").get(timeout=60) == 10
        # Same client key, same payload, sent again later: answered from the stored result.
        assert charge.apply_async((10,), idempotency_key="client-key-1").get(timeout=60) == 10
    assert seen == ["client-key-1", "client-key-1"]
    run = RunStore(db_url).get("oncelery.t_callkey", "client-key-1")
    assert run is not None and run.status is RunStatus.COMPLETED and run.attempts == 2


def test_effects_roll_back_when_the_body_fails(app: Celery, db_url: str) -> None:
    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_rollback", idempotency_key="rb:{n}")
    def half_done(self: IdempotentTask, n: int) -> int:
        with self.effects() as session:
            session.execute(insert(effects_table).values(key="rb", pid=0))
        raise ValueError("model returned garbage")

    app.finalize()
    with pytest.raises(ValueError):
        half_done(1)
    store = RunStore(db_url)
    assert count_rows(store.engine, effects_table, "rb") == 0
    run = store.get("oncelery.t_rollback", "rb:1")
    assert run is not None and run.status is RunStatus.FAILED and "garbage" in (run.error or "")
