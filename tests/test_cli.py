"""The `oncelery` command line as a real subprocess: db upgrade, runs, outcomes, demo, `celery ... oncelery`."""

from __future__ import annotations

import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import make_url

from oncelery.models import RunStatus, TaskRun
from oncelery.runs.claims import RunStore
from oncelery.runs.keys import Identity
from tests import services
from tests.services import (
    ONCELERY,
    Done,
    clean_env,
    kill_reported_workers,
    live_workers,
    run_to_completion,
    worker_pids,
)

CLI_TIMEOUT = 60.0
DEMO_TIMEOUT = 150.0


def run(argv: list[str], cwd: Path, env: Mapping[str, str] | None = None, timeout: float = CLI_TIMEOUT) -> Done:
    """Run `argv` to completion; on timeout SIGTERM it (the demo then stops its worker), then SIGKILL, and fail."""
    env = dict(env) if env is not None else clean_env()
    return Done(*run_to_completion(argv, cwd, env, timeout, kill_reported_workers))


def oncelery(*args: str, cwd: Path, env: Mapping[str, str] | None = None, timeout: float = CLI_TIMEOUT) -> Done:
    """Run the `oncelery` console script of this virtualenv."""
    return run([ONCELERY, *args], cwd, env, timeout)


def sqlite_url(path: Path) -> str:
    return f"sqlite:///{path}"


# -- db upgrade and reads ------------------------------------------------------------------------


def test_db_upgrade_on_a_fresh_sqlite_file_then_runs_list(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "fresh.db")
    first = oncelery("--database-url", url, "db", "upgrade", cwd=tmp_path)
    assert first.code == 0, first.err
    assert "upgraded from revision <none> to" in first.out and "(head)" in first.out

    with ThreadPoolExecutor(2) as pool:  # two processes on the migrated file, side by side
        again, listed = pool.map(
            lambda args: oncelery("--database-url", url, *args, cwd=tmp_path), [("db", "upgrade"), ("runs", "list")]
        )
    assert again.code == 0, again.err
    assert "already at revision" in again.out

    assert listed.code == 0, listed.err
    header = listed.out.splitlines()[0].split()
    assert header == ["id", "task", "key", "status", "token", "attempts", "owner", "lease_expires_at", "updated_at"]
    assert "(0 runs)" in listed.out


def test_the_environment_variable_chooses_the_database(tmp_path: Path) -> None:
    env = clean_env(ONCELERY_DATABASE_URL=sqlite_url(tmp_path / "from-env.db"))
    done = oncelery("db", "upgrade", cwd=tmp_path, env=env)
    assert done.code == 0, done.err
    assert (tmp_path / "from-env.db").exists()
    assert not (tmp_path / "oncelery.db").exists()


@pytest.mark.parametrize(
    "command", [["runs", "list"], ["runs", "show", "k"], ["outcomes"]], ids=["list", "show", "outcomes"]
)
def test_reads_without_tables_say_to_run_db_upgrade(tmp_path: Path, command: list[str]) -> None:
    sqlite3.connect(tmp_path / "empty.db").close()  # a database without Oncelery's tables
    done = oncelery("--database-url", sqlite_url(tmp_path / "empty.db"), *command, cwd=tmp_path)
    assert done.code != 0
    assert "oncelery db upgrade" in done.err
    assert "Traceback" not in done.err


@pytest.mark.parametrize(
    "command", [["runs", "list"], ["runs", "show", "k"], ["outcomes"]], ids=["list", "show", "outcomes"]
)
def test_reads_never_create_a_database_file(tmp_path: Path, command: list[str]) -> None:
    """A read against a SQLite file that does not exist fails with the fix, and leaves no file behind."""
    done = oncelery("--database-url", sqlite_url(tmp_path / "absent.db"), *command, cwd=tmp_path)
    assert done.code != 0
    assert "No database at" in done.err and "oncelery db upgrade" in done.err
    assert not (tmp_path / "absent.db").exists()


def test_no_database_configured_is_one_line_and_creates_nothing(tmp_path: Path) -> None:
    """Without --database-url, app config or ONCELERY_DATABASE_URL (and no demo file), commands say what to set."""
    commands = (["runs", "list"], ["outcomes"], ["db", "upgrade"])
    with ThreadPoolExecutor(len(commands)) as pool:  # side by side: each spends ~2 s starting up
        answers = list(pool.map(lambda command: oncelery(*command, cwd=tmp_path), commands))
    for command, done in zip(commands, answers, strict=True):
        assert done.code != 0, command
        assert "No claims database configured" in done.err and "ONCELERY_DATABASE_URL" in done.err
        assert "Traceback" not in done.err
    assert list(tmp_path.iterdir()) == []


def test_an_unreachable_database_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there once the socket closes
    done = oncelery("--database-url", f"postgresql://postgres@127.0.0.1:{port}/x", "runs", "list", cwd=tmp_path)
    assert done.code != 0
    assert "cannot reach the claims database --database-url=" in done.err
    assert "Traceback" not in done.err


def test_upgrade_list_show_outcomes_on_each_store(db_url: str, tmp_path: Path) -> None:
    # The CLI must accept a plain postgresql:// URL (psycopg 3 is chosen for it).
    url = db_url.replace("postgresql+psycopg://", "postgresql://", 1)
    upgraded = oncelery("--database-url", url, "db", "upgrade", cwd=tmp_path)
    assert upgraded.code == 0, upgraded.err
    assert "already at revision" in upgraded.out  # the fixture migrated it

    store = RunStore(db_url)
    ident = Identity("cli:k1", "f" * 64, {"a": "0" * 64})
    claimed = store.claim("oncelery.t_cli", ident, lease=30)
    assert claimed.claim is not None
    store.complete(claimed.claim, {"answer": 42, "text": "naïve"})

    # Five reads of the same database, each its own process: run side by side (each spends ~2 s starting up).
    reads = [
        ("runs", "list", "--status", "COMPLETED"),
        ("runs", "list", "--status", "running"),
        ("runs", "show", "cli:k1", "--task", "oncelery.t_cli"),
        ("runs", "show", "nope"),
        ("outcomes", "--task", "oncelery.t_cli"),
    ]
    with ThreadPoolExecutor(len(reads)) as pool:
        listed, none_running, shown, missing, counted = pool.map(
            lambda args: oncelery("--database-url", url, *args, cwd=tmp_path), reads
        )
    assert listed.code == 0, listed.err
    assert re.search(r"oncelery\.t_cli\s+cli:k1\s+COMPLETED\s+1\s+1\s", listed.out), listed.out
    assert "(0 runs)" in none_running.out

    assert shown.code == 0, shown.err
    assert '"answer": 42' in shown.out and "naïve" in shown.out
    assert claimed.claim.owner in shown.out  # the full owner id

    assert missing.code != 0 and "No run with key 'nope'" in missing.err

    assert counted.code == 0, counted.err
    assert re.search(r"^executed\s+1$", counted.out, re.M), counted.out
    assert re.search(r"^total\s+1$", counted.out, re.M), counted.out


@pytest.fixture
def empty_pg_url() -> Iterator[str]:
    """A PostgreSQL database with no tables at all, dropped afterwards."""
    services.need("PostgreSQL", services.postgres_available(), "start it (see README: Services)")
    name = f"{services.PG_TEST_DB}_cli"
    admin = create_engine(services.PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(services.PG_ADMIN_URL).set(drivername="postgresql", database=name).render_as_string(False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_db_upgrade_creates_the_schema_on_an_empty_postgresql(empty_pg_url: str, tmp_path: Path) -> None:
    before = oncelery("--database-url", empty_pg_url, "runs", "list", cwd=tmp_path)
    assert before.code != 0 and "oncelery db upgrade" in before.err

    done = oncelery("db", "upgrade", cwd=tmp_path, env=clean_env(ONCELERY_DATABASE_URL=empty_pg_url))
    assert done.code == 0, done.err
    assert "upgraded from revision <none> to" in done.out

    after = oncelery("--database-url", empty_pg_url, "runs", "list", cwd=tmp_path)
    assert after.code == 0, after.err


# -- as a celery subcommand ----------------------------------------------------------------------


def test_celery_subcommand_uses_the_apps_database(tmp_path: Path) -> None:
    (tmp_path / "cliapp.py").write_text(
        "from celery import Celery\n"
        "app = Celery('cliapp')\n"
        f"app.conf.oncelery_database_url = {sqlite_url(tmp_path / 'from-conf.db')!r}\n"
    )
    # The app's setting wins over the environment.
    env = clean_env(ONCELERY_DATABASE_URL=sqlite_url(tmp_path / "from-env.db"), PYTHONPATH=str(tmp_path))
    done = run([sys.executable, "-m", "celery", "-A", "cliapp", "oncelery", "db", "upgrade"], tmp_path, env)
    assert done.code == 0, done.err
    assert "from-conf.db" in done.out
    assert (tmp_path / "from-conf.db").exists() and not (tmp_path / "from-env.db").exists()

    missing = run([sys.executable, "-m", "celery", "-A", "cliapp", "oncelery", "runs", "list"], tmp_path, env)
    assert missing.code == 0, missing.err


# -- the demo on the embedded default ------------------------------------------------------------


def test_demo_on_the_embedded_default_runs_each_document_once(tmp_path: Path) -> None:
    done = oncelery("demo", "--jobs", "10", "--duplicates", "0.5", cwd=tmp_path, timeout=DEMO_TIMEOUT)
    try:
        assert done.code == 0, f"{done.out}\n{done.err}"
        assert "exactly once: 10 bodies ran for 15 deliveries of 10 documents" in done.out
    finally:
        kill_reported_workers(done.out)

    assert len(worker_pids(done.out)) == 1 and live_workers(done.out) == [], "the demo left its worker running"
    engine = create_engine(sqlite_url(tmp_path / "oncelery.db"))
    try:
        with engine.connect() as conn:
            rows = conn.execute(select(TaskRun.status, func.count()).group_by(TaskRun.status)).all()
    finally:
        engine.dispose()
    assert [(status, n) for status, n in rows] == [(RunStatus.COMPLETED, 10)]
    counts = RunStore(sqlite_url(tmp_path / "oncelery.db")).outcome_counts("oncelery.demo_score")
    assert counts["executed"] == 10
    assert counts["replayed"] == 5  # every duplicate delivery was absorbed, none lost
    leftover = list((tmp_path / ".oncelery" / "broker" / "queue").glob("*.celery.msg"))
    assert leftover == []
    assert not (tmp_path / "control").exists()  # the broker's files stay under .oncelery/


def test_a_terminated_demo_stops_its_worker(tmp_path: Path) -> None:
    argv = [ONCELERY, "demo", "--jobs", "200", "--work-seconds", "0.2"]
    proc = subprocess.Popen(
        argv, cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "deliveries settled" in line and not line.startswith("runs done 0/"):
                started.set()  # the worker is executing jobs

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert started.wait(60), "".join(lines)
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        reader.join(timeout=10)
        kill_reported_workers("".join(lines))
        err = proc.stderr.read() if proc.stderr is not None else ""
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    assert code != 0
    assert "interrupted" in err
    out = "".join(lines)
    assert len(worker_pids(out)) == 1 and live_workers(out) == [], "the demo left its worker running"
