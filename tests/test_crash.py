"""Crashes tested by crashing: real `celery worker` subprocesses on Redis, over SQLite and PostgreSQL.

Each test starts its own workers (tests/apps/crash_app.py) on a queue of its own, then duplicates,
re-delivers, SIGKILLs, SIGSTOPs, or flushes Redis under them, and checks G1 (one effect per key),
G2 (no lost job), G3 (a zombie cannot commit) and G6 (Redis state does not matter) in the database.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult
from sqlalchemy import select, text
from sqlalchemy.engine import make_url

from oncelery import CELERY_DELIVERY_DEFAULTS
from oncelery.models import RunStatus
from oncelery.runs.claims import RunStore
from oncelery.store.database import get_engine
from tests.conftest import ON_POSTGRESQL, ON_SQLITE
from tests.services import (
    count_rows,
    delete_queue_keys,
    effects_table,
    executions_table,
    kill_sessions,
    proc_state,
    results_url,
    unique_queue,
    wait_for,
)

pytestmark = pytest.mark.crash

REPO = Path(__file__).resolve().parent.parent
EFFECT_TASK = "oncelery.crash_effect"
PLAIN_TASK = "oncelery.crash_plain"
# Generous bounds for a noisy 2-core machine; every wait ends as soon as its condition holds.
STARTUP_TIMEOUT = 60.0
JOB_TIMEOUT = 60.0
STOP_GRACE = 5.0  # a warm shutdown's bound, for a test that stops its workers itself (tests/test_replay_cache.py)


def run_key(key: str) -> str:
    """Return the idempotency key crash_app's task derives for `key`."""
    return f"crash:{key}"


class Worker:
    """One `celery worker` subprocess, in a session of its own so its pool children die with it."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes], log: Path, hostname: str) -> None:
        self.name = name
        self.proc = proc
        self.log_path = log
        self.hostname = hostname

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def is_ready(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"worker {self.name} exited with {self.proc.returncode}:\n{self.log()}")
        return f"{self.hostname} ready." in self.log()

    def received(self, task_name: str) -> int:
        """Return how many deliveries of `task_name` this worker logged as received."""
        return self.log().count(f"Task {task_name}[")


class Cluster:
    """The workers, sender app and Redis keys of one test; `close()` stops every process it started."""

    def __init__(self, tmp_path: Path, db_url: str, redis_url: str, **settings: float) -> None:
        self.tmp_path = tmp_path
        self.db_url = db_url
        self.broker_url = redis_url
        self.backend_url = results_url(redis_url)
        self.queue = unique_queue()
        self.env = {
            **os.environ,
            "ONCELERY_DATABASE_URL": db_url,
            "ONCELERY_BROKER_URL": self.broker_url,
            "ONCELERY_RESULT_BACKEND": self.backend_url,
            "ONCELERY_CRASH_QUEUE": self.queue,
            "ONCELERY_VISIBILITY_TIMEOUT": str(settings.get("visibility_timeout", 3600)),
            "ONCELERY_UNACKED_RESTORE_INTERVAL": str(settings.get("restore_interval", 1)),
            "ONCELERY_CRASH_LEASE": str(settings.get("lease", 60)),
        }
        self.workers: list[Worker] = []
        self.sender = Celery(f"crash-sender-{os.getpid()}")
        self.sender.conf.update(
            **CELERY_DELIVERY_DEFAULTS,  # the workers' serializers and accepted content
            broker_url=self.broker_url,
            result_backend=self.backend_url,
            task_default_queue=self.queue,
            broker_connection_retry_on_startup=True,
        )
        self.store = RunStore(db_url)
        self.engine = get_engine(db_url)

    # -- processes ---------------------------------------------------------------------------------

    def start(self, name: str, pool: str = "prefork", concurrency: int = 1) -> Worker:
        """Start a `celery worker` on this test's queue (use `wait_ready` before relying on it)."""
        hostname = f"{name}-{self.queue}@crash"
        log = self.tmp_path / f"worker-{name}.log"
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.apps.crash_app",
            "worker",
            "-Q",
            self.queue,
            "--hostname",
            hostname,
            "--pool",
            pool,
            "--concurrency",
            str(concurrency),
            "--loglevel",
            "INFO",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
        with log.open("wb") as out:
            proc = subprocess.Popen(
                cmd, cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        worker = Worker(name, proc, log, hostname)
        self.workers.append(worker)
        return worker

    def wait_ready(self, *workers: Worker) -> None:
        """Wait until every worker consumes (so a message sent now can reach any of them)."""
        for w in workers:
            wait_for(w.is_ready, timeout=STARTUP_TIMEOUT, interval=0.1, what=f"worker {w.name} to be ready")

    def close(self) -> None:
        """Kill every worker's process group by PID (the test's checks are done; how its workers end is none of
        them: a test that checks a stop stops them itself, e.g. with stop_sessions); delete its Redis keys."""
        kill_sessions([w.proc for w in self.workers])
        for w in self.workers:
            print(f"===== worker {w.name} pid={w.pid} rc={w.proc.returncode} =====\n{w.log()}")
        self.sender.close()
        delete_queue_keys(self.broker_url, self.queue)

    # -- jobs and observations -----------------------------------------------------------------------

    def send(self, task_name: str, key: str, seconds: float) -> AsyncResult[Any]:
        return self.sender.send_task(task_name, args=[key, seconds])

    def executions(self, key: str) -> int:
        return count_rows(self.engine, executions_table, key)

    def effects(self, key: str) -> int:
        return count_rows(self.engine, effects_table, key)

    def execution_pids(self, key: str) -> list[int]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(executions_table.c.pid).where(executions_table.c.key == key).order_by(executions_table.c.id)
            )
            return [int(pid) for (pid,) in rows]

    def effect_pids(self, key: str) -> list[int]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(effects_table.c.pid).where(effects_table.c.key == key))
            return [int(pid) for (pid,) in rows]

    def wait_executing(self, key: str, count: int = 1) -> int:
        """Wait until the body for `key` has started `count` times; return the PID of the latest start."""
        wait_for(lambda: self.executions(key) >= count, timeout=JOB_TIMEOUT, what=f"execution #{count} of {key}")
        return self.execution_pids(key)[-1]

    def outcomes(self) -> dict[str, int]:
        return self.store.outcome_counts(EFFECT_TASK)

    def flush_redis(self) -> None:
        """Flush every Redis database this test's processes use: the broker's and the result backend's."""
        for url in (self.broker_url, self.backend_url):
            client = redis.Redis.from_url(url)
            try:
                client.flushdb()
            finally:
                client.close()


@contextmanager
def cluster(tmp_path: Path, db_url: str, redis_url: str, **settings: float) -> Iterator[Cluster]:
    """A Cluster whose processes are stopped (by PID) however the test ends."""
    c = Cluster(tmp_path, db_url, redis_url, **settings)
    try:
        yield c
    finally:
        c.close()


def _database_idle(db_url: str) -> bool:
    """Return whether no other session is inside a database transaction (holds a lock) right now."""
    url = make_url(db_url)
    if url.get_backend_name() == "sqlite":
        con = sqlite3.connect(url.database or "", timeout=0, isolation_level=None)
        try:
            con.execute("BEGIN IMMEDIATE")
            con.execute("ROLLBACK")
            return True
        except sqlite3.OperationalError:
            return False
        finally:
            con.close()
    with get_engine(db_url).connect() as conn:
        busy = conn.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND backend_type = 'client backend' AND state <> 'idle'"
            )
        ).scalar_one()
    return int(busy) == 0


def freeze_between_transactions(pid: int, db_url: str) -> None:
    """SIGSTOP `pid` at a moment it holds no database lock (else thaw and try again).

    A process frozen inside a transaction (e.g. mid lease renewal) keeps its row lock (PostgreSQL) or the
    file's write lock (SQLite), so a taker would wait for the zombie instead of taking over: that is the
    database's liveness, not what this test is about.
    """

    def attempt() -> bool:
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: proc_state(pid) in ("T", "t"), timeout=60, interval=0.01, what=f"{pid} to stop")
        if _database_idle(db_url):
            return True
        os.kill(pid, signal.SIGCONT)
        return False

    # Between tries (the interval) it runs on and finishes the transaction it was in.
    wait_for(attempt, timeout=60, interval=0.03, what=f"a moment when {pid} holds no database lock")


# -- 1. duplicate deliveries across two worker processes --------------------------------------------------


@ON_POSTGRESQL
def test_two_workers_duplicate_messages_execute_once(tmp_path: Path, db_url: str, redis_url: str) -> None:
    key = f"dup-{uuid.uuid4().hex[:8]}"
    with cluster(tmp_path, db_url, redis_url) as c:
        a, b = c.start("a"), c.start("b")
        c.wait_ready(a, b)
        assert a.pid != b.pid
        # 1.5 s: the copies sent with the first find it running (in_progress), and are answered once it ends.
        results = [c.send(EFFECT_TASK, key, 1.5) for _ in range(6)]
        values = [r.get(timeout=JOB_TIMEOUT) for r in results]

        assert c.executions(key) == 1
        assert c.effects(key) == 1
        assert all(v == values[0] for v in values) and values[0]["key"] == key
        run = c.store.get(EFFECT_TASK, run_key(key))
        assert run is not None and run.status is RunStatus.COMPLETED
        assert run.token == 1 and run.attempts == 1 and run.result == values[0]
        # Both processes pulled the duplicates: the race was real.
        assert a.received(EFFECT_TASK) >= 1 and b.received(EFFECT_TASK) >= 1
        counts = c.outcomes()
        assert counts.get("executed") == 1
        assert counts.get("replayed") == 5
        assert counts.get("in_progress", 0) >= 1


# -- 2. visibility timeout shorter than the job ----------------------------------------------------------


@ON_POSTGRESQL
def test_visibility_timeout_redelivery_is_absorbed(tmp_path: Path, db_url: str, redis_url: str) -> None:
    plain_key = f"plain-{uuid.uuid4().hex[:8]}"
    key = f"vt-{uuid.uuid4().hex[:8]}"
    job = 5.0
    with cluster(tmp_path, db_url, redis_url, visibility_timeout=2, restore_interval=1, lease=10) as c:
        a, b = c.start("a", concurrency=2), c.start("b", concurrency=2)
        c.wait_ready(a, b)
        plain = c.send(PLAIN_TASK, plain_key, job)
        result = c.send(EFFECT_TASK, key, job)

        # The scenario is real: Redis re-delivers the running plain job, and it runs again.
        wait_for(lambda: c.executions(plain_key) >= 2, timeout=JOB_TIMEOUT, what="the control to run twice")
        value = result.get(timeout=JOB_TIMEOUT)
        assert plain.get(timeout=JOB_TIMEOUT)["key"] == plain_key
        # The idempotent job's re-delivery reached the claim, waited, and was answered from the result.
        wait_for(lambda: c.outcomes().get("replayed", 0) >= 1, timeout=JOB_TIMEOUT, what="a replayed redelivery")

        # ... and its effect happens again: what the claim prevents.
        wait_for(lambda: c.effects(plain_key) >= 2, timeout=JOB_TIMEOUT, what="the control's second effect")
        assert c.executions(key) == 1
        assert c.effects(key) == 1
        run = c.store.get(EFFECT_TASK, run_key(key))
        assert run is not None and run.status is RunStatus.COMPLETED and run.token == 1
        assert value == run.result and value["key"] == key
        counts = c.outcomes()
        assert counts.get("executed") == 1 and counts.get("in_progress", 0) >= 1


# -- 3. SIGKILL mid-job -----------------------------------------------------------------------------------


# Each victim on one store (the kill is the same on both; see ON_SQLITE in conftest).
@pytest.mark.parametrize(
    ("db_url", "victim"), [("postgresql", "pool-child"), ("sqlite", "whole-worker")], indirect=["db_url"]
)
def test_sigkill_mid_job_completes_once(tmp_path: Path, db_url: str, redis_url: str, victim: str) -> None:
    key = f"kill-{uuid.uuid4().hex[:8]}"
    # A 2 s job; a 2 s lease (renewed while the holder lives: only a dead one's runs out); a 4 s visibility
    # timeout (Redis re-delivers no copy while a live holder still runs it).
    with cluster(tmp_path, db_url, redis_url, visibility_timeout=4, restore_interval=1, lease=2) as c:
        a, b = c.start("a"), c.start("b")
        c.wait_ready(a, b)
        result = c.send(EFFECT_TASK, key, 2.0)
        child = c.wait_executing(key)
        holder = next(w for w in c.workers if os.getpgid(child) == w.pid)
        assert child != holder.pid  # prefork: the body runs in a pool child
        if victim == "pool-child":
            # The parent sees WorkerLostError and rejects with requeue (task_reject_on_worker_lost).
            os.kill(child, signal.SIGKILL)
        else:
            # Host loss: parent and child die at once; the message stays unacked in Redis until the
            # visibility timeout, then the surviving worker restores and runs it.
            os.killpg(holder.pid, signal.SIGKILL)
            holder.proc.wait(timeout=30)

        value = result.get(timeout=JOB_TIMEOUT)
        assert c.executions(key) == 2
        assert c.effects(key) == 1
        assert c.effect_pids(key) == [value["pid"]] and value["pid"] != child
        run = c.store.get(EFFECT_TASK, run_key(key))
        assert run is not None and run.status is RunStatus.COMPLETED
        assert run.token == 2 and run.attempts == 2 and run.result == value
        assert c.outcomes().get("executed") == 1


# -- 4. a zombie holder ---------------------------------------------------------------------------------


@ON_SQLITE
def test_zombie_holder_cannot_commit(tmp_path: Path, db_url: str, redis_url: str) -> None:
    key = f"zombie-{uuid.uuid4().hex[:8]}"
    with cluster(tmp_path, db_url, redis_url, lease=2) as c:
        a, b = c.start("a", pool="solo"), c.start("b", pool="solo")
        c.wait_ready(a, b)
        first = c.send(EFFECT_TASK, key, 3.0)  # longer than the lease (2 s): frozen, it outlives its claim
        zombie_pid = c.wait_executing(key)
        zombie = next(w for w in c.workers if w.pid == zombie_pid)  # solo: the body runs in the worker
        freeze_between_transactions(zombie.pid, db_url)
        try:
            # The same job again: the other worker waits out the frozen holder's lease, then takes over.
            second = c.send(EFFECT_TASK, key, 3.0)
            taker_value = second.get(timeout=JOB_TIMEOUT)
            assert taker_value["pid"] != zombie.pid
            run = c.store.get(EFFECT_TASK, run_key(key))
            assert run is not None and run.status is RunStatus.COMPLETED and run.token == 2
            assert c.effects(key) == 1
        finally:
            os.kill(zombie.pid, signal.SIGCONT)

        # The zombie wakes inside its body, tries to write its effect and complete: fenced out.
        wait_for(lambda: c.outcomes().get("lease_lost", 0) >= 1, timeout=JOB_TIMEOUT, what="the zombie's lease_lost")
        # Its delivery is re-sent, not dropped, and answered with the taker's result.
        assert first.get(timeout=JOB_TIMEOUT) == taker_value

        assert c.executions(key) == 2
        assert c.effects(key) == 1 and c.effect_pids(key) == [taker_value["pid"]]
        run = c.store.get(EFFECT_TASK, run_key(key))
        assert run is not None and run.status is RunStatus.COMPLETED
        assert run.token == 2 and run.result == taker_value
        assert c.outcomes().get("executed") == 1


# -- 5. Redis flushed while the body runs -----------------------------------------------------------------


@ON_POSTGRESQL
def test_redis_flush_mid_job_keeps_one_effect(tmp_path: Path, db_url: str, redis_url: str) -> None:
    key = f"flush-{uuid.uuid4().hex[:8]}"
    with cluster(tmp_path, db_url, redis_url) as c:
        a = c.start("a", pool="solo")
        c.wait_ready(a)
        result = c.send(EFFECT_TASK, key, 1.5)
        c.wait_executing(key)
        # Claimed, body running: wipe the queue, the unacked bookkeeping and the results.
        c.flush_redis()
        value = result.get(timeout=JOB_TIMEOUT)
        assert c.executions(key) == 1 and c.effects(key) == 1

        # The same job after the flush: answered from the database, the body does not run again.
        again = c.send(EFFECT_TASK, key, 1.5).get(timeout=JOB_TIMEOUT)
        assert again == value
        assert c.executions(key) == 1
        assert c.effects(key) == 1
        run = c.store.get(EFFECT_TASK, run_key(key))
        assert run is not None and run.status is RunStatus.COMPLETED and run.token == 1 and run.result == value
        counts = c.outcomes()
        assert counts.get("executed") == 1 and counts.get("replayed") == 1


# -- 6. SIGKILL during step 2 of 3: resume, don't redo ------------------------------------------------------


@ON_SQLITE
def test_sigkill_during_step_two_resumes_from_checkpoint(tmp_path: Path, db_url: str, redis_url: str) -> None:
    key = f"steps-{uuid.uuid4().hex[:8]}"
    with cluster(tmp_path, db_url, redis_url, lease=2) as c:
        a = c.start("a")
        c.wait_ready(a)
        result = c.sender.send_task("oncelery.crash_steps", args=[key, 2.0])  # step 2 takes 2 s
        child = c.wait_executing(f"{key}:s2")  # step 1 checkpointed, step 2 running
        os.kill(child, signal.SIGKILL)  # reject_on_worker_lost requeues; a new pool child takes over
        value = result.get(timeout=JOB_TIMEOUT)

        assert value["steps"] == ["s1-done", "s2-done", "s3-done"] and value["pid"] != child
        assert c.executions(f"{key}:s1") == 1  # replayed from its checkpoint, not executed again
        assert c.executions(f"{key}:s2") == 2  # the killed step's body, then its re-execution
        assert c.executions(f"{key}:s3") == 1
        assert c.effects(key) == 1
        run = c.store.get("oncelery.crash_steps", f"steps:{key}")
        assert run is not None and run.status is RunStatus.COMPLETED and run.token == 2
        counts = c.store.outcome_counts("oncelery.crash_steps")
        # The redelivery may arrive before the dead holder's lease runs out: it then waits (in_progress).
        assert counts["resumed"] == 1 and "executed" not in counts and "failed" not in counts
