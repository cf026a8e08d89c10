"""A paid model call's ledger row survives a database outage: spooled, then written exactly once.

A row the database cannot take (the server stopped, SQLite's file locked) waits in the process's spool file
and is written when the database answers again, with its running totals; a row whose commit reached the
database but whose answer was lost is replayed from the spool and still counted once (its call_id); files that
processes left behind are written when a worker starts. Real databases (the throwaway PostgreSQL cluster for
the outage), a real in-process worker, real files; oncelery.ledger.spool.
"""

from __future__ import annotations

import os
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import create_engine, insert, text
from sqlalchemy.pool import NullPool

from oncelery import IdempotentTask, StoreUnavailable, model_call
from oncelery.ledger.spool import spool_row
from oncelery.ledger.spool_files import PREFIX, REJECTED_FILE, spooled_rows
from oncelery.runs.faults import fault_injected
from oncelery.settings import CONF_LEDGER_SPOOL_DIR, ENV_DATABASE_URL, ENV_LEDGER_SPOOL_DIR, ENV_SQLITE_BUSY_TIMEOUT
from tests.conftest import ON_POSTGRESQL, migrated, running_worker
from tests.services import close_app, effects_table, unique_queue, wait_for
from tests.store_faults import JOB_TIMEOUT, LEASE, Db, LogLines, Once, expected, job_key, report

SPOOL_TIMEOUT = 20.0  # bound for a spool to be written once its database answers (retries start at 0.5 s)


def ledger(url: str) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """(model_calls rows as (call_id, fencing_token, model, input, output), ledger_totals rows), on a connection
    of the test's own (never the pools of the code under test)."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            calls = conn.execute(
                text(
                    "SELECT call_id, fencing_token, model, input_tokens, output_tokens FROM model_calls "
                    "ORDER BY fencing_token, id"
                )
            ).all()
            totals = conn.execute(
                text("SELECT task_name, model, calls, input_tokens, output_tokens FROM ledger_totals")
            ).all()
    finally:
        engine.dispose()
    return [tuple(r) for r in calls], [tuple(r) for r in totals]


def spool_files(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"{PREFIX}*")) if folder.exists() else []


@pytest.fixture
def spool(tmp_path: Path) -> Iterator[Path]:
    """A spool folder, set as oncelery_ledger_spool_dir of a fresh current app (what a call outside any task
    reads its settings from)."""
    folder = tmp_path / "spool"
    app = Celery("ledger-spool-current")  # the current app from here on
    app.conf[CONF_LEDGER_SPOOL_DIR] = str(folder)
    try:
        yield folder
    finally:
        close_app(app)


def test_a_call_made_while_postgresql_is_down_is_written_once_it_is_back(
    pg_db: Db, pg_app: Celery, logs: LogLines, tmp_path: Path
) -> None:
    """The server stops as the body's model call writes its row: the row is spooled, the job is sent again
    and taken over (a second, real call), and once the server is back both calls are in the ledger once each,
    the totals and the run's sums agree, and the spool is gone."""
    n = 21
    key = job_key(n)
    name = "oncelery.t_ledger_spool_outage"
    folder = tmp_path / "spool"
    pg_app.conf.oncelery_ledger_spool_dir = str(folder)
    cluster = pg_db.cluster
    assert cluster is not None

    @pg_app.task(shared=False, base=IdempotentTask, bind=True, name=name, idempotency_key="fault:{n}", lease=LEASE)
    def job(self: IdempotentTask, n: int) -> dict[str, int]:
        with model_call("fake-llm", prompt="draft") as call:
            call.tokens(12, 3)
        with self.effects() as session:
            session.execute(insert(effects_table).values(key=job_key(n), pid=os.getpid()))
        return expected(n)

    hook = Once(lambda: cluster.stop("fast"), key)
    with running_worker(pg_app, concurrency=2), fault_injected("ledger_write", hook):
        result = job.delay(n)
        wait_for(lambda: spooled_rows(folder), timeout=JOB_TIMEOUT, what="the row to be spooled")
        cluster.start()
        assert result.get(timeout=JOB_TIMEOUT) == expected(n), report(pg_db, name, key, logs)
        wait_for(lambda: not spool_files(folder), timeout=SPOOL_TIMEOUT, what="the spool to be written")
    assert hook.error is None and hook.injected.is_set(), f"the fault was not injected: {hook.error!r}"
    detail = report(pg_db, name, key, logs)
    calls, totals = ledger(pg_db.url)
    # The call made before the outage (token 1) and the one the takeover made (token 2): each once.
    assert [c[1:] for c in calls] == [(1, "fake-llm", 12, 3), (2, "fake-llm", 12, 3)], detail
    assert len({c[0] for c in calls}) == 2, detail
    assert totals == [(name, "fake-llm", 2, 24, 6)], detail
    run = pg_db.run(name, key)
    assert run is not None and run.token == 2, detail
    with pg_db.observer.connect() as conn:
        sums = conn.execute(text("SELECT llm_calls, llm_input_tokens FROM task_runs WHERE id = :i"), {"i": run.run_id})
        assert tuple(sums.one()) == (2, 24), detail
    assert pg_db.rows(effects_table, key) == 1, detail
    assert logs.has("spooled to"), detail


def test_a_commit_whose_answer_was_lost_is_replayed_from_the_spool_and_counted_once(
    db_url: str, spool: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The row's transaction commits but its writer sees an error (a fault point after COMMIT): the row is
    spooled, the next successful write replays it, and the insert meets the same call_id: one row, and the
    totals count it once."""
    folder = spool
    monkeypatch.setenv(ENV_DATABASE_URL, db_url)

    def lose_the_answer() -> None:
        raise StoreUnavailable("the server closed the connection before COMMIT's answer arrived")

    hook = Once(lose_the_answer)
    with fault_injected("ledger_committed", hook):
        with model_call("gpt-4o-mini", prompt="lost") as call:
            call.tokens(100, 10)
        assert hook.injected.is_set() and [r["call_id"] for r in spooled_rows(folder)] == [call.call_id]
        with model_call("gpt-4o-mini", prompt="next") as after:
            after.tokens(1, 1)
        wait_for(lambda: not spool_files(folder), timeout=SPOOL_TIMEOUT, what="the spool to be replayed")
    calls, totals = ledger(db_url)
    assert sorted(c[0] for c in calls) == sorted([call.call_id, after.call_id])
    assert totals == [("", "gpt-4o-mini", 2, 101, 11)]


def test_a_call_meeting_a_locked_sqlite_file_is_written_once_the_lock_is_released(
    tmp_path: Path, spool: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite's write lock is held past the busy timeout as the row is written: spooled (nothing in the file),
    then written once the lock is released, with its totals; the spool is gone."""
    path = tmp_path / "claims.db"
    url = f"sqlite:///{path}"
    folder = spool
    monkeypatch.setenv(ENV_DATABASE_URL, url)
    monkeypatch.setenv(ENV_SQLITE_BUSY_TIMEOUT, "0.05")  # read as this process's engine for `url` is made
    migrated(url)
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")  # another writer holds the file's write lock
        with model_call("gpt-4o-mini", prompt="locked") as call:
            call.tokens(7, 2)
        assert [r["call_id"] for r in spooled_rows(folder)] == [call.call_id]
        assert ledger(url)[0] == []
    finally:
        holder.execute("COMMIT")
        holder.close()
    wait_for(lambda: not spool_files(folder), timeout=SPOOL_TIMEOUT, what="the flusher to write the spool")
    assert ledger(url) == ([(call.call_id, None, "gpt-4o-mini", 7, 2)], [("", "gpt-4o-mini", 1, 7, 2)])


def spool_in_a_child(url: str, folder: Path, rows: int) -> int:
    """Fork a child (as a prefork pool does) that spools `rows` rows for `url` into `folder` and exits; its pid."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.environ[ENV_LEDGER_SPOOL_DIR] = str(folder)  # the child's own environment: no app, the variable
        for _ in range(rows):
            row = {
                "call_id": uuid.uuid4().hex,
                "task_name": "t",
                "tenant": "",
                "model": "m",
                "input_tokens": 1,
                "output_tokens": 0,
                "latency_ms": 1.0,
                "ok": True,
                "cost_micros": None,
            }
            spool_row(url, None, row)
        code = 0
    finally:
        os._exit(code)  # no pytest teardown, no atexit handlers in the child


@ON_POSTGRESQL  # the files are the same whatever the database; the session's database needs no migration
def test_processes_spooling_at_once_lose_no_row_and_a_worker_start_writes_what_they_left(
    db_url: str, tmp_path: Path, redis_url: str
) -> None:
    """Two forked processes spool into one folder at once (as prefork children do) and exit with their rows
    unwritten: every line is whole, and the next worker start writes all of them, each once; a line torn by a
    crash is set aside in rejected.jsonl."""
    url = db_url
    folder = tmp_path / "spool"
    children = [spool_in_a_child(url, folder, 15) for _ in range(2)]
    for pid in children:
        assert os.waitpid(pid, 0)[1] == 0
    assert len(spool_files(folder)) == 2 and len(spooled_rows(folder)) == 30
    torn = b'{"v":1,"db":"postgresql+psycopg://postgres@127.0.0.1/x","row":{"call_id":"ab'
    with open(spool_files(folder)[0], "ab") as file:  # a child killed in the middle of its last write
        file.write(torn)
    app = Celery("ledger-spool-start", set_as_current=False)
    app.conf.update(
        broker_url=redis_url,
        task_default_queue=unique_queue(),
        oncelery_database_url=url,
        oncelery_ledger_spool_dir=str(folder),
    )
    try:
        with running_worker(app, concurrency=1):
            pass  # worker_init replays the files no live process holds
    finally:
        close_app(app)
    assert spool_files(folder) == []
    calls, totals = ledger(url)
    assert len({c[0] for c in calls}) == 30 and totals == [("t", "m", 30, 30, 0)]
    assert (folder / REJECTED_FILE).read_bytes() == torn + b"\n"  # set aside, once, never silently dropped
