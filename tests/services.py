"""Real-service addresses for the tests, and the rule: skip locally without a service, fail in CI; the one
copy of the helpers for the subprocesses the tests start (commands, `celery worker`s) and for waiting.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from sqlalchemy import Column, Integer, MetaData, String, Table, create_engine, text
from sqlalchemy.engine import Engine, make_url

from oncelery.testing import wait_until

if TYPE_CHECKING:
    from celery import Celery

PG_ADMIN_URL = os.environ.get("ONCELERY_TEST_PG_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
# One database per test session (inherited by worker subprocesses), so concurrent sessions never collide.
PG_TEST_DB = os.environ.setdefault("ONCELERY_TEST_PG_DB", f"oncelery_test_{os.getpid()}")
REDIS_URL = os.environ.get("ONCELERY_TEST_REDIS_URL", "redis://127.0.0.1:6379/11")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# The `oncelery` console script of this virtualenv.
ONCELERY = str(Path(sys.executable).parent / "oncelery")


def need(service: str, reachable: bool, how: str) -> None:
    """Skip the test when `service` is unreachable locally; fail it in CI, where it must be there."""
    if reachable:
        return
    msg = f"{service} is not reachable: {how}"
    if IN_CI:
        pytest.fail(msg)
    pytest.skip(msg)


def port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    """Return whether a TCP connect to host:port succeeds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def pg_url() -> str:
    """Return the URL of the (session-wide) PostgreSQL test database."""
    return make_url(PG_ADMIN_URL).set(database=PG_TEST_DB).render_as_string(hide_password=False)


def redis_available() -> bool:
    """Return whether the test Redis answers."""
    u = make_url(REDIS_URL.replace("redis://", "redis+x://", 1))
    return port_open(u.host or "127.0.0.1", u.port or 6379)


def postgres_available() -> bool:
    """Return whether the PostgreSQL server answers."""
    u = make_url(PG_ADMIN_URL)
    return port_open(u.host or "127.0.0.1", u.port or 5432)


def drop_pg_database() -> None:
    """Drop the session's PostgreSQL test database."""
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{PG_TEST_DB}" WITH (FORCE)'))
    admin.dispose()


def recreate_pg_database() -> None:
    """Drop and create the PostgreSQL test database (fresh schema every test session)."""
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(
            text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :d AND pid <> pg_backend_pid()"
            ),
            {"d": PG_TEST_DB},
        )
        conn.execute(text(f'DROP DATABASE IF EXISTS "{PG_TEST_DB}"'))
        conn.execute(text(f'CREATE DATABASE "{PG_TEST_DB}"'))
    admin.dispose()


# Test-only tables: effects written through `self.effects()`, and executions counted outside any
# transaction of the run (so a rolled-back zombie still shows it ran).
test_metadata = MetaData()


def _key_pid_table(name: str) -> Table:
    """A test table of (id, key, pid) rows: one row per effect or execution, naming the process."""
    return Table(
        name,
        test_metadata,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("key", String(255), nullable=False),
        Column("pid", Integer, nullable=False),
    )


effects_table = _key_pid_table("test_effects")
executions_table = _key_pid_table("test_executions")


def count_rows(engine: Engine, table: Table, key: str | None = None) -> int:
    """Return how many rows `table` has (for `key`, if given)."""
    stmt = f"SELECT COUNT(*) FROM {table.name}" + (" WHERE key = :k" if key is not None else "")
    with engine.connect() as conn:
        return int(conn.execute(text(stmt), {"k": key}).scalar_one())


# The kit's poller (oncelery.testing.wait_until): the project's tests use the kit where it fits.
wait_for = wait_until


def close_app(celery_app: Celery) -> None:
    """Close the app's broker pool and result-backend sockets (unclosed sockets are errors here)."""
    backend = celery_app.__dict__.get("backend")
    client = getattr(backend, "client", None)
    if client is not None:
        client.close()
        pool = getattr(client, "connection_pool", None)
        if pool is not None:
            pool.disconnect()
    celery_app.close()


def unique_queue() -> str:
    """Return a queue name no other test uses (so leftover messages never cross tests)."""
    return f"oncelery-test-{uuid.uuid4().hex[:12]}"


def results_url(broker_url: str) -> str:
    """Return the Redis URL of the result backend: the database after the broker's."""
    parts = urlsplit(broker_url)
    return urlunsplit(parts._replace(path=f"/{int(parts.path.lstrip('/') or 0) + 1}"))


def delete_queue_keys(redis_url: str, queue: str) -> None:
    """Delete every Redis key that names `queue` (its list, its unacked bookkeeping), so nothing outlives the test."""
    client = redis.Redis.from_url(redis_url)
    try:
        leftovers = list(client.scan_iter(match=f"*{queue}*"))
        if leftovers:
            client.delete(*leftovers)
    finally:
        client.close()


def redis_cli(*args: str) -> str:
    """Run redis-cli against the test Redis and return its output."""
    u = make_url(REDIS_URL.replace("redis://", "redis+x://", 1))
    out = subprocess.run(
        ["redis-cli", "-h", u.host or "127.0.0.1", "-p", str(u.port or 6379), *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return out.stdout.strip()


def run_to_completion(
    argv: list[str],
    cwd: Any,
    env: dict[str, str],
    timeout: float,
    on_timeout: Callable[[str], None],
) -> tuple[int, str, str]:
    """Run `argv` in its own session; on timeout SIGTERM it, then SIGKILL its group, call `on_timeout`, fail."""
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGTERM)  # our commands stop their own workers on SIGTERM
        try:
            out, err = proc.communicate(timeout=45)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the session this test started for it
            out, err = proc.communicate(timeout=10)
        on_timeout(out)
        pytest.fail(f"{argv[1:]} timed out after {timeout}s\n--- stdout\n{out}\n--- stderr\n{err}")
    return proc.returncode, out, err


# -- subprocesses ------------------------------------------------------------------------------------


@dataclass
class Done:
    """A finished command: exit code, output, and (for `oncelery process --summary-json`) its summary."""

    code: int
    out: str
    err: str
    summary: dict[str, Any] = field(default_factory=dict)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any ONCELERY_*/CELERY_* setting (so the embedded defaults apply), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ONCELERY_", "CELERY_"))}
    env.update(extra)
    return env


def proc_state(pid: int) -> str:
    """Return the kernel's one-letter state of `pid` ('T' when stopped, 'Z' when exited), or '' if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[0]


def alive(pid: int) -> bool:
    """Return whether `pid` is a process that has not exited (a zombie has)."""
    return proc_state(pid) not in ("", "Z")


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Send `sig` to the process group `pgid` (a session a test started), if any process of it is left."""
    with suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def stop_sessions(procs: Sequence[subprocess.Popen[Any]], grace: float = 30.0) -> list[int | None]:
    """Stop processes that each lead a session of their own (`start_new_session=True`), by their PIDs.

    SIGCONT to each session (a stopped process cannot act on SIGTERM) and SIGTERM to each leader (a warm
    shutdown), at most `grace` seconds in all for them to exit, then SIGKILL of every session's process
    group, which also reaps pool children orphaned by a SIGKILL of their parent. Returns the exit codes.
    """
    for proc in procs:
        signal_group(proc.pid, signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)  # nothing if it has already been reaped
    deadline = time.monotonic() + grace
    for proc in procs:
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    for proc in procs:
        signal_group(proc.pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
    return [proc.returncode for proc in procs]


def kill_sessions(procs: Sequence[subprocess.Popen[Any]]) -> list[int | None]:
    """SIGKILL the process group of each session leader in `procs` (pool children included) and reap the leaders.

    For a test's cleanup once its checks are done: a warm shutdown (stop_sessions) costs a prefork worker 2-3 s
    of pool teardown and proves nothing there. Returns the exit codes.
    """
    for proc in procs:
        signal_group(proc.pid, signal.SIGKILL)  # a stopped (SIGSTOPped) process dies of SIGKILL too
    for proc in procs:
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
    return [proc.returncode for proc in procs]


def worker_pids(out: str) -> list[int]:
    """Return the PIDs of every worker a command (`oncelery demo`/`process`) reported starting, restarts too."""
    return [int(pid) for pid in re.findall(r"started a worker: pid (\d+)", out)]


def live_workers(out: str) -> list[int]:
    """Return the PIDs of the workers reported in `out` that are still running."""
    return [pid for pid in worker_pids(out) if alive(pid)]


def kill_reported_workers(out: str) -> None:
    """SIGKILL the process group of every reported worker still alive (each leads its own session)."""
    for pid in live_workers(out):
        try:
            ours = b"celery" in Path(f"/proc/{pid}/cmdline").read_bytes()  # not a reused PID
        except OSError:
            continue
        if ours:
            signal_group(pid, signal.SIGKILL)


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that keeps the test output clean (no access log lines)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class LocalHTTPServer:
    """A real HTTP server on 127.0.0.1 (a free port) serving `handler` in a thread while the block runs."""

    def __init__(self, handler: type[BaseHTTPRequestHandler], path: str = "/v1") -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)

    def __enter__(self) -> Any:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)
