"""The cost ledger (`oncelery.model_call`): calls through the real OpenAI SDK to a local server, recorded once per
real call, on SQLite and PostgreSQL; costs and what replays saved read back through the real `oncelery costs`."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import sqlite3
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import openai
import pytest
from celery import Celery, current_app
from click.testing import CliRunner
from sqlalchemy import select

from oncelery import ConfigurationError, Database, IdempotentTask, model_call, purge
from oncelery.cli import oncelery as oncelery_cli
from oncelery.models import ModelCall, TaskRun
from oncelery.runs.claims import RunStore
from oncelery.store.database import get_engine
from tests.services import LocalHTTPServer, QuietHandler, count_rows, effects_table, wait_for
from tests.test_metrics import scrape

MODEL = "gpt-4o-mini"
UNPRICED = "local-small"  # no entry in the price table: its calls cost NULL
PRICES = {MODEL: {"input": 0.15, "output": 0.60}}  # USD per 1M tokens


def usage_of(content: str) -> tuple[int, int]:
    """The (prompt, completion) tokens the server reports for a prompt: fixed per text, different per job."""
    return len(content.split()) * 11 + 7, len(content) % 13 + 2


def reply_to(content: str) -> str:
    """The server's answer to a prompt."""
    return "S " + content[:40]


def document(n: int) -> str:
    """Job n's input: a text whose length (so whose token count) differs per job."""
    return f"article {n}: " + "lorem ipsum " * (n + 1)


class OpenAIServer(LocalHTTPServer):
    """A real HTTP server on 127.0.0.1 speaking OpenAI's chat completions, counting what it was asked."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []  # (model, prompt) of every request it received
        self.fail_next = 0  # answer this many next requests with a 500
        self.lock = threading.Lock()
        server = self

        class Handler(QuietHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))))
                content = body["messages"][-1]["content"]
                with server.lock:
                    server.requests.append((body["model"], content))
                    failing = server.fail_next > 0
                    server.fail_next -= failing
                if failing:
                    self._send(500, {"error": {"message": "model overloaded", "type": "server_error"}})
                    return
                prompt_tokens, completion_tokens = usage_of(content)
                self._send(
                    200,
                    {
                        "id": "chatcmpl-ledger",
                        "object": "chat.completion",
                        "created": 1_700_000_000,
                        "model": body["model"] + "-2024-07-18",
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": reply_to(content)},
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": {
                            "prompt_tokens": prompt_tokens,
                            "completion_tokens": completion_tokens,
                            "total_tokens": prompt_tokens + completion_tokens,
                        },
                    },
                )

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        super().__init__(Handler)


@pytest.fixture
def server() -> Iterator[OpenAIServer]:
    """A running OpenAI-compatible server."""
    with OpenAIServer() as srv:
        yield srv


@pytest.fixture
def client(server: OpenAIServer) -> Iterator[openai.OpenAI]:
    """The real OpenAI SDK pointed at `server`, without its own retries (each request is one call)."""
    sdk = openai.OpenAI(base_url=server.url, api_key="sk-test", max_retries=0, timeout=10.0)
    try:
        yield sdk
    finally:
        sdk.close()


@contextmanager
def current(app: Celery) -> Iterator[Celery]:
    """Make `app` Celery's current app (whose price table a call outside any task reads), then restore."""
    before = current_app._get_current_object()
    app.set_current()
    try:
        yield app
    finally:
        before.set_current()
        app.close()


def ask(client: openai.OpenAI, model: str, prompt: str, content: str) -> str:
    """One chat completion, recorded in the ledger through the context manager."""
    with model_call(model, prompt=prompt) as call:
        resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}])
        call.usage(resp.usage)
    return str(resp.choices[0].message.content)


def ledger(db_url: str) -> list[Any]:
    """Every model_calls row, oldest first."""
    table = ModelCall.__table__
    with get_engine(db_url).connect() as conn:
        return list(conn.execute(select(table).order_by(table.c.id)).all())


def costs(db_url: str, *args: str) -> dict[str, Any]:
    """`oncelery costs --json` through the real command group."""
    result = CliRunner().invoke(oncelery_cli, ["--database-url", db_url, "costs", "--json", *args])
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.output, parse_float=Decimal))  # USD as printed, exactly


def micros(prompt_tokens: int, completion_tokens: int) -> int:
    """What PRICES (0.15 and 0.60 USD per 1M tokens) charge for these tokens, in micro-USD rounded up."""
    return -(-(prompt_tokens * 15 + completion_tokens * 60) // 100)


def usd(micro_usd: int) -> Decimal:
    """Micro-USD as exact USD."""
    return Decimal(micro_usd) / 1_000_000


def test_calls_made_and_saved_by_replays_are_exact(
    app: Celery, worker_factory: Any, db_url: str, server: OpenAIServer, client: openai.OpenAI
) -> None:
    app.conf.oncelery_prices = PRICES

    @model_call(UNPRICED, prompt="keywords")  # the decorator: tokens read from the response's .usage
    def keywords(text: str) -> Any:
        return client.chat.completions.create(model=UNPRICED, messages=[{"role": "user", "content": text}])

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_ledger_job", idempotency_key="doc:{n}")
    def job(self: IdempotentTask, n: int) -> str:
        summary = self.step("summarize", ask, client, MODEL, "summarize", document(n))
        return str(self.step("keywords", lambda s: keywords(s).choices[0].message.content, summary))

    def tenant(n: int) -> str:
        return "acme" if n % 2 == 0 else "globex"

    jobs = range(20)
    duplicates = random.Random(11).choices(jobs, k=9)  # 9 of 29 deliveries (~30 %); some keys twice
    with worker_factory(app, concurrency=4):
        originals = [job.apply_async((n,), tenant=tenant(n)) for n in jobs]
        assert [r.get(timeout=60) for r in originals] == [reply_to(reply_to(document(n))) for n in jobs]
        # Only now, with every key COMPLETED, the duplicates: each is answered from the stored result.
        again = [job.apply_async((n,), tenant=tenant(n)) for n in duplicates]
        assert [r.get(timeout=60) for r in again] == [reply_to(reply_to(document(n))) for n in duplicates]

    calls_per_job = 2
    assert job.outcome_counts() == {"executed": 20, "replayed": 9}
    assert len(server.requests) == calls_per_job * len(jobs)
    with get_engine(db_url).connect() as conn:
        replays = dict(conn.execute(select(TaskRun.idempotency_key, TaskRun.replays)).all())
    assert replays == {f"doc:{n}": Counter(duplicates)[n] for n in jobs}

    def job_usage(n: int) -> tuple[tuple[int, int], tuple[int, int]]:  # (summarize, keywords) tokens
        return usage_of(document(n)), usage_of(reply_to(document(n)))

    report = costs(db_url)
    made, saved = report["total"]["made"], report["total"]["saved"]
    assert made["calls"] == len(server.requests) and made["failed_calls"] == 0
    assert saved["calls"] == len(duplicates) * calls_per_job
    assert made["input_tokens"] == sum(usage_of(content)[0] for _, content in server.requests)
    assert made["output_tokens"] == sum(usage_of(content)[1] for _, content in server.requests)
    assert saved["input_tokens"] == sum(a[0] + b[0] for a, b in map(job_usage, duplicates))
    assert saved["output_tokens"] == sum(a[1] + b[1] for a, b in map(job_usage, duplicates))
    # Only MODEL has a price: the keywords calls are counted, never priced.
    # Exact: each call rounded up to the micro-USD, then summed as integers.
    assert made["cost"] == usd(sum(micros(*job_usage(n)[0]) for n in jobs))
    assert saved["cost"] == usd(sum(micros(*job_usage(n)[0]) for n in duplicates))
    assert made["unpriced_calls"] == len(jobs) and saved["unpriced_calls"] == len(duplicates)
    lines = {(x["task"], x["tenant"], x["model"]): x for x in report["lines"]}
    assert sorted(lines) == [("oncelery.t_ledger_job", t, m) for t in ("acme", "globex") for m in (MODEL, UNPRICED)]
    assert lines[("oncelery.t_ledger_job", "globex", UNPRICED)]["made"]["cost"] is None

    acme = costs(db_url, "--tenant", "acme")["total"]
    assert acme["made"]["calls"] == calls_per_job * 10
    assert acme["saved"]["calls"] == calls_per_job * sum(1 for n in duplicates if tenant(n) == "acme")
    assert costs(db_url, "--task", "oncelery.other")["lines"] == []
    table = CliRunner().invoke(oncelery_cli, ["--database-url", db_url, "costs"])
    assert table.exit_code == 0 and "total" in table.output and "(20 calls of models without a price" in table.output

    # The exporter's running totals (no scan of model_calls) agree with the ledger's own sums, line by line.
    got = scrape(db_url)
    for (task, who, model), line in lines.items():
        key = (("model", model), ("name", task), ("tenant", who))
        made = line["made"]
        assert got["oncelery_llm_calls_total", key] == made["calls"]
        assert got["oncelery_llm_cost_usd_total", key] == pytest.approx(float(made["cost"] or 0))
        assert got["oncelery_llm_tokens_total", (("direction", "output"), *key)] == made["output_tokens"]
    for who in ("acme", "globex"):
        spared = costs(db_url, "--tenant", who)["total"]["saved"]
        key = (("name", "oncelery.t_ledger_job"), ("tenant", who))
        assert got["oncelery_llm_saved_calls_total", key] == spared["calls"]
        assert got["oncelery_llm_saved_cost_usd_total", key] == pytest.approx(float(spared["cost"] or 0))
        assert got["oncelery_llm_saved_tokens_total", (("direction", "input"), *key)] == spared["input_tokens"]
        assert got["oncelery_steps_executed_total", key] == 2 * 10
        assert got["oncelery_steps_replayed_total", key] == 0

    run = RunStore(db_url).get("oncelery.t_ledger_job", "doc:3", "globex")
    assert run is not None
    rows = [r for r in ledger(db_url) if r.run_id == run.run_id]
    assert [(r.task_name, r.tenant, r.idempotency_key, r.step, r.prompt, r.fencing_token) for r in rows] == [
        ("oncelery.t_ledger_job", "globex", "doc:3", "summarize", "summarize", 1),
        ("oncelery.t_ledger_job", "globex", "doc:3", "keywords", "keywords", 1),
    ]
    assert [(r.input_tokens, r.output_tokens) for r in rows] == list(job_usage(3))
    assert rows[0].cost_micros == micros(*job_usage(3)[0]) and rows[1].cost_micros is None
    assert all(r.ok and r.error is None and r.latency_ms > 0 for r in rows)


def test_a_failed_call_is_recorded_and_its_own_error_raised(
    app: Celery, db_url: str, server: OpenAIServer, client: openai.OpenAI
) -> None:
    app.conf.oncelery_prices = PRICES

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_ledger_fail", idempotency_key="f:{n}")
    def job(self: IdempotentTask, n: int) -> str:
        return str(self.step("summarize", ask, client, MODEL, "summarize", document(n)))

    app.finalize()
    server.fail_next = 1
    with pytest.raises(openai.InternalServerError, match="model overloaded"):
        job(1)
    [row] = ledger(db_url)
    assert (row.ok, row.step, row.input_tokens, row.output_tokens, row.cost_micros) == (False, "summarize", 0, 0, 0)
    assert row.error.startswith("InternalServerError: ") and "model overloaded" in row.error
    assert job(1) == reply_to(document(1))  # the retry pays for a second call, on the books too
    assert [(r.ok, r.fencing_token) for r in ledger(db_url)] == [(False, 1), (True, 2)]
    assert len(server.requests) == 2


def test_a_step_replayed_from_its_checkpoint_writes_no_row(
    app: Celery, db_url: str, server: OpenAIServer, client: openai.OpenAI
) -> None:
    attempts: list[int] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_ledger_resume", idempotency_key="r:{n}")
    def job(self: IdempotentTask, n: int) -> str:
        summary = self.step("summarize", ask, client, MODEL, "summarize", document(n))
        attempts.append(n)
        if len(attempts) == 1:
            raise RuntimeError("dies after step 1; the next attempt resumes")
        return str(self.step("keywords", ask, client, MODEL, "keywords", summary))

    app.finalize()
    with pytest.raises(RuntimeError):
        job(1)
    assert job(1) == reply_to(reply_to(document(1)))
    assert job.outcome_counts() == {"failed": 1, "resumed": 1}
    assert [(r.step, r.fencing_token) for r in ledger(db_url)] == [("summarize", 1), ("keywords", 2)]
    assert len(server.requests) == 2
    # Retention deletes a purged run's rows with it (once it finished before the cutoff, by the database clock).
    purged = wait_for(lambda: purge(Database(db_url), older_than=0).ledger, timeout=10, what="the run to be purged")
    assert purged == 2 and ledger(db_url) == []


def test_the_row_survives_a_rollback_of_the_effects(
    app: Celery, db_url: str, server: OpenAIServer, client: openai.OpenAI
) -> None:
    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_ledger_rb", idempotency_key="e:{n}")
    def job(self: IdempotentTask, n: int) -> None:
        draft = ask(client, MODEL, "draft", document(n))  # in the body, outside any step
        with self.effects() as session:
            session.execute(effects_table.insert().values(key=draft[:40], pid=os.getpid()))
        raise RuntimeError("fails after writing its effects: they roll back")

    app.finalize()
    with pytest.raises(RuntimeError, match="they roll back"):
        job(1)
    assert count_rows(get_engine(db_url), effects_table) == 0
    run = RunStore(db_url).get("oncelery.t_ledger_rb", "e:1")
    assert run is not None
    [row] = ledger(db_url)
    assert (row.ok, row.run_id, row.idempotency_key, row.step, row.prompt) == (True, run.run_id, "e:1", None, "draft")


def test_a_call_after_effects_is_refused_before_it_is_made(
    app: Celery, db_url: str, server: OpenAIServer, client: openai.OpenAI
) -> None:
    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_ledger_late", idempotency_key="l:{n}")
    def job(self: IdempotentTask, n: int) -> str:
        with self.effects() as session:
            session.execute(effects_table.insert().values(key="l", pid=os.getpid()))
        return ask(client, MODEL, "late", document(n))

    app.finalize()
    with pytest.raises(ConfigurationError, match="before opening effects"):
        job(1)
    assert server.requests == [] and ledger(db_url) == []


def test_outside_a_task_the_env_database_or_nothing(
    db_url: str, server: OpenAIServer, client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ONCELERY_DATABASE_URL", raising=False)
    ask(client, MODEL, "summarize", "not recorded")
    assert ledger(db_url) == []

    monkeypatch.setenv("ONCELERY_DATABASE_URL", db_url)
    app = Celery("ledger-outside", set_as_current=False)
    app.conf.oncelery_prices = PRICES
    with current(app):
        ask(client, MODEL, "summarize", "recorded")
        aclient = openai.AsyncOpenAI(base_url=server.url, api_key="sk-test", max_retries=0, timeout=10.0)

        @model_call(MODEL, prompt="async", meta={"route": "batch"}, usage=lambda resp: resp.usage)
        async def summarize(text: str) -> Any:
            return await aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}])

        async def main() -> None:
            try:
                await summarize("async call")
            finally:
                await aclient.close()

        asyncio.run(main())
    rows = ledger(db_url)
    assert [(r.task_name, r.run_id, r.step, r.prompt, r.meta) for r in rows] == [
        (None, None, None, "summarize", None),
        (None, None, None, "async", {"route": "batch"}),
    ]
    assert [(r.input_tokens, r.output_tokens) for r in rows] == [usage_of("recorded"), usage_of("async call")]
    assert rows[1].cost_micros == micros(*usage_of("async call"))


def test_a_ledger_that_cannot_be_written_is_logged_never_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    empty = tmp_path / "no_schema.db"
    sqlite3.connect(empty).close()  # a database without the ledger's table
    monkeypatch.setenv("ONCELERY_DATABASE_URL", f"sqlite:///{empty}")
    with caplog.at_level(logging.ERROR, logger="oncelery.ledger"):
        with pytest.raises(ValueError, match="the call's own error"), model_call(MODEL, prompt="p"):
            raise ValueError("the call's own error")
        with model_call(MODEL, prompt="p") as call:
            call.tokens(3, 4)
    assert [r.getMessage() for r in caplog.records] == [
        "could not record model call gpt-4o-mini (p) in the cost ledger"
    ] * 2
    assert (call.ok, call.input_tokens, call.output_tokens) == (True, 3, 4)


def test_a_bad_price_table_fails_before_the_call(server: OpenAIServer, client: openai.OpenAI) -> None:
    app = Celery("ledger-prices", set_as_current=False)
    app.conf.oncelery_prices = {MODEL: {"prompt": 0.15}}
    with current(app), pytest.raises(ConfigurationError, match=r"oncelery_prices\['gpt-4o-mini'\]"):
        ask(client, MODEL, "summarize", "never sent")
    assert server.requests == []
