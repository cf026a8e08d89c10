"""The fixtures and options of the `oncelery` pytest plugin (loaded through `oncelery.testing`).

Which database `oncelery_db` is, in order: `--oncelery-db-url` / $ONCELERY_TEST_DATABASE_URL (a PostgreSQL
server URL, or `sqlite`); else the PostgreSQL server at DEFAULT_TEST_SERVER when it answers and lets this role
create databases; else a SQLite file. On PostgreSQL each test gets a fresh database named
`<prefix><random>` (`--oncelery-db-prefix` / $ONCELERY_TEST_DB_PREFIX, default `oncelery_test_`), copied from
a template migrated once per session, and dropped after the test.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
from celery.contrib.testing.worker import start_worker
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from oncelery.errors import ConfigurationError
from oncelery.settings import ENV_PASS_THROUGH
from oncelery.store.database import dispose_engines, get_engine
from oncelery.store.schema import upgrade_schema
from oncelery.testing.broker import TEST_VISIBILITY_TIMEOUT, TEST_WORKER_POLL
from oncelery.testing.cluster import PgCluster, missing_binaries, postgres_bindir, teardown_on_sigterm
from oncelery.testing.db import OnceleryDb
from oncelery.testing.isolation import isolated
from oncelery.testing.worker import WorkerProcess, check_test_database, import_app

__all__ = [
    "DEFAULT_DB_PREFIX",
    "DEFAULT_TEST_SERVER",
    "ENV_TEST_DATABASE_URL",
    "ENV_TEST_DB_PREFIX",
    "TEST_WORKER_POLL",
    "in_process_worker",
    "oncelery_app",
    "oncelery_cluster_db",
    "oncelery_db",
    "oncelery_pass_through",
    "oncelery_pg_cluster",
    "oncelery_worker",
    "oncelery_worker_process",
    "pytest_addoption",
    "running_worker",
]

ENV_TEST_DATABASE_URL = "ONCELERY_TEST_DATABASE_URL"
ENV_TEST_DB_PREFIX = "ONCELERY_TEST_DB_PREFIX"
DEFAULT_DB_PREFIX = "oncelery_test_"
#: The PostgreSQL server oncelery_db uses when none is given, if it answers (libpq's PGPASSWORD applies).
DEFAULT_TEST_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
_PROBE_TIMEOUT = 2  # seconds the default server has to answer before the kit settles for SQLite


# -- the databases ---------------------------------------------------------------------------------------


class _Templates:
    """One migrated template database per PostgreSQL server for the session: a test's database is a copy."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._made: dict[str, str] = {}  # server admin URL -> template name

    def fresh(self, server: str) -> tuple[str, str]:
        """Create a fresh migrated database on `server` (a copy of the session's template); (name, URL)."""
        template = self._made.get(server)
        if template is None:
            template = f"{self.prefix}template_{os.getpid()}_{uuid.uuid4().hex[:6]}"
            _admin(server, f'CREATE DATABASE "{template}"')
            self._made[server] = template
            url = _on(server, template)
            upgrade_schema(url)
            get_engine(url).dispose()  # CREATE DATABASE ... TEMPLATE needs it without connections
        name = f"{self.prefix}{uuid.uuid4().hex[:12]}"
        _admin(server, f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        return name, _on(server, name)

    def drop_all(self) -> None:
        """Drop the templates (at the session's end)."""
        for server, template in self._made.items():
            with suppress(Exception):  # the server may be gone (a removed cluster): nothing left to drop there
                _admin(server, f'DROP DATABASE IF EXISTS "{template}" WITH (FORCE)')
        self._made.clear()


def _on(server: str, name: str) -> str:
    return make_url(server).set(database=name).render_as_string(hide_password=False)


def _admin(server: str, sql: str) -> None:
    engine = create_engine(server, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text(sql))
    finally:
        engine.dispose()


def _default_server_answers() -> bool:
    """Whether DEFAULT_TEST_SERVER accepts a connection within _PROBE_TIMEOUT and lets this role create databases."""
    try:
        import psycopg  # noqa: F401  (the `postgres` extra; without it the kit uses SQLite)
    except ImportError:
        return False
    probe = "SELECT rolcreatedb OR rolsuper FROM pg_roles WHERE rolname = current_user"
    engine = create_engine(DEFAULT_TEST_SERVER, poolclass=NullPool, connect_args={"connect_timeout": _PROBE_TIMEOUT})
    try:
        with engine.connect() as conn:
            return bool(conn.execute(text(probe)).scalar())
    except Exception:  # unreachable, refused, no such role: any of them means "not this server"
        return False
    finally:
        engine.dispose()


def _prefix(config: pytest.Config) -> str:
    prefix = config.getoption("oncelery_db_prefix", None) or os.environ.get(ENV_TEST_DB_PREFIX) or DEFAULT_DB_PREFIX
    if not prefix.replace("_", "").isalnum() or not prefix[0].isalpha():
        raise ConfigurationError(
            f"--oncelery-db-prefix / {ENV_TEST_DB_PREFIX} = {prefix!r}: use letters, digits and _ (a letter first)"
        )
    return prefix.lower()


@pytest.fixture(scope="session")
def _oncelery_templates(request: pytest.FixtureRequest) -> Iterator[_Templates]:
    templates = _Templates(_prefix(request.config))
    try:
        yield templates
    finally:
        dispose_engines()
        templates.drop_all()


@pytest.fixture(scope="session")
def _oncelery_server(request: pytest.FixtureRequest) -> str | None:
    """The PostgreSQL server of oncelery_db (given, else the default one if it answers), or None: SQLite."""
    given = request.config.getoption("oncelery_db_url", None) or os.environ.get(ENV_TEST_DATABASE_URL)
    if given:
        if str(given).lower() == "sqlite":
            return None
        if not str(given).startswith("postgresql"):
            raise ConfigurationError(
                f"--oncelery-db-url / {ENV_TEST_DATABASE_URL} must be a postgresql:// URL or sqlite"
            )
        return str(given)
    return DEFAULT_TEST_SERVER if _default_server_answers() else None


@pytest.fixture
def oncelery_db(
    request: pytest.FixtureRequest, tmp_path: Path, _oncelery_server: str | None, _oncelery_templates: _Templates
) -> Iterator[OnceleryDb]:
    """A fresh migrated claims schema: a new database on PostgreSQL when one is reachable, else a SQLite file."""
    if _oncelery_server is None:
        url = f"sqlite:///{tmp_path / 'oncelery.db'}"
        upgrade_schema(url)
        yield OnceleryDb(url)
        dispose_engines()
        return
    name, url = _oncelery_templates.fresh(_oncelery_server)
    try:
        yield OnceleryDb(url)
    finally:
        dispose_engines()
        _admin(_oncelery_server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def oncelery_pg_cluster() -> Iterator[PgCluster]:
    """One throwaway PostgreSQL cluster for the session (skipped, with the reason, without PostgreSQL's server
    binaries): stopped by its PID and removed at the end. Tests share it, never a database."""
    why = missing_binaries()
    bindir = postgres_bindir()
    if why is not None or bindir is None:
        pytest.skip(f"oncelery_pg_cluster: {why}")
    cluster = PgCluster(bindir)
    with teardown_on_sigterm():
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.remove()


@pytest.fixture
def oncelery_cluster_db(oncelery_pg_cluster: PgCluster, _oncelery_templates: _Templates) -> Iterator[OnceleryDb]:
    """A fresh migrated claims database on the throwaway cluster, which `database_down` may stop: to use it as
    `oncelery_db`, override that fixture to return this one. Left running for the next test, whatever this one did."""
    oncelery_pg_cluster.ensure_running()
    name, url = _oncelery_templates.fresh(oncelery_pg_cluster.url)
    try:
        yield OnceleryDb(url, cluster=oncelery_pg_cluster)
    finally:
        dispose_engines()
        oncelery_pg_cluster.ensure_running()
        oncelery_pg_cluster.drop_database(name)


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
    """Run a real in-process worker (threads) of `app` on `db` for the block: for tasks defined in the test.

    For the block the app is isolated (oncelery.testing.isolation): the test process and the worker use `db`, the
    test's own queues and results, whatever the app configures, and never the developer's; the app's settings
    are back after. Should the app set its database again when the worker starts, WorkerDatabaseMismatch
    names both URLs.
    """
    with isolated(app, db.url):
        check_test_database(app, db.url, "the kit's in-process worker")
        with in_process_worker(app, concurrency=concurrency) as worker:
            # The app's own worker_init handlers have run by now: the test database must still be the one.
            check_test_database(app, db.url, "the kit's in-process worker")
            yield worker


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


@pytest.fixture
def oncelery_pass_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """Switch the claim off for this test ($ONCELERY_PASS_THROUGH=1): task bodies run as plain functions."""
    monkeypatch.setenv(ENV_PASS_THROUGH, "1")


@pytest.fixture
def oncelery_worker_process(request: pytest.FixtureRequest, oncelery_db: OnceleryDb, tmp_path: Path) -> Iterator[Any]:
    """A factory: `oncelery_worker_process("myapp.celery:app")` starts a real worker subprocess on `oncelery_db`.

    The app path may also come from the ini option `oncelery_app`. The worker uses `oncelery_db` whatever the
    app configures (or refuses to start, naming both URLs), and so does the test process until the test ends:
    the app is isolated (oncelery.testing.isolation) from the fixture's start where it is known then (the test
    uses `oncelery_app`, or the ini names it), else from the first worker's start (WorkerProcess isolates the app
    at its path). On Redis a worker gives a killed worker's job back after `visibility_timeout` seconds (default
    TEST_VISIBILITY_TIMEOUT; None keeps the app's).
    """
    started: list[WorkerProcess] = []
    with ExitStack() as isolations:
        apps: set[int] = set()

        def isolate(app: Any) -> None:
            if id(app) not in apps:
                isolations.enter_context(isolated(app, oncelery_db.url))
                apps.add(id(app))

        if "oncelery_app" in request.fixturenames:
            isolate(request.getfixturevalue("oncelery_app"))
        if request.config.getini("oncelery_app"):
            isolate(import_app(str(request.config.getini("oncelery_app"))))

        def start(
            app_path: str | None = None,
            hostname: str | None = None,
            concurrency: int = 1,
            visibility_timeout: float | None = TEST_VISIBILITY_TIMEOUT,
            **env: str,
        ) -> Any:
            path = app_path or request.config.getini("oncelery_app")
            if not path:
                raise ConfigurationError("give the app's import path: oncelery_worker_process('pkg.module:app')")
            name = hostname or f"oncelery-test-{len(started) + 1}-{uuid.uuid4().hex[:6]}@%h"
            log_dir = {"ONCELERY_TEST_LOG_DIR": str(tmp_path), **env}
            worker = WorkerProcess(str(path), oncelery_db, name, concurrency, log_dir, visibility_timeout)
            started.append(worker)
            return worker

        try:
            yield start
        finally:
            for worker in started:
                worker.stop()


# -- the plugin's options ------------------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    """--oncelery-db-url, --oncelery-db-prefix (oncelery_db's server and database names), the ini oncelery_app."""
    group = parser.getgroup("oncelery")
    group.addoption(
        "--oncelery-db-url",
        dest="oncelery_db_url",
        default=None,
        help=f"PostgreSQL server on which oncelery_db creates a fresh database per test, or `sqlite` (or "
        f"${ENV_TEST_DATABASE_URL}; default: {DEFAULT_TEST_SERVER} if it answers, else SQLite)",
    )
    group.addoption(
        "--oncelery-db-prefix",
        dest="oncelery_db_prefix",
        default=None,
        help=f"name prefix of the kit's PostgreSQL test databases (or ${ENV_TEST_DB_PREFIX}; "
        f"default {DEFAULT_DB_PREFIX})",
    )
    parser.addini("oncelery_app", "import path ('pkg.module:app') of the app oncelery_worker_process starts")
