"""Claims through PgBouncer in transaction pooling mode (`?oncelery_pgbouncer=1`): first executions and their
duplicates work, claims still commit asynchronously and completions durably, and nothing is prepared.

A private pgbouncer (tests/pgbouncer.py, stopped by its PID) with ONE server connection in front of the session's
PostgreSQL database: every transaction of every client runs on that one backend, so a startup option would be
refused, a session setting would leak into the next client's transaction, and a statement psycopg prepared
automatically (after 5 runs on a connection) would collide with the same name prepared by another client.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from celery import Celery
from sqlalchemy import func, literal, select, text
from sqlalchemy.engine import make_url

from oncelery import ConfigurationError, IdempotentTask
from oncelery.ops.reach import check_database
from oncelery.store.database import Database, dispose_engines, get_engine
from tests import services
from tests.conftest import running_worker
from tests.pgbouncer import PgBouncer, missing_pgbouncer

TIMEOUT = 30
JOBS = 8  # each claim statement then runs more than 5 times on a connection: psycopg would prepare it


@pytest.fixture
def bouncer(pg_session_url: str) -> Iterator[PgBouncer]:
    """A private PgBouncer, transaction mode, one server connection, in front of the session's database."""
    why = missing_pgbouncer()
    services.need("PgBouncer", why is None, why or "")
    target = make_url(pg_session_url)
    server = PgBouncer(target.host or "127.0.0.1", target.port or 5432, target.username or "postgres", pool_size=1)
    server.start()
    try:
        yield server
    finally:
        dispose_engines()  # this process's pools on it, before it goes
        server.stop()


@pytest.fixture
def db_url(bouncer: PgBouncer, pg_session_url: str) -> str:
    """The claims URL of this module's apps (conftest's `app`): the session's database through the PgBouncer."""
    return bouncer.url(pg_session_url)


def test_first_executions_and_duplicates_run_through_pgbouncer_in_transaction_mode(
    bouncer: PgBouncer, app: Celery, db_url: str, pg_session_url: str
) -> None:
    executed: list[int] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name=f"t.pgbouncer.{uuid.uuid4().hex[:8]}")
    def summarize(self: IdempotentTask, doc: int) -> str:
        executed.append(doc)
        return f"summary {doc}"

    with running_worker(app, concurrency=2):
        firsts = [summarize.delay(doc).get(timeout=TIMEOUT) for doc in range(JOBS)]
        # Answered by the worker's claim: the statement psycopg would have prepared by now.
        duplicates = [summarize.apply_async((doc,), producer_dedupe=False).get(timeout=TIMEOUT) for doc in range(JOBS)]
        # Answered at the producer, whose check's statement_timeout is set per transaction too.
        at_producer = summarize.delay(0).get(timeout=TIMEOUT)
    assert firsts == duplicates == [f"summary {doc}" for doc in range(JOBS)]
    assert at_producer == "summary 0"
    assert sorted(executed) == list(range(JOBS))
    assert summarize.outcome_counts() == {"executed": JOBS, "replayed": JOBS + 1}
    # Asked through PgBouncer, so of the one server connection every client's transactions ran on.
    count = select(func.count().label("n")).select_from(text("pg_prepared_statements"))
    assert Database(db_url).one(count, {})[0].n == 0
    (pool,) = [p for p in bouncer.show("POOLS") if p["database"] == make_url(pg_session_url).database]
    assert int(pool["sv_active"]) + int(pool["sv_idle"]) + int(pool["sv_used"]) == 1


def test_claims_commit_asynchronously_and_completions_durably_on_one_shared_server_connection(db_url: str) -> None:
    check_database(db_url, "ONCELERY_DATABASE_URL")  # the commands' up-front check: the flag is not libpq's
    db = Database(db_url)
    setting = select(func.current_setting("synchronous_commit").label("value"), literal(1).label("one"))
    seen = [db.one(setting, {}, durable=durable)[0].value for durable in (False, True, False, True)]
    # A claim's setting lives in its own transaction: the durable statement right after it, on the same
    # server connection, commits durably.
    assert seen == ["off", "on", "off", "on"]


def test_a_pgbouncer_url_refuses_startup_options_and_unknown_flag_values() -> None:
    url = "postgresql://app@127.0.0.1:6432/claims"
    with pytest.raises(ConfigurationError, match="ALTER ROLE"):
        get_engine(f"{url}?oncelery_pgbouncer=1&options=-csearch_path%3Dx")
    with pytest.raises(ConfigurationError, match="oncelery_pgbouncer=1"):
        Database(f"{url}?oncelery_pgbouncer=maybe").dialect  # noqa: B018
