"""Every argument a run may store is JSON, not only the fingerprinted ones: a message keeps all of them (a kept
message, kept arguments, a dead letter). A non-JSON argument outside the fingerprint is refused at the call, and
one sent around the producer's checks (`app.send_task`) is dead-lettered by the worker: never a run left RUNNING,
never a delivery that vanishes without a run or an outcome.

Real in-process workers on the real Redis broker, both stores.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import select

from oncelery import IdempotentTask, PayloadNotJSON
from oncelery.runs.decisions import REASON_BAD_MESSAGE
from oncelery.store.database import get_engine
from oncelery.store.tables import LETTERS, RUNS
from oncelery.testing import wait_until

WHEN = dt.datetime(2024, 5, 1, 12, 30, tzinfo=dt.UTC)
JOB = 30.0


def stamped(app: Celery, name: str, **options: Any) -> Any:
    """A task keyed and fingerprinted by `doc` alone: `when` is outside the fingerprint, but in every message."""

    @app.task(shared=False, base=IdempotentTask, bind=True, name=name, idempotency_key="d:{doc}",
              fingerprint=("doc",), **options)  # fmt: skip
    def job(self: IdempotentTask, doc: str, when: Any = None) -> str:
        if doc == "f":
            raise ValueError("the body failed")
        return f"{doc} at {when}"

    return job


def rows(db_url: str, table: Any) -> list[dict[str, Any]]:
    with get_engine(db_url).connect() as conn:
        return [dict(r._mapping) for r in conn.execute(select(table))]


def test_a_non_json_argument_outside_the_fingerprint_is_refused_at_the_call(
    app: Celery, db_url: str, published: list[str]
) -> None:
    kept = stamped(app, "oncelery.t_json_kept", keep_arguments=True)
    plain = stamped(app, "oncelery.t_json_plain")
    for task in (kept, plain):
        with pytest.raises(PayloadNotJSON, match=r"argument 'when' is a datetime, not JSON; .*\.isoformat\(\)"):
            task.delay("a", WHEN)
        with pytest.raises(PayloadNotJSON, match="argument 'when' is a datetime"):
            task.apply_async(kwargs={"doc": "a", "when": WHEN})
    assert published == []  # nothing was sent
    assert rows(db_url, RUNS) == [] and rows(db_url, LETTERS) == []
    kept.delay("a", WHEN.isoformat())  # the fix the message names: the same call, with JSON
    assert published == [kept.name]


def test_a_non_json_argument_sent_around_the_checks_is_dead_lettered_and_no_run_stays_running(
    app: Celery, worker_factory: Any, db_url: str
) -> None:
    # Kombu's JSON gives the worker a datetime back: with keep_arguments the claim's insert of the message failed
    # (no run, no outcome); without, the failure's dead letter (holding the message) failed and the run stayed
    # RUNNING. Either way the delivery was acked as a failure with nothing recorded.
    kept = stamped(app, "oncelery.t_json_kept", keep_arguments=True)
    failing = stamped(app, "oncelery.t_json_failing", dead_on=(ValueError,))
    with worker_factory(app, concurrency=2):
        sent = [app.send_task(kept.name, ["k", WHEN]), app.send_task(failing.name, ["f", WHEN])]
        for result in sent:
            with pytest.raises(PayloadNotJSON, match="argument 'when' is a datetime"):
                result.get(timeout=JOB)
        wait_until(lambda: len(rows(db_url, LETTERS)) == 2, timeout=JOB, what="both messages dead-lettered")
    assert rows(db_url, RUNS) == []  # refused before any claim: no run, so none left RUNNING
    assert kept.outcome_counts() == {"dead": 1} and failing.outcome_counts() == {"dead": 1}
    letters = {r["task_name"]: r for r in rows(db_url, LETTERS)}
    for task, doc in ((kept, "k"), (failing, "f")):
        letter = letters[task.name]
        assert letter["reason"] == REASON_BAD_MESSAGE and "'when' is a datetime" in letter["error"]
        # The letter keeps the message as it came (a datetime in kombu's JSON form), so a replay sends the same.
        assert letter["message"]["args"] == [doc, {"__type__": "datetime", "__value__": WHEN.isoformat()}]
