"""Fixtures: one contract suite over SQLite and PostgreSQL, a real Redis broker, in-process workers."""

from __future__ import annotations

import os
import shutil
import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.signals import before_task_publish
from sqlalchemy import text
from sqlalchemy.engine import Engine

from oncelery import CELERY_DELIVERY_DEFAULTS, IdempotentTask
from oncelery.llm.adapters.openai_responses import OpenAIResponses
from oncelery.models.migrate import JOBS, upgrade
from oncelery.store.database import dispose_engines, get_engine
from oncelery.testing import in_process_worker
from tests import services
from tests.pg_cluster import pg_cluster  # noqa: F401  (one throwaway cluster per session, for every module)
from tests.services import close_app
from tests.wheel_venv import oncelery_wheel  # noqa: F401  (the wheel, built once per session)

# The store-fault tests' helpers assert too: rewritten like a test module's asserts (before the import below).
pytest.register_assert_rewrite("tests.store_faults")

# The store-fault fixtures (a fresh database on the throwaway cluster, or a SQLite file; an app on it; the
# worker's log lines), for tests/test_store_fault_*.py and any other module that breaks the database.
from tests.store_faults import logs, pg_app, pg_db, sqlite_app, sqlite_db  # noqa: E402, F401

# The users' pytest kit, declared as a user's conftest declares it: installing Oncelery registers no pytest plugin
# (an unrelated pytest run of the environment never imports it; docs/testing.md).
pytest_plugins = ["oncelery.testing"]

ORDERED_TABLES = [
    "article_scores",
    "llm_intents",
    "llm_limiters",
    "llm_budgets",
    "oncelery_caps",
    "oncelery_cap_changes",
    "llm_batches",
    "llm_batch_items",
    "oncelery_leases",
    "model_calls",
    "ledger_totals",
    "ledger_label_totals",
    "step_results",
    "dead_letters",
    "outbox",
    "oncelery_debounce",
    "oncelery_forks",
    "entity_versions",
    "delivery_outcomes",
    "task_runs",
    "test_effects",
    "test_executions",
]


def migrated(url: str) -> Engine:
    """Return this process's engine for `url`, migrated to head (framework and jobs), with the test tables."""
    engine = get_engine(url)
    upgrade(engine)
    upgrade(engine, branch=JOBS)
    services.test_metadata.create_all(engine)
    return engine


@pytest.fixture(scope="session")
def pg_session_url() -> Iterator[str]:
    """A fresh PostgreSQL database for this test session, migrated to head."""
    services.need("PostgreSQL", services.postgres_available(), "start it (see README: Services)")
    services.recreate_pg_database()
    url = services.pg_url()
    migrated(url)
    yield url
    dispose_engines()
    services.drop_pg_database()


# One store only, for tests of process faults (SIGKILL, a broker that is down, redelivery): those behave the
# same on both stores, whose SQL the store contract and fault tests cover; the suite stays under its budget.
ON_SQLITE = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
ON_POSTGRESQL = pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite claims file migrated once per session, which each test's `db_url` file is a copy of."""
    path = tmp_path_factory.mktemp("sqlite-template") / "claims.db"
    migrated(f"sqlite:///{path}").dispose()
    with closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # every page in the file that is copied
    return path


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The claims database URL, once per store: a fresh SQLite file, and a truncated PostgreSQL database.

    The SQLite file is a copy of one migrated once (sqlite_template): the same schema as migrating each file,
    without the 0.2 s each migration costs."""
    if request.param == "sqlite":
        path = tmp_path / "claims.db"
        shutil.copyfile(request.getfixturevalue("sqlite_template"), path)
        url = f"sqlite:///{path}"
        engine = get_engine(url)
        yield url
        engine.dispose()
        return
    url = request.getfixturevalue("pg_session_url")
    engine = get_engine(url)
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE " + ", ".join(ORDERED_TABLES) + " RESTART IDENTITY CASCADE"))
    yield url


@pytest.fixture
def db_engine(db_url: str) -> Engine:
    """This process's engine for `db_url`."""
    return get_engine(db_url)


@pytest.fixture
def redis_url() -> str:
    """The test Redis URL (a dedicated logical database), required in CI."""
    services.need("Redis", services.redis_available(), "start redis-server (see README: Services)")
    return services.REDIS_URL


@pytest.fixture
def app(db_url: str, redis_url: str) -> Iterator[Celery]:
    """A Celery app on the real Redis broker, a unique queue, and `db_url` as the claims database."""
    celery_app = Celery(f"test-{os.getpid()}")
    celery_app.conf.update(
        **CELERY_DELIVERY_DEFAULTS,
        broker_url=redis_url,
        result_backend=redis_url,
        oncelery_database_url=db_url,
        # These tests send duplicates to prove what a WORKER does with them: the producer's own answer (on by
        # default where a claims database is configured) is tested in tests/test_producer_dedupe.py.
        oncelery_producer_dedupe=False,
        task_default_queue=services.unique_queue(),
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    yield celery_app
    close_app(celery_app)


@contextmanager
def running_worker(app: Celery, concurrency: int = 4, pool: str = "threads") -> Iterator[Any]:
    """Run a real in-process Celery worker consuming `app`'s queue until the block exits."""
    with in_process_worker(app, concurrency=concurrency, pool=pool) as worker:
        yield worker


def offline_job(app: Celery, name: str, **options: Any) -> Any:
    """An IdempotentTask `name` of `app` (with `options`) that returns its argument as text: for the tests that
    only build or call a task in the caller (no worker, no database)."""

    @app.task(shared=False, base=IdempotentTask, bind=True, name=name, **options)
    def job(self: IdempotentTask, doc: Any) -> str:
        return str(doc)

    return job


@pytest.fixture
def responses(fake: Any) -> Iterator[OpenAIResponses]:
    """An OpenAI Responses adapter (background mode) on the module's `fake` provider fixture, closed afterwards."""
    with OpenAIResponses(fake.openai_base_url, "sk") as adapter:
        yield adapter


@pytest.fixture
def worker_factory() -> Any:
    """Return `running_worker`, so tests can start a worker after defining their tasks."""
    return running_worker


@pytest.fixture
def published() -> Iterator[list[str]]:
    """The names of the tasks published while the test runs (Celery's before_task_publish signal)."""
    names: list[str] = []

    def record(sender: str | None = None, **_: Any) -> None:
        names.append(str(sender))

    before_task_publish.connect(record, weak=False)
    try:
        yield names
    finally:
        before_task_publish.disconnect(record)
