"""A worker on Redis gets the visibility timeout its tasks' leases need (max_lease + lease), merged into the app's
broker_transport_options where the app sets none, and keeps the app's own where it sets one; the startup check
says in one line when the app's is far from the leases, either way. A killed worker's job then comes back after
seconds, not kombu's hour.

Real Redis; a real in-process worker (its kombu channel is read), and `celery worker` subprocesses for the kill.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, signals
from celery.contrib.testing.worker import start_worker

from oncelery import CELERY_DELIVERY_DEFAULTS, IdempotentTask, Runs, RunStatus
from oncelery.store.database import dispose_engines
from tests.conftest import migrated
from tests.services import clean_env, close_app, delete_queue_keys, stop_sessions, unique_queue, wait_for

STARTUP_LOGGER = "oncelery.startup"


@pytest.fixture(scope="module")
def db_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One migrated SQLite claims database for the module: the startup check needs one; no test here stores runs
    but the kill test, under a key of its own."""
    url = f"sqlite:///{tmp_path_factory.mktemp('visibility') / 'claims.db'}"
    migrated(url)
    yield url
    dispose_engines()


@pytest.fixture
def queue(redis_url: str) -> Iterator[str]:
    """A queue of this test's own; its keys (and the unacked bookkeeping named after it) are deleted after."""
    name = unique_queue()
    yield name
    delete_queue_keys(redis_url, name)


def own_bookkeeping(queue: str) -> dict[str, Any]:
    """Transport options that keep the app's unacked messages apart: a short timeout must restore no one else's."""
    return {
        "unacked_key": f"{queue}.unacked",
        "unacked_index_key": f"{queue}.unacked_index",
        "unacked_mutex_key": f"{queue}.unacked_mutex",
    }


def make_app(db_url: str, broker: str, queue: str, options: dict[str, Any] | None) -> Celery:
    """An app with two idempotent tasks (holds 1+2 = 3 s and 5+2 = 7 s) and the given transport options."""
    app = Celery(f"visibility-{queue}", broker=broker, set_as_current=False)
    app.conf.update(
        **CELERY_DELIVERY_DEFAULTS,
        oncelery_database_url=db_url,
        task_default_queue=queue,
        worker_hijack_root_logger=False,
    )
    if options is not None:
        app.conf.broker_transport_options = options

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_vt_short", lease=1, max_lease=2)
    def short(self: IdempotentTask, n: int) -> int:
        return n

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_vt_long", lease=2, time_limit=5)
    def long(self: IdempotentTask, n: int) -> int:
        return n

    return own_tasks_only(app)


def own_tasks_only(app: Celery) -> Celery:
    """Finalize `app` with its own idempotent tasks only: Celery adds every shared task this process has defined
    (the demo's score_article, other tests' apps) to each app it finalizes, and one with no max_lease would stop
    the derivation; a worker's app holds only its project's tasks."""
    app.finalize()
    for name, task in list(app.tasks.items()):
        if isinstance(task, IdempotentTask) and not name.startswith("oncelery.t_vt_"):
            del app.tasks[name]
    return app


class Starting:
    """What worker_init's sender offers the startup check: the worker's app and host name."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.hostname = "visibility@test"


def worker_starts(app: Celery) -> None:
    """Send worker_init as a starting worker does (the startup check runs), without consuming anything."""
    signals.worker_init.send(sender=Starting(app))


def test_an_app_without_one_gets_max_lease_plus_lease_on_the_workers_channel(
    db_url: str, redis_url: str, queue: str
) -> None:
    """No visibility_timeout: the worker's kombu channel (and its QoS, which restores unacked messages) has
    7 s, the longest max_lease + lease; the app's other options (priority_steps...) are on the channel too."""
    options = {"priority_steps": [0, 5, 9], "polling_interval": 0.1, **own_bookkeeping(queue)}
    app = make_app(db_url, redis_url, queue, options)
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=30) as worker:
            channel = worker.consumer.task_consumer.channel
            assert channel.visibility_timeout == 7.0
            assert channel.qos.visibility_timeout == 7.0
            assert channel.priority_steps == [0, 5, 9] and channel.unacked_key == f"{queue}.unacked"
        assert app.conf.broker_transport_options == {**options, "visibility_timeout": 7.0}
        assert "visibility_timeout" not in options  # merged into a new dict: the app's own is left as it was
    finally:
        close_app(app)


def test_an_apps_own_timeout_and_options_are_kept_on_the_workers_channel(
    db_url: str, redis_url: str, queue: str, caplog: pytest.LogCaptureFixture
) -> None:
    """visibility_timeout=10 (within 4x the 7 s hold): kept as it is, with priority_steps; no warning."""
    options = {"visibility_timeout": 10, "priority_steps": [0, 3, 6], "polling_interval": 0.1, **own_bookkeeping(queue)}
    app = make_app(db_url, redis_url, queue, dict(options))
    try:
        with (
            caplog.at_level(logging.INFO, logger=STARTUP_LOGGER),
            start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=30) as worker,
        ):
            channel = worker.consumer.task_consumer.channel
            assert channel.visibility_timeout == 10 and channel.qos.visibility_timeout == 10
            assert channel.priority_steps == [0, 3, 6]
        assert app.conf.broker_transport_options == options
        assert not [r for r in caplog.records if r.name == STARTUP_LOGGER and r.levelno >= logging.WARNING]
    finally:
        close_app(app)


@pytest.mark.parametrize(
    ("broker", "options", "derived"),
    [
        ("sentinel://127.0.0.1:26379;sentinel://127.0.0.1:26380", {"master_name": "mymaster"}, True),
        ("rediss://127.0.0.1:6380/0", {"ssl_cert_reqs": "required"}, True),
        ("amqp://guest@127.0.0.1:5672//", {"confirm_publish": True}, False),
        ("oncelery-fs://", {"data_folder_in": "/nowhere"}, False),
    ],
)
def test_redis_like_brokers_get_it_merged_and_others_are_left_alone(
    db_url: str, broker: str, options: dict[str, Any], derived: bool
) -> None:
    """Sentinel and rediss keep master_name / ssl options beside the derived timeout, in the very options kombu's
    connection for the consumer is built from; RabbitMQ and the embedded broker get nothing added."""
    app = make_app(db_url, broker, unique_queue(), dict(options))
    try:
        worker_starts(app)
        expected = {**options, "visibility_timeout": 7.0} if derived else options
        assert app.conf.broker_transport_options == expected
        conn = app.connection_for_read()
        try:
            assert conn.transport_options == expected
        finally:
            conn.release()
    finally:
        app.close()


@pytest.mark.parametrize(
    ("options", "tasks_bounded", "line"),
    [
        ({"visibility_timeout": 2}, True, "visibility_timeout=2 s < hold 7 s (oncelery.t_vt_long: max_lease+lease)"),
        ({"visibility_timeout": 3600}, True, "visibility_timeout=3600 s > 4x hold 7 s (oncelery.t_vt_long"),
        ({}, False, "oncelery.t_vt_unbounded has no max_lease (nor time_limit): visibility_timeout stays 3600 s"),
    ],
)
def test_a_timeout_far_from_the_holds_is_one_warning_line(
    db_url: str,
    redis_url: str,
    caplog: pytest.LogCaptureFixture,
    options: dict[str, Any],
    tasks_bounded: bool,
    line: str,
) -> None:
    """Below the longest hold (a running job redelivered mid-run), above 4x it (a killed worker's job waits), or
    not derivable (a task with no bound): one line each, on oncelery.startup; nothing is changed."""
    app = make_app(db_url, redis_url, unique_queue(), dict(options))
    if not tasks_bounded:

        @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_vt_unbounded")
        def unbounded(self: IdempotentTask, n: int) -> int:
            return n

    try:
        with caplog.at_level(logging.INFO, logger=STARTUP_LOGGER):
            worker_starts(app)
        warnings = [r.getMessage() for r in caplog.records if r.name == STARTUP_LOGGER and r.levelno == logging.WARNING]
        assert len(warnings) == 1 and line in warnings[0], warnings
        assert "\n" not in warnings[0]
        assert app.conf.broker_transport_options == options
    finally:
        app.close()


KILL_APP = """
import os, time
from pathlib import Path
from celery import Celery
from oncelery import CELERY_DELIVERY_DEFAULTS, IdempotentTask

queue = os.environ["VT_QUEUE"]
app = Celery("vtkill", broker=os.environ["VT_BROKER"], set_as_current=False)
app.conf.update(
    CELERY_DELIVERY_DEFAULTS,
    oncelery_database_url=os.environ["VT_DB"],
    task_default_queue=queue,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    # The app's own restore sweep (kombu's default scans every 100 s) and bookkeeping; no visibility_timeout.
    broker_transport_options={
        "unacked_restore_interval": 0.5,
        "unacked_restore_throttle": 1,
        "polling_interval": 0.1,
        "unacked_key": queue + ".unacked",
        "unacked_index_key": queue + ".unacked_index",
        "unacked_mutex_key": queue + ".unacked_mutex",
    },
)


@app.task(base=IdempotentTask, bind=True, name="oncelery.t_vt_kill", lease=0.5, max_lease=1)
def job(self, n):
    hold = Path(os.environ["VT_HOLD"])
    (hold.parent / f"started-{os.getpid()}").touch()
    deadline = time.monotonic() + 60
    while hold.exists() and time.monotonic() < deadline:  # the first holder stays here until it is killed
        time.sleep(0.05)
    return n * 2
"""


def test_a_sigkilled_workers_job_comes_back_after_the_derived_timeout(
    db_url: str, redis_url: str, queue: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `celery worker` of an app with no visibility_timeout (max_lease 1 + lease 0.5: 2 s) is SIGKILLed while it
    runs the job; a worker of the same app started after it runs that job within seconds, taking the run over
    (kombu's default would hold it back for an hour)."""
    (tmp_path / "vtkill.py").write_text(KILL_APP)
    hold = tmp_path / "hold"
    hold.touch()
    env = {"VT_QUEUE": queue, "VT_BROKER": redis_url, "VT_DB": db_url, "VT_HOLD": str(hold)}
    argv = [sys.executable, "-m", "celery", "-A", "vtkill", "worker", "--pool", "solo", "-l", "INFO"]
    with (tmp_path / "holder.log").open("wb") as log:
        holder = subprocess.Popen(
            argv,
            cwd=tmp_path,
            env=clean_env(PYTHONPATH=str(tmp_path), **env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.syspath_prepend(str(tmp_path))
        import vtkill  # the same app in this process: it sends the job, and its in-process worker survives

        own_tasks_only(vtkill.app)
        vtkill.job.delay(21)
        wait_for(lambda: (tmp_path / f"started-{holder.pid}").exists(), timeout=60, what="the worker to start the job")
        os.killpg(holder.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        hold.unlink()
        with start_worker(vtkill.app, pool="solo", perform_ping_check=False, shutdown_timeout=30):
            runs = Runs(db_url)
            done = wait_for(
                lambda: runs.list(task_name="oncelery.t_vt_kill", status=RunStatus.COMPLETED),
                timeout=30,
                what="the new worker to get the killed worker's job back (after the derived 2 s, not 3600 s)",
            )
        print(f"job back and done {time.monotonic() - killed_at:.1f} s after the kill")
        assert [run.result for run in done] == [42] and done[0].token == 2  # taken over from the killed holder
        assert vtkill.app.conf.broker_transport_options["visibility_timeout"] == 2.0
    finally:
        stop_sessions([holder])
        sys.modules.pop("vtkill", None)
