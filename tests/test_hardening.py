"""Checkpoints by stored position, the fence inside effects(), expired entity holders, retry countdowns.

Each test fails on the code before these fixes; each runs on SQLite and PostgreSQL, most through a real
in-process worker on the real Redis broker.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import insert

from oncelery import IdempotentTask, LeaseLost, Runs, RunStatus, StepMismatch
from oncelery.ops.dead_letters import DeadLetters
from oncelery.runs.claims import RunStore
from oncelery.runs.keys import Identity
from oncelery.testing import expire_lease
from tests.services import count_rows, effects_table, wait_for


class Timeout(Exception):
    """A model call that timed out (the body catches it and falls back)."""


def expire(db_url: str, task_name: str, key: str) -> None:
    """Move a run's lease into the past by the database clock (as if its holder froze): the kit's helper."""
    expire_lease(db_url, task_name, key)


# -- 2. checkpoints by their stored position ------------------------------------------------------


def test_a_caught_step_failure_keeps_later_checkpoints_in_their_slots(
    app: Celery, worker_factory: Any, db_url: str
) -> None:
    """A body that catches a step's error leaves a gap; the retry replays each step from its own slot."""
    calls: Counter[str] = Counter()

    def work(name: str, value: str) -> str:
        calls[name] += 1
        if name == "flaky":
            raise Timeout("model timed out")
        if name == "last" and calls[name] == 1:
            raise RuntimeError("fail once after the gap")
        return f"{name}({value})"

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_gap",
        idempotency_key="gap:{doc}",
        autoretry_for=(RuntimeError,),
        retry_kwargs={"countdown": 0, "max_retries": 3},
        lease=5,
    )
    def gappy(self: IdempotentTask, doc: str) -> str:
        first = self.step("first", work, "first", doc)
        try:
            middle = self.step("flaky", work, "flaky", first)
        except Timeout:
            middle = "fallback"
        second = self.step("second", work, "second", middle)
        return str(self.step("last", work, "last", second))

    with worker_factory(app):
        assert gappy.delay("d").get(timeout=90) == "last(second(fallback))"

    # first and second replayed from their own positions on the retry; only the failed step ran again.
    assert calls == {"first": 1, "flaky": 2, "second": 1, "last": 2}
    run = Runs(db_url).get("oncelery.t_gap", "gap:d")
    assert run is not None and run.status is RunStatus.COMPLETED and run.token == 2
    assert [(s.position, s.name) for s in Runs(db_url).steps(run.run_id)] == [(0, "first"), (2, "second"), (3, "last")]
    assert gappy.outcome_counts().get("lease_lost", 0) == 0


def test_a_replay_with_other_arguments_at_a_position_is_refused_or_rerun(db_url: str) -> None:
    """A loop whose items changed order never returns another item's checkpoint."""
    app = Celery("args-digest", broker="memory://")  # the replay's message is published, never consumed
    app.conf.oncelery_database_url = db_url
    seen: list[str] = []
    order = {"items": ["a", "b"], "fail": True, "rerun": False}

    def handle(item: str) -> str:
        seen.append(item)
        return item.upper()

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_args", idempotency_key="loop:{n}")
    def loop(self: IdempotentTask, n: int) -> list[str]:
        out = [self.step("item", handle, item, rerun_on_change=order["rerun"]) for item in order["items"]]
        if order["fail"]:
            raise RuntimeError("fail after the checkpoints")
        return out

    app.finalize()
    with pytest.raises(RuntimeError):
        loop(1)
    order.update(items=["b", "a"], fail=False)
    with pytest.raises(StepMismatch, match="arguments"):
        loop(1)
    # A StepMismatch can never succeed on the same code: the run is DEAD until the code is fixed and replayed.
    letters = DeadLetters(db_url).list(task_name="oncelery.t_args")
    assert [(letter.reason, letter.run_status) for letter in letters] == [("never_succeeds", RunStatus.DEAD)]
    order.update(rerun=True)
    assert [letter.key for letter in DeadLetters(db_url).replay(app, letters).replayed] == ["loop:1"]
    assert loop(1) == ["B", "A"]  # re-run with the new arguments, never ["A", "B"] from the old slots
    assert seen == ["a", "b", "b", "a"]


# -- 3. the fence holds inside effects() -----------------------------------------------------------


def test_a_users_commit_inside_effects_cannot_escape_the_fence(db_url: str) -> None:
    """A zombie that calls session.commit() in effects() still has its writes rolled back."""
    app = Celery("zombie-commit")
    app.conf.oncelery_database_url = db_url
    store = RunStore(db_url)

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_zcommit", idempotency_key="z:{n}")
    def charge(self: IdempotentTask, n: int) -> str:
        # Another worker takes the run over (this holder's lease expired): this holder is now a zombie that
        # does not know it yet. (Taken over first: on SQLite an open effects transaction holds the one
        # writer lock, so no takeover could happen while it is open.)
        expire(db_url, "oncelery.t_zcommit", f"z:{n}")
        taken = store.claim("oncelery.t_zcommit", self.identity_of((n,)), lease=30)
        assert taken.claim is not None and taken.claim.token == 2
        with self.effects() as session:
            session.execute(insert(effects_table).values(key=f"z:{n}", pid=1))
            session.commit()  # a user's commit: must not reach the database on its own
        # Nothing visible outside the run's transaction.
        assert count_rows(store.read_engine, effects_table, f"z:{n}") == 0
        return "charged"

    app.finalize()
    with pytest.raises(LeaseLost):
        charge(1)
    assert count_rows(store.engine, effects_table, "z:1") == 0


def test_each_effects_block_is_a_savepoint(db_url: str) -> None:
    """A caught error in the second block rolls back that block only; the first block's rows commit."""
    app = Celery("savepoints")
    app.conf.oncelery_database_url = db_url

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_savepoint", idempotency_key="s:{n}")
    def two_blocks(self: IdempotentTask, n: int) -> str:
        with self.effects() as session:
            session.execute(insert(effects_table).values(key=f"s:{n}:first", pid=1))
        try:
            with self.effects() as session:
                session.execute(insert(effects_table).values(key=f"s:{n}:second", pid=1))
                raise ValueError("the second block fails and is caught")
        except ValueError:
            pass
        return "done"

    app.finalize()
    assert two_blocks(1) == "done"
    engine = RunStore(db_url).engine
    assert count_rows(engine, effects_table, "s:1:first") == 1
    assert count_rows(engine, effects_table, "s:1:second") == 0
    run = Runs(db_url).get("oncelery.t_savepoint", "s:1")
    assert run is not None and run.status is RunStatus.COMPLETED


# -- 4. an expired holder never blocks an entity ---------------------------------------------------


def test_an_expired_entity_holder_does_not_block_the_next_version(
    app: Celery, worker_factory: Any, db_url: str
) -> None:
    """Version 2 runs although version 1 was left RUNNING by a dead holder; version 1 is demoted."""

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_entity",
        idempotency_key="doc:{doc}:v{version}",
        concurrency_key="doc:{doc}",
        lease=5,
    )
    def score(self: IdempotentTask, doc: str, version: int) -> str:
        return f"{doc}@{version}"

    app.finalize()
    store = RunStore(db_url)
    dead = store.claim("oncelery.t_entity", score.identity_of(("a", 1)), lease=5, concurrency_key="doc:a")
    assert dead.claim is not None
    expire(db_url, "oncelery.t_entity", "doc:a:v1")
    with worker_factory(app):
        assert score.delay("a", 2).get(timeout=60) == "a@2"
    v1 = Runs(db_url).get("oncelery.t_entity", "doc:a:v1")
    assert v1 is not None and v1.status is RunStatus.FAILED
    # The dead holder is fenced out: its completion is refused.
    with pytest.raises(LeaseLost):
        store.complete(dead.claim, "zombie")


def test_a_live_entity_holder_still_blocks(db_url: str) -> None:
    """The demotion applies only to an expired lease: a live holder keeps its entity."""
    store = RunStore(db_url)
    live = store.claim("oncelery.t_entity2", Identity("doc:b:v1", "f1", {}), lease=30, concurrency_key="doc:b")
    assert live.claim is not None
    second = store.claim("oncelery.t_entity2", Identity("doc:b:v2", "f2", {}), lease=30, concurrency_key="doc:b")
    assert second.decision.value == "entity_busy"


# -- 8. retries keep their countdown ----------------------------------------------------------------


def test_a_retry_countdown_holds_off_duplicates(app: Celery, worker_factory: Any, db_url: str) -> None:
    """self.retry(countdown=4): a duplicate arriving meanwhile waits; the body runs again only after it."""
    runs: list[float] = []

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_countdown",
        idempotency_key="c:{n}",
        max_retries=3,
    )
    def paid(self: IdempotentTask, n: int) -> int:
        runs.append(time.monotonic())
        if len(runs) == 1:
            raise self.retry(countdown=4)
        return n

    with worker_factory(app, concurrency=4):
        first = paid.delay(5)
        wait_for(lambda: runs, timeout=60, what="the first attempt")
        run = wait_for(
            lambda: (
                (r := Runs(db_url).get("oncelery.t_countdown", "c:5")) is not None
                and r.status is RunStatus.FAILED
                and r
            ),
            timeout=60,
            what="the run recorded FAILED with its countdown",
        )
        assert run.retry_wait and run.retries == 1
        duplicates = [paid.delay(5) for _ in range(3)]
        assert [d.get(timeout=90) for d in duplicates] == [5, 5, 5]
        assert first.get(timeout=90) == 5

    assert len(runs) == 2  # two paid calls in all, not one per waiting copy
    assert runs[1] - runs[0] >= 3.5  # the countdown held (database clock; a little slack for clock reads)
    counts = paid.outcome_counts()
    assert counts.get("executed", 0) + counts.get("resumed", 0) == 1


def test_retries_are_counted_per_run_not_per_message(db_url: str) -> None:
    """A new message for a run that spent its retries does not get a fresh allowance."""
    app = Celery("per-run-retries")
    app.conf.oncelery_database_url = db_url
    app.conf.task_always_eager = False
    attempts: list[int] = []
    barrier = threading.Event()

    @app.task(
        shared=False, base=IdempotentTask, bind=True, name="oncelery.t_budget", idempotency_key="b:{n}", max_retries=1
    )
    def flaky(self: IdempotentTask, n: int) -> int:
        attempts.append(self.request.retries)
        barrier.set()
        return n

    app.finalize()
    store = RunStore(db_url)
    ident = flaky.identity_of((1,))
    claimed = store.claim("oncelery.t_budget", ident, lease=30)
    assert claimed.claim is not None
    assert store.fail(claimed.claim, "retry requested", retry_in=0.0)
    # The run has spent one retry; a fresh message (request.retries == 0) runs with the run's count.
    assert flaky(1) == 1
    assert attempts == [1]


# -- 7. a worker that meets an identity error says so ------------------------------------------------


def test_a_worker_records_an_outcome_for_a_message_without_an_identity(
    app: Celery, worker_factory: Any, db_url: str
) -> None:
    """A message the caller-side check never saw (sent by name) with a key too long: counted, with the reason."""

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_noident", idempotency_key="k:{doc}")
    def job(self: IdempotentTask, doc: str) -> str:
        return doc

    with worker_factory(app):
        result = app.send_task("oncelery.t_noident", args=["x" * 300])
        with pytest.raises(Exception, match="255"):
            result.get(timeout=60)
    # It can never succeed: dead-lettered without a run (nothing to replay until the message is fixed).
    assert job.outcome_counts() == {"dead": 1}
    assert Runs(db_url).list(task_name="oncelery.t_noident") == []
    letters = DeadLetters(db_url).list(task_name="oncelery.t_noident")
    assert [(x.reason, x.run_id, x.message["args"]) for x in letters] == [("bad_message", None, ["x" * 300])]
