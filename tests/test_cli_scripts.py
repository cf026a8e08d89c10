"""The command line for scripts: `--json` documents of runs and outcomes, and one-line errors (exit code 2) for a
service that cannot be reached or an environment value that cannot be used, through the real console script."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner

from oncelery import IdempotentTask, model_call
from oncelery.cli import EXIT_CONFIGURATION
from oncelery.cli import oncelery as oncelery_cli
from tests.services import ONCELERY, clean_env

HANG_BOUND = 30.0  # seconds: a bound on a hang (the checks time out after 2 s; a loaded 2-core machine takes
# over 10 s to start the CLI), not a benchmark
PASSWORD = "pw-s3cret"


def free_port() -> int:
    """A local port nothing listens on (the socket that held it is closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def one_line_error(argv: list[str], env: Mapping[str, str], cwd: Path) -> str:
    """Run the console script; assert it failed with exit code 2 and ONE stderr line, quickly; return the line."""
    started = time.monotonic()
    done = subprocess.run(
        [ONCELERY, *argv], cwd=cwd, env=dict(env), capture_output=True, text=True, timeout=60, check=False
    )
    elapsed = time.monotonic() - started
    lines = done.stderr.splitlines()
    assert done.returncode == EXIT_CONFIGURATION, (done.returncode, done.stdout, done.stderr)
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("oncelery: ")
    assert elapsed < HANG_BOUND, f"took {elapsed:.1f} s"
    assert PASSWORD not in done.stderr + done.stdout
    return lines[0]


@pytest.fixture
def articles(tmp_path: Path) -> Path:
    path = tmp_path / "articles.jsonl"
    path.write_text('{"id": "a1", "version": 1, "text": "A short article about queues."}\n')
    return path


def test_an_unreachable_broker_is_one_line_naming_the_setting(tmp_path: Path, articles: Path) -> None:
    port = free_port()
    env = clean_env(ONCELERY_BROKER_URL=f"redis://:{PASSWORD}@127.0.0.1:{port}/0")
    line = one_line_error(["process", str(articles)], env, tmp_path)
    assert f"ONCELERY_BROKER_URL=redis://:***@127.0.0.1:{port}/0" in line and "broker" in line
    relay = one_line_error(["--database-url", f"sqlite:///{tmp_path / 'r.db'}", "relay", "--once"], env, tmp_path)
    assert "ONCELERY_BROKER_URL=" in relay


def test_an_unreachable_result_backend_is_one_line(tmp_path: Path, articles: Path, redis_url: str) -> None:
    port = free_port()
    env = clean_env(ONCELERY_BROKER_URL=redis_url, ONCELERY_RESULT_BACKEND=f"redis://:{PASSWORD}@127.0.0.1:{port}/1")
    line = one_line_error(["demo", "--jobs", "1"], env, tmp_path)
    assert f"result backend ONCELERY_RESULT_BACKEND=redis://:***@127.0.0.1:{port}/1" in line


def test_an_unreachable_database_is_one_line(tmp_path: Path) -> None:
    url = f"postgresql+psycopg://u:{PASSWORD}@127.0.0.1:{free_port()}/db"
    line = one_line_error(["runs", "list"], clean_env(ONCELERY_DATABASE_URL=url), tmp_path)
    assert "claims database ONCELERY_DATABASE_URL=postgresql+psycopg://u:***@127.0.0.1:" in line
    flag = one_line_error(["--database-url", url, "outcomes", "--json"], clean_env(), tmp_path)
    assert "--database-url=" in flag


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("ONCELERY_VISIBILITY_TIMEOUT", "2m", "give seconds as a number > 0"),
        ("ONCELERY_UNACKED_RESTORE_INTERVAL", "x", "give seconds as a number > 0"),
        ("ONCELERY_SQLITE_BUSY_TIMEOUT", "-1", "give seconds >= 0"),
        ("ONCELERY_LLM_TIMEOUT", "abc", "give seconds as a number > 0"),
    ],
)
def test_a_bad_environment_value_is_one_line_naming_it(
    tmp_path: Path, articles: Path, redis_url: str, variable: str, value: str, expected: str
) -> None:
    # A reachable broker, so the only thing wrong is the value; the LLM variables apply with a server URL.
    env = clean_env(
        ONCELERY_BROKER_URL=redis_url,
        ONCELERY_LLM_BASE_URL="http://127.0.0.1:9/v1",
        ONCELERY_LLM_MODEL="m",
        **{variable: value},
    )
    line = one_line_error(["process", str(articles)], env, tmp_path)
    assert f"{variable}={value!r}" in line and expected in line


# -- --json --------------------------------------------------------------------------------------


def cli_json(db_url: str, *args: str) -> Any:
    """Run an `oncelery` command in process with --json and return the parsed document."""
    done = CliRunner().invoke(oncelery_cli, ["--database-url", db_url, *args, "--json"], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    return json.loads(done.output)


def iso_utc(value: str) -> datetime:
    moment = datetime.fromisoformat(value)
    assert moment.utcoffset() is not None and moment.utcoffset().total_seconds() == 0, value  # type: ignore[union-attr]
    return moment


def test_json_of_a_resumed_run_its_steps_and_model_calls(app: Celery, db_url: str, worker_factory: Any) -> None:
    failed_once: set[int] = set()

    def summarize(n: int) -> str:
        with model_call("gpt-4o-mini", prompt="summarize") as call:
            call.tokens(10 + n, 3)
        return f"summary {n}"

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_cli_json", idempotency_key="j:{n}")
    def job(self: IdempotentTask, n: int) -> str:
        summary = self.step("summarize", summarize, n)
        if n not in failed_once:
            failed_once.add(n)
            raise RuntimeError("dies after step 1; the next delivery resumes")
        return str(self.step("finish", lambda s: s.upper(), summary))

    with worker_factory(app):
        with pytest.raises(RuntimeError):
            job.delay(1).get(timeout=30)
        assert job.delay(1).get(timeout=30) == "SUMMARY 1"
        assert job.delay(1).get(timeout=30) == "SUMMARY 1"  # a duplicate: answered from the stored result

    listed = cli_json(db_url, "runs", "list", "--task", "oncelery.t_cli_json")
    assert listed["count"] == 1 and listed["pass_through_seen"] is None
    (row,) = listed["runs"]
    assert (row["key"], row["status"], row["token"], row["replays"]) == ("j:1", "COMPLETED", 2, 1)
    assert row["lease_live"] is False
    iso_utc(row["updated_at"])

    (run,) = cli_json(db_url, "runs", "show", "j:1")["runs"]
    assert run["status"] == "COMPLETED" and run["result"] == "SUMMARY 1" and run["attempts"] == 2
    steps = [(s["position"], s["name"], s["token"], s["by_last_attempt"]) for s in run["steps"]]
    assert steps == [(0, "summarize", 1, "replayed"), (1, "finish", 2, "executed")]
    assert all(s["seconds"] >= 0 for s in run["steps"])
    assert iso_utc(run["steps"][0]["created_at"]) >= iso_utc(run["created_at"])
    (call,) = run["model_calls"]  # the resumed attempt replayed the step: no second call
    assert (call["model"], call["prompt"], call["input_tokens"], call["output_tokens"]) == (
        "gpt-4o-mini",
        "summarize",
        11,
        3,
    )
    assert call["ok"] is True and call["step"] == "summarize" and call["token"] == 1 and call["latency_ms"] >= 0
    assert {"owner", "lease_expires_at", "lease_live", "fingerprint", "error", "message", "replays"} <= run.keys()

    text = CliRunner().invoke(oncelery_cli, ["--database-url", db_url, "runs", "show", "j:1"])
    assert text.exit_code == 0, text.output
    assert "model calls (1):" in text.output and "replayed" in text.output and "executed" in text.output

    counted = cli_json(db_url, "outcomes", "--task", "oncelery.t_cli_json")
    assert counted["outcomes"]["failed"] == 1 and counted["outcomes"]["resumed"] == 1
    assert counted["outcomes"]["replayed"] == 1 and counted["outcomes"]["executed"] == 0
    assert counted["total"] == 3 and counted["task"] == "oncelery.t_cli_json"
