"""LLM clients against a real local server speaking the OpenAI protocol, and the ledger inside real steps."""

from __future__ import annotations

import json
import pickle
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import select

from oncelery import ConfigurationError, IdempotentTask, cost_report, step_seed
from oncelery.delivery.steps import load_checkpoints
from oncelery.models import ModelCall
from oncelery.runs.claims import RunStore
from oncelery.store.database import get_engine
from oncelery.tasks.ledger import call_llm
from oncelery.tasks.llm import (
    LLMHTTPError,
    LLMMalformedReply,
    LLMResult,
    LLMUnavailable,
    LocalModel,
    OpenAICompatibleClient,
    UnsupportedTask,
)
from tests.services import LocalHTTPServer, QuietHandler

TEXT = "Lighthouses guided ships for centuries. Keepers tended the lamps every night."


@dataclass
class Reply:
    """One scripted answer of the fake model server."""

    status: int = 200
    body: Any = None  # dict -> JSON; str -> sent verbatim; None -> a valid completion
    delay: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)


def completion(content: str = "A summary.", prompt_tokens: int = 17, completion_tokens: int = 3) -> dict[str, Any]:
    """A chat-completions reply as OpenAI-compatible servers send it."""
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "model": "test-model-2024-01-01",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


class ModelServer(LocalHTTPServer):
    """A real HTTP server on 127.0.0.1 answering POST /v1/chat/completions from a script of replies."""

    def __init__(self) -> None:
        self.script: list[Reply] = []
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.lock = threading.Lock()
        server = self

        class Handler(QuietHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                raw = self.rfile.read(length)
                with server.lock:
                    server.requests.append({"path": self.path, **json.loads(raw)})
                    server.headers.append({k.lower(): v for k, v in self.headers.items()})
                    reply = server.script.pop(0) if server.script else Reply()
                if reply.delay:
                    time.sleep(reply.delay)
                if self.path != "/v1/chat/completions":
                    reply = Reply(404, {"error": {"message": "not found"}})
                body = reply.body if reply.body is not None else completion()
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                try:
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the client timed out and hung up: that is the point of a delayed reply

        super().__init__(Handler)


@pytest.fixture
def server() -> Iterator[ModelServer]:
    """A running fake OpenAI-compatible server."""
    with ModelServer() as srv:
        yield srv


@pytest.fixture
def client(server: ModelServer) -> Iterator[OpenAICompatibleClient]:
    """A client of `server` with fast retries."""
    with OpenAICompatibleClient(server.url, "test-model", "sk-test", timeout=5.0, max_attempts=3, backoff=0.01) as c:
        yield c


# -- the client against the server ---------------------------------------------------------------------------


def test_seed_temperature_and_prompt_reach_the_request_and_usage_is_read(
    server: ModelServer, client: OpenAICompatibleClient
) -> None:
    result = client.complete("summarize", TEXT, temperature=0.7, seed=1234, max_tokens=64)

    assert result == LLMResult(
        text="A summary.",
        input_tokens=17,
        output_tokens=3,
        latency_ms=result.latency_ms,
        model="test-model",
        model_version="test-model-2024-01-01",
    )
    assert result.latency_ms > 0
    [sent] = server.requests
    assert sent["path"] == "/v1/chat/completions"
    assert sent["seed"] == 1234 and sent["temperature"] == 0.7 and sent["max_tokens"] == 64
    assert sent["model"] == "test-model"
    assert sent["messages"][-1] == {"role": "user", "content": TEXT}
    assert server.headers[0]["authorization"] == "Bearer sk-test"


def test_prompt_hash_is_stable_and_changes_with_task_text_and_model(server: ModelServer) -> None:
    a = OpenAICompatibleClient(server.url, "m1")
    b = OpenAICompatibleClient(server.url + "/", "m1")
    assert a.prompt_hash("summarize", TEXT) == b.prompt_hash("summarize", TEXT)
    assert len(a.prompt_hash("summarize", TEXT)) == 64
    assert a.prompt_hash("summarize", TEXT) != a.prompt_hash("keywords", TEXT)
    assert a.prompt_hash("summarize", TEXT) != a.prompt_hash("summarize", TEXT + " ")
    assert a.prompt_hash("summarize", TEXT) != OpenAICompatibleClient(server.url, "m2").prompt_hash("summarize", TEXT)
    with pytest.raises(UnsupportedTask, match="summarize, keywords, quality"):
        a.prompt_hash("translate", TEXT)


@pytest.mark.parametrize(
    "failure",
    [Reply(500, {"error": "overloaded"}), Reply(429, {"error": "slow down"}, headers={"Retry-After": "0"})],
    ids=["500", "429"],
)
def test_transient_failure_then_success_is_retried(
    server: ModelServer, client: OpenAICompatibleClient, failure: Reply
) -> None:
    server.script = [failure, Reply()]
    assert client.complete("keywords", TEXT).text == "A summary."
    assert len(server.requests) == 2


def test_persistent_5xx_raises_llm_unavailable_after_bounded_attempts(
    server: ModelServer, client: OpenAICompatibleClient
) -> None:
    server.script = [Reply(503, {"error": "down"})] * 5
    with pytest.raises(LLMUnavailable, match="failed 3 times; last: HTTP 503") as info:
        client.complete("summarize", TEXT)
    assert len(server.requests) == 3
    assert info.value.attempts == 3


def test_timeout_is_retried_then_raises_llm_unavailable(server: ModelServer) -> None:
    server.script = [Reply(delay=1.0), Reply(delay=1.0)]
    with (
        OpenAICompatibleClient(server.url, "m", timeout=0.2, max_attempts=2, backoff=0.01) as slow,
        pytest.raises(LLMUnavailable, match="ReadTimeout"),
    ):
        slow.complete("summarize", TEXT)
    assert len(server.requests) == 2


def test_refused_connection_raises_llm_unavailable() -> None:
    with ModelServer() as gone:
        url = gone.url
    with (
        OpenAICompatibleClient(url, "m", max_attempts=2, backoff=0.01) as c,
        pytest.raises(LLMUnavailable, match="ConnectError"),
    ):
        c.complete("summarize", TEXT)


@pytest.mark.parametrize(
    ("status", "fix"),
    [(400, "rejected the request"), (401, "ONCELERY_LLM_API_KEY"), (404, "ONCELERY_LLM_MODEL"), (308, "redirects")],
)
def test_4xx_raises_llm_http_error_naming_the_fix_without_retry(
    server: ModelServer, client: OpenAICompatibleClient, status: int, fix: str
) -> None:
    server.script = [Reply(status, {"error": {"message": "bad request: max_tokens too large"}})]
    with pytest.raises(LLMHTTPError, match=fix) as info:
        client.complete("summarize", TEXT)
    assert len(server.requests) == 1
    assert info.value.status_code == status
    assert "max_tokens too large" in str(info.value)
    clone = pickle.loads(pickle.dumps(info.value))  # Celery pickles task errors between processes
    assert type(clone) is LLMHTTPError and clone.status_code == status and str(clone) == str(info.value)


@pytest.mark.parametrize(
    "body",
    [
        "<html>502 Bad Gateway</html>",
        {"choices": []},
        {"choices": [{"message": {"role": "assistant"}}]},
        {"choices": [{"message": {"content": None}}]},
        {"error": "no choices at all"},
    ],
    ids=["not-json", "no-choices", "no-content", "null-content", "no-choices-key"],
)
def test_malformed_reply_raises_llm_malformed_reply_without_retry(
    server: ModelServer, client: OpenAICompatibleClient, body: Any
) -> None:
    server.script = [Reply(200, body)]
    with pytest.raises(LLMMalformedReply):
        client.complete("summarize", TEXT)
    assert len(server.requests) == 1


def test_missing_usage_counts_zero_tokens(server: ModelServer, client: OpenAICompatibleClient) -> None:
    reply = completion("42")
    del reply["usage"]
    server.script = [Reply(200, reply)]
    result = client.complete("quality", TEXT)
    assert (result.text, result.input_tokens, result.output_tokens) == ("42", 0, 0)


def test_from_env_reads_the_configuration_and_names_what_is_missing(
    server: ModelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("ONCELERY_LLM_BASE_URL", "ONCELERY_LLM_MODEL", "ONCELERY_LLM_API_KEY", "ONCELERY_LLM_MODEL_VERSION"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigurationError, match="ONCELERY_LLM_BASE_URL and ONCELERY_LLM_MODEL"):
        OpenAICompatibleClient.from_env()
    monkeypatch.setenv("ONCELERY_LLM_BASE_URL", server.url)
    monkeypatch.setenv("ONCELERY_LLM_MODEL", "env-model")
    monkeypatch.setenv("ONCELERY_LLM_API_KEY", "sk-env")
    monkeypatch.setenv("ONCELERY_LLM_MAX_ATTEMPTS", "2")
    with OpenAICompatibleClient.from_env(backoff=0.01) as c:
        assert (c.model, c.model_version, c.max_attempts) == ("env-model", "env-model", 2)
        c.complete("summarize", TEXT)
    assert server.requests[0]["model"] == "env-model"
    assert server.headers[0]["authorization"] == "Bearer sk-env"


# -- the ledger, inside real IdempotentTask steps ---------------------------------------------------------


def ledger_rows(db_url: str) -> list[Any]:
    """Every ledger row (model_calls columns as attributes), oldest first."""
    with get_engine(db_url).connect() as conn:
        return list(conn.execute(select(ModelCall.__table__).order_by(ModelCall.__table__.c.id)).all())


def test_successful_step_writes_one_row_and_a_replay_writes_none(
    app: Celery, db_url: str, server: ModelServer, client: OpenAICompatibleClient
) -> None:
    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_llm_ok", idempotency_key="art:{n}")
    def summarize_article(self: IdempotentTask, n: int, text: str) -> str:
        return str(self.step("summarize", lambda: call_llm(client, "summarize", text, temperature=0.7).text))

    app.finalize()
    assert summarize_article(1, TEXT) == "A summary."
    assert summarize_article(1, TEXT) == "A summary."  # a duplicate delivery: replayed from the stored result

    seed = step_seed("oncelery.t_llm_ok", "art:1", "summarize")
    assert len(server.requests) == 1 and server.requests[0]["seed"] == seed
    [row] = ledger_rows(db_url)
    run = RunStore(db_url).get("oncelery.t_llm_ok", "art:1")
    assert run is not None
    assert (row.task_name, row.idempotency_key, row.step, row.run_id, row.fencing_token) == (
        "oncelery.t_llm_ok",
        "art:1",
        "summarize",
        run.run_id,
        run.token,
    )
    assert (row.model, row.prompt, row.meta["model_version"], row.meta["seed"], row.meta["temperature"]) == (
        "test-model",
        "summarize",
        "test-model-2024-01-01",
        seed,
        0.7,
    )
    assert row.meta["prompt_hash"] == client.prompt_hash("summarize", TEXT)
    assert (row.input_tokens, row.output_tokens, row.ok, row.error, row.cost_micros) == (17, 3, True, None, None)
    assert row.latency_ms > 0
    made = cost_report(db_url).made
    assert (made.calls, made.ok_calls, made.failed_calls, made.input_tokens, made.output_tokens) == (1, 1, 0, 17, 3)


def test_malformed_reply_in_a_step_leaves_a_failed_row_and_no_ok_row(
    app: Celery, db_url: str, server: ModelServer, client: OpenAICompatibleClient
) -> None:
    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_llm_bad", idempotency_key="art:{n}")
    def keywords_of(self: IdempotentTask, n: int, text: str) -> str:
        return str(self.step("keywords", lambda: call_llm(client, "keywords", text).text))

    app.finalize()
    server.script = [Reply(200, {"choices": []})]
    with pytest.raises(LLMMalformedReply):
        keywords_of(2, TEXT)

    [row] = ledger_rows(db_url)
    assert (row.step, row.ok, row.input_tokens, row.output_tokens) == ("keywords", False, 0, 0)
    assert row.error.startswith("LLMMalformedReply: LLM reply has no choices[0].message.content")
    assert row.meta["seed"] == step_seed("oncelery.t_llm_bad", "art:2", "keywords")
    assert cost_report(db_url).made.ok_calls == 0
    run = RunStore(db_url).get("oncelery.t_llm_bad", "art:2")
    assert run is not None and load_checkpoints(RunStore(db_url), run.run_id) == []


def test_call_whose_step_never_checkpoints_keeps_its_row_and_the_rerun_is_visible(
    app: Celery, db_url: str, server: ModelServer, client: OpenAICompatibleClient
) -> None:
    dies = [True]

    def summarize_then_maybe_die(text: str) -> str:
        answer = call_llm(client, "summarize", text).text
        if dies[0]:
            raise RuntimeError("worker lost between the model's answer and the checkpoint")
        return answer

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_llm_lost", idempotency_key="art:{n}")
    def fragile(self: IdempotentTask, n: int, text: str) -> str:
        return str(self.step("summarize", summarize_then_maybe_die, text))

    app.finalize()
    with pytest.raises(RuntimeError):
        fragile(3, TEXT)
    assert [r.ok for r in ledger_rows(db_url)] == [True]  # the spent call is on the books
    dies[0] = False
    assert fragile(3, TEXT) == "A summary."
    assert fragile(3, TEXT) == "A summary."
    rows = ledger_rows(db_url)
    assert [(r.ok, r.fencing_token) for r in rows] == [(True, 1), (True, 2)]  # wasted call visible; replay: none
    assert len(server.requests) == 2


def test_call_outside_a_step_uses_the_env_database_or_records_nothing(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = LocalModel()
    monkeypatch.delenv("ONCELERY_DATABASE_URL", raising=False)
    call_llm(model, "quality", TEXT)
    assert ledger_rows(db_url) == []
    monkeypatch.setenv("ONCELERY_DATABASE_URL", db_url)
    result = call_llm(model, "quality", TEXT, seed=7)
    [row] = ledger_rows(db_url)
    assert (row.task_name, row.idempotency_key, row.step, row.run_id, row.meta["seed"]) == (None, None, None, None, 7)
    assert (row.model, row.prompt, row.meta["model_version"], row.ok) == ("local-extractive", "quality", "1", True)
    assert row.input_tokens == len(TEXT.split()) and row.output_tokens == result.output_tokens == 1
    with pytest.raises(UnsupportedTask):
        call_llm(model, "translate", TEXT)
    assert len(ledger_rows(db_url)) == 1  # no call was made, so no row
