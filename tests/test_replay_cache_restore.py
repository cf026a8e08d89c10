"""The replay cache never outlives the database: a restored or replaced database is never answered by entries
of the one before it.

The restore tests dump the claims database BEFORE the job runs, let the job complete (cached), then restore the
dump behind the SAME URL, and send the job again while the same worker process runs. The cache must no longer
answer: the job runs once in the restored database, with its effect. Today's code replayed it from Redis, with no
run and no effect behind the answer, for ever.
- A new cluster (pg_restore into a fresh `initdb`) takes over the old one's address: a new system_identifier.
- The dump restored into the same cluster as a new database of the same name: a new oid.
Both on PostgreSQL only: SQLite has no server identity, so its restore is proven with `oncelery cache flush`
(and the flush command on both stores). The privilege fallback (a role refused pg_control_*) is read on the
session's throwaway cluster, which is restarted once to show the fallback still changes.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from sqlalchemy import event, insert
from sqlalchemy.engine import Engine, make_url

from oncelery import IdempotentTask, RunStatus
from oncelery.cli import oncelery as oncelery_cli
from oncelery.runs.outcomes import flush_replays
from oncelery.store.database import Database, dispose_engines
from oncelery.store.dialects import PostgreSQL
from oncelery.store.identity import REFRESH, ServerIdentity
from tests.chaos.procs import RedisServer
from tests.conftest import ON_SQLITE, running_worker
from tests.pg_cluster import PgCluster, postgres_bindir
from tests.services import effects_table
from tests.store_faults import LEASE, Db, app_on
from tests.test_replay_cache import (  # noqa: F401  (fixtures, by name)
    Statements,
    cache_redis,
    cached_job,
    counts_written,
    entry_exists,
)

TIMEOUT = 60
RESTORED_TASK = "oncelery.t_cache_restored"


@pytest.fixture
def cache(request: pytest.FixtureRequest) -> RedisServer:
    """The test's own redis-server for the cache (tests.test_replay_cache's `cache_redis`, stopped by PID)."""
    server: RedisServer = request.getfixturevalue("cache_redis")
    return server


def effect_job(app: Celery, cache: RedisServer) -> tuple[Any, list[int]]:
    """A task with the replay cache on, one effect row per execution, and the doc ids its body ran for."""
    app.conf.oncelery_replay_cache = cache.url
    calls: list[int] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name=RESTORED_TASK, idempotency_key="doc:{n}", lease=LEASE)
    def job(self: IdempotentTask, n: int) -> dict[str, int]:
        calls.append(n)
        with self.effects() as session:
            session.execute(insert(effects_table).values(key=f"doc:{n}", pid=os.getpid()))
        return {"doc": n}

    return job, calls


def pg_tool(name: str, *argv: str) -> None:
    """Run pg_dump / pg_restore (a client: any user) from the server's own bindir; raise with its output."""
    bindir = postgres_bindir()
    assert bindir is not None
    done = subprocess.run([str(bindir / name), *argv], capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, f"{name} failed: {done.stderr}"


def dump(cluster: PgCluster, dbname: str, path: Path) -> None:
    pg_tool("pg_dump", "-Fc", "-h", "127.0.0.1", "-p", str(cluster.port), "-U", "postgres", "-f", str(path), dbname)


def restore(cluster: PgCluster, dbname: str, path: Path) -> None:
    """Create `dbname` on `cluster` and restore the dump into it."""
    cluster.execute(f'CREATE DATABASE "{dbname}"')
    pg_tool(
        "pg_restore",
        "--no-owner",
        "-h",
        "127.0.0.1",
        "-p",
        str(cluster.port),
        "-U",
        "postgres",
        "-d",
        dbname,
        str(path),
    )


@contextmanager
def new_cluster_at_the_same_address(old: PgCluster) -> Iterator[PgCluster]:
    """Stop `old`; start a fresh cluster (initdb) on its port. After: the new one stopped (by PID) and removed,
    `old` running again for the session's next tests."""
    new = PgCluster(old.bindir)
    try:
        old.stop()
        new.port = old.port
        new.start()
        yield new
    finally:
        new.remove()
        old.ensure_running()


def run_again_after_restore(db: Db, redis_url: str, cache: RedisServer, swap: Any) -> tuple[list[int], Any]:
    """The job once (cached), the database swapped by `swap()` behind the same URL, then two more deliveries
    from the same worker process. Returns (the doc ids the body ran for, the last two answers)."""
    with app_on(db, redis_url) as app:
        job, calls = effect_job(app, cache)
        with running_worker(app, concurrency=2):
            first = job.delay(1).get(timeout=TIMEOUT)
            assert job.delay(1).get(timeout=TIMEOUT) == first and calls == [1]  # answered from the cache
            flush_replays()  # its count goes to the database it was answered for
            swapped = time.monotonic()
            with swap():
                # A real restore takes longer than this: the worker's last identity read is REFRESH old at least.
                time.sleep(max(0.0, REFRESH - (time.monotonic() - swapped)))
                answers = [job.delay(1).get(timeout=TIMEOUT) for _ in range(2)]
                ran_once_there(db, job)
    return calls, answers


def ran_once_there(db: Db, job: Any) -> None:
    """The restored database has the run, COMPLETED, its one effect, and the deliveries it saw counted."""
    run = db.run(RESTORED_TASK, "doc:1")
    assert run is not None and run.status is RunStatus.COMPLETED, "the cache answered: no run behind the answer"
    assert db.rows(effects_table, "doc:1") == 1
    assert job.outcome_counts() == {"executed": 1, "replayed": 1}  # the second answered by the new entry


def test_a_dump_restored_into_a_new_cluster_at_the_same_address_runs_the_job_once_more(
    pg_cluster: PgCluster, pg_db: Db, redis_url: str, cache: RedisServer, tmp_path: Path
) -> None:
    backup = tmp_path / "claims.dump"
    dump(pg_cluster, pg_db.name, backup)  # before the run

    @contextmanager
    def swap() -> Iterator[None]:
        with new_cluster_at_the_same_address(pg_cluster) as restored:
            restore(restored, pg_db.name, backup)
            yield

    calls, answers = run_again_after_restore(pg_db, redis_url, cache, swap)
    assert calls == [1, 1]  # once on each database
    assert answers == [{"doc": 1}] * 2


def test_a_dump_restored_as_a_new_database_of_the_same_name_runs_the_job_once_more(
    pg_cluster: PgCluster, pg_db: Db, redis_url: str, cache: RedisServer, tmp_path: Path
) -> None:
    backup = tmp_path / "claims.dump"
    dump(pg_cluster, pg_db.name, backup)

    @contextmanager
    def swap() -> Iterator[None]:
        pg_cluster.drop_database(pg_db.name)  # same cluster, same server, same URL: only the oid changes
        restore(pg_cluster, pg_db.name, backup)
        yield

    calls, answers = run_again_after_restore(pg_db, redis_url, cache, swap)
    assert calls == [1, 1]
    assert answers == [{"doc": 1}] * 2


# -- how the identity is read ----------------------------------------------------------------------------


class IdentityReads:
    """Counts this process's reads of a database identity while active."""

    def __init__(self) -> None:
        self.n = 0

    def _on_engine(self, _conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        self.n += statement in PostgreSQL.identity_queries

    def __enter__(self) -> IdentityReads:
        event.listen(Engine, "before_cursor_execute", self._on_engine)
        return self

    def __exit__(self, *_exc: object) -> None:
        event.remove(Engine, "before_cursor_execute", self._on_engine)


def test_the_identity_is_read_again_after_a_new_connection_and_after_its_refresh_never_per_call(pg_db: Db) -> None:
    identity = ServerIdentity(Database(pg_db.url), refresh=0.5)
    with IdentityReads() as reads:
        values = {identity.current() for _ in range(200)}
        # The first read may open the pool's first connection: one more read, then none until a trigger.
        assert reads.n <= 2
        before = reads.n
        with pg_db.observer.connect():  # this process opens a connection (a reconnect, as after a restore)
            pass
        identity.current()
        assert reads.n == before + 1
        time.sleep(0.5)
        identity.current()
        identity.current()
        assert reads.n == before + 2
    (value,) = values
    sysid, timeline, oid, started = str(value).split("/")
    row = pg_db.cluster.execute(  # type: ignore[union-attr]
        "SELECT s.system_identifier, c.timeline_id, d.oid FROM pg_control_system() s, pg_control_checkpoint() c, "
        "pg_database d WHERE d.datname = %s",
        (pg_db.name,),
    )[0]
    assert (int(sysid), int(timeline), int(oid)) == row and float(started) > 0


def test_sqlite_has_one_identity_read_from_nothing(tmp_path: Path) -> None:
    identity = ServerIdentity(Database(f"sqlite:///{tmp_path / 'x.db'}"))
    with IdentityReads() as reads:
        assert identity.current() == ""
    assert reads.n == 0


def test_a_role_refused_pg_control_falls_back_to_an_identity_a_restart_still_changes(
    pg_cluster: PgCluster, pg_db: Db, caplog: pytest.LogCaptureFixture
) -> None:
    role = f"oncelery_app_{os.getpid()}"
    pg_cluster.execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        # Function privileges live in each database's catalog: this revoke touches the test's database only.
        pg_cluster.execute("REVOKE EXECUTE ON FUNCTION pg_control_system() FROM PUBLIC", dbname=pg_db.name)
        url = make_url(pg_db.url).set(username=role).render_as_string(hide_password=False)
        identity = ServerIdentity(Database(url), refresh=0.0)
        with caplog.at_level(logging.WARNING, "oncelery.identity"):
            first = identity.current()
            assert identity.current() == first
        ((oid, started),) = pg_cluster.execute(
            "SELECT d.oid, extract(epoch FROM pg_postmaster_start_time())::text FROM pg_database d "
            "WHERE d.datname = %s",
            (pg_db.name,),
        )
        assert first == f"no-control/{oid}/{started}"
        warnings = [r.getMessage() for r in caplog.records if r.name == "oncelery.identity"]
        assert len(warnings) == 1 and "GRANT EXECUTE ON FUNCTION pg_control_system()" in warnings[0]
        pg_cluster.restart()  # any server start: a restore into a new cluster, a promoted replica
        dispose_engines()
        again = identity.current()
        assert again is not None and again.startswith(f"no-control/{oid}/") and again != first
    finally:
        dispose_engines()
        pg_cluster.ensure_running()
        pg_cluster.execute(f'DROP ROLE IF EXISTS "{role}"')


# -- oncelery cache flush (SQLite's restore, and anything the identity cannot see) --------------------------


def flush(db_url: str, *args: str) -> Any:
    return CliRunner().invoke(oncelery_cli, ["--database-url", db_url, "cache", "flush", *args])


def test_cache_flush_empties_this_databases_entries_and_the_database_answers_next(
    app: Celery, worker_factory: Any, db_url: str, cache: RedisServer
) -> None:
    job, calls = cached_job(app, cache, "oncelery.t_cache_flush_cli")
    other = "oncelery:done:0123456789abcdef:0a0b0c0d0e0f:digest"  # another claims database's entry
    with cache.client() as client:
        client.set(other, "{}")
    with worker_factory(app, concurrency=2):
        first = job.delay(1, "a b").get(timeout=TIMEOUT)
        job.delay(2, "c").get(timeout=TIMEOUT)
        assert entry_exists(cache, job, "doc:1") and entry_exists(cache, job, "doc:2")
        out = flush(db_url, "--cache-url", cache.url)
        assert out.exit_code == 0, out.output
        assert out.output.startswith("flushed 2 replay cache entries of "), out.output
        assert not entry_exists(cache, job, "doc:1") and not entry_exists(cache, job, "doc:2")
        with cache.client() as client:
            assert client.exists(other), "another database's entries are not this command's"
        with Statements() as statements:
            again = job.delay(1, "a b").get(timeout=TIMEOUT)
        assert statements.n >= 1, "flushed: the database answers"
    assert again == first
    assert sorted(calls) == [1, 2]
    assert job.outcome_counts() == {"executed": 2, "replayed": 1}


@ON_SQLITE
def test_cache_flush_without_a_cache_says_what_to_set(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ONCELERY_REPLAY_CACHE", raising=False)
    out = CliRunner().invoke(oncelery_cli, ["--database-url", db_url, "cache", "flush"])
    assert out.exit_code == 2
    assert "No replay cache configured: pass --cache-url, set ONCELERY_REPLAY_CACHE" in out.output


@ON_SQLITE
def test_a_restored_sqlite_file_runs_its_lost_job_once_after_cache_flush(
    app: Celery,
    worker_factory: Any,
    db_url: str,
    cache: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SQLite has no server to name it: the operator's `oncelery cache flush` after the restore does."""
    claims = make_url(db_url).database
    assert claims is not None
    backup = tmp_path / "backup.db"
    copy_sqlite(claims, str(backup))  # before the run
    job, calls = cached_job(app, cache, "oncelery.t_cache_sqlite_restore")
    with worker_factory(app, concurrency=2):
        first = job.delay(3, "x y").get(timeout=TIMEOUT)
    dispose_engines()  # the workers are stopped for the restore
    copy_sqlite(str(backup), claims)
    monkeypatch.setenv("ONCELERY_REPLAY_CACHE", cache.url)
    out = flush(db_url)
    assert out.exit_code == 0 and out.output.startswith("flushed 1 replay cache entry"), out.output
    with worker_factory(app, concurrency=2):
        answers = [job.delay(3, "x y").get(timeout=TIMEOUT) for _ in range(2)]
    assert calls == [3, 3]  # once before the restore, once after it
    assert answers == [first] * 2
    assert job.outcome_counts() == {"executed": 1, "replayed": 1}


def copy_sqlite(source: str, target: str) -> None:
    """Copy a SQLite database with the backup API (its WAL included), as an operator's backup or restore does."""
    with closing(sqlite3.connect(source)) as src, closing(sqlite3.connect(target)) as dst:
        src.backup(dst)
