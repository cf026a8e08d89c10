"""The test kit's database faults: a fault at a named point of a delivery (`fail_at`), every connection to the
test database killed (`terminate_connections`), the database server down (`database_down`).

They are the faults the project's own store-fault tests inject (tests/test_store_fault_*.py), for a user's
task: the points are `oncelery.runs.faults.POINTS` (the claim, a checkpoint, the completion, ...), reached by
the deliveries of an in-process worker (the points live in the test's own process). After each, the job must
still end exactly once: the worker sends the delivery again instead of acking it as a failure.

`terminate_connections` runs pg_terminate_backend, which PostgreSQL allows a superuser, a member of the role
the killed connections belong to (the workers' own role, which the test's URL is), or a member of the
`pg_signal_backend` role (not for a superuser's connections). `database_down` stops the server: only the
throwaway cluster's (`oncelery_cluster_db`), never a shared one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from oncelery.errors import ConfigurationError
from oncelery.runs.faults import POINTS, fault_injected
from oncelery.testing.db import OnceleryDb, _name
from oncelery.testing.waiting import DEFAULT_TIMEOUT, wait_until

__all__ = [
    "InjectedFault",
    "database_down",
    "fail_at",
    "terminate_connections",
]

# MATERIALIZED: the filter runs first (the planner must not call pg_terminate_backend on rows the WHERE would
# have excluded, such as this very connection).
_TERMINATE = (
    "WITH victims AS MATERIALIZED (SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
    "AND backend_type = 'client backend' AND pid <> pg_backend_pid()) "
    "SELECT pid FROM victims WHERE pg_terminate_backend(pid)"
)
_LEFT = "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(CAST(:pids AS integer[]))"


def terminate_connections(db: OnceleryDb | str) -> int:
    """Kill every other connection to the test database (pg_terminate_backend) and wait until they are gone;
    return how many. The workers' pooled connections are dead afterwards: their next statement fails."""
    url = db if isinstance(db, str) else db.url
    if not url.startswith("postgresql"):
        raise ConfigurationError(f"terminate_connections needs a PostgreSQL test database, not {url.split(':')[0]}")
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            try:
                killed = [int(pid) for (pid,) in conn.execute(text(_TERMINATE))]
            except DBAPIError as exc:
                raise ConfigurationError(
                    f"terminate_connections was refused ({str(exc.orig).strip().splitlines()[0]}): connect as a "
                    "superuser, as the workers' own role, or as a member of pg_signal_backend"
                ) from exc
            # pg_terminate_backend only signals: wait (bounded) until those backends are gone, so the next
            # statement on any of their client sockets fails for certain.
            deadline = time.monotonic() + 10
            while killed and time.monotonic() < deadline and conn.execute(text(_LEFT), {"pids": killed}).scalar():
                time.sleep(0.01)
    finally:
        engine.dispose()
    return len(killed)


class InjectedFault:
    """A fault run the first `times` times a delivery (of `task`/`key`, if given) reaches its point: `hits`
    counts every arrival, `results` what each run of the fault returned, `error` what it raised, if anything."""

    def __init__(self, point: str, fault: Callable[[], Any], task: Any, key: str | None, times: int) -> None:
        self.point = point
        self.hits = 0
        self.results: list[Any] = []
        self.error: BaseException | None = None
        self.injected = threading.Event()
        self._fault = fault
        self._task = None if task is None else _name(task)
        self._key = key
        self._left = times
        self._lock = threading.Lock()

    def __call__(self, _point: str, context: dict[str, Any]) -> None:
        if self._task is not None and context.get("task") not in (None, self._task):
            return
        if self._key is not None and context.get("key") not in (None, self._key):
            return
        with self._lock:
            self.hits += 1
            due, self._left = self._left > 0, self._left - 1
        if not due:
            return
        try:
            self.results.append(self._fault())
        except BaseException as exc:  # kept for the test: a fault that was not injected proves nothing
            self.error = exc
            raise
        finally:
            self.injected.set()

    def wait(self, timeout: float = DEFAULT_TIMEOUT) -> InjectedFault:
        """Wait until the fault has run (fail the test after `timeout` s); raise what it raised, if anything."""
        wait_until(self.injected.is_set, timeout, what=f"a delivery to reach {self.point!r}")
        if self.error is not None:
            raise self.error
        return self


@contextmanager
def fail_at(
    point: str, fault: Callable[..., Any], *args: Any, task: Any = None, key: str | None = None, times: int = 1
) -> Iterator[InjectedFault]:
    """Within the block, run `fault(*args)` right before a delivery's stage `point` (one of
    oncelery.runs.faults.POINTS), the first `times` times a delivery of `task` (and `key`) reaches it.

    E.g. `with fail_at("complete", terminate_connections, db, task=charge) as fault:` kills the worker's
    connections just before the completion; `fault.wait()` waits until it did.
    """
    if point not in POINTS:
        raise ConfigurationError(f"fail_at: no fault point {point!r}; use one of {', '.join(POINTS)}")
    injected = InjectedFault(point, lambda: fault(*args), task, key, times)
    with fault_injected(point, injected):
        yield injected


@contextmanager
def database_down(
    db: OnceleryDb, *, at: str | None = None, task: Any = None, key: str | None = None, mode: str = "fast"
) -> Iterator[InjectedFault | None]:
    """Stop the test database's server for the block (at once, or with `at=` the first time a delivery of
    `task` reaches that point), and start it again at the block's end. Only on the kit's throwaway cluster.

    `mode`: "fast" (a clean shutdown: connections closed) or "immediate" (a crash: recovery at the restart).
    """
    cluster = getattr(db, "cluster", None)
    if cluster is None:
        raise ConfigurationError(
            "database_down stops the database server: use it on the kit's throwaway cluster (the fixture "
            "oncelery_cluster_db), never on a shared server"
        )
    try:
        if at is None:
            cluster.stop(mode)
            yield None
        else:
            with fail_at(at, cluster.stop, mode, task=task, key=key) as fault:
                yield fault
    finally:
        cluster.ensure_running()
