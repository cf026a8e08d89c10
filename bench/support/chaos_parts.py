"""The parts of bench/store_chaos.py around its run: chaos thread, worker process, Redis queue, run resources.

Split out of store_chaos.py (which keeps the app, the run and the counts) to keep each file under 400 lines.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import redis
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from oncelery import StoreError
from oncelery.store.database import dispose_engines
from tests.pg_cluster import PgCluster

T = TypeVar("T")
KILL_EVERY = 0.5  # seconds between two rounds of backend terminations (jittered +-20 %)
WORKER_GRACE = 30.0
APP_MODULE = "chaos_app"


def key_of(n: int) -> str:
    """The idempotency key of job n."""
    return f"chaos:{n}"


def expected(n: int) -> dict[str, int]:
    """The result job n must store."""
    return {"n": n, "first": 2 * n, "second": 2 * n + 1}


def retrying(fn: Callable[[], T], what: str, timeout: float = 120.0) -> T:
    """Call `fn` until it gets past a database fault (a killed connection, a restarting server)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except (StoreError, DBAPIError) as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"kept failing for {timeout}s while {what}: {exc}") from exc
            time.sleep(0.2)


class Chaos(threading.Thread):
    """Every ~0.5 s terminate every client backend of the database; restart the cluster once when told."""

    def __init__(self, cluster: PgCluster, database: str, seed: int = 8) -> None:
        super().__init__(name="chaos", daemon=True)
        self.cluster = cluster
        self.database = database
        self.stop_event = threading.Event()
        self.restart_now = threading.Event()
        self.rounds = 0  # termination rounds that killed at least one backend
        self.empty_rounds = 0  # rounds that found no backend to kill
        self.backends_killed = 0
        self.restarts = 0
        self.restart_seconds = 0.0
        self.errors: list[BaseException] = []
        self.rng = random.Random(seed)

    def run(self) -> None:
        """Kill rounds until stopped; the one restart when asked (errors are kept, the cluster restarted)."""
        while not self.stop_event.wait(KILL_EVERY * self.rng.uniform(0.8, 1.2)):
            try:
                if self.restart_now.is_set() and not self.restarts:
                    started = time.monotonic()
                    self.cluster.restart("fast")
                    self.restart_seconds = time.monotonic() - started
                    self.restarts += 1
                    continue
                killed = self.cluster.terminate_backends(database=self.database)
                if killed:
                    self.rounds += 1
                    self.backends_killed += killed
                else:
                    self.empty_rounds += 1
            except Exception as exc:
                self.errors.append(exc)
                if not self.cluster.running():
                    with suppress(Exception):
                        self.cluster.start()

    def stop(self) -> None:
        """Stop the chaos and wait for the thread."""
        self.stop_event.set()
        self.join(120)


def start_worker(env: dict[str, str], cwd: Path, logfile: Path) -> subprocess.Popen[bytes]:
    """Start `celery -A chaos_app worker` (prefork 2) in a session of its own, logging to `logfile`."""
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        APP_MODULE,
        "worker",
        "--pool",
        "prefork",
        "--concurrency",
        "2",
        "--loglevel",
        "INFO",
        "-n",
        f"chaos-{uuid.uuid4().hex[:6]}@%h",
        "--without-mingle",
        "--without-gossip",
    ]
    log = open(logfile, "ab")  # noqa: SIM115  (the worker writes to it; closed with the process)
    try:
        return subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()


def stop_worker(proc: subprocess.Popen[bytes]) -> int | None:
    """SIGTERM the worker (warm shutdown), then SIGKILL its session after WORKER_GRACE seconds."""
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGCONT)
    with suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=WORKER_GRACE)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the session this script started for it (pool children too)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    return proc.returncode


def delete_queue_keys(redis_url: str, queue: str) -> int:
    """Delete the queue's keys and its messages in kombu's shared `unacked` bookkeeping; return how many."""
    client = redis.Redis.from_url(redis_url)
    removed = 0
    try:
        keys = list(client.scan_iter(match=f"*{queue}*"))
        if keys:
            removed += int(client.delete(*keys))
        for tag, raw in client.hscan_iter("unacked"):
            try:
                _message, _exchange, routing_key = json.loads(raw)
            except (ValueError, TypeError):
                continue
            if routing_key == queue:
                removed += int(client.hdel("unacked", tag))
                client.zrem("unacked_index", tag)
    finally:
        client.close()
    return removed


def queue_length(redis_url: str, queue: str) -> int:
    """The number of messages waiting in the Redis list of `queue`."""
    client = redis.Redis.from_url(redis_url)
    try:
        return int(client.llen(queue))
    finally:
        client.close()


@dataclass
class ChaosRun:
    """One run: its options, and what `cleanup` releases whatever happened (filled in as the run goes)."""

    opts: argparse.Namespace
    queue: str
    workdir: Path
    cluster: PgCluster
    dbname: str = ""
    url: str = ""
    worker: subprocess.Popen[bytes] | None = None
    chaos: Chaos | None = None
    observer: Engine | None = None

    @property
    def logfile(self) -> Path:
        """The worker's log, in the temporary folder."""
        return self.workdir / "worker.log"


def cleanup(run: ChaosRun, code: int) -> None:
    """Stop the chaos and the worker, drop the queue's keys and the cluster; keep the log unless all went well."""
    if run.chaos is not None and run.chaos.is_alive():
        run.chaos.stop()
    if run.worker is not None:
        rc = stop_worker(run.worker)
        print(f"worker stopped (exit {rc})", flush=True)
    if run.observer is not None:
        run.observer.dispose()
    dispose_engines()
    with suppress(Exception):
        delete_queue_keys(run.opts.broker_url, run.queue)
    if run.opts.keep_log and run.logfile.exists():
        with suppress(OSError):
            Path(run.opts.keep_log).write_bytes(run.logfile.read_bytes())
    run.cluster.remove()
    if code == 0:
        shutil.rmtree(run.workdir, ignore_errors=True)
    else:
        print(f"worker log kept: {run.logfile}")
