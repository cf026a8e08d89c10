"""Dead letters through real workers on a real Redis broker, over SQLite and PostgreSQL.

A run that spends its last retry, fails with an error that can never succeed, or loses its worker on
`max_deliveries` deliveries (a poison message) goes DEAD with one dead letter; no delivery runs it again
until `oncelery dlq replay`, which resumes it from its checkpoints. A message without an identity is a
run-less dead letter. The `oncelery dlq` commands list, show, replay and purge them.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from sqlalchemy import select, text

from oncelery import (
    CELERY_DELIVERY_DEFAULTS,
    ConfigurationError,
    Database,
    DeadLetters,
    IdempotencyConflict,
    IdempotentTask,
    InvalidKey,
    LetterView,
    RunIsDead,
    Runs,
    RunStatus,
    purge,
)
from oncelery.cli import oncelery as oncelery_cli
from oncelery.store.database import get_engine
from tests.conftest import ON_POSTGRESQL, close_app
from tests.services import (
    ONCELERY,
    alive,
    clean_env,
    count_rows,
    delete_queue_keys,
    effects_table,
    executions_table,
    kill_sessions,
    results_url,
    run_to_completion,
    unique_queue,
    wait_for,
)

REPO = Path(__file__).resolve().parent.parent
POISON_APP = "tests.apps.poison_app"
POISON_TASK = "oncelery.poison_kill"  # tests/apps/poison_app.py
ORDINARY_TASK = "oncelery.poison_ordinary"
POISON_MAX_DELIVERIES = 3  # the poison task's max_deliveries option
POISON_LEASE = 1.0
# Generous bounds for a noisy 2-core machine; every wait ends as soon as its condition holds.
TIMEOUT = 120.0
CLI_TIMEOUT = 60.0


# -- helpers ---------------------------------------------------------------------------------------


def app_env(db_url: str, broker_url: str, backend_url: str, queue: str) -> dict[str, str]:
    """The environment of a subprocess that imports tests/apps/poison_app.py (a worker, or a CLI's --app)."""
    return clean_env(
        PYTHONPATH=str(REPO),
        ONCELERY_DATABASE_URL=db_url,
        ONCELERY_BROKER_URL=broker_url,
        ONCELERY_RESULT_BACKEND=backend_url,
        ONCELERY_POISON_QUEUE=queue,
        ONCELERY_POISON_LEASE=str(POISON_LEASE),
    )


def oncelery_subprocess(db_url: str, *args: str, env: dict[str, str]) -> str:
    """Run `oncelery --database-url URL ARGS...` as a real subprocess; return its stdout (exit 0 required)."""
    code, out, err = run_to_completion(
        [ONCELERY, "--database-url", db_url, *args], REPO, env, CLI_TIMEOUT, lambda _out: None
    )
    assert code == 0, f"oncelery {' '.join(args)} exited {code}\n--- stdout\n{out}\n--- stderr\n{err}"
    return out


def dlq(db_url: str, *args: str, exit_code: int = 0) -> str:
    """Run `oncelery --database-url URL dlq ARGS...` through click's runner; return its output."""
    result = CliRunner().invoke(oncelery_cli, ["--database-url", db_url, "dlq", *args], catch_exceptions=False)
    assert result.exit_code == exit_code, f"dlq {' '.join(args)} exited {result.exit_code}:\n{result.output}"
    return result.output


def json_lines(output: str) -> list[dict[str, Any]]:
    """Parse `dlq list --jsonl` output: one JSON object per line."""
    return [json.loads(line) for line in output.splitlines() if line.strip()]


def listed(output: str) -> list[dict[str, Any]]:
    """The letters of a `dlq list --json` document (and check its count)."""
    document = json.loads(output)
    assert document["count"] == len(document["letters"]), document
    return list(document["letters"])


def only_letter(db_url: str, task_name: str) -> LetterView:
    """The one dead letter of `task_name` (replayed ones included), failing if there is not exactly one."""
    letters = DeadLetters(db_url).list(task_name=task_name, include_replayed=True, limit=None)
    assert len(letters) == 1, letters
    return letters[0]


def run_status(db_url: str, task_name: str, key: str, tenant: str = "") -> RunStatus | None:
    run = Runs(db_url).get(task_name, key, tenant)
    return None if run is None else run.status


# -- 1. retries exhausted: DEAD, refused, replayed from its checkpoint ----------------------------------


def test_retries_exhausted_goes_dead_then_replay_resumes_from_checkpoint(
    app: Celery, worker_factory: Any, db_url: str, redis_url: str
) -> None:
    broken = threading.Event()
    broken.set()
    bodies: list[int] = []
    step_one: list[int] = []
    step_two: list[int] = []
    name = "oncelery.t_dl_exhausted"

    def parse(n: int) -> dict[str, int]:
        step_one.append(n)
        return {"parsed": n}

    def enrich(parsed: dict[str, int]) -> int:
        step_two.append(parsed["parsed"])
        if broken.is_set():
            raise RuntimeError("the input is broken")
        return parsed["parsed"] * 10

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name=name,
        idempotency_key="dl:{n}",
        autoretry_for=(RuntimeError,),
        max_retries=2,
        retry_kwargs={"countdown": 0.1},
    )
    def job(self: IdempotentTask, n: int) -> dict[str, int]:
        bodies.append(n)
        parsed = self.step("one", parse, n)
        return {"n": n, "value": self.step("two", enrich, parsed)}

    with worker_factory(app, concurrency=2):
        with pytest.raises(RuntimeError, match="the input is broken"):
            job.apply_async((1,), tenant="acme").get(timeout=TIMEOUT)

        # Three attempts (the first, two retries), then DEAD with one dead letter.
        assert bodies == [1, 1, 1]
        assert step_one == [1] and step_two == [1, 1, 1]  # step one replayed from its checkpoint on retries
        run = Runs(db_url).get(name, "dl:1", "acme")
        assert run is not None and run.status is RunStatus.DEAD and run.attempts == 3
        letter = only_letter(db_url, name)
        assert letter.run_id == run.run_id and letter.run_status is RunStatus.DEAD
        assert (letter.task_name, letter.key, letter.tenant) == (name, "dl:1", "acme")
        assert letter.reason == "retries_exhausted"
        assert letter.error is not None and "RuntimeError: the input is broken" in letter.error
        assert letter.traceback is not None and "Traceback (most recent call last)" in letter.traceback
        assert "the input is broken" in letter.traceback and "enrich" in letter.traceback
        assert letter.attempts == 3
        assert letter.first_failed_at is not None and letter.last_failed_at is not None
        assert letter.first_failed_at <= letter.last_failed_at
        assert letter.replayed_at is None and letter.replays == 0
        counts = Runs(db_url).outcome_counts(name)
        assert counts.get("dead") == 1 and counts.get("failed") == 2 and "executed" not in counts

        # A later duplicate of the same key: refused without calling the body, counted `dead`.
        with pytest.raises(RunIsDead, match="dl:1"):
            job.apply_async((1,), tenant="acme").get(timeout=TIMEOUT)
        assert bodies == [1, 1, 1]
        assert Runs(db_url).outcome_counts(name).get("dead") == 2
        assert run_status(db_url, name, "dl:1", "acme") is RunStatus.DEAD

        # Fix the input, then replay from another process while the worker runs.
        broken.clear()
        env = app_env(db_url, redis_url, redis_url, str(app.conf.task_default_queue))
        out = oncelery_subprocess(db_url, "dlq", "replay", "dl:1", "--app", f"{POISON_APP}:app", env=env)
        assert f"replayed {letter.letter_id} {name}[dl:1]" in out and "1 replayed, 0 skipped" in out

        wait_for(
            lambda: run_status(db_url, name, "dl:1", "acme") is RunStatus.COMPLETED,
            timeout=TIMEOUT,
            what="the replayed run to complete",
        )
        run = Runs(db_url).get(name, "dl:1", "acme")
        assert run is not None and run.result == {"n": 1, "value": 10}
        assert step_one == [1]  # not executed again: replayed from its checkpoint
        assert step_two == [1, 1, 1, 1] and bodies == [1, 1, 1, 1]
        assert Runs(db_url).outcome_counts(name).get("resumed") == 1
        # Now the key answers from its stored result.
        assert job.apply_async((1,), tenant="acme").get(timeout=TIMEOUT) == {"n": 1, "value": 10}
        assert bodies == [1, 1, 1, 1]

    replayed = only_letter(db_url, name)
    assert replayed.letter_id == letter.letter_id
    assert replayed.replayed_at is not None and replayed.replays == 1
    assert replayed.run_status is RunStatus.COMPLETED
    listed = dlq(db_url, "list", "--task", name)
    assert "dl:1" not in listed and "(0 letters)" in listed
    listed_all = dlq(db_url, "list", "--task", name, "--all")
    assert "dl:1" in listed_all and "(1 letter)" in listed_all


# -- 2. an error that can never succeed -----------------------------------------------------------------


@pytest.mark.parametrize(
    "retrying",
    [(RuntimeError,), (Exception,)],
    ids=["autoretry-other-errors", "autoretry-every-error"],
)
def test_dead_on_error_goes_dead_on_the_first_attempt(
    app: Celery, worker_factory: Any, db_url: str, retrying: tuple[type[BaseException], ...]
) -> None:
    calls: list[int] = []
    name = "oncelery.t_dl_never"

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name=name,
        idempotency_key="v:{n}",
        dead_on=(ValueError,),
        autoretry_for=retrying,
        max_retries=3,
        retry_kwargs={"countdown": 0.1},
    )
    def validate(self: IdempotentTask, n: int) -> int:
        calls.append(n)
        raise ValueError(f"record {n} violates the schema")

    with worker_factory(app, concurrency=2), pytest.raises(ValueError, match="violates the schema"):
        validate.delay(4).get(timeout=TIMEOUT)

    assert calls == [4]
    run = Runs(db_url).get(name, "v:4")
    assert run is not None and run.status is RunStatus.DEAD and run.attempts == 1
    letter = only_letter(db_url, name)
    assert letter.reason == "never_succeeds" and letter.attempts == 1 and letter.key == "v:4"
    assert letter.error is not None and "ValueError: record 4 violates the schema" in letter.error
    assert Runs(db_url).outcome_counts(name) == {"dead": 1}


# -- 3. a poison message: the worker dies on every delivery -------------------------------------------------


class PoisonWorker:
    """One `celery worker` subprocess (prefork) on tests/apps/poison_app.py, in a session of its own."""

    def __init__(self, proc: subprocess.Popen[bytes], log: Path, hostname: str) -> None:
        self.proc = proc
        self.log_path = log
        self.hostname = hostname

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def is_ready(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"the worker exited with {self.proc.returncode}:\n{self.log()}")
        return f"{self.hostname} ready." in self.log()


def session_pids(leader: int) -> list[int]:
    """The live processes of the session `leader` leads (the worker and its pool children)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and alive(int(entry.name)):
            try:
                if os.getsid(int(entry.name)) == leader:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def dump_stacks(worker: PoisonWorker) -> None:
    """On a failure, have each of the worker's processes write its threads' stacks to the log (SIGUSR2)."""
    pids = session_pids(worker.proc.pid)
    before = worker.log().count("most recent call first")
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR2)
    with suppress(pytest.fail.Exception):  # best effort: the test's own failure is what is reported
        wait_for(
            lambda: worker.log().count("most recent call first") >= before + len(pids),
            timeout=10,
            what="the stack dumps",
        )
    print(f"===== stacks dumped for pids {pids} (see the worker log) =====")


@contextmanager
def poison_worker(tmp_path: Path, env: dict[str, str], queue: str, broker_url: str) -> Iterator[PoisonWorker]:
    """Start the worker; stop it by PID (SIGTERM, a bounded wait, SIGKILL of its group) however the test ends."""
    hostname = f"poison-{queue}@dl"
    log = tmp_path / "worker-poison.log"
    cmd = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        POISON_APP,
        "worker",
        "-Q",
        queue,
        "--hostname",
        hostname,
        "--pool",
        "prefork",
        "--concurrency",
        "2",
        "--loglevel",
        "INFO",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    worker = PoisonWorker(proc, log, hostname)
    try:
        yield worker
    except BaseException:
        dump_stacks(worker)
        raise
    finally:
        kill_sessions([proc])  # the checks need no warm shutdown: the poison run and every job settled before
        print(f"===== poison worker pid={proc.pid} rc={proc.returncode} =====\n{worker.log()}")
        delete_queue_keys(broker_url, queue)


@ON_POSTGRESQL
def test_poison_message_goes_dead_after_max_deliveries(tmp_path: Path, db_url: str, redis_url: str) -> None:
    assert IdempotentTask.max_deliveries == 5  # the default bound
    key = f"poison-{uuid.uuid4().hex[:8]}"
    jobs = [f"job-{i}-{uuid.uuid4().hex[:6]}" for i in range(20)]
    job_keys = [f"job:{job}" for job in jobs]
    queue = unique_queue()
    backend_url = results_url(redis_url)
    env = app_env(db_url, redis_url, backend_url, queue)
    engine = get_engine(db_url)
    sender = Celery(f"poison-sender-{os.getpid()}")
    sender.conf.update(
        **CELERY_DELIVERY_DEFAULTS,
        broker_url=redis_url,
        result_backend=backend_url,
        task_default_queue=queue,
        broker_connection_retry_on_startup=True,
    )
    assert sender.conf.task_acks_late and sender.conf.task_reject_on_worker_lost
    try:
        with poison_worker(tmp_path, env, queue, redis_url) as worker:
            wait_for(worker.is_ready, timeout=TIMEOUT, interval=0.1, what="the worker to be ready")
            poison = sender.send_task(POISON_TASK, args=[key])
            for job in jobs:
                sender.send_task(ORDINARY_TASK, args=[job])

            # Waits on the database (the source of truth), not on the result backend.
            wait_for(
                lambda: Runs(db_url).keys_in(ORDINARY_TASK, RunStatus.COMPLETED, job_keys) == set(job_keys),
                timeout=TIMEOUT,
                what="the 20 ordinary jobs to complete",
            )
            wait_for(
                lambda: run_status(db_url, POISON_TASK, f"poison:{key}") is RunStatus.DEAD,
                timeout=TIMEOUT,
                what="the poison run to be DEAD",
            )
            # The delivery that found it lost once too often was answered RunIsDead (acked, FAILURE).
            wait_for(lambda: poison.state == "FAILURE", timeout=TIMEOUT, what="the poison message's FAILURE")
            assert isinstance(poison.result, RunIsDead) and "poison message" in str(poison.result)
            assert worker.proc.poll() is None  # only pool processes died; the worker lived on

        # The body started once per delivery that reached it, each in a fresh pool process, then never again.
        with engine.connect() as conn:
            pids = conn.execute(
                select(executions_table.c.pid).where(executions_table.c.key == key).order_by(executions_table.c.id)
            ).all()
        assert len(pids) == POISON_MAX_DELIVERIES
        assert len({pid for (pid,) in pids}) == POISON_MAX_DELIVERIES
        with engine.connect() as conn:
            status, lost, attempts = conn.execute(
                text("SELECT status, lost, attempts FROM task_runs WHERE task_name = :t AND idempotency_key = :k"),
                {"t": POISON_TASK, "k": f"poison:{key}"},
            ).one()
        assert status == RunStatus.DEAD.value
        assert lost == POISON_MAX_DELIVERIES and attempts == POISON_MAX_DELIVERIES
        letter = only_letter(db_url, POISON_TASK)
        assert letter.reason == "max_deliveries" and letter.key == f"poison:{key}"
        assert letter.attempts == POISON_MAX_DELIVERIES
        assert letter.error is not None and f"max_deliveries={POISON_MAX_DELIVERIES}" in letter.error
        assert letter.message is not None and letter.message["args"] == [key]  # kept, to replay it
        poison_counts = Runs(db_url).outcome_counts(POISON_TASK)
        assert poison_counts.get("dead") == 1
        assert not {"executed", "resumed", "failed"} & set(poison_counts)

        # Every ordinary job on the same queue completed, its body executed once.
        runs = {r.key: r for r in Runs(db_url).list(task_name=ORDINARY_TASK, limit=None)}
        assert sorted(runs) == sorted(job_keys)
        for job in jobs:
            run = runs[f"job:{job}"]
            assert run.status is RunStatus.COMPLETED and run.token == 1 and run.result["key"] == job
            assert count_rows(engine, executions_table, job) == 1, job
            assert count_rows(engine, effects_table, job) == 1, job
        assert Runs(db_url).outcome_counts(ORDINARY_TASK).get("executed") == 20
    finally:
        close_app(sender)


# -- 4. the dlq commands ------------------------------------------------------------------------------


def test_dlq_commands_list_show_and_purge(app: Celery, worker_factory: Any, db_url: str) -> None:
    secret = "patient 4711 has condition X"
    broken = threading.Event()
    broken.set()
    calls: list[int] = []
    a_name, b_name = "oncelery.t_dl_cli_a", "oncelery.t_dl_cli_b"

    @app.task(shared=False, base=IdempotentTask, bind=True, name=a_name, idempotency_key="a:{n}", dead_on=(ValueError,))
    def check_note(self: IdempotentTask, n: int, note: str) -> dict[str, Any]:
        calls.append(n)
        if broken.is_set():
            raise ValueError(f"note {n} is not valid")
        return {"n": n, "length": len(note)}

    @app.task(shared=False, base=IdempotentTask, bind=True, name=b_name, idempotency_key="b:{n}", max_retries=0)
    def upload(self: IdempotentTask, n: int) -> None:
        raise RuntimeError("the backend rejected it")

    with worker_factory(app, concurrency=2):
        for n in (1, 2):
            with pytest.raises(ValueError, match="is not valid"):
                check_note.delay(n, secret).get(timeout=TIMEOUT)
        with pytest.raises(RuntimeError, match="rejected"):
            upload.delay(1).get(timeout=TIMEOUT)

        # list --json: one document, filtered by task and reason; never the payload.
        out = dlq(db_url, "list", "--json")
        assert secret not in out
        every = listed(out)
        assert sorted((x["task"], x["key"], x["reason"]) for x in every) == [
            (a_name, "a:1", "never_succeeds"),
            (a_name, "a:2", "never_succeeds"),
            (b_name, "b:1", "retries_exhausted"),
        ]
        assert all(x["run_status"] == "DEAD" and x["attempts"] == 1 and x["replayed_at"] is None for x in every)
        by_task = listed(dlq(db_url, "list", "--json", "--task", a_name))
        assert sorted(x["key"] for x in by_task) == ["a:1", "a:2"]
        by_reason = listed(dlq(db_url, "list", "--json", "--reason", "retries_exhausted"))
        assert [(x["task"], x["key"]) for x in by_reason] == [(b_name, "b:1")]
        assert listed(dlq(db_url, "list", "--json", "--task", a_name, "--reason", "retries_exhausted")) == []
        # --jsonl: the lines `--json` printed before, one letter each.
        lines = json_lines(dlq(db_url, "list", "--jsonl", "--task", a_name))
        assert sorted(x["key"] for x in lines) == ["a:1", "a:2"] and all("replay" not in x for x in lines)

        # show: the traceback, and the message redacted unless --show-payload.
        a1 = next(x for x in every if x["key"] == "a:1")
        shown = dlq(db_url, "show", str(a1["id"]))
        assert "traceback:" in shown and "Traceback (most recent call last)" in shown
        assert "ValueError: note 1 is not valid" in shown and "never_succeeds" in shown
        assert "--show-payload prints it" in shown and secret not in shown
        with_payload = dlq(db_url, "show", str(a1["id"]), "--show-payload")
        assert secret in with_payload and "Traceback (most recent call last)" in with_payload
        assert "a:1" in dlq(db_url, "show", "a:1")  # by key too

        # purge: refuses everything without a filter; by task deletes the letters and their DEAD runs.
        dlq(db_url, "purge", exit_code=2)
        assert "2 dead letters purged" in dlq(db_url, "purge", "--task", a_name)
        assert DeadLetters(db_url).list(task_name=a_name, include_replayed=True, limit=None) == []
        assert Runs(db_url).get(a_name, "a:1") is None and Runs(db_url).get(a_name, "a:2") is None
        assert [x["key"] for x in listed(dlq(db_url, "list", "--json"))] == ["b:1"]
        assert run_status(db_url, b_name, "b:1") is RunStatus.DEAD

        # The key may be sent again, and then it executes.
        broken.clear()
        assert check_note.delay(1, secret).get(timeout=TIMEOUT) == {"n": 1, "length": len(secret)}

    assert calls == [1, 2, 1]
    run = Runs(db_url).get(a_name, "a:1")
    assert run is not None and run.status is RunStatus.COMPLETED and run.attempts == 1
    assert Runs(db_url).outcome_counts(a_name).get("executed") == 1


# -- 5. a message without an identity ---------------------------------------------------------------


def test_bad_message_is_a_run_less_dead_letter(app: Celery, worker_factory: Any, db_url: str) -> None:
    calls: list[int] = []
    name = "oncelery.t_dl_bad"

    @app.task(shared=False, base=IdempotentTask, bind=True, name=name, idempotency_key="k:{n}")
    def keyed(self: IdempotentTask, n: int) -> int:
        calls.append(n)
        return n

    with worker_factory(app, concurrency=2), pytest.raises(ConfigurationError, match="arguments do not match"):
        app.send_task(name, kwargs={"zzz": 1}).get(timeout=TIMEOUT)

    assert calls == []
    assert Runs(db_url).list(task_name=name, limit=None) == []
    letter = only_letter(db_url, name)
    assert letter.reason == "bad_message" and letter.run_id is None and letter.key is None
    assert letter.error is not None and "arguments do not match the task" in letter.error and "'n'" in letter.error
    assert letter.message is not None and letter.message["kwargs"] == {"zzz": 1}
    assert Runs(db_url).outcome_counts(name) == {"dead": 1}
    # It has no run to replay: skipped, with why.
    report = DeadLetters(db_url).replay(app, [letter])
    assert report.replayed == [] and len(report.skipped) == 1
    assert "no run to replay" in report.skipped[0][1]


def test_a_worker_records_an_outcome_for_a_message_without_an_identity(
    app: Celery, worker_factory: Any, db_url: str
) -> None:
    """A message the caller-side check never saw (sent by name) with a key too long: counted, with the reason."""

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_noident", idempotency_key="k:{doc}")
    def job(self: IdempotentTask, doc: str) -> str:
        return doc

    with worker_factory(app):
        result = app.send_task("oncelery.t_noident", args=["x" * 300])
        with pytest.raises(Exception, match="255"):
            result.get(timeout=60)
    # It can never succeed: dead-lettered without a run (nothing to replay until the message is fixed).
    assert job.outcome_counts() == {"dead": 1}
    assert Runs(db_url).list(task_name="oncelery.t_noident") == []
    letters = DeadLetters(db_url).list(task_name="oncelery.t_noident")
    assert [(x.reason, x.run_id, x.message["args"]) for x in letters] == [("bad_message", None, ["x" * 300])]


def test_autoretry_max_retries_in_retry_kwargs_is_the_limit_that_makes_a_run_dead(
    app: Celery, worker_factory: Any, db_url: str
) -> None:
    """Celery's documented autoretry limit (retry_kwargs["max_retries"]) decides when retries are exhausted."""
    calls: list[int] = []
    name = "oncelery.t_dl_kwargs_limit"

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name=name,
        idempotency_key="rk:{n}",
        autoretry_for=(RuntimeError,),
        retry_kwargs={"countdown": 0.1, "max_retries": 1},
    )
    def flaky(self: IdempotentTask, n: int) -> int:
        calls.append(n)
        raise RuntimeError("still broken")

    with worker_factory(app, concurrency=2), pytest.raises(RuntimeError, match="still broken"):
        flaky.delay(5).get(timeout=TIMEOUT)
    assert calls == [5, 5]  # the first try and the one retry retry_kwargs allows
    run = Runs(db_url).get(name, "rk:5")
    assert run is not None and run.status is RunStatus.DEAD and run.attempts == 2
    assert only_letter(db_url, name).reason == "retries_exhausted"


def test_a_replay_keeps_the_calls_own_options(app: Celery, worker_factory: Any, db_url: str) -> None:
    """A job sent with lease=7 and on_in_progress='skip' that went DEAD is replayed with both options, as
    well as its key: the replayed delivery sees the same per-call headers as the first."""
    seen: list[dict[str, Any]] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_replay_options", dead_on=(KeyError,))
    def job(self: IdempotentTask, n: int) -> int:
        headers = self.request.headers or {}
        seen.append({name: headers.get(name) for name in ("oncelery_lease", "oncelery_on_in_progress")})
        if len(seen) == 1:
            raise KeyError("dead on purpose: replayed below")
        return n

    app.finalize()
    with worker_factory(app):
        with pytest.raises(KeyError):
            job.apply_async((4,), lease=7, on_in_progress="skip").get(timeout=60)
        letters = DeadLetters(db_url).list(task_name=job.name, limit=None)
        assert len(DeadLetters(db_url).replay(app, letters).replayed) == 1
        wait_for(lambda: len(seen) == 2, timeout=60, what="the replayed delivery")
    assert seen[1] == seen[0] == {"oncelery_lease": 7.0, "oncelery_on_in_progress": "skip"}, seen


def test_conflicts_are_counted_with_one_redacted_letter_per_payload(
    app: Celery, worker_factory: Any, db_url: str
) -> None:
    """Five conflicting deliveries of two other payloads for one key: five `conflict` outcomes, two letters (one
    per payload fingerprint, attempts 3 and 2) that keep neither payload's values; a purge removes them."""
    secret = "PIN 4711"

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_conflict_letters", idempotency_key="k:{n}")
    def job(self: IdempotentTask, n: int, note: str) -> str:
        return note

    with worker_factory(app):
        assert job.delay(1, "first").get(timeout=60) == "first"
        for note in (f"{secret} b", f"{secret} b", f"{secret} c", f"{secret} b", f"{secret} c"):
            with pytest.raises(IdempotencyConflict):
                job.delay(1, note).get(timeout=60)
    assert job.outcome_counts() == {"executed": 1, "conflict": 5}
    letters = DeadLetters(db_url).list(task_name=job.name, limit=None)
    assert sorted(letter.attempts for letter in letters) == [2, 3]
    assert {letter.reason for letter in letters} == {"conflict"}
    for letter in letters:
        assert letter.message["fields_that_differ"] == ["note"]
        assert secret not in json.dumps(letter.message), "a conflict letter kept the payload"
    assert purge(Database(db_url), older_than=0).dead_letters == 2
    assert DeadLetters(db_url).list(task_name=job.name, limit=None) == []


def test_a_lone_surrogate_from_another_producer_is_a_typed_refusal_with_an_outcome_and_a_letter(
    app: Celery, worker_factory: Any, db_url: str
) -> None:
    """A non-Python producer's JSON may carry a lone surrogate ("\\ud800"), which has no UTF-8 form: the delivery
    is refused with a typed error, counted `dead`, and dead-lettered (the letter keeps the escaped text)."""

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_surrogate", idempotency_key="k:{doc}")
    def job(self: IdempotentTask, doc: str) -> str:
        return doc

    with worker_factory(app):
        result = app.send_task("oncelery.t_surrogate", args=["a\ud800b"])  # sent by name: no caller-side check
        with pytest.raises(InvalidKey):
            result.get(timeout=60)
    assert job.outcome_counts() == {"dead": 1}
    letters = DeadLetters(db_url).list(task_name="oncelery.t_surrogate")
    assert [(x.reason, x.run_id) for x in letters] == [("bad_message", None)]
    assert letters[0].error is not None and "surrogate" in letters[0].error


def test_a_conflict_is_logged_as_expected_without_a_traceback(
    app: Celery, worker_factory: Any, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """IdempotencyConflict is raised on purpose (counted, lettered): Celery logs it at INFO with no traceback,
    not as ERROR "raised unexpected"."""

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_conflict_log", idempotency_key="k:{n}")
    def job(self: IdempotentTask, n: int, note: str) -> str:
        return note

    with caplog.at_level(logging.INFO, logger="celery.app.trace"), worker_factory(app):
        assert job.delay(1, "first").get(timeout=60) == "first"
        with pytest.raises(IdempotencyConflict):
            job.delay(1, "second").get(timeout=60)
    traced = [r for r in caplog.records if r.name == "celery.app.trace" and "IdempotencyConflict" in r.getMessage()]
    assert traced, "the conflict was not logged by Celery's tracer"
    assert all(r.levelno == logging.INFO and r.exc_info is None for r in traced), [
        (r.levelname, r.getMessage()[:80]) for r in traced
    ]
