"""What a user's own test needs from oncelery.testing, on a real in-process worker, on SQLite and PostgreSQL:
a duplicate storm asserted without counting its timing-dependent in_progress re-checks; a step failing once with
the user's own error, so the task's `autoretry_for` retries it; and `self.run_id` under the pass-through switch.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from oncelery import IdempotentTask
from oncelery.errors import ConfigurationError
from oncelery.testing import (
    ANY,
    OnceleryDb,
    assert_outcomes,
    assert_ran_once,
    assert_steps,
    deliver_concurrently,
    fail_step_once,
    wait_until,
)
from tests.conftest import ON_SQLITE

TIMEOUT = 30


class Flaky(Exception):
    """The user's own transient error, the one their task's `autoretry_for` retries."""


def test_a_duplicate_storm_is_asserted_with_any_count_of_in_progress(
    app: Celery, db_url: str, worker_factory: Any
) -> None:
    db = OnceleryDb(db_url)

    @app.task(base=IdempotentTask, bind=True, shared=False, name="kit.storm", idempotency_key="storm:{n}")
    def storm(self: IdempotentTask, n: int) -> int:
        # Held until a duplicate has found the key running: the storm always has re-checks, as a slow task has.
        wait_until(lambda: db.outcome_counts("kit.storm").get("in_progress"), TIMEOUT, what="a re-check")
        return n

    with worker_factory(app):
        results = deliver_concurrently(storm, 3, times=10)
        assert [r.get(timeout=TIMEOUT) for r in results] == [3] * 10
    assert_ran_once(db, storm, "storm:3")
    counts = assert_outcomes(db, storm, executed=1, replayed=9, in_progress=ANY)
    assert counts["in_progress"] >= 1, counts
    assert_outcomes(db, storm, executed=1, replayed=9, ignore=("in_progress",))
    assert_outcomes(db, storm, executed=1, replayed=9, ignore="in_progress")
    assert_outcomes(db, storm, executed=1, replayed=9, in_progress=ANY, conflict=ANY)  # ANY includes none
    with pytest.raises(AssertionError, match="any count of in_progress"):  # the other counts are still exact
        assert_outcomes(db, storm, executed=1, replayed=8, in_progress=ANY)
    with pytest.raises(AssertionError):  # without ANY, in_progress is counted exactly (here: not zero)
        assert_outcomes(db, storm, executed=1, replayed=9)
    with pytest.raises(ConfigurationError, match=r"in_progres is no outcome; use one of .*in_progress"):
        assert_outcomes(db, storm, executed=1, replayed=9, in_progres=ANY)


def test_fail_step_once_raises_the_users_error_so_autoretry_retries_it(
    app: Celery, db_url: str, worker_factory: Any
) -> None:
    db = OnceleryDb(db_url)

    @app.task(
        base=IdempotentTask,
        bind=True,
        shared=False,
        name="kit.retrying",
        idempotency_key="retrying:{n}",
        autoretry_for=(Flaky,),
        retry_kwargs={"countdown": 0, "max_retries": 1},
    )
    def retrying(self: IdempotentTask, n: int) -> int:
        fetched = self.step("fetch", lambda: n)
        return int(self.step("score", lambda: fetched * 10))

    with worker_factory(app):
        with fail_step_once(retrying, "score", exc=Flaky) as failed:  # a class: built with the kit's message
            assert retrying.delay(1).get(timeout=TIMEOUT) == 10  # retried by the task's own policy
        assert failed == ["retrying:1"]
        with fail_step_once(retrying, "score", exc=Flaky("model timed out")) as failed:  # an instance: as given
            assert retrying.delay(2).get(timeout=TIMEOUT) == 20
        assert failed == ["retrying:2"]
    for key in ("retrying:1", "retrying:2"):
        assert_ran_once(db, retrying, key)
        assert_steps(db, retrying, key, executed=["score"], replayed=["fetch"])


@ON_SQLITE  # no database is read: the body runs unclaimed
def test_run_id_is_none_in_pass_through_and_named_when_read_outside_a_body(
    app: Celery, oncelery_pass_through: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    @app.task(base=IdempotentTask, bind=True, shared=False, name="kit.tagged", idempotency_key="tagged:{n}")
    def tagged(self: IdempotentTask, n: int) -> dict[str, Any]:
        return {"n": self.step("double", lambda: n * 2), "run_id": self.run_id}

    assert tagged(4) == {"n": 8, "run_id": None}  # a unit test of the body: no run, so no run id
    monkeypatch.delenv("ONCELERY_PASS_THROUGH")
    with pytest.raises(ConfigurationError, match=r"kit.tagged: self.run_id can only be used inside the task body"):
        _ = tagged.run_id  # genuine misuse: read outside any body
