"""The sweeper meets Redis down while it puts a dead holder's job back: it waits, and the job still ends once.

A `celery worker` holding `crash_effect` (no kept message: the default on Redis) is SIGKILLed mid-body, so its
message stays in kombu's unacked hash (an hour's visibility timeout) and its lease expires on the database
clock. Redis is then down (shut down with its data saved, as a restart or a failover leaves it) when the relay's
sweeper runs: the sweep puts nothing back, raises nothing, logs that it retries after its interval, and leaves the
run as it was. Redis comes back with its data; the next sweep after the interval puts the message back, a new
worker takes the run over (token 2), and the body's effect is written once. A private `redis-server` (never the
shared one), on both stores.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from oncelery import RunStatus
from oncelery.relay.sweeper import sweep_lost_runs
from oncelery.store.database import Database
from tests.chaos.procs import Sessions
from tests.pg_cluster import free_port
from tests.services import wait_for
from tests.test_a_killed_workers_job_is_back_within_its_lease import HOUR, relay_app
from tests.test_crash import EFFECT_TASK, JOB_TIMEOUT, cluster
from tests.test_visibility_timeout import own_bookkeeping

pytestmark = pytest.mark.crash

BODY_SECONDS = 3.0  # long enough to be killed inside it; the survivor's run of it takes as long
INTERVAL = 0.5  # the sweeper's interval: how soon a run it could not put back is tried again


class PrivateRedis:
    """A redis-server of this test's own on a fixed port and folder, stopped and started again with its data."""

    def __init__(self, sessions: Sessions, workdir: Path) -> None:
        self.sessions = sessions
        self.workdir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.starts = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it (loading the data a shutdown saved in its folder) and wait until it answers PING."""
        self.starts += 1
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        argv += ["--dir", str(self.workdir)]
        self.proc = self.sessions.spawn(argv, dict(os.environ), self.workdir / f"redis-{self.starts}.log")
        wait_for(self.answers, timeout=JOB_TIMEOUT, interval=0.05, what="the private redis-server to answer")

    def answers(self) -> bool:
        """Whether it answers PING now."""
        try:
            with self.client() as client:
                return bool(client.ping())
        except redis.RedisError:
            return False

    def shut_down_saving(self) -> None:
        """SHUTDOWN SAVE: down, its data (the unacked hash included) on disk for the next start."""
        assert self.proc is not None
        # The server closes the connection as it exits: that is the answer.
        with self.client() as client, contextlib.suppress(redis.ConnectionError):
            client.shutdown(save=True)
        self.proc.wait(timeout=JOB_TIMEOUT)

    def client(self) -> redis.Redis:
        """A client of database 0 (the broker's)."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    """The test's own Redis, running; every server it started is stopped by its PID after the test."""
    sessions = Sessions()
    folder = tmp_path / "redis"
    folder.mkdir()
    server = PrivateRedis(sessions, folder)
    try:
        server.start()
        yield server
    finally:
        sessions.stop_all()


def held_in_unacked(server: PrivateRedis, queue: str) -> int:
    """How many messages the queue's unacked hash holds (a dead holder's)."""
    with server.client() as client:
        return int(client.hlen(own_bookkeeping(queue)["unacked_key"]))


@pytest.mark.parametrize("db_url", ["sqlite", "postgresql"], indirect=True)
def test_a_sweep_that_meets_redis_down_retries_and_the_job_ends_once(
    tmp_path: Path, db_url: str, private_redis: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    key = f"outage-{uuid.uuid4().hex[:8]}"
    run_key = f"crash:{key}"
    with cluster(tmp_path, db_url, private_redis.url, lease=2, visibility_timeout=HOUR) as c:
        holder = c.start("holder", pool="solo")
        c.wait_ready(holder)
        c.send(EFFECT_TASK, key, BODY_SECONDS)
        c.wait_executing(key)
        os.killpg(holder.pid, signal.SIGKILL)
        holder.proc.wait(timeout=JOB_TIMEOUT)

        def lease_expired() -> bool:
            run = c.store.get(EFFECT_TASK, run_key)
            return run is not None and run.status is RunStatus.RUNNING and not run.lease_live

        wait_for(lease_expired, timeout=JOB_TIMEOUT, what="the killed holder's lease to expire")
        assert held_in_unacked(private_redis, c.queue) == 1, "the dead holder's message waits in kombu's unacked"

        # Redis is down when the sweeper runs.
        private_redis.shut_down_saving()
        app, db = relay_app(c), Database(db_url)
        with caplog.at_level(logging.WARNING, logger="oncelery.sweeper"):
            assert sweep_lost_runs(app, db, interval=INTERVAL) == 0
        assert "could not put back 1 lost jobs on Redis" in caplog.text, caplog.text
        run = c.store.get(EFFECT_TASK, run_key)
        assert run is not None and run.status is RunStatus.RUNNING and run.token == 1, "nothing changed the run"

        # Redis is back, with the message still unacked: the next sweep after the interval puts it back.
        private_redis.start()
        assert held_in_unacked(private_redis, c.queue) == 1
        survivor = c.start("survivor", pool="solo")
        c.wait_ready(survivor)
        wait_for(
            lambda: sweep_lost_runs(app, db, interval=INTERVAL) == 1,
            timeout=JOB_TIMEOUT,
            interval=0.1,
            what="a sweep after the interval to put the job back",
        )

        def completed() -> bool:
            done = c.store.get(EFFECT_TASK, run_key)
            return done is not None and done.status is RunStatus.COMPLETED

        wait_for(completed, timeout=JOB_TIMEOUT, what="the job to complete on the survivor")
        run = c.store.get(EFFECT_TASK, run_key)
        assert run is not None and run.token == 2, "taken over once, by the survivor"
        assert c.executions(key) == 2 and c.effects(key) == 1, "the killed body, then one that wrote the effect"
        assert survivor.log().count("] received") == 1, "put back once"
        assert held_in_unacked(private_redis, c.queue) == 0
        assert sweep_lost_runs(app, db, interval=0.0) == 0, "a finished run is never put back again"
