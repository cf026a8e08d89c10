"""What the caller sees and chooses: outcome_of, error fields through the JSON result backend, pipeline
re-enqueues, per-call and app-wide options, and the ONCELERY_PASS_THROUGH switch; real workers on Redis.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from sqlalchemy import delete, insert

from oncelery import (
    ConfigurationError,
    IdempotencyConflict,
    IdempotentTask,
    InProgress,
    Outcome,
    Runs,
    outcome_of,
    pipeline,
)
from oncelery.cli import oncelery as oncelery_cli
from oncelery.models import RunStatus
from oncelery.settings import PASS_THROUGH_SEEN
from oncelery.store.database import get_engine
from oncelery.store.tables import SECRETS
from tests.services import count_rows, delete_queue_keys, effects_table, wait_for

# Where the database does not matter (the caller's view lives in Redis), one dialect is enough.
SQLITE_ONLY = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
TIMEOUT = 30


def wait_running(db_url: str, task_name: str, key: str, tenant: str = "") -> None:
    """Wait until the run of (task, tenant, key) is RUNNING: a holder is in its body."""

    def running() -> bool:
        run = Runs(db_url).get(task_name, key, tenant)
        return run is not None and run.status is RunStatus.RUNNING

    wait_for(running, timeout=TIMEOUT, what=f"{task_name}[{key}] RUNNING")


def lease_of_own_run(db_url: str, task_name: str, key: str, tenant: str = "") -> float:
    """Seconds between the run's lease expiry and its last update (the lease it was claimed with)."""
    run = Runs(db_url).get(task_name, key, tenant)
    assert run is not None and run.lease_expires_at is not None and run.updated_at is not None
    return (run.lease_expires_at - run.updated_at).total_seconds()


@contextmanager
def opened(gate: threading.Event) -> Iterator[threading.Event]:
    """Yield `gate`, and set it however the block ends (a held body must never outlive its worker)."""
    try:
        yield gate
    finally:
        gate.set()


# -- outcome_of ----------------------------------------------------------------------------------


@SQLITE_ONLY
def test_outcome_of_is_executed_then_replayed_and_none_for_an_unknown_task_id(
    app: Celery, worker_factory: Any, db_url: str
) -> None:
    calls: list[int] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_out_first", idempotency_key="o:{n}")
    def double(self: IdempotentTask, n: int) -> int:
        calls.append(n)
        return n * 2

    with worker_factory(app):
        first = double.delay(3)
        assert first.get(timeout=TIMEOUT) == 6
        second = double.delay(3)
        assert second.get(timeout=TIMEOUT) == 6

    assert second.id != first.id
    assert outcome_of(first) is Outcome.EXECUTED
    assert outcome_of(second) is Outcome.REPLAYED
    assert outcome_of(app.AsyncResult(str(uuid.uuid4()))) is None
    assert calls == [3]
    run = Runs(db_url).get(double.name, "o:3")
    assert run is not None and run.replays == 1  # the run counts the duplicate it answered (`runs show`)
    # Stored next to the result, with the result's expiry (never a key that outlives it).
    ttl = app.backend.client.ttl(f"celery-task-meta-{first.id}:oncelery")
    assert 0 < ttl <= app.backend.expires


@SQLITE_ONLY
def test_outcome_of_a_retry_that_replayed_a_checkpointed_step_is_resumed(app: Celery, worker_factory: Any) -> None:
    calls: Counter[str] = Counter()

    def work(name: str, value: str) -> str:
        calls[name] += 1
        if name == "second" and calls[name] == 1:
            raise RuntimeError("model timed out")
        return f"{name}({value})"

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_out_resumed",
        idempotency_key="r:{doc}",
        autoretry_for=(RuntimeError,),
        retry_kwargs={"max_retries": 2, "countdown": 0.1},
    )
    def two_steps(self: IdempotentTask, doc: str) -> str:
        first = self.step("first", work, "first", doc)
        return str(self.step("second", work, "second", first))

    with worker_factory(app):
        result = two_steps.delay("d")
        assert result.get(timeout=TIMEOUT) == "second(first(d))"

    assert calls == {"first": 1, "second": 2}  # the retry replayed "first" from its checkpoint
    assert outcome_of(result) is Outcome.RESUMED


@pytest.mark.parametrize("db_url", ["sqlite", "postgresql"], indirect=True)
def test_per_call_raise_refuses_while_a_plain_duplicate_waits_then_replays(
    app: Celery, worker_factory: Any, db_url: str
) -> None:
    gate = threading.Event()
    calls: list[int] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_opt_raise", idempotency_key="h:{n}")
    def held(self: IdempotentTask, n: int) -> int:
        calls.append(n)
        assert gate.wait(TIMEOUT)
        return n + 100

    with worker_factory(app, concurrency=4), opened(gate):
        holder = held.delay(1)
        wait_running(db_url, "oncelery.t_opt_raise", "h:1")
        refused = held.apply_async((1,), on_in_progress="raise")
        waiting = held.delay(1)  # the default policy: re-sent with the same task id until the holder is done
        with pytest.raises(InProgress) as info:
            refused.get(timeout=TIMEOUT)
        wait_for(lambda: outcome_of(waiting) is Outcome.IN_PROGRESS, timeout=TIMEOUT, what="the duplicate waiting")
        assert not waiting.ready()
        gate.set()
        assert waiting.get(timeout=TIMEOUT) == 101
        assert holder.get(timeout=TIMEOUT) == 101

    assert info.value.key == "h:1" and info.value.task_name == "oncelery.t_opt_raise"
    assert outcome_of(refused) is Outcome.IN_PROGRESS
    assert outcome_of(waiting) is Outcome.REPLAYED
    assert outcome_of(holder) is Outcome.EXECUTED
    assert calls == [1]


@pytest.mark.parametrize("db_url", ["sqlite", "postgresql"], indirect=True)
def test_skip_policy_answers_a_running_duplicate_with_none_and_outcome_in_progress(
    app: Celery, worker_factory: Any, db_url: str
) -> None:
    gate = threading.Event()
    calls: list[int] = []

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_out_skip",
        idempotency_key="s:{n}",
        on_in_progress="skip",
    )
    def held(self: IdempotentTask, n: int) -> int:
        calls.append(n)
        assert gate.wait(TIMEOUT)
        return n

    with worker_factory(app, concurrency=4), opened(gate):
        holder = held.delay(5)
        wait_running(db_url, "oncelery.t_out_skip", "s:5")
        duplicate = held.delay(5)
        assert duplicate.get(timeout=TIMEOUT) is None
        assert outcome_of(duplicate) is Outcome.IN_PROGRESS
        assert not holder.ready()
        gate.set()
        assert holder.get(timeout=TIMEOUT) == 5

    assert outcome_of(holder) is Outcome.EXECUTED
    assert calls == [5]


@SQLITE_ONLY
def test_outcome_of_a_waiting_duplicate_that_then_ran_and_failed_is_failed(
    app: Celery, worker_factory: Any, db_url: str
) -> None:
    gate = threading.Event()
    calls: list[int] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_out_failed", idempotency_key="f:{n}")
    def failing(self: IdempotentTask, n: int) -> int:
        calls.append(n)
        assert gate.wait(TIMEOUT)
        raise RuntimeError(f"attempt {len(calls)} failed")

    with worker_factory(app, concurrency=4), opened(gate):
        holder = failing.delay(1)
        wait_running(db_url, "oncelery.t_out_failed", "f:1")
        waiting = failing.delay(1)
        wait_for(lambda: outcome_of(waiting) is Outcome.IN_PROGRESS, timeout=TIMEOUT, what="the duplicate waiting")
        gate.set()
        with pytest.raises(RuntimeError, match="attempt 1 failed"):
            holder.get(timeout=TIMEOUT)
        # The holder's run FAILED: the waiting duplicate's re-send takes it over, runs the body, and fails too.
        with pytest.raises(RuntimeError, match="attempt 2 failed"):
            waiting.get(timeout=TIMEOUT)

    assert calls == [1, 1]
    counts = Runs(db_url).outcome_counts("oncelery.t_out_failed")
    # One wait at least; a loaded machine may re-send the duplicate before the holder's failure is recorded,
    # and each wait is counted (the CI flake of stop 19 counted 2).
    assert counts.get("failed") == 2 and counts.get("in_progress", 0) >= 1 and set(counts) == {"failed", "in_progress"}
    assert outcome_of(holder) is Outcome.FAILED  # is None
    assert outcome_of(waiting) is Outcome.FAILED  # is IN_PROGRESS: the wait's, not the execution's


# -- errors through the JSON result backend ------------------------------------------------------


@SQLITE_ONLY
def test_idempotency_conflict_keeps_its_fields_through_the_json_result_backend(
    app: Celery, worker_factory: Any
) -> None:
    assert app.conf.result_serializer == "json"

    @app.task(
        shared=False, base=IdempotentTask, bind=True, name="oncelery.t_err_fields", idempotency_key="doc:{doc_id}"
    )
    def summarize(self: IdempotentTask, doc_id: int, text: str) -> str:
        return text.upper()

    with worker_factory(app):
        assert summarize.delay(1, "a").get(timeout=TIMEOUT) == "A"
        conflicting = summarize.delay(1, "b")
        with pytest.raises(IdempotencyConflict) as info:
            conflicting.get(timeout=TIMEOUT)

    exc = info.value
    assert type(exc) is IdempotencyConflict
    assert exc.key == "doc:1"
    assert exc.fields == ["text"]
    assert exc.task_name == "oncelery.t_err_fields"
    assert str(exc) == exc.message
    assert str(exc).startswith("oncelery.t_err_fields: idempotency key 'doc:1' was first used with a different")
    assert "fields that differ: text" in str(exc)
    assert outcome_of(conflicting) is Outcome.CONFLICT


# -- pipelines -----------------------------------------------------------------------------------


@SQLITE_ONLY
def test_enqueuing_the_same_pipeline_object_again_resumes_at_the_failed_link(app: Celery, worker_factory: Any) -> None:
    calls: Counter[str] = Counter()
    failing = [False]

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_pipe_summarize")
    def summarize(self: IdempotentTask, text: str) -> str:
        calls["summarize"] += 1
        return text.upper()

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_pipe_keywords")
    def keywords(self: IdempotentTask, summary: str) -> list[str]:
        calls["keywords"] += 1
        return sorted(set(summary.split()))

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_pipe_score")
    def score(self: IdempotentTask, words: list[str]) -> dict[str, Any]:
        calls["score"] += 1
        if failing[0]:
            raise RuntimeError("scorer down")
        return {"words": words, "score": len(words)}

    text = "the cat sat on the mat"
    with worker_factory(app):
        never_failed = pipeline("article:41:v3", summarize.s(text), keywords.s(), score.s())
        expected = never_failed.delay().get(timeout=TIMEOUT)
        assert expected == {"words": ["CAT", "MAT", "ON", "SAT", "THE"], "score": 5}
        calls.clear()

        flow = pipeline("article:42:v3", summarize.s(text), keywords.s(), score.s())
        failing[0] = True
        first = flow.delay()
        with pytest.raises(RuntimeError, match="scorer down"):
            first.get(timeout=TIMEOUT)
        failing[0] = False
        second = flow.delay()
        assert second.id != first.id
        assert second.get(timeout=TIMEOUT) == expected

    assert calls == {"summarize": 1, "keywords": 1, "score": 2}  # links 1-2 answered from stored results
    assert outcome_of(second) is Outcome.EXECUTED
    assert outcome_of(second.parent) is Outcome.REPLAYED
    assert outcome_of(second.parent.parent) is Outcome.REPLAYED


# -- per-call options ----------------------------------------------------------------------------


@SQLITE_ONLY
@pytest.mark.parametrize(
    ("option", "named"),
    [({"lease": 0.1}, "lease=0.1"), ({"on_in_progress": "bogus"}, "on_in_progress='bogus'")],
    ids=["lease-below-minimum", "unknown-policy"],
)
def test_a_bad_per_call_option_raises_configuration_error_at_call_time(
    app: Celery, published: list[str], option: dict[str, Any], named: str
) -> None:
    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_opt_bad", idempotency_key="b:{n}")
    def job(self: IdempotentTask, n: int) -> int:
        return n

    with pytest.raises(ConfigurationError, match=f"\\(this call\\): {named.replace('.', '[.]')}"):
        job.apply_async((1,), **option)
    assert published == []  # refused in the caller: nothing reached the broker


@pytest.mark.parametrize("db_url", ["sqlite", "postgresql"], indirect=True)
def test_a_per_call_lease_is_the_lease_of_that_call_only(app: Celery, worker_factory: Any, db_url: str) -> None:
    @app.task(
        shared=False, base=IdempotentTask, bind=True, name="oncelery.t_opt_lease", idempotency_key="l:{n}", lease=60
    )
    def measure(self: IdempotentTask, n: int) -> float:
        return lease_of_own_run(db_url, "oncelery.t_opt_lease", f"l:{n}")

    with worker_factory(app):
        per_call = measure.apply_async((1,), lease=300).get(timeout=TIMEOUT)
        task_default = measure.delay(2).get(timeout=TIMEOUT)

    assert 295 <= per_call <= 305
    assert 55 <= task_default <= 65


# -- app-wide defaults ---------------------------------------------------------------------------


@SQLITE_ONLY
def test_app_wide_skip_and_lease_apply_unless_the_task_sets_its_own(
    app: Celery, worker_factory: Any, db_url: str
) -> None:
    app.conf.oncelery_on_in_progress = "skip"
    app.conf.oncelery_lease = 300
    gate = threading.Event()

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_app_plain", idempotency_key="p:{n}")
    def plain(self: IdempotentTask, n: int) -> float:
        assert gate.wait(TIMEOUT)
        return lease_of_own_run(db_url, "oncelery.t_app_plain", f"p:{n}")

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_app_raise",
        idempotency_key="q:{n}",
        on_in_progress="raise",
    )
    def own_policy(self: IdempotentTask, n: int) -> int:
        assert gate.wait(TIMEOUT)
        return n

    with worker_factory(app, concurrency=4), opened(gate):
        plain_holder, raise_holder = plain.delay(1), own_policy.delay(1)
        wait_running(db_url, "oncelery.t_app_plain", "p:1")
        wait_running(db_url, "oncelery.t_app_raise", "q:1")
        skipped = plain.delay(1)
        refused = own_policy.delay(1)
        assert skipped.get(timeout=TIMEOUT) is None
        with pytest.raises(InProgress):
            refused.get(timeout=TIMEOUT)
        gate.set()
        app_lease = plain_holder.get(timeout=TIMEOUT)
        assert raise_holder.get(timeout=TIMEOUT) == 1

    assert outcome_of(skipped) is Outcome.IN_PROGRESS
    assert outcome_of(refused) is Outcome.IN_PROGRESS
    assert 295 <= app_lease <= 305  # app.conf.oncelery_lease, not the 60 s default


@SQLITE_ONLY
def test_app_wide_tenant_resolver_puts_runs_in_its_tenant(app: Celery, worker_factory: Any, db_url: str) -> None:
    seen: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def tenant_of(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        seen.append((name, args, kwargs))
        return "acme"

    app.conf.oncelery_tenant = tenant_of

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_app_tenant", idempotency_key="t:{n}")
    def job(self: IdempotentTask, n: int) -> int:
        return n

    with worker_factory(app):
        assert job.delay(7).get(timeout=TIMEOUT) == 7

    assert seen == [("oncelery.t_app_tenant", (7,), {})]
    runs = Runs(db_url)
    run = runs.get("oncelery.t_app_tenant", "t:7", "acme")
    assert run is not None and run.status is RunStatus.COMPLETED and run.tenant == "acme"
    assert runs.get("oncelery.t_app_tenant", "t:7") is None
    assert [r.key for r in runs.list(tenant="acme")] == ["t:7"]


@SQLITE_ONLY
def test_a_misspelt_app_setting_makes_delay_raise_naming_it(app: Celery, published: list[str], redis_url: str) -> None:
    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_app_typo", idempotency_key="y:{n}")
    def job(self: IdempotentTask, n: int) -> int:
        return n

    app.conf.oncelery_leese = 5
    try:
        with pytest.raises(ConfigurationError, match="unknown Oncelery setting\\(s\\) oncelery_leese in"):
            job.delay(1)
        assert published == []
    finally:
        del app.conf["oncelery_leese"]
    try:
        job.delay(1)  # the fixed configuration sends
        assert published == ["oncelery.t_app_typo"]
    finally:
        delete_queue_keys(redis_url, app.conf.task_default_queue)


@SQLITE_ONLY
def test_a_misspelt_app_setting_is_refused_for_a_task_with_its_own_tenant_too(
    app: Celery, published: list[str], redis_url: str
) -> None:
    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_app_typo_tenant",
        idempotency_key="y:{n}",
        tenant="acme",
        lease=30,
        on_in_progress="skip",
    )
    def job(self: IdempotentTask, n: int) -> int:
        return n

    app.conf.oncelery_leese = 5
    try:
        with pytest.raises(ConfigurationError, match="oncelery_leese"):
            job.delay(1)
        assert published == []
    finally:
        del app.conf["oncelery_leese"]
        delete_queue_keys(redis_url, app.conf.task_default_queue)


# -- ONCELERY_PASS_THROUGH -----------------------------------------------------------------------


@SQLITE_ONLY
def test_pass_through_direct_call_runs_plainly_with_committed_effects(
    app: Celery, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ONCELERY_PASS_THROUGH", "1")
    steps: list[str] = []

    def summarize(text: str) -> str:
        steps.append(text)
        return text.upper()

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_pass_direct", idempotency_key="d:{n}")
    def job(self: IdempotentTask, n: int, text: str) -> str:
        summary = str(self.step("summarize", summarize, text))
        with self.effects() as session:
            session.execute(insert(effects_table).values(key=f"d:{n}", pid=os.getpid()))
        return summary

    app.finalize()
    assert job(1, "abc") == "ABC"
    assert job(1, "abc") == "ABC"  # no claim: the same key runs again

    assert steps == ["abc", "abc"]  # the step was a plain call each time
    assert count_rows(get_engine(db_url), effects_table, "d:1") == 2  # each effects() block committed
    assert Runs(db_url).list(task_name="oncelery.t_pass_direct") == []
    assert Runs(db_url).outcome_counts("oncelery.t_pass_direct") == {}


@pytest.mark.parametrize("db_url", ["sqlite", "postgresql"], indirect=True)
def test_pass_through_worker_is_recorded_and_runs_list_warns(
    app: Celery, worker_factory: Any, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = get_engine(db_url)
    forget = delete(SECRETS).where(SECRETS.c.name == PASS_THROUGH_SEEN)
    with engine.begin() as conn:  # PostgreSQL keeps oncelery_secrets across tests
        conn.execute(forget)
    calls: list[int] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_pass_worker", idempotency_key="w:{n}")
    def job(self: IdempotentTask, n: int) -> int:
        calls.append(n)
        return n

    def runs_list() -> str:
        done = CliRunner().invoke(oncelery_cli, ["--database-url", db_url, "runs", "list"], catch_exceptions=False)
        assert done.exit_code == 0, done.output
        return str(done.output)

    try:
        assert Runs(db_url).pass_through_seen() is None
        assert "WARNING" not in runs_list()
        monkeypatch.setenv("ONCELERY_PASS_THROUGH", "1")
        with worker_factory(app):
            assert job.delay(3).get(timeout=TIMEOUT) == 3
            assert job.delay(3).get(timeout=TIMEOUT) == 3

        assert calls == [3, 3]  # unclaimed: no dedup
        assert Runs(db_url).list(task_name="oncelery.t_pass_worker") == []
        seen = Runs(db_url).pass_through_seen()
        assert seen is not None and f"(pid {os.getpid()})" in seen and " UTC on " in seen
        warning = [line for line in runs_list().splitlines() if line.startswith("WARNING")]
        assert warning == [
            f"WARNING: a worker ran with ONCELERY_PASS_THROUGH on (last: {seen}): its jobs ran unclaimed"
        ]
    finally:
        with engine.begin() as conn:
            conn.execute(forget)
