"""Where a step's checkpoint lives: its stored position and its name, on SQLite and PostgreSQL.

A body that catches a step's error leaves a gap, and its retry replays each later step from its own slot; a
step replayed with other arguments at a position is refused (or re-run on request), never another item's
result; one step name called in a loop gets distinct seeds, stable across attempts; a step name over 255
characters is refused before the step runs.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from celery import Celery

from oncelery import ConfigurationError, IdempotentTask, Runs, RunStatus, StepMismatch, step_seed
from oncelery.ops.dead_letters import DeadLetters


class Timeout(Exception):
    """A model call that timed out (the body catches it and falls back)."""


# -- checkpoints by their stored position --------------------------------------------------------------------


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


# -- steps in a loop -----------------------------------------------------------------------------------------


def test_steps_in_a_loop_get_distinct_stable_seeds(app: Celery, db_url: str) -> None:
    """Three calls of one step name get three distinct seeds, the same again on the run's next attempt."""
    seen: list[tuple[int, int]] = []
    fail_third = [True]

    def sample(i: int, seed: int) -> int:
        seen.append((i, seed))
        if i == 2 and fail_third[0]:
            raise RuntimeError("model overloaded")
        return seed

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_loop_seeds", idempotency_key="loop:{n}")
    def loop(self: IdempotentTask, n: int) -> list[int]:
        return [self.step("sample", sample, i) for i in range(3)]

    app.finalize()
    expected = [step_seed(loop.name, "loop:1", name) for name in ("sample", "sample#1", "sample#2")]
    assert len(set(expected)) == 3

    with pytest.raises(RuntimeError, match="overloaded"):
        loop(1)  # the first attempt fails at the third step
    assert seen == list(enumerate(expected))
    fail_third[0] = False
    assert loop(1) == expected  # the second attempt replays two steps and runs the third with its seed
    assert seen == [*enumerate(expected), (2, expected[2])]

    run = Runs(db_url).get(loop.name, "loop:1")
    assert run is not None and run.status is RunStatus.COMPLETED and run.token == 2 and run.result == expected
    assert [s.name for s in Runs(db_url).steps(run.run_id)] == ["sample", "sample", "sample"]


# -- step names ----------------------------------------------------------------------------------------------


def test_too_long_step_name_is_refused_before_the_step_runs(app: Celery, db_url: str) -> None:
    """A step name over 255 characters raises ConfigurationError and its function is never called."""
    called: list[str] = []

    def paid_call(text: str) -> str:
        called.append(text)
        return text.upper()

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_long_step", idempotency_key="ls:{n}")
    def job(self: IdempotentTask, n: int) -> str:
        return str(self.step("s" * 256, paid_call, "hello"))

    app.finalize()
    with pytest.raises(ConfigurationError, match="at most 255 characters"):
        job(1)
    assert called == []
    run = Runs(db_url).get(job.name, "ls:1")
    assert run is not None and run.status is RunStatus.DEAD  # a bad step name never succeeds: dead-lettered
    assert Runs(db_url).steps(run.run_id) == []
