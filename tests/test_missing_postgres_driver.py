"""Without psycopg (the `oncelery[postgres]` extra), a PostgreSQL URL is one line naming the extra, never the
driver's traceback: in every command (exit 2) and at worker start (the startup check refuses)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.services import ONCELERY, clean_env

EXTRA = "pip install 'oncelery[postgres]'"
# Nothing listens there: a command that connected before checking the driver would say "cannot reach" instead.
PG_URL = "postgresql://someone:secret@127.0.0.1:9/claims"

WORKER_START = """
from celery import Celery, signals
from oncelery import IdempotentTask

app = Celery("nodriver", broker="memory://", set_as_current=False)
app.conf.oncelery_database_url = {url!r}

@app.task(base=IdempotentTask, bind=True, name="nodriver.job")
def job(self, doc):
    return doc

class Worker:  # what worker_init's sender offers the check: its app
    pass

worker = Worker()
worker.app = app
signals.worker_init.send(sender=worker)
print("started")
"""


@pytest.fixture
def no_psycopg(tmp_path: Path) -> dict[str, str]:
    """An environment whose Python cannot import psycopg (a module of that name on PYTHONPATH raises)."""
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "psycopg.py").write_text("raise ImportError('No module named psycopg (blocked by the test)')\n")
    return clean_env(PYTHONPATH=str(blocker))


@pytest.mark.parametrize("command", [["db", "upgrade"], ["runs", "list"], ["dlq", "list"]])
def test_a_command_on_postgresql_without_psycopg_is_one_line_naming_the_extra(
    no_psycopg: dict[str, str], tmp_path: Path, command: list[str]
) -> None:
    """Exit 2 (a configuration problem), and stderr is the one line that says what to install."""
    done = subprocess.run(
        [ONCELERY, "--database-url", PG_URL, *command],
        cwd=tmp_path,
        env=no_psycopg,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert EXTRA in lines[0] and "secret" not in lines[0]


def test_a_worker_on_postgresql_without_psycopg_refuses_to_start_in_one_line(
    no_psycopg: dict[str, str], tmp_path: Path
) -> None:
    """The startup check (worker_init) stops the worker with one line naming the extra, before any job."""
    script = WORKER_START.format(url=PG_URL)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=no_psycopg, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and "started" not in done.stdout, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "refuses to start" in lines[0] and EXTRA in lines[0]
