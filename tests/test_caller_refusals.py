"""What the caller refuses or settles at call time, before anything is published or waited for.

A payload that is not JSON, a key the worker would refuse (a lone surrogate, too long), callable options
called with the task's arguments; and an eager call on a key held under a live lease, which has no broker to
wait through and so answers at once (InProgress, or None with on_in_progress="skip").
"""

from __future__ import annotations

import datetime as dt
import uuid
from decimal import Decimal
from typing import Any

import pytest
from celery import Celery

from oncelery import IdempotentTask, InProgress, InvalidKey, PayloadNotJSON, Runs, RunStatus
from oncelery.runs.claims import RunStore
from tests.conftest import offline_job

# -- the caller refuses what the worker would ----------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [uuid.uuid4(), dt.datetime(2024, 5, 1, 12, 30, tzinfo=dt.UTC), Decimal("1.10")],
    ids=["uuid", "datetime", "decimal"],
)
def test_non_json_argument_is_refused_in_the_caller(value: Any, published: list[str]) -> None:
    """A UUID, datetime or Decimal argument raises PayloadNotJSON at .delay(), naming the argument and its type,
    and nothing is published."""
    app = Celery("edges-payload", broker="memory://")
    job = offline_job(app, "oncelery.t_payload")
    with pytest.raises(PayloadNotJSON, match=f"argument 'doc' is a {type(value).__name__}, not JSON; pass JSON types"):
        job.delay(value)
    assert published == []
    job.delay("plain-text")  # the control: a JSON argument is published
    assert published == [job.name]
    app.close()


def test_lone_surrogate_in_a_per_call_key_is_refused(published: list[str]) -> None:
    """A per-call idempotency_key holding a lone surrogate raises InvalidKey in the caller."""
    app = Celery("edges-surrogate", broker="memory://")
    job = offline_job(app, "oncelery.t_surrogate", idempotency_key="doc:{doc}")
    with pytest.raises(InvalidKey, match="surrogate"):
        job.apply_async(("d",), idempotency_key="key-\ud800")
    assert published == []
    app.close()


def test_callable_key_returning_too_long_a_key_is_refused_at_delay(published: list[str]) -> None:
    """A callable idempotency_key that returns 300 characters raises InvalidKey at .delay()."""
    app = Celery("edges-longkey", broker="memory://")
    job = offline_job(app, "oncelery.t_longkey", idempotency_key=lambda doc: "k" * 300)
    with pytest.raises(InvalidKey, match="300 characters"):
        job.delay("d")
    assert published == []
    app.close()


@pytest.mark.parametrize("option", ["idempotency_key", "tenant"])
def test_callable_option_is_called_with_the_task_arguments(option: str) -> None:
    """A plain function given as idempotency_key or tenant receives the task's arguments (not the task)."""
    app = Celery("edges-callable", broker="memory://")
    job = offline_job(app, f"oncelery.t_callable_{option}", **{option: lambda doc: f"x-{doc}"})
    app.finalize()
    ident = job.key_of(("d",))
    assert getattr(ident, "key" if option == "idempotency_key" else "tenant") == "x-d"
    app.close()


# -- eager mode: a held key answers at once ------------------------------------------------------------------


def test_eager_call_on_a_held_key_raises_in_progress_at_once(app: Celery, db_url: str) -> None:
    """Eager calls on a key held under a live lease: InProgress at once with "retry", None with "skip".

    Eager mode is the subject here, not a stand-in for a worker: an eager call has no broker to wait
    through, so Oncelery refuses it. The same policies on real workers and Redis are proven by
    test_worker_delivery.py::test_in_flight_duplicate_waits_without_spending_retries ("retry") and
    test_caller_options.py::test_skip_policy_answers_a_running_duplicate_with_none_and_outcome_in_progress."""
    calls: list[str] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_eager_retry", idempotency_key="e:{n}")
    def retrying(self: IdempotentTask, n: int) -> str:
        calls.append("retry")
        return "ran"

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_eager_skip",
        idempotency_key="e:{n}",
        on_in_progress="skip",
    )
    def skipping(self: IdempotentTask, n: int) -> str:
        calls.append("skip")
        return "ran"

    app.finalize()
    store = RunStore(db_url)
    for task in (retrying, skipping):
        assert store.claim(task.name, task.identity_of((1,)), lease=60).claim is not None

    with pytest.raises(InProgress, match="eager"):
        retrying.apply((1,)).get(timeout=10)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    with pytest.raises(InProgress, match="eager"):
        retrying.delay(1)
    assert skipping.apply((1,)).get(timeout=10) is None
    assert skipping.delay(1).get(timeout=10) is None

    assert calls == []
    assert retrying.outcome_counts() == {"in_progress": 2}
    assert skipping.outcome_counts() == {"in_progress": 2}
    for task in (retrying, skipping):
        run = Runs(db_url).get(task.name, "e:1")
        # Still the test's claim, its 60 s lease live (database clock): the calls answered without waiting it out.
        assert run is not None and run.status is RunStatus.RUNNING and run.token == 1 and run.lease_live


def test_a_key_over_the_limit_once_encoded_is_refused_at_call_time_saying_so(app: Celery, published: list[str]) -> None:
    """28 CJK characters are 252 characters of the key once percent-encoded: `.delay()` refuses it in the caller,
    and the message says the length counts the encoded values (not the 28 characters the caller typed)."""
    job = offline_job(app, "oncelery.t_cjk_key", idempotency_key="doc:{doc}")
    with pytest.raises(InvalidKey, match="counted as encoded"):
        job.delay("漢" * 28)
    assert published == []
