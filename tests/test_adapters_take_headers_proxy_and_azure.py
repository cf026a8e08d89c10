"""Provider adapters as a production network needs them: extra headers on every request (a gateway's tenant or
trace header), an HTTP proxy, and Azure OpenAI's URL, `api-version` and `api-key`. Real requests to the fake
provider, which records what reached it; the proxy is a real forward proxy in a thread that counts what it relays.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import pytest

from oncelery.fake_provider import FakeProvider, Knobs
from oncelery.llm.adapters.anthropic_messages import AnthropicMessages
from oncelery.llm.adapters.base import CallState
from oncelery.llm.adapters.batch import OpenAIBatches
from oncelery.llm.adapters.gemini_generate import GeminiGenerateContent
from oncelery.llm.adapters.openai_chat import OpenAIChat
from oncelery.llm.adapters.openai_responses import OpenAIResponses

HELLO = {"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
EXTRA = {"X-Gateway-Tenant": "acme", "X-Trace": "t-1"}
HOP_BY_HOP = {"connection", "proxy-connection", "keep-alive", "transfer-encoding", "te", "upgrade"}


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """A fake provider in a thread, stopped afterwards."""
    with FakeProvider(Knobs(poll_after_ms=10)) as provider:
        yield provider


class _Forward(BaseHTTPRequestHandler):
    """A plain HTTP forward proxy: the request line holds the absolute URL; relay it, count it (no CONNECT)."""

    server: _ProxyServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        """Stay quiet."""

    def _relay(self) -> None:
        target = urlsplit(self.path)
        with self.server.lock:
            self.server.relayed.append(f"{self.command} {target.path}")
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        upstream = http.client.HTTPConnection(target.hostname or "", target.port or 80, timeout=10)
        try:
            path = target.path + (f"?{target.query}" if target.query else "")
            upstream.request(self.command, path, body=body or None, headers=headers)
            answer = upstream.getresponse()
            data = answer.read()
        finally:
            upstream.close()
        self.send_response(answer.status)
        for name, value in answer.getheaders():
            if name.lower() not in HOP_BY_HOP and name.lower() != "content-length":
                self.send_header(name, value)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_DELETE = _relay


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Forward)
        self.lock = threading.Lock()
        self.relayed: list[str] = []


@pytest.fixture
def proxy() -> Iterator[_ProxyServer]:
    """A forward proxy on 127.0.0.1 in a thread, stopped afterwards."""
    server = _ProxyServer()
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def seen(fake: FakeProvider) -> list[dict[str, Any]]:
    """The model-API requests that reached the fake, oldest first."""
    return list(fake.stats()["requests_seen"])


def test_extra_headers_reach_the_provider_on_every_request_of_every_adapter(fake: FakeProvider) -> None:
    """`headers=` rides on creates, polls and batch calls of each provider's adapter, beside its own auth."""
    with OpenAIResponses(fake.openai_base_url, "sk-test", headers=EXTRA) as responses:
        first = responses.create({"model": "m", "input": "Hello."}, "intent-h", background=True)
        assert first.reference
        responses.poll(first.reference)
    with AnthropicMessages(fake.openai_base_url, "ak-test", headers=EXTRA) as messages:
        messages.create(
            {"model": "claude", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]},
            "i2",
            background=False,
        )
    with GeminiGenerateContent(fake.gemini_base_url, "gk-test", headers=EXTRA) as gemini:
        gemini.create({"model": "gemini-x", "contents": [{"parts": [{"text": "Hi"}]}]}, "i3", background=False)
    with OpenAIChat(fake.openai_base_url, "sk-test", headers=EXTRA) as chat:
        chat.create({"model": "m", "messages": [{"role": "user", "content": "Hi"}]}, "i4", background=False)
    with OpenAIBatches(fake.openai_base_url, "sk-test", headers=EXTRA) as batches:
        batches.http.json("GET", "/batches?limit=1")
    requests = seen(fake)
    assert len(requests) == 6, requests
    for request in requests:
        assert {k.lower(): v for k, v in EXTRA.items()}.items() <= request["headers"].items(), request
    by_path = {r["path"]: r["headers"] for r in requests}
    assert by_path["/v1/responses"]["authorization"] == "Bearer sk-test"
    assert by_path["/v1/messages"]["x-api-key"] == "ak-test"
    assert by_path["/v1beta/models/gemini-x:generateContent"]["x-goog-api-key"] == "gk-test"


def test_extra_headers_never_reach_the_adapters_repr_or_an_error() -> None:
    """A header may hold a secret (a gateway key): neither the adapter's repr nor a connection error shows it."""
    adapter = OpenAIResponses("http://127.0.0.1:9/v1", "sk-test", headers={"X-Gateway-Key": "hush-123"})
    with adapter:
        assert "hush-123" not in repr(adapter) and "hush-123" not in repr(adapter.http)
        with pytest.raises(Exception) as caught:
            adapter.create({"model": "m", "input": "Hi"}, "intent-x", background=False)
    assert "hush-123" not in str(caught.value)


@pytest.mark.parametrize(
    ("api_version", "path", "query"),
    [
        (None, "/openai/v1/responses", ""),  # the v1 API: no api-version
        ("preview", "/openai/v1/responses", "api-version=preview"),
        ("2025-04-01-preview", "/openai/responses", "api-version=2025-04-01-preview"),  # a dated version
    ],
)
def test_the_azure_form_sends_api_key_and_api_version(
    fake: FakeProvider, api_version: str | None, path: str, query: str
) -> None:
    """`OpenAIResponses.azure(endpoint, ...)` calls `{endpoint}/openai/v1/responses` (or `/openai/responses` for a
    dated api-version), with the key in `api-key` and no bearer token; a poll keeps its own query as well."""
    fake.set_knobs(generation_s=0.1)
    with OpenAIResponses.azure(fake.url, "az-key", api_version=api_version, headers=EXTRA) as azure:
        first = azure.create({"model": "my-deployment", "input": "Hello."}, "intent-az", background=True)
        assert first.state is CallState.PENDING and first.reference
        azure.poll(first.reference)
        assert list(azure.follow(first.reference, -1))
    create, poll, resume = seen(fake)
    assert (create["method"], create["path"], create["query"]) == ("POST", path, query)
    assert poll["path"] == f"{path}/{first.reference}" and poll["query"] == query
    assert resume["query"].startswith("stream=true&starting_after=-1") and resume["query"].endswith(query)
    for request in (create, poll, resume):
        assert request["headers"]["api-key"] == "az-key" and "authorization" not in request["headers"]
        assert request["headers"]["x-gateway-tenant"] == "acme"
    assert fake.stats()["creates_by_intent"] == {"intent-az": 1}


def test_the_azure_key_defaults_to_its_environment_variable(
    monkeypatch: pytest.MonkeyPatch, fake: FakeProvider
) -> None:
    """With no key given, the Azure form reads $AZURE_OPENAI_API_KEY (as Azure's SDK does), never $OPENAI_API_KEY."""
    monkeypatch.setenv("AZURE_OPENAI_API_KEY", "from-env")
    monkeypatch.setenv("OPENAI_API_KEY", "not-this-one")
    with OpenAIResponses.azure(fake.url) as azure:
        azure.create({"model": "d", "input": "Hi"}, "intent-env", background=False)
    assert seen(fake)[0]["headers"]["api-key"] == "from-env"


def test_the_proxy_option_routes_every_request_through_the_proxy(fake: FakeProvider, proxy: _ProxyServer) -> None:
    """`proxy=` sends the adapter's requests through an HTTP proxy (here a forward proxy that counts them)."""
    url = f"http://127.0.0.1:{proxy.server_address[1]}"
    with OpenAIResponses(fake.openai_base_url, "sk-test", proxy=url) as responses:
        first = responses.create({"model": "m", "input": "Hello."}, "intent-p", background=True)
        assert first.reference
        responses.poll(first.reference)
    with AnthropicMessages(fake.openai_base_url, "ak-test", proxy=url) as messages:
        answer = messages.create(
            {"model": "c", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}, "i", background=False
        )
    assert answer.state is CallState.DONE
    assert proxy.relayed == ["POST /v1/responses", f"GET /v1/responses/{first.reference}", "POST /v1/messages"]
    assert fake.stats()["creates_by_intent"] == {"intent-p": 1, "i": 1}
