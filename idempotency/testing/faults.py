"""The test kit's delivery faults: duplicate deliveries, a killed or frozen holder, an expired lease, a step
that fails once (the broker's in `broker`, the database's in `database_faults`). Each waits for what it needs
to see first.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from oncelery.models import RunStatus
from oncelery.runs.faults import expire_run_lease, fault_injected
from oncelery.runs.views import RunView
from oncelery.store.database import Database
from oncelery.testing.broker import flush_broker, on_redis, restore_delivery
from oncelery.testing.db import OnceleryDb, _name
from oncelery.testing.waiting import DEFAULT_TIMEOUT, poll, wait_until
from oncelery.testing.worker import WorkerProcess

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


def expire_lease(db: OnceleryDb | str, task: Any, key: str, tenant: str = "") -> None:
    """Move the run's lease into the past by the database clock: as if its holder froze (no sleeping)."""
    store = Database(db if isinstance(db, str) else db.url)
    expire_run_lease(store, _name(task), tenant, key)


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
    worker: WorkerProcess,
    db: OnceleryDb,
    task: Any,
    key: str,
    tenant: str = "",
    after_steps: int = 0,
    wait_timeouts: bool = False,
) -> RunView:
    """SIGKILL the worker once the key's run is RUNNING with `after_steps` steps checkpointed; return the run.

    Then, since the holder is dead for certain, what its timeouts would do later happens now: its lease is
    expired by the database clock, and (on Redis, `task` given as a task) its unacked message is put back on
    its queue by kombu's own restore, so the next worker resumes the run within seconds. With
    `wait_timeouts=True` the test waits them out instead: the worker's visibility timeout, then the lease.
    """
    run = _held(db, task, key, tenant, after_steps)
    worker.kill()
    if wait_timeouts:
        return run
    expire_lease(db, task, key, tenant)  # first: the restored message must find the lease already gone
    app = getattr(task, "app", None)
    if app is not None and run.celery_task_id and on_redis(app):
        # In the bookkeeping keys the worker used: the kit's own, or the app's where it kept the app's options.
        restore_delivery(app, run.celery_task_id, worker.transport_options(app))
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
