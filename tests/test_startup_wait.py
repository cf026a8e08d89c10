"""A worker started before its claims database answers waits for it (bounded, with backoff, one line per retry)
and then starts; past the bound it refuses in one line; a database that answers but is wrong (a schema behind
the code, no such database) is refused at once, since waiting cannot fix it.

The startup check runs as a starting worker runs it (Celery's worker_init); the database that comes up late is
the throwaway PostgreSQL cluster, stopped and started again by the test.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, signals

from oncelery import IdempotentTask
from oncelery.models.migrate import upgrade
from oncelery.store.database import dispose_engines, get_engine
from tests.pg_cluster import PgCluster, free_port
from tests.services import wait_for

STARTUP_LOGGER = "oncelery.startup"
RETRY_LINE = "; retry "


class Starting:
    """What worker_init's sender offers the startup check: the worker's app and host name."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.hostname = "startup-wait@test"


def worker_app(url: str, **conf: Any) -> Celery:
    """An app with one idempotent task on the claims database `url` (no broker needed: nothing is consumed)."""
    app = Celery("startup-wait", broker="memory://", set_as_current=False)
    app.conf.update(oncelery_database_url=url, **conf)

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_startup_wait")
    def job(self: IdempotentTask, n: int) -> int:
        return n

    return app


def start(app: Celery) -> str | None:
    """Run the startup check as a starting worker does; return its refusal (the worker's exit message), or None."""
    try:
        signals.worker_init.send(sender=Starting(app))
    except SystemExit as exc:
        return str(exc.code)
    return None


def retries(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The retry lines the startup check logged."""
    return [r.getMessage() for r in caplog.records if r.name == STARTUP_LOGGER and RETRY_LINE in r.getMessage()]


@pytest.fixture
def late_database(pg_cluster: PgCluster) -> Iterator[str]:
    """A migrated database on the throwaway cluster, with the cluster stopped: it comes up when the test says."""
    name, url = pg_cluster.create_database("startup_wait")
    upgrade(get_engine(url))
    dispose_engines()
    pg_cluster.stop()
    try:
        yield url
    finally:
        dispose_engines()
        pg_cluster.ensure_running()
        pg_cluster.drop_database(name)


def test_a_worker_waits_for_a_database_that_comes_up_late_then_starts(
    late_database: str, pg_cluster: PgCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """The cluster is down when the worker starts: the check retries (one line each, numbered once) until the
    cluster is up a moment later, then passes; the worker is not refused."""
    app = worker_app(late_database, oncelery_startup_wait_s=60)
    refusal: list[str | None] = []
    with caplog.at_level(logging.INFO, logger=STARTUP_LOGGER):
        starting = threading.Thread(target=lambda: refusal.append(start(app)), name="starting-worker", daemon=True)
        starting.start()
        wait_for(lambda: retries(caplog), timeout=30, what="the startup check to wait for the database")
        pg_cluster.start()
        starting.join(60)
    assert not starting.is_alive()
    assert refusal == [None]
    lines = retries(caplog)
    assert [line.split(RETRY_LINE)[1].split()[0] for line in lines] == [str(n) for n in range(1, len(lines) + 1)]
    assert all("\n" not in line and "not reachable (" in line and "up to 60 s" in line for line in lines), lines
    assert "claims database schema at revision" in caplog.text


def test_past_the_bound_the_worker_refuses_in_one_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing listens on the port: after $ONCELERY_STARTUP_WAIT_S (1 s) of retries the worker refuses, in one line
    naming the database, why, how long it waited and the setting that would wait longer."""
    monkeypatch.setenv("ONCELERY_STARTUP_WAIT_S", "1")
    app = worker_app(f"postgresql://nobody@127.0.0.1:{free_port()}/claims")
    with caplog.at_level(logging.INFO, logger=STARTUP_LOGGER):
        refusal = start(app)
    assert refusal is not None and "\n" not in refusal
    assert refusal.startswith("oncelery: this worker refuses to start: Cannot use the claims database postgresql://")
    assert "connection refused" in refusal.lower() and "(waited 1 s: raise ONCELERY_STARTUP_WAIT_S" in refusal
    assert retries(caplog)


@pytest.fixture
def behind_schema(tmp_path: Path) -> str:
    """A SQLite claims database whose schema is at an old revision (0005)."""
    url = f"sqlite:///{tmp_path / 'behind.db'}"
    upgrade(get_engine(url), revision="0005")
    dispose_engines()
    return url


@pytest.mark.parametrize("wrong", ["schema behind", "no such database"])
def test_a_database_that_answers_wrong_is_refused_at_once(
    wrong: str, behind_schema: str, pg_cluster: PgCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A schema behind the code, or a server without that database: refused with the fix, with no retry at all,
    however long the worker may wait for a database that does not answer."""
    url = behind_schema if wrong == "schema behind" else pg_cluster.database_url("no_such_database")
    app = worker_app(url, oncelery_startup_wait_s=30)
    with caplog.at_level(logging.INFO, logger=STARTUP_LOGGER):
        refusal = start(app)
    assert refusal is not None and "\n" not in refusal
    fix = "this code needs" if wrong == "schema behind" else "does not exist: create it"
    assert fix in refusal and "oncelery db upgrade" in refusal
    assert retries(caplog) == []
