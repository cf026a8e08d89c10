"""G8 by breaking the database at every call site of a delivery (issue 8, item 1).

"A database error anywhere on a delivery's path (disconnect, restart, lock timeout) re-sends or requeues the
delivery; it is never acked as a failure, and a run is never left RUNNING with its message gone. Each case
ends with exactly one effect per job and a recorded outcome."

A real in-process Celery worker (threads pool, real Redis broker) runs the jobs against a throwaway
PostgreSQL cluster that the tests start, restart, stop and kill the backends of (tests/pg_cluster.py), never
the shared server. A named fault point (`oncelery.faults`) injects each fault the FIRST time a delivery
reaches that stage; then the test waits for the run to complete and counts: one effect row, a COMPLETED run,
executed-or-resumed counted once, nothing counted as failed, and the caller gets the job's value.
"""

from __future__ import annotations

import logging
import os
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from celery import Celery
from sqlalchemy import create_engine, insert, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from oncelery import CELERY_DELIVERY_DEFAULTS, IdempotentTask, Runs, RunStatus, RunView, StoreError, model_call
from oncelery.models.migrate import JOBS, upgrade
from oncelery.runs.faults import fault_injected
from oncelery.settings import ENV_SQLITE_BUSY_TIMEOUT, sqlite_busy_timeout_ms
from oncelery.store.database import dispose_engines, get_engine
from tests import services
from tests.conftest import close_app, running_worker
from tests.pg_cluster import PgCluster, pg_cluster  # noqa: F401  (the module's cluster fixture)
from tests.services import effects_table, executions_table, wait_for

LEASE = 2.0  # small, so a re-sent delivery takes an abandoned run over within seconds
JOB_TIMEOUT = 90.0  # generous bound for one faulted job on a loaded 2-core machine
STAGES = ("claim", "load_checkpoints", "step_save", "effects_flush", "complete", "record_failure")
FAULTS = ("terminate", "restart")
SOAK_JOBS = 200
SOAK_DEADLINE = 240.0
T = TypeVar("T")


# -- databases and apps ----------------------------------------------------------------------------------


def migrate(url: str) -> Engine:
    """Migrate `url` to head (framework and jobs branches) and create the test tables."""
    engine = get_engine(url)
    upgrade(engine)
    upgrade(engine, branch=JOBS)
    services.test_metadata.create_all(engine)
    return engine


def retrying(fn: Callable[[], T], what: str, timeout: float = 60.0) -> T:
    """Call `fn` until it gets past a database fault (a killed connection, a restarting server)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except (StoreError, DBAPIError) as exc:
            if time.monotonic() > deadline:
                exc.add_note(f"(the test kept failing for {timeout}s while {what})")
                raise
            time.sleep(0.1)


@dataclass
class Db:
    """One test's claims database: its URL, and an observer engine of its own that never pools a dead socket."""

    url: str
    name: str = ""
    cluster: PgCluster | None = None
    observer: Engine = field(init=False)

    def __post_init__(self) -> None:
        self.observer = create_engine(self.url, poolclass=NullPool)

    def rows(self, table: Any, key: str) -> int:
        return retrying(lambda: services.count_rows(self.observer, table, key), f"counting {table.name}")

    def run(self, task_name: str, key: str) -> RunView | None:
        return retrying(lambda: Runs(self.url).get(task_name, key), "reading the run")

    def counts(self, task_name: str) -> dict[str, int]:
        return retrying(lambda: Runs(self.url).outcome_counts(task_name), "reading outcomes")

    def completed(self, task_name: str, key: str) -> bool:
        """Whether the run is COMPLETED, read on the observer's own connection.

        Polling never uses the worker's pools (the in-process worker shares this process's engines): a poll
        that met a dead pooled socket first would invalidate the pool and heal it before the worker's
        statement reached the fault.
        """
        stmt = text("SELECT status FROM task_runs WHERE task_name = :t AND idempotency_key = :k")
        try:
            with self.observer.connect() as conn:
                return bool(conn.execute(stmt, {"t": task_name, "k": key}).scalar() == RunStatus.COMPLETED.value)
        except DBAPIError:
            return False

    def record(self, table: Any, key: str) -> None:
        """Insert one (key, pid) row in a transaction of its own, outliving the run's (retried past faults)."""

        def once() -> None:
            with self.observer.begin() as conn:
                conn.execute(insert(table).values(key=key, pid=os.getpid()))

        retrying(once, f"recording {key}")

    def close(self) -> None:
        self.observer.dispose()


@pytest.fixture
def pg_db(pg_cluster: PgCluster) -> Iterator[Db]:  # noqa: F811
    """A fresh, migrated database (faults_<n>) on the throwaway cluster; engines closed and it dropped after."""
    if not pg_cluster.running():  # a previous test that failed while the server was down
        pg_cluster.start()
    name, url = pg_cluster.create_database()
    migrate(url)
    db = Db(url, name, pg_cluster)
    try:
        yield db
    finally:
        db.close()
        dispose_engines()
        if not pg_cluster.running():
            pg_cluster.start()
        pg_cluster.drop_database(name)


@pytest.fixture
def sqlite_db(tmp_path: Path) -> Iterator[Db]:
    """A fresh, migrated SQLite claims database file."""
    url = f"sqlite:///{tmp_path / 'claims.db'}"
    migrate(url)
    db = Db(url)
    try:
        yield db
    finally:
        db.close()
        dispose_engines()


def make_app(url: str, redis_url: str) -> Celery:
    """A Celery app as tests.conftest's `app` fixture makes it, with `url` as the claims database."""
    app = Celery(f"faults-{os.getpid()}")
    app.conf.update(
        **CELERY_DELIVERY_DEFAULTS,
        broker_url=redis_url,
        result_backend=redis_url,
        oncelery_database_url=url,
        task_default_queue=services.unique_queue(),
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    return app


@contextmanager
def app_on(db: Db, redis_url: str) -> Iterator[Celery]:
    app = make_app(db.url, redis_url)
    try:
        yield app
    finally:
        queue = app.conf.task_default_queue
        close_app(app)
        services.delete_queue_keys(redis_url, queue)


@pytest.fixture
def pg_app(pg_db: Db, redis_url: str) -> Iterator[Celery]:
    with app_on(pg_db, redis_url) as app:
        yield app


@pytest.fixture
def sqlite_app(sqlite_db: Db, redis_url: str) -> Iterator[Celery]:
    with app_on(sqlite_db, redis_url) as app:
        yield app


# -- the job ---------------------------------------------------------------------------------------------


def job_key(n: int) -> str:
    return f"fault:{n}"


def expected(n: int) -> dict[str, int]:
    return {"n": n, "first": 2 * n, "second": 2 * n + 1}


def define_job(
    app: Celery,
    db: Db,
    name: str,
    *,
    fail_once: bool = False,
    effects: bool = True,
    step_seconds: float = 0.0,
    in_effects: Callable[[], None] | None = None,
) -> Any:
    """An IdempotentTask: two checkpointed steps, then one effect row; every execution counted outside the run.

    `fail_once`: the body raises once (after its steps) the first time it runs, then succeeds.
    `effects=False`: no effects() block (the stored result is the job's only effect).
    `in_effects`: called inside the effects() block, before its first statement.
    """
    failures = [1 if fail_once else 0]
    lock = threading.Lock()

    def first(key: str, n: int) -> int:
        db.record(executions_table, f"{key}/first")
        if step_seconds:
            time.sleep(step_seconds)
        return 2 * n

    def second(key: str, value: int) -> int:
        db.record(executions_table, f"{key}/second")
        return value + 1

    @app.task(shared=False, base=IdempotentTask, bind=True, name=name, idempotency_key="fault:{n}", lease=LEASE)
    def job(self: IdempotentTask, n: int) -> dict[str, int]:
        key = job_key(n)
        db.record(executions_table, key)
        a = self.step("first", first, key, n)
        b = self.step("second", second, key, a)
        with lock:
            fail, failures[0] = failures[0] > 0, max(0, failures[0] - 1)
        if fail:
            raise RuntimeError("model overloaded (once)")
        if effects:
            with self.effects() as session:
                if in_effects is not None:
                    in_effects()
                session.execute(insert(effects_table).values(key=key, pid=os.getpid()))
        return {"n": n, "first": a, "second": b}

    return job


# -- faults and observations -----------------------------------------------------------------------------


class Once:
    """A fault hook: runs `fault` the first `times` times its point is reached (for `key`, if given)."""

    def __init__(self, fault: Callable[[], object], key: str | None = None, times: int = 1) -> None:
        self.fault = fault
        self.key = key
        self.hits = 0
        self.injected = threading.Event()
        self.error: BaseException | None = None
        self._left = times
        self._lock = threading.Lock()

    def __call__(self, name: str, context: dict[str, Any]) -> None:
        if self.key is not None and context.get("key") not in (None, self.key):
            return
        with self._lock:
            self.hits += 1
            due, self._left = self._left > 0, self._left - 1
        if not due:
            return
        try:
            self.fault()
        except BaseException as exc:  # reported by the test: a fault that was not injected proves nothing
            self.error = exc
            raise
        finally:
            self.injected.set()


class LogLines(logging.Handler):
    """Every `oncelery` log line of the worker, to wait on (a store failure seen) and to report."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self._guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        line = f"{record.threadName} {record.levelname} {record.name}: {record.getMessage()}"
        with self._guard:
            self.lines.append(line)

    def has(self, *parts: str) -> bool:
        with self._guard:
            return any(all(p in line for p in parts) for line in self.lines)

    def text(self, last: int = 60) -> str:
        with self._guard:
            return "\n".join(self.lines[-last:])


@pytest.fixture
def logs() -> Iterator[LogLines]:
    handler = LogLines()
    logger = logging.getLogger("oncelery")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def fault_of(kind: str, db: Db, killed: list[int]) -> Callable[[], None]:
    """The fault `kind` on `db`'s cluster: kill every backend of the database, or restart the server."""
    cluster = db.cluster
    assert cluster is not None

    def terminate() -> None:
        killed.append(cluster.terminate_backends(database=db.name))

    def restart() -> None:
        cluster.restart("fast")
        killed.append(-1)

    return {"terminate": terminate, "restart": restart}[kind]


def report(db: Db, task_name: str, key: str, logs: LogLines) -> str:
    """What the database says about the job, and the worker's log: the message of a failed assertion."""
    try:
        run = retrying(lambda: Runs(db.url).get(task_name, key), "reporting", timeout=10)
        counts = retrying(lambda: Runs(db.url).outcome_counts(task_name), "reporting", timeout=10)
        effects = retrying(lambda: services.count_rows(db.observer, effects_table, key), "reporting", timeout=10)
        executions = retrying(lambda: services.count_rows(db.observer, executions_table, key), "reporting", timeout=10)
        state = (
            f"run={run.status.value if run else None} token={run.token if run else None} "
            f"attempts={run.attempts if run else None} error={(run.error or '')[:300] if run else None!r}\n"
            f"outcomes={counts} effects={effects} executions={executions}"
        )
    except Exception as exc:  # the report must not hide the failure it describes
        state = f"(could not read the database: {exc})"
    return f"{task_name}[{key}]: {state}\n--- worker log (last lines)\n{logs.text()}"


def assert_once(db: Db, job: Any, n: int, result: Any, logs: LogLines) -> dict[str, int]:
    """Wait for the run to complete, then: one effect, COMPLETED, executed-or-resumed once, none failed, the value."""
    key = job_key(n)
    what = f"{job.name}[{key}] to complete"
    # A FAILURE state is final: the delivery was acked as a failure, exactly what G8 forbids; say so at once.
    try:
        wait_for(
            lambda: db.completed(job.name, key) or result.state == "FAILURE",
            timeout=JOB_TIMEOUT,
            interval=0.1,
            what=what,
        )
    except pytest.fail.Exception:
        pytest.fail(f"timed out after {JOB_TIMEOUT}s waiting for {what}\n{report(db, job.name, key, logs)}")
    if result.state == "FAILURE" and not db.completed(job.name, key):
        pytest.fail(f"the delivery was acked as a failure: {result.result!r}\n{report(db, job.name, key, logs)}")
    value = result.get(timeout=JOB_TIMEOUT)
    run = db.run(job.name, key)
    counts = db.counts(job.name)
    detail = report(db, job.name, key, logs)
    assert run is not None and run.status is RunStatus.COMPLETED, detail
    assert db.rows(effects_table, key) == 1, detail
    assert counts.get("executed", 0) + counts.get("resumed", 0) == 1, detail
    assert counts.get("failed", 0) == 0, detail
    assert value == expected(n), detail
    assert run.result == expected(n), detail
    return counts


def wait_lease_expired(db: Db, task_name: str, key: str) -> None:
    def expired() -> bool:
        run = db.run(task_name, key)
        return run is not None and run.status is RunStatus.RUNNING and not run.lease_live

    wait_for(expired, timeout=JOB_TIMEOUT, interval=0.1, what=f"the lease of {task_name}[{key}] to expire")


def abandon_after_first_step(db: Db, job: Any, n: int) -> None:
    """Leave the run RUNNING with step 1 checkpointed and its lease expired: what a takeover finds.

    Only a taken-over run loads checkpoints. A holder (a direct caller) loses its database right before its
    second checkpoint, gets StoreUnavailable, and stops renewing; then its lease runs out.
    """
    cluster = db.cluster
    assert cluster is not None
    key = job_key(n)
    lose_db = Once(lambda: cluster.terminate_backends(database=db.name), key)

    def before_second_checkpoint(name: str, ctx: dict[str, Any]) -> None:
        if ctx.get("step") == "second":
            lose_db(name, ctx)

    with fault_injected("step_save", before_second_checkpoint), pytest.raises(StoreError):
        job(n)
    assert lose_db.injected.is_set() and lose_db.error is None
    wait_lease_expired(db, job.name, key)


# -- 1. every stage x (backends killed, server restarted) --------------------------------------------------


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("stage", STAGES)
def test_a_store_fault_at_each_stage_ends_once(
    stage: str, fault: str, pg_db: Db, pg_app: Celery, logs: LogLines
) -> None:
    n = 7
    warm = define_job(pg_app, pg_db, "oncelery.t_fault_warmup")
    job = define_job(pg_app, pg_db, f"oncelery.t_fault_{stage}_{fault}", fail_once=stage == "record_failure")
    killed: list[int] = []
    hook = Once(fault_of(fault, pg_db, killed))

    with running_worker(pg_app, concurrency=4):
        # Fill the worker's connection pools, so a killed or restarted server leaves dead sockets in them.
        assert warm.delay(1).get(timeout=JOB_TIMEOUT) == expected(1)
        if stage == "load_checkpoints":
            abandon_after_first_step(pg_db, job, n)
        with fault_injected(stage, hook):
            result = job.delay(n)
            wait_for(hook.injected.is_set, timeout=JOB_TIMEOUT, what=f"the fault at {stage!r}")
            counts = assert_once(pg_db, job, n, result, logs)

    assert hook.error is None, f"the fault could not be injected: {hook.error!r}"
    # The fault was real: backends were killed (or the server restarted) right before the stage.
    assert killed and killed[0] != 0, f"no backend to kill at {stage!r}: {killed}"
    print(f"{stage}/{fault}: outcomes={counts} hits={hook.hits} killed={killed}")


@pytest.mark.parametrize("fault", FAULTS)
def test_a_store_fault_counting_a_replay_ends_once(fault: str, pg_db: Db, pg_app: Celery, logs: LogLines) -> None:
    """A duplicate answered from the stored result meets the fault as it counts its outcome: counted once.

    On PostgreSQL the duplicate's claim statement is what counts it (claim, replay and count in one round
    trip), so the fault strikes right before that statement."""
    n = 8
    job = define_job(pg_app, pg_db, f"oncelery.t_fault_count_{fault}")
    killed: list[int] = []
    hook = Once(fault_of(fault, pg_db, killed), job_key(n))

    with running_worker(pg_app, concurrency=4):
        assert_once(pg_db, job, n, job.delay(n), logs)
        with fault_injected("claim", hook):
            again = job.delay(n)
            wait_for(hook.injected.is_set, timeout=JOB_TIMEOUT, what="the fault at the duplicate's claim")
            assert again.get(timeout=JOB_TIMEOUT) == expected(n), report(pg_db, job.name, job_key(n), logs)

    assert hook.error is None, f"the fault could not be injected: {hook.error!r}"
    assert killed and killed[0] != 0, f"no backend to kill: {killed}"
    counts = pg_db.counts(job.name)
    detail = report(pg_db, job.name, job_key(n), logs)
    assert counts.get("replayed") == 1 and counts.get("executed", 0) + counts.get("resumed", 0) == 1, detail
    assert counts.get("failed", 0) == 0, detail
    assert pg_db.rows(effects_table, job_key(n)) == 1, detail
    # The run's replays count moves with the outcome count (one statement): once, whatever the fault undid.
    run = pg_db.run(job.name, job_key(n))
    assert run is not None and run.replays == 1, detail


@pytest.mark.parametrize("fault", FAULTS)
def test_a_store_fault_counting_an_in_progress_wait_ends_once(
    fault: str, pg_db: Db, pg_app: Celery, logs: LogLines
) -> None:
    """A duplicate that finds the run held meets the fault as it counts `in_progress`: sent again, it waits,
    then replays; the job's effect is written once and nothing is counted as failed."""
    n = 10
    key = job_key(n)
    gate = threading.Event()

    name = f"oncelery.t_fault_wait_{fault}"

    @pg_app.task(shared=False, base=IdempotentTask, bind=True, name=name, idempotency_key="fault:{n}", lease=LEASE)
    def job(self: IdempotentTask, n: int) -> dict[str, int]:
        # The holder stays inside a step (no transaction open) until the test has seen the duplicate's fault.
        self.step("wait", lambda: gate.wait(JOB_TIMEOUT))
        with self.effects() as session:
            session.execute(insert(effects_table).values(key=job_key(n), pid=os.getpid()))
        return expected(n)

    killed: list[int] = []
    hook = Once(fault_of(fault, pg_db, killed), key)
    try:
        with running_worker(pg_app, concurrency=4):
            holder = job.delay(n)
            wait_for(lambda: _status(pg_db, job.name, key) is RunStatus.RUNNING, JOB_TIMEOUT, what="the holder")
            with fault_injected("count_outcome", hook):
                again = job.delay(n)
                wait_for(hook.injected.is_set, timeout=JOB_TIMEOUT, what="the fault counting in_progress")
                # Counted through a fresh connection (pre-ping) or not at all and sent again: either way, once.
                wait_for(
                    lambda: (
                        pg_db.counts(job.name).get("in_progress", 0) >= 1
                        or logs.has("claims database failed delivering", f"[{key}]")
                    ),
                    timeout=JOB_TIMEOUT,
                    what="the duplicate's wait counted, or given up on the fault",
                )
            gate.set()
            assert holder.get(timeout=JOB_TIMEOUT) == again.get(timeout=JOB_TIMEOUT) == expected(n)
    finally:
        gate.set()
    assert hook.error is None, f"the fault could not be injected: {hook.error!r}"
    assert killed and killed[0] != 0, f"no backend to kill: {killed}"
    counts = pg_db.counts(job.name)
    detail = report(pg_db, job.name, key, logs)
    assert counts.get("executed", 0) + counts.get("resumed", 0) == 1 and counts.get("replayed") == 1, detail
    assert counts.get("failed", 0) == 0, detail
    assert pg_db.rows(effects_table, key) == 1, detail


def define_renewal_job(app: Celery, name: str, lease: float, renewed: Callable[[], bool]) -> Any:
    """An IdempotentTask whose body outlives a fault and one renewal after it (`renewed`, observed in the
    database), then writes its effect."""

    @app.task(shared=False, base=IdempotentTask, bind=True, name=name, idempotency_key="fault:{n}", lease=lease)
    def job(self: IdempotentTask, n: int) -> dict[str, int]:
        self.step("wait", lambda: wait_for(renewed, JOB_TIMEOUT, what="a renewal after the fault"))
        with self.effects() as session:
            session.execute(insert(effects_table).values(key=job_key(n), pid=os.getpid()))
        return expected(n)

    return job


@pytest.mark.parametrize("fault", FAULTS)
def test_a_store_fault_renewing_the_lease_ends_once(fault: str, pg_db: Db, pg_app: Celery, logs: LogLines) -> None:
    """The holder's lease renewal meets killed backends (or a restart) while the body runs: the heartbeat
    keeps trying, a later renewal lands, and the job completes once, never taken over or fenced."""
    n = 12
    key = job_key(n)
    name = f"oncelery.t_fault_heartbeat_{fault}"
    hook = Once(fault_of(fault, pg_db, killed := []), key)
    seen: list[Any] = []

    def renewed_after_the_fault() -> bool:
        run = pg_db.run(name, key)
        if run is None or not hook.injected.is_set():
            return False
        seen.append(run.lease_expires_at)
        return len(seen) > 1 and seen[-1] > seen[0]

    job = define_renewal_job(pg_app, name, LEASE, renewed_after_the_fault)

    with running_worker(pg_app, concurrency=4), fault_injected("heartbeat", hook):
        assert job.delay(n).get(timeout=JOB_TIMEOUT) == expected(n), report(pg_db, name, key, logs)
    assert hook.error is None and hook.injected.is_set(), f"the fault was not injected: {hook.error!r}"
    assert killed and killed[0] != 0, f"no backend to kill: {killed}"
    detail = report(pg_db, name, key, logs)
    assert pg_db.rows(effects_table, key) == 1, detail
    run = pg_db.run(name, key)
    assert run is not None and run.status is RunStatus.COMPLETED and run.token == 1, detail
    assert pg_db.counts(name) == {"executed": 1}, detail


def _status(db: Db, task_name: str, key: str) -> RunStatus | None:
    run = db.run(task_name, key)
    return None if run is None else run.status


@pytest.mark.parametrize("fault", FAULTS)
def test_a_store_fault_writing_a_model_calls_ledger_row_loses_no_row(
    fault: str, pg_db: Db, pg_app: Celery, logs: LogLines
) -> None:
    """The ledger row of a model call meets a killed pooled connection (or a restart) as it is written: it is
    written once, on a fresh connection, with its running totals; the job ends once."""
    n = 11
    key = job_key(n)
    name = f"oncelery.t_fault_ledger_{fault}"

    @pg_app.task(shared=False, base=IdempotentTask, bind=True, name=name, idempotency_key="fault:{n}", lease=LEASE)
    def job(self: IdempotentTask, n: int) -> dict[str, int]:
        def ask() -> int:
            with model_call("fake-llm", prompt="draft") as call:
                call.tokens(12, 3)
            return 2 * n

        self.step("first", ask)
        with self.effects() as session:
            session.execute(insert(effects_table).values(key=job_key(n), pid=os.getpid()))
        return expected(n)

    killed: list[int] = []
    hook = Once(fault_of(fault, pg_db, killed), key)
    with running_worker(pg_app, concurrency=4), fault_injected("ledger_write", hook):
        assert job.delay(n).get(timeout=JOB_TIMEOUT) == expected(n), report(pg_db, name, key, logs)
    assert hook.error is None and hook.injected.is_set(), f"the fault was not injected: {hook.error!r}"
    assert killed and killed[0] != 0, f"no backend to kill: {killed}"
    detail = report(pg_db, name, key, logs)
    assert pg_db.rows(effects_table, key) == 1, detail
    assert not logs.has("could not record model call"), detail
    run = pg_db.run(name, key)
    assert run is not None
    calls = retrying(lambda: query_ledger(pg_db, name), "reading the ledger")
    assert calls == [(run.run_id, "fake-llm", 12, 3)], detail


def query_ledger(db: Db, task_name: str) -> list[tuple[Any, ...]]:
    """The model_calls rows of a task, and a check that ledger_totals agrees with them."""
    with db.observer.connect() as conn:
        rows = conn.execute(
            text("SELECT run_id, model, input_tokens, output_tokens FROM model_calls WHERE task_name = :t"),
            {"t": task_name},
        ).all()
        totals = conn.execute(text("SELECT calls FROM ledger_totals WHERE task_name = :t"), {"t": task_name}).all()
    assert [tuple(t) for t in totals] == [(len(rows),)], totals
    return [tuple(r) for r in rows]


# -- 2. the server stopped while a job completes, started again after the next claim fails -------------------


def test_server_down_at_completion_comes_back_and_the_job_ends_once(pg_db: Db, pg_app: Celery, logs: LogLines) -> None:
    n = 8
    key = job_key(n)
    cluster = pg_db.cluster
    assert cluster is not None
    warm = define_job(pg_app, pg_db, "oncelery.t_down_warmup")
    job = define_job(pg_app, pg_db, "oncelery.t_down_complete")
    seen_claim_fail = threading.Event()
    starters: list[threading.Thread] = []

    def start_after_a_failed_claim() -> None:
        # Observable: the re-sent delivery's claim failed against the stopped server (bounded wait).
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                if logs.has("claims database failed delivering", key):
                    seen_claim_fail.set()
                    break
                time.sleep(0.02)
        finally:
            cluster.start()

    def stop_server() -> None:
        cluster.stop("fast")  # down before the completion statement runs
        starter = threading.Thread(target=start_after_a_failed_claim, name="pg-starter", daemon=True)
        starters.append(starter)
        starter.start()

    hook = Once(stop_server, key)
    try:
        with running_worker(pg_app, concurrency=4):
            assert warm.delay(1).get(timeout=JOB_TIMEOUT) == expected(1)
            with fault_injected("complete", hook):
                result = job.delay(n)
                counts = assert_once(pg_db, job, n, result, logs)
    finally:
        for starter in starters:
            starter.join(90)
        if not cluster.running():
            cluster.start()

    assert hook.error is None, f"the server could not be stopped: {hook.error!r}"
    assert seen_claim_fail.is_set(), f"the worker never tried to claim while the server was down\n{logs.text()}"
    assert logs.has("claims database failed finishing", key), logs.text()
    print(f"down-at-complete: outcomes={counts}")


# -- 3. a fresh task's first delivery reads the digest secret before it claims ------------------------------


@pytest.mark.parametrize("fault", FAULTS)
def test_a_store_fault_before_the_claim_is_not_a_failure(fault: str, pg_db: Db, pg_app: Celery, logs: LogLines) -> None:
    """The path before the claim (deriving the key's field digests reads the database's secret once per task)."""
    n = 9
    warm = define_job(pg_app, pg_db, "oncelery.t_pre_warmup")
    job = define_job(pg_app, pg_db, f"oncelery.t_pre_claim_{fault}")
    killed: list[int] = []
    with running_worker(pg_app, concurrency=4):
        assert warm.delay(1).get(timeout=JOB_TIMEOUT) == expected(1)
        fault_of(fault, pg_db, killed)()  # the worker is idle: its next database use is this job's
        # send_task: the producer does not derive the identity, so the worker's task has read nothing yet.
        result = pg_app.send_task(job.name, args=[n])
        counts = assert_once(pg_db, job, n, result, logs)
    assert killed and killed[0] != 0
    print(f"pre-claim/{fault}: outcomes={counts} killed={killed}")


# -- 4. the body's own first statement in effects() meets the dead connection --------------------------------


@pytest.mark.parametrize("fault", FAULTS)
def test_a_store_fault_at_the_first_effects_statement_is_not_a_failure(
    fault: str, pg_db: Db, pg_app: Celery, logs: LogLines
) -> None:
    """effects() opens the run's transaction; the body's first statement in it (the SAVEPOINT, then its
    INSERT) is where a connection killed in between is found. No named fault point is there: the body injects
    the fault itself, once, right before that statement (the soak test found this call site).
    """
    n = 10
    killed: list[int] = []
    once = Once(fault_of(fault, pg_db, killed))
    warm = define_job(pg_app, pg_db, "oncelery.t_stmt_warmup")
    job = define_job(pg_app, pg_db, f"oncelery.t_effects_stmt_{fault}", in_effects=lambda: once("body", {}))
    with running_worker(pg_app, concurrency=4):
        assert warm.delay(1).get(timeout=JOB_TIMEOUT) == expected(1)
        result = job.delay(n)
        counts = assert_once(pg_db, job, n, result, logs)
    assert once.injected.is_set() and once.error is None and killed and killed[0] != 0
    print(f"effects-statement/{fault}: outcomes={counts} killed={killed}")


# -- 5. SQLite: the write lock held past busy_timeout at the claim and at the completion ---------------------


class WriteLock:
    """Another connection holding SQLite's write lock (BEGIN IMMEDIATE) until released."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.conn: sqlite3.Connection | None = None
        self.taken_at = 0.0
        self._guard = threading.Lock()

    def hold(self) -> None:
        with self._guard:
            if self.conn is None:
                conn = sqlite3.connect(self.path, timeout=20, isolation_level=None, check_same_thread=False)
                conn.execute("BEGIN IMMEDIATE")
                self.conn, self.taken_at = conn, time.monotonic()

    def release(self) -> float:
        """Roll back and close; return how long the lock was held."""
        with self._guard:
            conn, self.conn = self.conn, None
            if conn is None:
                return 0.0
            conn.execute("ROLLBACK")
            conn.close()
            return time.monotonic() - self.taken_at


@pytest.fixture
def short_lock(sqlite_db: Db, monkeypatch: pytest.MonkeyPatch) -> Iterator[WriteLock]:
    """The write lock of `sqlite_db`'s file, to hold in a fault hook; busy_timeout is 1 s for the worker's engines."""
    monkeypatch.setenv(ENV_SQLITE_BUSY_TIMEOUT, "1")
    dispose_engines()  # the worker's engines are made anew, with the shorter timeout
    lock = WriteLock(sqlite_db.url.removeprefix("sqlite:///"))
    try:
        yield lock
    finally:
        lock.release()


def release_once_given_up(lock: WriteLock, logs: LogLines, what: str, *line: str) -> float:
    """Wait for the log line (`line`'s parts) that says the worker gave up on the held lock; release it; return
    how long it was held."""
    wait_for(lambda: logs.has(*line), timeout=JOB_TIMEOUT, interval=0.1, what=what)
    return lock.release()


@pytest.mark.timeout(180)
def test_sqlite_lock_held_past_busy_timeout_at_claim_and_complete(
    sqlite_db: Db, sqlite_app: Celery, logs: LogLines, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both jobs wait out busy_timeout (5 s here, $ONCELERY_SQLITE_BUSY_TIMEOUT) on the same held lock.

    At "complete" the job has no effects() block: a body that writes effects holds the write lock itself
    from its first block to its completion (BEGIN IMMEDIATE), so its completion can never wait on a lock.
    """
    monkeypatch.setenv(ENV_SQLITE_BUSY_TIMEOUT, "5")
    dispose_engines()  # the worker's engines are made anew, with the shorter timeout
    path = sqlite_db.url.removeprefix("sqlite:///")
    lock = WriteLock(path)
    at_claim = define_job(sqlite_app, sqlite_db, "oncelery.t_lock_claim")
    at_complete = define_job(sqlite_app, sqlite_db, "oncelery.t_lock_complete", effects=False)
    n_claim, n_complete = 5, 6
    hold_at_claim = Once(lock.hold, job_key(n_claim))
    hold_at_complete = Once(lock.hold, job_key(n_complete))

    def only(task_name: str, hook: Once) -> Callable[[str, dict[str, Any]], None]:
        return lambda name, ctx: hook(name, ctx) if ctx.get("task") == task_name else None

    try:
        with (
            running_worker(sqlite_app, concurrency=4),
            fault_injected("claim", only(at_claim.name, hold_at_claim)),
            fault_injected("complete", only(at_complete.name, hold_at_complete)),
        ):
            r_complete = at_complete.delay(n_complete)
            wait_for(hold_at_complete.injected.is_set, timeout=JOB_TIMEOUT, what="the lock taken at complete")
            r_claim = at_claim.delay(n_claim)
            wait_for(hold_at_claim.injected.is_set, timeout=JOB_TIMEOUT, what="the claim to reach the lock")
            busy = sqlite_busy_timeout_ms() / 1000
            assert busy == 5
            # Released only after the worker has seen both statements fail (each waited out busy_timeout).
            wait_for(
                lambda: (
                    logs.has("claims database failed finishing", f"{at_complete.name}[{job_key(n_complete)}]")
                    and logs.has("claims database failed delivering", f"{at_claim.name}[{job_key(n_claim)}]")
                ),
                timeout=busy + 60,
                interval=0.1,
                what="both deliveries to give up on the lock",
            )
            held = lock.release()
            assert held >= busy, f"the lock was held {held:.1f}s, less than busy_timeout {busy}s"
            claim_counts = assert_once(sqlite_db, at_claim, n_claim, r_claim, logs)
            key = job_key(n_complete)
            wait_for(lambda: sqlite_db.completed(at_complete.name, key), timeout=JOB_TIMEOUT, what="completion")
            value = r_complete.get(timeout=JOB_TIMEOUT)
    finally:
        lock.release()

    detail = report(sqlite_db, at_complete.name, key, logs)
    run = sqlite_db.run(at_complete.name, key)
    counts = sqlite_db.counts(at_complete.name)
    assert run is not None and run.status is RunStatus.COMPLETED and run.result == expected(n_complete), detail
    assert value == expected(n_complete), detail
    assert counts.get("executed", 0) + counts.get("resumed", 0) == 1 and counts.get("failed", 0) == 0, detail
    # Its steps were checkpointed before the lock: the re-run replayed them instead of executing them again.
    assert sqlite_db.rows(executions_table, f"{key}/first") == 1, detail
    assert sqlite_db.rows(executions_table, f"{key}/second") == 1, detail
    print(f"sqlite lock: held={held:.1f}s claim outcomes={claim_counts} complete outcomes={counts}")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", ("step_save", "effects_begin", "record_failure"))
def test_sqlite_lock_held_past_busy_timeout_at_each_stage_ends_once(
    stage: str, sqlite_db: Db, sqlite_app: Celery, logs: LogLines, short_lock: WriteLock
) -> None:
    """The stages between the claim and the completion, on SQLite: another connection holds the write lock
    past busy_timeout right before the stage's statement; the delivery gives up on it (re-sent, not failed),
    and once the lock is gone the job ends once, its effect written once.

    The effects' lock wait is at their transaction's BEGIN IMMEDIATE (effects_begin): inside a block the run
    holds the write lock itself until its completion, so no other connection can take it at effects_flush.
    Reads (load_checkpoints, a replay's answer) never wait on the write lock in WAL mode: no stage of theirs.
    """
    n = 8
    key = job_key(n)
    job = define_job(sqlite_app, sqlite_db, f"oncelery.t_lock_{stage}", fail_once=stage == "record_failure")
    hook = Once(short_lock.hold, key)
    with running_worker(sqlite_app, concurrency=2), fault_injected(stage, hook):
        result = job.delay(n)
        wait_for(hook.injected.is_set, timeout=JOB_TIMEOUT, what=f"the lock taken at {stage!r}")
        what = f"the delivery to give up on the lock at {stage!r}"
        held = release_once_given_up(short_lock, logs, what, "claims database failed", key)
        counts = assert_once(sqlite_db, job, n, result, logs)
    assert hook.error is None, f"the lock could not be taken at {stage!r}: {hook.error!r}"
    assert held >= 1, f"the lock was held {held:.1f}s, less than busy_timeout 1s"
    print(f"sqlite lock at {stage}: held={held:.1f}s outcomes={counts}")


@pytest.mark.timeout(180)
def test_sqlite_lock_held_past_busy_timeout_counting_a_replay_counts_it_once(
    sqlite_db: Db, sqlite_app: Celery, logs: LogLines, short_lock: WriteLock
) -> None:
    """On SQLite a duplicate is answered by a read and counted by a write of its own: the write lock held past
    busy_timeout there sends the duplicate again (uncounted is unsettled), and it is answered and counted once."""
    n = 9
    key = job_key(n)
    job = define_job(sqlite_app, sqlite_db, "oncelery.t_lock_count")
    hook = Once(short_lock.hold, key)
    with running_worker(sqlite_app, concurrency=2):
        assert_once(sqlite_db, job, n, job.delay(n), logs)
        with fault_injected("count_outcome", hook):
            again = job.delay(n)
            wait_for(hook.injected.is_set, timeout=JOB_TIMEOUT, what="the lock taken at the replay's count")
            what = "the duplicate to give up on the lock"
            held = release_once_given_up(short_lock, logs, what, "claims database failed", key)
            assert again.get(timeout=JOB_TIMEOUT) == expected(n), report(sqlite_db, job.name, key, logs)
    assert hook.error is None, f"the lock could not be taken: {hook.error!r}"
    assert held >= 1, f"the lock was held {held:.1f}s, less than busy_timeout 1s"
    detail = report(sqlite_db, job.name, key, logs)
    counts = sqlite_db.counts(job.name)
    assert counts == {"executed": 1, "replayed": 1}, detail
    assert sqlite_db.rows(effects_table, key) == 1, detail
    run = sqlite_db.run(job.name, key)
    assert run is not None and run.replays == 1, detail


@pytest.mark.timeout(180)
def test_sqlite_lock_held_past_busy_timeout_at_a_lease_renewal_ends_once(
    sqlite_db: Db, sqlite_app: Celery, logs: LogLines, short_lock: WriteLock
) -> None:
    """A renewal meets SQLite's write lock held by another connection past busy_timeout: it fails, the
    heartbeat keeps trying, a renewal lands once the lock is gone, and the job completes once (never fenced).

    The renewal is fenced by token only, so a lease that lapsed while the lock was held is renewed as long as
    no other delivery took the run over (none is sent here).
    """
    lock = short_lock
    n = 13
    key = job_key(n)
    name = "oncelery.t_lock_heartbeat"
    hold = Once(lock.hold, key)
    seen: list[Any] = []

    def renewed_after_the_lock() -> bool:
        run = sqlite_db.run(name, key)
        if run is None or not hold.injected.is_set() or lock.conn is not None:
            return False
        seen.append(run.lease_expires_at)
        return len(seen) > 1 and seen[-1] > seen[0]

    job = define_renewal_job(sqlite_app, name, 3.0, renewed_after_the_lock)

    with running_worker(sqlite_app, concurrency=2), fault_injected("heartbeat", hold):
        result = job.delay(n)
        wait_for(hold.injected.is_set, timeout=JOB_TIMEOUT, what="the lock taken at a renewal")
        held = release_once_given_up(lock, logs, "the renewal to give up on the lock", "heartbeat for", key, "failed")
        assert result.get(timeout=JOB_TIMEOUT) == expected(n), report(sqlite_db, name, key, logs)
    assert hold.error is None, f"the lock could not be taken: {hold.error!r}"
    assert held >= 1, f"the lock was held {held:.1f}s, less than busy_timeout 1s"
    detail = report(sqlite_db, name, key, logs)
    assert sqlite_db.rows(effects_table, key) == 1, detail
    run = sqlite_db.run(name, key)
    assert run is not None and run.status is RunStatus.COMPLETED and run.token == 1, detail
    assert sqlite_db.counts(name) == {"executed": 1}, detail
    assert not logs.has("lease lost for", key), detail


# -- 6. an error text PostgreSQL cannot store ------------------------------------------------------------


def test_nul_in_the_error_is_recorded_and_the_run_fails(pg_db: Db, pg_app: Celery, logs: LogLines) -> None:
    @pg_app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_nul", idempotency_key="nul:{n}")
    def broken(self: IdempotentTask, n: int) -> int:
        raise ValueError(f"model returned bytes\x00garbage {n}")

    with running_worker(pg_app, concurrency=2):
        result = broken.delay(3)
        with pytest.raises(ValueError, match="garbage"):
            result.get(timeout=JOB_TIMEOUT)

    run = pg_db.run(broken.name, "nul:3")
    detail = f"{run}\n{logs.text()}"
    assert run is not None and run.status is RunStatus.FAILED, detail
    assert run.error is not None and "\x00" not in run.error and "garbage 3" in run.error, detail
    assert pg_db.counts(broken.name) == {"failed": 1}, detail


# -- 7. soak: many jobs while backends are killed every ~0.3 s and the server restarts once -----------------


@pytest.mark.timeout(SOAK_DEADLINE + 60)
def test_soak_backends_killed_and_a_restart_lose_and_duplicate_nothing(
    pg_db: Db, pg_app: Celery, logs: LogLines
) -> None:
    cluster = pg_db.cluster
    assert cluster is not None
    job = define_job(pg_app, pg_db, "oncelery.t_soak", step_seconds=0.02)
    keys = [job_key(i) for i in range(SOAK_JOBS)]
    stop = threading.Event()
    chaos = {"terminations": 0, "killed": 0, "restarts": 0}
    errors: list[BaseException] = []
    rng = random.Random(8)

    def break_things() -> None:
        try:
            rounds = 0
            while not stop.wait(rng.uniform(0.2, 0.4)):
                rounds += 1
                if rounds == 12 and not chaos["restarts"]:
                    cluster.restart("fast")
                    chaos["restarts"] += 1
                    continue
                killed = cluster.terminate_backends(database=pg_db.name)
                if killed:
                    chaos["terminations"] += 1
                    chaos["killed"] += killed
        except BaseException as exc:
            errors.append(exc)

    started = time.monotonic()
    results = []
    breaker = threading.Thread(target=break_things, name="chaos", daemon=True)
    with running_worker(pg_app, concurrency=4):
        results.append(job.delay(0))  # derives (and caches) the identity's secret before the chaos starts
        breaker.start()
        try:
            for i in range(1, SOAK_JOBS):
                results.append(job.delay(i))
                time.sleep(0.03)  # jobs arrive over ~6 s, so the faults land among them
            # Every job settles: SUCCESS, or a FAILURE (acked as final, which the asserts below report).
            deadline = started + SOAK_DEADLINE
            pending = list(results)
            while pending and time.monotonic() < deadline:
                pending = [r for r in pending if not r.ready()]
                time.sleep(0.25)
            settled = time.monotonic() - started
        finally:
            stop.set()
            breaker.join(60)
        values = {}
        for i, r in enumerate(results):
            try:
                values[i] = r.get(timeout=5)
            except Exception as exc:
                values[i] = repr(exc)

    elapsed = time.monotonic() - started
    with pg_db.observer.connect() as conn:
        runs = {
            key: (status, (error or "")[:200])
            for key, status, error in conn.execute(
                text("SELECT idempotency_key, status, error FROM task_runs WHERE task_name = :t"), {"t": job.name}
            )
        }
        statuses = {key: status for key, (status, _) in runs.items()}
        effects: dict[str, int] = dict(conn.execute(text("SELECT key, count(*) FROM test_effects GROUP BY key")).all())
    lost = sorted(k for k in keys if statuses.get(k) != "COMPLETED" or effects.get(k, 0) == 0)
    duplicated = sorted(k for k in keys if effects.get(k, 0) > 1)
    wrong = sorted(i for i, v in values.items() if v != expected(i))
    counts = pg_db.counts(job.name)
    print(
        f"soak: jobs={SOAK_JOBS} lost={len(lost)} duplicated={len(duplicated)} wrong_results={len(wrong)} "
        f"settled_in={settled:.1f}s elapsed={elapsed:.1f}s terminations={chaos['terminations']} "
        f"backends_killed={chaos['killed']} restarts={chaos['restarts']} outcomes={counts}"
    )
    detail = (
        f"lost={lost[:20]} duplicated={duplicated[:20]} wrong={[(i, values[i]) for i in wrong[:5]]} "
        f"runs_of_lost={[(k, *runs.get(k, ('no run', ''))) for k in lost[:5]]}\n"
        + "\n".join(line for line in logs.lines if any(f"[{k}]" in line for k in lost[:5]))
    )
    assert not errors, f"the chaos thread failed: {errors!r}"
    assert chaos["terminations"] >= 10 and chaos["restarts"] == 1, chaos
    assert len(lost) == 0 and len(duplicated) == 0, detail
    assert not wrong, detail
    assert counts.get("executed", 0) + counts.get("resumed", 0) == SOAK_JOBS, f"{counts}\n{detail}"
    assert counts.get("failed", 0) == 0, f"{counts}\n{detail}"
