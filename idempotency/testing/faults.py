"""The test kit's faults: duplicate deliveries, a killed or frozen holder, an expired lease, a flushed broker,
a step that fails once; and the real worker subprocess they act on. Each waits for what it needs to see first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import update

from oncelery.errors import ConfigurationError
from oncelery.models import RunStatus
from oncelery.runs.faults import fault_injected
from oncelery.runs.views import RunView
from oncelery.settings import ENV_DATABASE_URL
from oncelery.store.database import Database
from oncelery.store.tables import RUNS
from oncelery.testing.db import OnceleryDb, _name

__all__ = [
    "DEFAULT_TIMEOUT",
    "StepFailedOnce",
    "WorkerProcess",
    "deliver_concurrently",
    "expire_lease",
    "fail_step_once",
    "flush_broker",
    "frozen_past_lease",
    "kill_holder",
    "poll",
    "wait_until",
]

DEFAULT_TIMEOUT = 60.0  # seconds any helper waits for an observable condition before failing the test


def poll(condition: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    """Poll `condition` until it returns a truthy value (returned) or `timeout` seconds pass (None)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            return None
        time.sleep(interval)


def wait_until(
    condition: Callable[[], Any], timeout: float = DEFAULT_TIMEOUT, interval: float = 0.05, what: str = ""
) -> Any:
    """Poll `condition` until it returns a truthy value (returned), or fail the test after `timeout` seconds."""
    value = poll(condition, timeout, interval)
    if not value:
        pytest.fail(f"timed out after {timeout}s waiting for {what or condition}")
    return value


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


def _held(db: OnceleryDb, task: Any, key: str, tenant: str, after_steps: int) -> RunView:
    """Wait until the key's run is RUNNING with `after_steps` steps checkpointed; return it."""

    def mid_body() -> RunView | None:
        run = _running(db, task, key, tenant)
        return run if run is not None and sum(map(len, db.steps(task, key, tenant))) >= after_steps else None

    run: RunView = wait_until(mid_body, what=f"{_name(task)}[{key}] to be running with {after_steps} steps done")
    return run


def kill_holder(
    worker: WorkerProcess, db: OnceleryDb, task: Any, key: str, tenant: str = "", after_steps: int = 0
) -> RunView:
    """SIGKILL the worker once the key's run is RUNNING with `after_steps` steps checkpointed; return the run."""
    run = _held(db, task, key, tenant, after_steps)
    worker.kill()
    return run


@contextmanager
def frozen_past_lease(
    worker: WorkerProcess, db: OnceleryDb, task: Any, key: str, tenant: str = "", after_steps: int = 0
) -> Iterator[None]:
    """Freeze the holder (SIGSTOP) once its run is RUNNING with `after_steps` steps checkpointed and expire
    its lease; SIGCONT it at exit.

    Inside the block another worker can take the run over; released, the old holder is a zombie whose
    writes the fencing token refuses.
    """
    _held(db, task, key, tenant, after_steps)
    worker.signal(signal.SIGSTOP)
    try:
        expire_lease(db, task, key, tenant)
        yield
    finally:
        worker.signal(signal.SIGCONT)


def flush_broker(app: Any) -> None:
    """Empty the app's Redis broker database (FLUSHDB), as a failover or a lost Redis would."""
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
def fail_step_once(task: Any, step: str, exc: BaseException | type[BaseException] | None = None) -> Iterator[list[str]]:
    """Within the block, make step `step` of `task` raise the first time it runs (in-process).

    It raises `exc` (an exception, or a class built with a message), e.g. the error your `autoretry_for`
    retries, else StepFailedOnce. Yields the keys it failed, so a test can wait on it.
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
        raise _step_error(task, step, exc)

    with fault_injected("step_call", hook):
        yield failed


def _step_error(task: Any, step: str, exc: BaseException | type[BaseException] | None) -> BaseException:
    """The error fail_step_once raises: `exc` as given, `exc` built with a message, or StepFailedOnce."""
    if isinstance(exc, BaseException):
        return exc
    message = f"oncelery.testing: step {step!r} of {_name(task)} fails once, as asked"
    return (exc or StepFailedOnce)(message)
