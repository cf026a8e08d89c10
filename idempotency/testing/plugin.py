"""The fixtures and options of the `oncelery` pytest plugin (loaded through `oncelery.testing`)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from celery.contrib.testing.worker import start_worker
from sqlalchemy import text
from sqlalchemy.engine import make_url

from oncelery.errors import ConfigurationError
from oncelery.settings import CONF_DATABASE_URL, ENV_PASS_THROUGH
from oncelery.store.database import Database, dispose_engines
from oncelery.store.schema import upgrade_schema
from oncelery.testing.db import OnceleryDb
from oncelery.testing.faults import (
    WorkerProcess,
)

__all__ = [
    "ENV_TEST_DATABASE_URL",
    "TEST_WORKER_POLL",
    "in_process_worker",
    "oncelery_app",
    "oncelery_db",
    "oncelery_pass_through",
    "oncelery_worker",
    "oncelery_worker_process",
    "pytest_addoption",
    "running_worker",
]

ENV_TEST_DATABASE_URL = "ONCELERY_TEST_DATABASE_URL"


# -- the database and the worker ------------------------------------------------------------------------


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
    with _database_of(app, db.url), in_process_worker(app, concurrency=concurrency) as worker:
        yield worker


#: How often an in-process test worker on Redis asks for the next message (kombu's default: every 1 s).
TEST_WORKER_POLL = 0.1


@contextmanager
def in_process_worker(app: Any, concurrency: int = 4, pool: str = "threads", **options: Any) -> Iterator[Any]:
    """Celery's in-process test worker of `app` for the block; on Redis it stops in ~0.1 s instead of ~1 s.

    A stopping Redis consumer first waits for the answer to its outstanding BRPOP, which kombu sends with a
    1 s timeout: every worker of a test suite costs that second at its end. For the block, the transport's
    `polling_interval` (kombu's BRPOP timeout on Redis) is 0.1 s unless the app sets one itself.
    """
    app.finalize()
    before = app.conf.broker_transport_options
    on_redis = str(app.conf.broker_url or "").startswith(("redis://", "rediss://"))
    if on_redis and "polling_interval" not in (before or {}):
        app.conf.broker_transport_options = {**(before or {}), "polling_interval": TEST_WORKER_POLL}
    try:
        with start_worker(
            app, pool=pool, concurrency=concurrency, perform_ping_check=False, shutdown_timeout=30, **options
        ) as worker:
            yield worker
    finally:
        app.conf.broker_transport_options = before


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
