"""Edges: call-time refusals, eager mode, loop step seeds, step names, and a hung body (issue items 6-10)."""

from __future__ import annotations

import datetime as dt
import threading
import uuid
from decimal import Decimal
from typing import Any

import pytest
from celery import Celery

from oncelery import (
    ConfigurationError,
    IdempotentTask,
    InProgress,
    InvalidKey,
    LeaseLost,
    PayloadNotJSON,
    Runs,
    RunStatus,
    step_seed,
)
from oncelery.runs.claims import RunStore
from tests.services import wait_for

# -- 6. the caller refuses what the worker would -----------------------------------------------------


def _offline_job(app: Celery, name: str, **options: Any) -> Any:
    @app.task(shared=False, base=IdempotentTask, bind=True, name=name, **options)
    def job(self: IdempotentTask, doc: Any) -> str:
        return str(doc)

    return job


@pytest.mark.parametrize(
    "value",
    [uuid.uuid4(), dt.datetime(2024, 5, 1, 12, 30, tzinfo=dt.UTC), Decimal("1.10")],
    ids=["uuid", "datetime", "decimal"],
)
def test_non_json_argument_is_refused_in_the_caller(value: Any, published: list[str]) -> None:
    """A UUID, datetime or Decimal argument raises PayloadNotJSON at .delay(), and nothing is published."""
    app = Celery("edges-payload", broker="memory://")
    job = _offline_job(app, "oncelery.t_payload")
    with pytest.raises(PayloadNotJSON, match="JSON types"):
        job.delay(value)
    assert published == []
    job.delay("plain-text")  # the control: a JSON argument is published
    assert published == [job.name]
    app.close()


def test_lone_surrogate_in_a_per_call_key_is_refused(published: list[str]) -> None:
    """A per-call idempotency_key holding a lone surrogate raises InvalidKey in the caller."""
    app = Celery("edges-surrogate", broker="memory://")
    job = _offline_job(app, "oncelery.t_surrogate", idempotency_key="doc:{doc}")
    with pytest.raises(InvalidKey, match="surrogate"):
        job.apply_async(("d",), idempotency_key="key-\ud800")
    assert published == []
    app.close()


def test_callable_key_returning_too_long_a_key_is_refused_at_delay(published: list[str]) -> None:
    """A callable idempotency_key that returns 300 characters raises InvalidKey at .delay()."""
    app = Celery("edges-longkey", broker="memory://")
    job = _offline_job(app, "oncelery.t_longkey", idempotency_key=lambda doc: "k" * 300)
    with pytest.raises(InvalidKey, match="300 characters"):
        job.delay("d")
    assert published == []
    app.close()


@pytest.mark.parametrize("option", ["idempotency_key", "tenant"])
def test_callable_option_is_called_with_the_task_arguments(option: str) -> None:
    """A plain function given as idempotency_key or tenant receives the task's arguments (not the task)."""
    app = Celery("edges-callable", broker="memory://")
    job = _offline_job(app, f"oncelery.t_callable_{option}", **{option: lambda doc: f"x-{doc}"})
    app.finalize()
    ident = job.identity_of(("d",), digests=False)
    assert getattr(ident, "key" if option == "idempotency_key" else "tenant") == "x-d"
    app.close()


# -- 7. eager mode -------------------------------------------------------------------------------------


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


# -- 8. steps in a loop ----------------------------------------------------------------------------------


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


# -- 9. step names -----------------------------------------------------------------------------------------


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


# -- 10. a hung body -------------------------------------------------------------------------------------------


def test_hung_body_stops_renewing_and_its_late_completion_is_fenced(app: Celery, db_url: str) -> None:
    """A blocked body stops renewing after max_lease; after a takeover its late completion is refused."""
    gate, started = threading.Event(), threading.Event()

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_hung",
        idempotency_key="hung:{n}",
        lease=1,
        max_lease=2,
    )
    def hung(self: IdempotentTask, n: int) -> str:
        started.set()
        if not gate.wait(60):
            raise TimeoutError("the test never released the body")
        return "late"

    app.finalize()
    outcome: dict[str, Any] = {}

    def deliver() -> None:
        try:
            outcome["result"] = hung(1)
        except BaseException as exc:
            outcome["error"] = exc

    runs, store = Runs(db_url), RunStore(db_url)
    body = threading.Thread(target=deliver, name="hung-delivery", daemon=True)
    body.start()
    try:
        assert started.wait(30)
        first = runs.get(hung.name, "hung:1")
        assert first is not None and first.status is RunStatus.RUNNING and first.lease_expires_at is not None

        def renewed() -> bool:
            run = runs.get(hung.name, "hung:1")
            expires = run.lease_expires_at if run is not None else None
            return expires is not None and expires > first.lease_expires_at

        wait_for(renewed, timeout=10, what="the heartbeat to renew the lease (it lasts 1 s)")
        wait_for(
            lambda: (run := runs.get(hung.name, "hung:1")) is not None and not run.lease_live,
            timeout=15,
            what="the lease of the hung body to expire by the database clock after max_lease",
        )
        assert body.is_alive() and not gate.is_set()  # the body is still blocked: expiry came from max_lease

        taken = store.claim(hung.name, hung.identity_of((1,)), lease=60)
        assert taken.claim is not None and taken.claim.token == 2 and taken.claim.takeover
    finally:
        gate.set()
        body.join(30)
    assert not body.is_alive()

    assert "result" not in outcome
    assert isinstance(outcome.get("error"), LeaseLost), outcome
    run = runs.get(hung.name, "hung:1")
    assert run is not None and run.status is RunStatus.RUNNING and run.token == 2
    assert run.owner == taken.claim.owner and run.result is None and run.lease_live
    assert hung.outcome_counts() == {"lease_lost": 1}


def test_the_renewal_bound_is_max_lease_then_the_hard_then_the_soft_time_limit() -> None:
    """max_lease wins, then the hard time limit (the task's, else the app's), then the soft; none: unbounded."""
    app = Celery(f"bounds-{uuid.uuid4().hex[:6]}")
    app.conf.task_time_limit = 50
    assert _offline_job(app, "oncelery.t_bound_app").max_lease_seconds() == 50.0
    assert _offline_job(app, "oncelery.t_bound_hard", time_limit=30).max_lease_seconds() == 30.0
    assert _offline_job(app, "oncelery.t_bound_soft", soft_time_limit=20).max_lease_seconds() == 50.0
    assert _offline_job(app, "oncelery.t_bound_own", time_limit=30, max_lease=7).max_lease_seconds() == 7.0
    bare = Celery(f"unbounded-{uuid.uuid4().hex[:6]}")
    assert _offline_job(bare, "oncelery.t_bound_none").max_lease_seconds() is None
    bare.conf.task_soft_time_limit = 15
    assert _offline_job(bare, "oncelery.t_bound_app_soft").max_lease_seconds() == 15.0
