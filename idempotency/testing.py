"""oncelery.testing: a pytest plugin that proves a user's own task is exactly-once, on real workers.

Registered as the pytest plugin `oncelery` (entry point `pytest11`), so installing Oncelery makes its fixtures
available; it builds on pytest-celery's Celery app fixtures (`celery_app`, `celery_config`) where a project uses
them. Fixtures:

- `oncelery_db`: a fresh migrated claims schema, on a temporary SQLite file, or on a fresh database created on
  the PostgreSQL server given by `--oncelery-db-url` or $ONCELERY_TEST_DATABASE_URL (dropped afterwards).
- `oncelery_app`: the Celery app under test; override it to return yours (default: pytest-celery's `celery_app`).
- `oncelery_worker`: a real in-process worker (threads) of that app on `oncelery_db`.
- `oncelery_worker_process`: a factory of real `celery worker` subprocesses (for kills and freezes).

Fault helpers are one-liners: `deliver_concurrently`, `kill_holder`, `frozen_past_lease`, `expire_lease`,
`flush_broker`, `fail_step_once`. Assertions: `assert_ran_once`, `assert_outcomes`, `assert_steps`,
`assert_ledger`. $ONCELERY_PASS_THROUGH=1 (fixture `oncelery_pass_through`) runs bodies unclaimed for plain
unit tests. See docs/testing.md.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import inspect, text, update
from sqlalchemy.engine import make_url

from oncelery.errors import ConfigurationError
from oncelery.faults import fault_injected
from oncelery.models import RunStatus
from oncelery.runs import Runs, RunView
from oncelery.schema import upgrade_schema
from oncelery.settings import CONF_DATABASE_URL, ENV_DATABASE_URL, ENV_PASS_THROUGH
from oncelery.statements import RUNS
from oncelery.store import Database, dispose_engines

__all__ = [
    "OnceleryDb",
    "StepFailedOnce",
    "WorkerProcess",
    "assert_ledger",
    "assert_outcomes",
    "assert_ran_once",
    "assert_steps",
    "deliver_concurrently",
    "expire_lease",
    "fail_step_once",
    "flush_broker",
    "frozen_past_lease",
    "kill_holder",
    "running_worker",
    "wait_until",
]

ENV_TEST_DATABASE_URL = "ONCELERY_TEST_DATABASE_URL"
DEFAULT_TIMEOUT = 60.0  # seconds any helper waits for an observable condition before failing the test


def wait_until(
    condition: Callable[[], Any], timeout: float = DEFAULT_TIMEOUT, interval: float = 0.05, what: str = ""
) -> Any:
    """Poll `condition` until it returns a truthy value (returned), or fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what or condition}")
        time.sleep(interval)


# -- the database ------------------------------------------------------------------------------------------


@dataclass
class OnceleryDb:
    """A migrated claims database for one test: its URL, and reads of runs, outcomes, steps and the ledger."""

    url: str
    runs: Runs = field(init=False)

    def __post_init__(self) -> None:
        self.runs = Runs(self.url)

    def run(self, task: Any, key: str, tenant: str = "") -> RunView | None:
        """The run of (task, tenant, key), or None (`task` is a task or its name)."""
        return self.runs.get(_name(task), key, tenant)

    def outcome_counts(self, task: Any) -> dict[str, int]:
        """The task's delivery outcome counts (exact, across processes)."""
        return self.runs.outcome_counts(_name(task))

    def steps(self, task: Any, key: str, tenant: str = "") -> tuple[list[str], list[str]]:
        """(executed, replayed) step names of the run's last attempt: replayed ones were saved by earlier tokens."""
        run = self.run(task, key, tenant)
        if run is None:
            return [], []
        steps = self.runs.steps(run.run_id)
        return [x.name for x in steps if x.token == run.token], [x.name for x in steps if x.token < run.token]

    def ledger_rows(self, task: Any, key: str) -> list[Any]:
        """The cost ledger's rows (model_calls) of the key, oldest first: one per real model call."""
        db = Database(self.url)
        if "model_calls" not in inspect(db.engine).get_table_names():
            return []
        with db.read() as conn:
            query = "SELECT * FROM model_calls WHERE task_name = :t AND idempotency_key = :k ORDER BY id"
            return list(conn.execute(text(query), {"t": _name(task), "k": key}))

    def count(self, sql: str, **params: Any) -> int:
        """Run a counting query of your own (e.g. rows your task wrote through effects()) and return it."""
        with Database(self.url).read() as conn:
            return int(conn.execute(text(sql), params).scalar_one())


def expire_lease(db: OnceleryDb | str, task: Any, key: str, tenant: str = "") -> None:
    """Move the run's lease into the past by the database clock: as if its holder froze (no sleeping)."""
    store = Database(db if isinstance(db, str) else db.url)
    r = RUNS.c
    stmt = (
        update(RUNS)
        .where(r.task_name == _name(task), r.tenant == tenant, r.idempotency_key == key)
        .values(lease_expires_at=store.dialect.lease_until("p_lease"))  # the database clock's now - 1 h
    )
    with store.begin() as conn:
        conn.execute(stmt, {"p_lease": store.dialect.lease_param(-3600.0)})


def _name(task: Any) -> str:
    return task if isinstance(task, str) else str(task.name)


@pytest.fixture
def oncelery_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OnceleryDb]:
    """A fresh migrated claims schema: a temporary SQLite file, or a new database on the given PostgreSQL."""
    server = request.config.getoption("oncelery_db_url", None) or os.environ.get(ENV_TEST_DATABASE_URL)
    if not server:
        url = f"sqlite:///{tmp_path / 'oncelery.db'}"
        upgrade_schema(url)
        yield OnceleryDb(url)
        dispose_engines()
        return
    name = f"oncelery_test_{uuid.uuid4().hex[:12]}"
    admin = Database(str(server))
    if admin.dialect.name != "postgresql":
        raise ConfigurationError(f"--oncelery-db-url / {ENV_TEST_DATABASE_URL} must be a postgresql:// URL")
    with admin.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(str(server)).set(database=name).render_as_string(hide_password=False)
    try:
        upgrade_schema(url)
        yield OnceleryDb(url)
    finally:
        dispose_engines()
        with admin.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def oncelery_app(request: pytest.FixtureRequest) -> Any:
    """The Celery app under test: override this fixture to return your app (default: pytest-celery's)."""
    try:
        return request.getfixturevalue("celery_app")
    except pytest.FixtureLookupError:
        raise ConfigurationError(
            "oncelery.testing needs your Celery app: define a fixture `oncelery_app` returning it "
            "(or use pytest-celery's `celery_app`)"
        ) from None


@contextmanager
def running_worker(app: Any, db: OnceleryDb, concurrency: int = 4) -> Iterator[Any]:
    """Run a real in-process worker (threads) of `app` on `db` for the block: for tasks defined in the test."""
    from celery.contrib.testing.worker import start_worker

    with _database_of(app, db.url):
        app.finalize()
        with start_worker(
            app, pool="threads", concurrency=concurrency, perform_ping_check=False, shutdown_timeout=30
        ) as worker:
            yield worker


@pytest.fixture
def oncelery_worker(oncelery_app: Any, oncelery_db: OnceleryDb) -> Iterator[Any]:
    """A real in-process worker (threads pool, 4 threads) of `oncelery_app`, on `oncelery_db`."""
    with running_worker(oncelery_app, oncelery_db) as worker:
        yield worker


@contextmanager
def _database_of(app: Any, url: str) -> Iterator[None]:
    before = app.conf.get(CONF_DATABASE_URL)
    app.conf[CONF_DATABASE_URL] = url
    try:
        yield
    finally:
        app.conf[CONF_DATABASE_URL] = before


@pytest.fixture
def oncelery_pass_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """Switch the claim off for this test ($ONCELERY_PASS_THROUGH=1): task bodies run as plain functions."""
    monkeypatch.setenv(ENV_PASS_THROUGH, "1")


# -- worker subprocesses -------------------------------------------------------------------------------------


class WorkerProcess:
    """A real `celery worker` subprocess (its own process group), stopped by its PID when the test ends."""

    def __init__(self, app_path: str, db: OnceleryDb, hostname: str, concurrency: int, env: dict[str, str]) -> None:
        self.hostname = hostname
        self.log = Path(env.get("ONCELERY_TEST_LOG_DIR", "/tmp")) / f"{hostname}.log"
        cmd = [sys.executable, "-m", "celery", "-A", app_path, "worker", "--loglevel=INFO", "-n", hostname]
        cmd += ["--pool", "prefork", "--concurrency", str(concurrency), "--without-gossip", "--without-mingle"]
        env = {**os.environ, **env, ENV_DATABASE_URL: db.url}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        wait_until(lambda: self.ready() or self.proc.poll() is not None, 120, what=f"worker {hostname} to be ready")
        if self.proc.poll() is not None:
            pytest.fail(f"worker {hostname} exited with {self.proc.returncode}:\n{self.output()[-3000:]}")

    @property
    def pid(self) -> int:
        """The worker's main process id (its pool children share its process group)."""
        return self.proc.pid

    def output(self) -> str:
        """What the worker has logged so far."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def ready(self) -> bool:
        """Whether the worker has started consuming."""
        return " ready." in self.output()

    def signal(self, sig: int) -> None:
        """Send `sig` to the worker and its pool children (its process group)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the worker and its children at once (as the OOM killer would) and reap it."""
        self.signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        """Stop the worker: SIGCONT (if frozen), SIGTERM, then SIGKILL after 30 s."""
        if self.proc.poll() is not None:
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()


@pytest.fixture
def oncelery_worker_process(request: pytest.FixtureRequest, oncelery_db: OnceleryDb, tmp_path: Path) -> Iterator[Any]:
    """A factory: `oncelery_worker_process("myapp.celery:app")` starts a real worker subprocess on `oncelery_db`.

    The app path may also come from the ini option `oncelery_app`. The app must read its claims database
    from $ONCELERY_DATABASE_URL (the default when app.conf.oncelery_database_url is unset).
    """
    started: list[WorkerProcess] = []

    def start(app_path: str | None = None, hostname: str | None = None, concurrency: int = 1, **env: str) -> Any:
        path = app_path or request.config.getini("oncelery_app")
        if not path:
            raise ConfigurationError("give the app's import path: oncelery_worker_process('pkg.module:app')")
        name = hostname or f"oncelery-test-{len(started) + 1}-{uuid.uuid4().hex[:6]}@%h"
        worker = WorkerProcess(
            str(path), oncelery_db, name, concurrency, {"ONCELERY_TEST_LOG_DIR": str(tmp_path), **env}
        )
        started.append(worker)
        return worker

    try:
        yield start
    finally:
        for worker in started:
            worker.stop()


# -- fault helpers -------------------------------------------------------------------------------------------


def deliver_concurrently(task: Any, *args: Any, times: int = 20, **kwargs: Any) -> list[Any]:
    """Send the same call `times` times at once (threads behind a barrier); return their AsyncResults."""
    barrier = threading.Barrier(times)
    results: list[Any] = [None] * times

    def send(i: int) -> None:
        barrier.wait(30)
        results[i] = task.apply_async(args, kwargs)

    threads = [threading.Thread(target=send, args=(i,), name=f"duplicate-{i}") for i in range(times)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def _running(db: OnceleryDb, task: Any, key: str, tenant: str) -> RunView | None:
    run = db.run(task, key, tenant)
    return run if run is not None and run.status is RunStatus.RUNNING else None


def kill_holder(
    worker: WorkerProcess, db: OnceleryDb, task: Any, key: str, tenant: str = "", after_steps: int = 0
) -> RunView:
    """SIGKILL the worker once the key's run is RUNNING with `after_steps` steps checkpointed; return the run."""

    def mid_body() -> RunView | None:
        run = _running(db, task, key, tenant)
        return run if run is not None and sum(map(len, db.steps(task, key, tenant))) >= after_steps else None

    run = wait_until(mid_body, what=f"{_name(task)}[{key}] to be running with {after_steps} steps done")
    worker.kill()
    return run  # type: ignore[no-any-return]


@contextmanager
def frozen_past_lease(worker: WorkerProcess, db: OnceleryDb, task: Any, key: str, tenant: str = "") -> Iterator[None]:
    """Freeze the holder (SIGSTOP) once its run is RUNNING and expire its lease; SIGCONT it at exit.

    Inside the block another worker can take the run over; released, the old holder is a zombie whose
    writes the fencing token refuses.
    """
    wait_until(lambda: _running(db, task, key, tenant), what=f"{_name(task)}[{key}] to be running")
    worker.signal(signal.SIGSTOP)
    try:
        expire_lease(db, task, key, tenant)
        yield
    finally:
        worker.signal(signal.SIGCONT)


def flush_broker(app: Any) -> None:
    """Empty the app's Redis broker database (FLUSHDB), as a failover or a lost Redis would."""
    import redis

    url = str(app.conf.broker_url or "")
    if not url.startswith(("redis://", "rediss://")):
        raise ConfigurationError(f"flush_broker needs a Redis broker, not {url.split(':')[0]}://")
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


class StepFailedOnce(RuntimeError):
    """The error `fail_step_once` raises in the chosen step (once)."""


@contextmanager
def fail_step_once(task: Any, step: str) -> Iterator[list[str]]:
    """Within the block, make step `step` of `task` raise StepFailedOnce the first time it runs (in-process).

    Yields the keys it failed, so a test can wait on it.
    """
    failed: list[str] = []
    lock = threading.Lock()

    def hook(_point: str, ctx: dict[str, Any]) -> None:
        if ctx.get("task") != _name(task) or ctx.get("step") != step:
            return
        with lock:
            if failed:
                return
            failed.append(str(ctx.get("key")))
        raise StepFailedOnce(f"oncelery.testing: step {step!r} of {_name(task)} fails once, as asked")

    with fault_injected("step_call", hook):
        yield failed


# -- assertions ----------------------------------------------------------------------------------------------


def _expect(condition: bool, message: str) -> None:
    # An explicit raise, not `assert`: the kit's checks must hold under `python -O` too.
    if not condition:
        raise AssertionError(message)


def assert_ran_once(
    db: OnceleryDb, task: Any, key: str, tenant: str = "", effects: Callable[[], int] | str | None = None
) -> RunView:
    """Assert the key's run COMPLETED with its result stored, and (if given) that its effects exist once.

    `effects`: a callable returning how many effects the run left, or a counting SQL query over your own
    tables with a `:key` parameter.
    """
    run = db.run(task, key, tenant)
    if run is None:
        raise AssertionError(f"{_name(task)}[{key}] never ran")
    _expect(run.status is RunStatus.COMPLETED, f"{_name(task)}[{key}] is {run.status.value}: {run.error}")
    if effects is not None:
        seen = effects() if callable(effects) else db.count(effects, key=key)
        _expect(seen == 1, f"{_name(task)}[{key}] left {seen} effects, not 1")
    return run


def assert_outcomes(db: OnceleryDb, task: Any, **expected: int) -> dict[str, int]:
    """Assert the task's outcome counts are exactly `expected` (e.g. executed=1, replayed=19)."""
    counts = db.outcome_counts(task)
    wanted = {k: v for k, v in expected.items() if v}
    _expect(counts == wanted, f"{_name(task)} outcomes {counts}, expected {wanted}")
    return counts


def assert_steps(
    db: OnceleryDb, task: Any, key: str, executed: list[str], replayed: list[str], tenant: str = ""
) -> None:
    """Assert which steps the run's last attempt executed and which it replayed from checkpoints."""
    seen = db.steps(task, key, tenant)
    _expect(seen == (executed, replayed), f"{_name(task)}[{key}] steps (executed, replayed) = {seen}")


def assert_ledger(db: OnceleryDb, task: Any, key: str, calls: int) -> list[Any]:
    """Assert the cost ledger holds exactly `calls` model calls for the key (one per real call)."""
    rows = db.ledger_rows(task, key)
    _expect(len(rows) == calls, f"{_name(task)}[{key}] has {len(rows)} ledger rows, expected {calls}")
    return rows


# -- the plugin's options ------------------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    """--oncelery-db-url (a PostgreSQL server for oncelery_db) and the ini option oncelery_app."""
    group = parser.getgroup("oncelery")
    group.addoption(
        "--oncelery-db-url",
        dest="oncelery_db_url",
        default=None,
        help=f"PostgreSQL server on which oncelery_db creates a fresh database per test (or ${ENV_TEST_DATABASE_URL})",
    )
    parser.addini("oncelery_app", "import path ('pkg.module:app') of the app oncelery_worker_process starts")
