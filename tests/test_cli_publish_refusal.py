"""A command that publishes never sends a job where no worker reads: `dlq replay`, `relay` and `process
--no-start-worker` in a user project.

With no `--app` and no ONCELERY_BROKER_URL the fallback broker is the demo's embedded one (./.oncelery/broker),
read only by the demo's workers: for any claims database but the demo's ./oncelery.db the command refuses in
one line (exit 2), before it marks a letter replayed or creates a file. With a broker, a replay goes through the
outbox: a letter whose message the broker refused shows `queued` (and the command exits 1 naming `relay`)
until `oncelery relay` publishes it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner, Result
from kombu.exceptions import OperationalError
from sqlalchemy import func, insert, select

from oncelery import Database, DeadLetters, Runs, RunStatus
from oncelery.cli import oncelery as oncelery_cli
from oncelery.runs.faults import fault_injected
from oncelery.settings import ENV_BROKER_URL
from oncelery.store.tables import LETTERS, OUTBOX, RUNS
from oncelery.tasks.commands import main as console_script
from tests.services import delete_queue_keys, unique_queue, wait_for

TASK = "userproj.enrich"  # a task of the user's app: the command's app need not know it
CONFIG_MODULE = "oncelery.celeryconfig"  # the fallback app's configuration, read from the environment at import
RELAY_TIMEOUT = 10.0  # the relay's back-off after the refused publish is 1 s


def dead_letter(db_url: str, key: str, queue: str = "userproj", tenant: str = "") -> int:
    """Store a DEAD run of TASK with its dead letter, as a worker leaves them (the message kept); return its id."""
    message = {"args": [key], "kwargs": {}, "headers": {}, "queue": queue}
    db = Database(db_url)
    with db.begin() as conn:
        run_id = conn.execute(
            insert(RUNS)
            .values(
                task_name=TASK,
                tenant=tenant,
                idempotency_key=key,
                fingerprint="0" * 64,
                field_digests={},
                status=RunStatus.DEAD,
                fencing_token=1,
                attempts=1,
                message=message,
                error="RuntimeError: the input is broken",
            )
            .returning(RUNS.c.id)
        ).scalar_one()
        return int(
            conn.execute(
                insert(LETTERS)
                .values(
                    run_id=run_id,
                    task_name=TASK,
                    tenant=tenant,
                    idempotency_key=key,
                    reason="retries_exhausted",
                    error="RuntimeError: the input is broken",
                    traceback="Traceback (most recent call last):\nRuntimeError: the input is broken",
                    attempts=1,
                    message=message,
                )
                .returning(LETTERS.c.id)
            ).scalar_one()
        )


def outbox_rows(db_url: str) -> int:
    with Database(db_url).read() as conn:
        return int(conn.execute(select(func.count()).select_from(OUTBOX)).scalar_one())


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A user's project folder as the working directory, with no ONCELERY_* setting in the environment.

    The fallback app's configuration module is imported afresh under this environment and folder, as a new
    `oncelery` process would (and the module an earlier test imported is restored afterwards).
    """
    folder = tmp_path / "userproj"
    folder.mkdir()
    monkeypatch.chdir(folder)
    for name in [n for n in os.environ if n.startswith(("ONCELERY_", "CELERY_"))]:
        monkeypatch.delenv(name)
    monkeypatch.delitem(sys.modules, CONFIG_MODULE, raising=False)
    yield folder


def invoke(db_url: str, *args: str) -> Result:
    """`oncelery --database-url URL ARGS...` in this process (as the console script runs it)."""
    return CliRunner().invoke(oncelery_cli, ["--database-url", db_url, *args], catch_exceptions=False)


def test_replay_and_relay_without_a_broker_refuse_in_one_line(db_url: str, project: Path) -> None:
    """Not the demo's database, no --app, no ONCELERY_BROKER_URL: exit 2, one line saying what to pass; the
    letter is not marked replayed, nothing is queued, and no ./.oncelery (broker folder) is created."""
    letter = dead_letter(db_url, "doc-1")
    for command in (["dlq", "replay", "doc-1"], ["relay", "--once"]):
        done = invoke(db_url, *command)
        assert done.exit_code == 2, done.output
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("oncelery: "), done.stderr
        assert "--app MODULE:APP" in lines[0] and "ONCELERY_BROKER_URL" in lines[0], lines[0]
        assert f"`oncelery {' '.join(command[: 2 if command[0] == 'dlq' else 1])}`" in lines[0], lines[0]
        assert "Traceback" not in done.output and "replayed" not in done.stdout
    after = DeadLetters(db_url).get(letter)
    assert after is not None and after.replayed_at is None and after.replays == 0 and after.replay is None
    assert after.run_status is RunStatus.DEAD
    assert outbox_rows(db_url) == 0
    assert not (project / ".oncelery").exists(), sorted(p.name for p in project.iterdir())


def test_the_demo_database_replays_on_the_embedded_broker(project: Path) -> None:
    """The demo's own ./oncelery.db (here named by a relative --database-url): the embedded broker is its
    broker, so the replay is published there, as a file its workers read."""
    demo_db = project / "oncelery.db"
    url = f"sqlite:///{demo_db}"
    assert invoke(url, "db", "upgrade").exit_code == 0
    letter = dead_letter(url, "doc-2", queue="celery")
    done = invoke("sqlite:///oncelery.db", "dlq", "replay", "doc-2")
    assert done.exit_code == 0, done.output
    assert "1 replayed, 0 skipped" in done.stdout and "queued" not in done.stdout
    spooled = list((project / ".oncelery" / "broker" / "queue").glob("*.msg"))
    assert len(spooled) == 1, spooled
    assert json.loads(spooled[0].read_text())["headers"]["oncelery_key"] == "doc-2"
    after = DeadLetters(url).get(letter)
    assert after is not None and after.replays == 1 and after.replay == "published"


def test_a_refused_publish_stays_queued_until_the_relay_publishes_it(
    db_url: str, project: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ONCELERY_BROKER_URL=redis://...: the replay lands in the outbox; the broker refuses the publish, so the
    command exits 1 naming `oncelery relay`, and the letter shows `queued` (list, show, --json); `relay`
    then puts the message on the letter's queue in Redis, with its key, and the letter shows `published`."""
    monkeypatch.setenv(ENV_BROKER_URL, redis_url)
    queue = unique_queue()
    letter = dead_letter(db_url, "doc-3", queue=queue)
    client = redis.Redis.from_url(redis_url)

    def refuse(_name: str, _context: dict[str, Any]) -> None:
        raise OperationalError("the broker went away")

    try:
        with fault_injected("publish", refuse):
            done = invoke(db_url, "dlq", "replay", "doc-3")
        assert done.exit_code == 1, done.output
        assert f"replayed {letter} {TASK}[doc-3]: queued, not yet published" in done.stdout
        assert "1 replayed, 0 skipped" in done.stdout
        assert "queued in the outbox, not yet published" in done.stderr
        assert "the broker went away" in done.stderr and "oncelery relay --app" in done.stderr
        run = Runs(db_url).get(TASK, "doc-3")
        assert run is not None and run.status is RunStatus.FAILED  # revived with its outbox row, in one commit
        assert client.llen(queue) == 0

        listed = json.loads(invoke(db_url, "dlq", "list", "--all", "--json").stdout)
        assert [(x["id"], x["replay"], x["replays"]) for x in listed["letters"]] == [(letter, "queued", 1)]
        shown = invoke(db_url, "dlq", "show", "doc-3").stdout
        assert "queued, not yet published" in shown
        assert "queued, not yet published" in invoke(db_url, "dlq", "list", "--all").stdout

        def relayed() -> bool:
            done = invoke(db_url, "relay", "--once", "--retention", "off", "--sweep-interval", "off", "--json")
            assert done.exit_code == 0, done.output
            return bool(json.loads(done.stdout)["published"])

        wait_for(relayed, timeout=RELAY_TIMEOUT, what="the relay to publish the queued replay")
        (raw,) = client.lrange(queue, 0, -1)
        headers = json.loads(raw)["headers"]
        assert (headers["task"], headers["oncelery_key"]) == (TASK, "doc-3")
        after = DeadLetters(db_url).get(letter)
        assert after is not None and after.replay == "published"
        assert "published" in invoke(db_url, "dlq", "show", "doc-3").stdout
    finally:
        client.close()
        delete_queue_keys(redis_url, queue)


def test_process_without_its_own_worker_refuses_the_embedded_broker(
    tmp_path: Path, project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`process --no-start-worker` on the embedded broker for a database that is not the demo's: exit 2 in one
    line, before the database is migrated (with its own worker, the command reads its own jobs: allowed)."""
    monkeypatch.delitem(sys.modules, "oncelery.tasks.app", raising=False)  # configured afresh, as a new process
    user_db = tmp_path / "user.db"
    argv = ["--database-url", f"sqlite:///{user_db}", "process", "--sample", "--limit", "1", "--no-start-worker"]
    done = CliRunner().invoke(console_script, argv, catch_exceptions=False)
    assert done.exit_code == 2, done.output
    (line,) = done.stderr.splitlines()
    assert "`oncelery process --no-start-worker` publishes" in line and "--app MODULE:APP" in line, line
    assert not user_db.exists() and "schema" not in done.stdout
