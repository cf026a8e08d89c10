"""What the store-fault tests share: databases on the throwaway cluster, the job, the faults, the checks.

G8: "A database error anywhere on a delivery's path (disconnect, restart, lock timeout) re-sends or requeues
the delivery; it is never acked as a failure, and a run is never left RUNNING with its message gone. Each case
ends with exactly one effect per job and a recorded outcome." The tests/test_store_fault_*.py modules prove it
call site by call site (before and at the claim, the checkpoints, the body's other writes, the completion, the
failure record, the dead letters, the relay, SQLite's write lock, and a soak).

A real in-process Celery worker (threads pool, real Redis broker) runs the jobs against the session's
throwaway PostgreSQL cluster (tests/pg_cluster.py), which the tests restart, stop and kill the backends of,
never the shared server; each test has a fresh database on it. A named fault point (`oncelery.runs.faults`)
injects each fault the FIRST time a delivery reaches that stage; then the test waits for the run to complete
and counts: one effect row, a COMPLETED run, executed-or-resumed counted once, nothing counted as failed, and
the caller gets the job's value.

The fixtures here (pg_db, sqlite_db, pg_app, sqlite_app, logs) are registered for every module by
tests/conftest.py.
"""

from __future__ import annotations

import itertools
import logging
import os
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

from oncelery import CELERY_DELIVERY_DEFAULTS, IdempotentTask, Runs, RunStatus, RunView, StoreError
from oncelery.models.migrate import JOBS, upgrade
from oncelery.runs.faults import fault_injected
from oncelery.store.database import dispose_engines, get_engine
from oncelery.testing import in_process_worker
from tests import services
from tests.pg_cluster import PgCluster
from tests.services import close_app, effects_table, executions_table, wait_for

LEASE = 2.0  # small, so a re-sent delivery takes an abandoned run over within seconds
JOB_TIMEOUT = 90.0  # generous bound for one faulted job on a loaded 2-core machine
FAULTS = ("terminate", "restart")
VERSION = 3  # the entity version the versioned events carry
T = TypeVar("T")
Hook = Callable[[str, dict[str, Any]], None]


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


# The migrated database each pg_db copies, by cluster: migrated once a session, never connected to afterwards.
_templates: dict[int, str] = {}
_copies = itertools.count(1)


def migrated_template(cluster: PgCluster) -> str:
    """The name of `cluster`'s template database: migrated to head (framework, jobs) with the test tables."""
    name = _templates.get(id(cluster))
    if name is None:
        name, url = cluster.create_database("faults_template")
        migrate(url)
        dispose_engines()  # CREATE DATABASE ... TEMPLATE needs no session on it
        _templates[id(cluster)] = name
    return name


@pytest.fixture
def pg_db(pg_cluster: PgCluster) -> Iterator[Db]:
    """A fresh, migrated database (faults_copy_<n>) on the session's throwaway cluster; engines closed and it
    dropped after, the cluster left running for the next test whatever this one did to it.

    A copy of a database migrated once (CREATE DATABASE ... TEMPLATE): the same schema as migrating each one,
    in a tenth of the time."""
    pg_cluster.ensure_running()  # a previous test that failed while the server was down
    template = migrated_template(pg_cluster)
    name = f"faults_copy_{next(_copies)}"
    pg_cluster.drop_database(name)
    pg_cluster.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    url = pg_cluster.database_url(name)
    db = Db(url, name, pg_cluster)
    try:
        yield db
    finally:
        db.close()
        dispose_engines()
        pg_cluster.ensure_running()
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
        oncelery_producer_dedupe=False,  # the faults under test are a worker's (the producer's: test_producer_dedupe)
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


# -- a body that outlives a renewal, and one stage's fault ---------------------------------------------------


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


def fault_at_stage_ends_once(
    stage: str,
    fault: str,
    db: Db,
    app: Celery,
    logs: LogLines,
    before: Callable[[Db, Any, int], None] | None = None,
) -> None:
    """The fault (`fault`: backends killed, or the server restarted) right before the delivery's `stage`: the
    job ends once (`assert_once`). `before(db, job, n)` prepares the run once the worker's pools are warm."""
    n = 7
    warm = define_job(app, db, "oncelery.t_fault_warmup")
    job = define_job(app, db, f"oncelery.t_fault_{stage}_{fault}", fail_once=stage == "record_failure")
    killed: list[int] = []
    hook = Once(fault_of(fault, db, killed))

    with in_process_worker(app, concurrency=4):
        # Fill the worker's connection pools, so a killed or restarted server leaves dead sockets in them.
        assert warm.delay(1).get(timeout=JOB_TIMEOUT) == expected(1)
        if before is not None:
            before(db, job, n)
        with fault_injected(stage, hook):
            result = job.delay(n)
            wait_for(hook.injected.is_set, timeout=JOB_TIMEOUT, what=f"the fault at {stage!r}")
            counts = assert_once(db, job, n, result, logs)

    assert hook.error is None, f"the fault could not be injected: {hook.error!r}"
    # The fault was real: backends were killed (or the server restarted) right before the stage.
    assert killed and killed[0] != 0, f"no backend to kill at {stage!r}: {killed}"
    print(f"{stage}/{fault}: outcomes={counts} hits={hook.hits} killed={killed}")


# -- observations (always on the observer's own connections, never the worker's pools) -----------------------


def query(db: Db, sql: str, **params: Any) -> list[Any]:
    """Run `sql` on the observer (retried past a fault) and return its rows."""

    def once() -> list[Any]:
        with db.observer.connect() as conn:
            return list(conn.execute(text(sql), params).all())

    return retrying(once, f"running {sql[:40]!r}")


def applied_version(db: Db, task_name: str, entity: str) -> int | None:
    rows = query(db, "SELECT version FROM entity_versions WHERE task_name = :t AND entity = :e", t=task_name, e=entity)
    return int(rows[0][0]) if rows else None


def letters(db: Db, task_name: str, key: str) -> list[Any]:
    """(reason, run_id, attempts) of every dead letter of (task, key)."""
    return query(
        db,
        "SELECT reason, run_id, attempts FROM dead_letters WHERE task_name = :t AND idempotency_key = :k ORDER BY id",
        t=task_name,
        k=key,
    )


def run_row(db: Db, task_name: str, key: str) -> Any:
    """(id, status, lost, attempts, retries, lease expired by the database clock) of the run."""
    now = "clock_timestamp()" if db.url.startswith("postgresql") else "strftime('%Y-%m-%d %H:%M:%f', 'now')"
    rows = query(
        db,
        "SELECT id, status, lost, attempts, retries, "
        f"(lease_expires_at IS NULL OR lease_expires_at < {now}) AS expired "
        "FROM task_runs WHERE task_name = :t AND idempotency_key = :k",
        t=task_name,
        k=key,
    )
    return rows[0] if rows else None


def only_for(task_name: str, key: str, hook: Hook) -> Hook:
    """`hook`, called only when the point is reached for this task and key."""

    def call(name: str, ctx: dict[str, Any]) -> None:
        if ctx.get("task") == task_name and ctx.get("key") == key:
            hook(name, ctx)

    return call


# -- the versioned event, the doomed job, and the warm-up job--------------------------------------------------------


def define_versioned(app: Celery, db: Db, name: str, *, effects: bool = True) -> Any:
    """A versioned event (entity "e:{n}", version argument `version`) that writes one effect row.

    Keyed and valued like `define_job`'s job (key "fault:{n}", result expected(n)), so `assert_once`
    applies; with effects=False the completion commits in a transaction of its own (the version with it).
    """

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name=name,
        idempotency_key="fault:{n}",
        entity="e:{n}",
        entity_version="version",
        lease=LEASE,
    )
    def job(self: IdempotentTask, n: int, version: int) -> dict[str, int]:
        key = job_key(n)
        db.record(executions_table, key)
        if effects:
            with self.effects() as session:
                session.execute(insert(effects_table).values(key=key, pid=os.getpid()))
        return expected(n)

    return job


def define_doomed(app: Celery, db: Db, name: str) -> Any:
    """A job that always raises, auto-retried once (max_retries=1): its second failure makes the run DEAD."""

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name=name,
        idempotency_key="fault:{n}",
        lease=LEASE,
        autoretry_for=(RuntimeError,),
        max_retries=1,
        retry_kwargs={"countdown": 0.2},
    )
    def job(self: IdempotentTask, n: int) -> None:
        db.record(executions_table, job_key(n))
        raise RuntimeError(f"the model refuses job {n}")

    return job


def warm_up(app: Celery, db: Db) -> Any:
    """A plain job run once first: it fills the worker's pools, so the fault leaves dead sockets in them."""
    return define_job(app, db, "oncelery.t_edge_warmup")
