"""The fake provider's HTTP side: routes, headers, held and hung answers, and the `/_fake/*` control API.

Batch APIs (`batches`): OpenAI's `/v1/files` (multipart upload, list, retrieve, content, delete) and
`/v1/batches` (create, retrieve, list, cancel); Anthropic's `/v1/messages/batches` (create, retrieve, list,
cancel, results, delete); Gemini's `/v1beta/models/{model}:batchGenerateContent` and `/v1beta/batches` (get, list,
`:cancel`). A batch create takes `fail_next`, `hold_creates` and `hang_next` like any create.

Gemini (REST v1beta, the `x-goog-api-key` header): `POST /v1beta/models/{model}:generateContent` answers a
GenerateContentResponse; its errors are Google's envelope, and a 429 says its wait in a RetryInfo detail, not a
`retry-after` header (Gemini sends no rate-limit headers).

Control endpoints (JSON): `GET /_fake/stats`, `POST /_fake/knobs` (a partial `Knobs`), `POST /_fake/release`
(held answers, and batches held by `batch_hold`), `POST /_fake/forget` (one call, or all: past retention now),
`POST /_fake/reset`, `GET /_fake/health`. They drive a fake run as a thread or as a process alike.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from oncelery.llm.fake import protocol as wire
from oncelery.llm.fake.batches import BatchError, FakeBatches
from oncelery.llm.fake.generate import Generator, default_generator
from oncelery.llm.fake.state import KnobError, Knobs, ProviderState, retry_after_header
from oncelery.llm.tokens import count_tokens, output_limit

# Each provider's error envelope: (HTTP status, message) -> the JSON body.
_ERRORS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "openai": wire.openai_error,
    "anthropic": wire.anthropic_error,
    "gemini": wire.gemini_error,
}
STREAM_TICK_S = 0.02  # how often a streaming answer looks for its next available event
SHUTDOWN_POLL_S = 0.02  # how often the threaded server looks for a shutdown request


class _Handler(BaseHTTPRequestHandler):
    """One request; `server.state` and `server.generator` are the fake's."""

    server: _Server
    protocol_version = "HTTP/1.1"
    # Headers and body leave in two writes: without TCP_NODELAY, Nagle and the client's delayed ACK add ~40 ms
    # to every answer, which a provider does not.
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        """Stay quiet: the counters are the record."""

    # -- routing ---------------------------------------------------------------------------------------------
    def do_GET(self) -> None:
        """Route a GET."""
        path, query = self._target()
        if path == "/_fake/stats":
            with self.server.state.lock:
                self._json(200, self.server.state.stats.as_json())
        elif path == "/_fake/health":
            self._json(200, {"ok": True})
        elif self._gemini("GET", path, query, None) or self._batches("GET", path, query, None):
            pass
        elif path.startswith("/v1/responses/") and path.count("/") == 3:
            self._retrieve(path.rsplit("/", 1)[1], query)
        else:
            self._json(404, wire.openai_error(404, f"Invalid URL (GET {path})"))

    def do_POST(self) -> None:
        """Route a POST."""
        path, query = self._target()
        if path == "/v1/files":
            self._upload()
            return
        body = self._body()
        if body is None:
            return
        state = self.server.state
        if self._gemini("POST", path, query, body) or self._batches("POST", path, query, body):
            pass
        elif path == "/_fake/knobs":
            try:
                with state.lock:
                    state.knobs.update(body)
                    knobs = dict(vars(state.knobs))
            except KnobError as exc:
                self._json(400, {"error": str(exc)})
                return
            self._json(200, knobs)
        elif path == "/_fake/release":
            self._json(200, {"released": state.release()})
        elif path == "/_fake/forget":
            self._json(200, {"forgotten": state.forget(body.get("id"))})
        elif path == "/_fake/reset":
            state.reset()
            self._json(200, {"ok": True})
        elif path == "/v1/responses":
            self._create("responses", body)
        elif path == "/v1/chat/completions":
            self._create("chat", body)
        elif path == "/v1/messages":
            self._create("messages", body)
        elif path.startswith("/v1/responses/") and path.endswith("/cancel"):
            self._cancel(path.split("/")[3])
        else:
            self._json(404, wire.openai_error(404, f"Invalid URL (POST {path})"))

    def do_DELETE(self) -> None:
        """Route a DELETE."""
        path, query = self._target()
        if not self._batches("DELETE", path, query, None):
            self._json(404, wire.openai_error(404, f"Invalid URL (DELETE {path})"))

    # -- Gemini ------------------------------------------------------------------------------------------------
    def _gemini(self, method: str, path: str, query: dict[str, list[str]], body: dict[str, Any] | None) -> bool:
        """Serve a Gemini request (generateContent, batchGenerateContent, batches); False when `path` is not one."""
        if not path.startswith("/v1beta/"):
            return False
        if not self._authorised("gemini", query):
            return True
        rest = path.removeprefix("/v1beta/")
        fake = self.server.batches
        base = f"http://{self.headers.get('host') or '127.0.0.1'}"
        try:
            if method == "POST" and rest.startswith("models/") and ":" in rest:
                model, verb = rest.removeprefix("models/").rsplit(":", 1)
                if verb == "generateContent":
                    self._create("gemini", {**(body or {}), "model": model})
                elif verb == "batchGenerateContent":
                    self._create_batch(lambda: fake.check_gemini(model, body or {}), base, "gemini")
                else:
                    raise BatchError(404, f"Method not found: models.{verb}")
            elif method == "GET" and rest == "batches":
                self._json(200, fake.list_batches("gemini", query, base))
            elif method == "GET" and rest.startswith("batches/") and rest.count("/") == 1 and ":" not in rest:
                self._json(200, fake.retrieve("gemini", rest.removeprefix("batches/"), base))
            elif method == "POST" and rest.startswith("batches/") and rest.endswith(":cancel"):
                self._json(200, fake.cancel("gemini", rest.removeprefix("batches/").removesuffix(":cancel"), base))
            else:
                raise BatchError(404, f"The requested URL {path} was not found on this server ({method}).")
        except BatchError as exc:
            self._json(exc.status, wire.gemini_error(exc.status, str(exc)))
        return True

    # -- batches -----------------------------------------------------------------------------------------------
    def _batches(self, method: str, path: str, query: dict[str, list[str]], body: dict[str, Any] | None) -> bool:
        """Serve a Files or batch API request; return False when `path` is not one of theirs."""
        parts = path.split("/")[1:]  # "v1", then the resource
        if parts[:3] == ["v1", "messages", "batches"]:
            provider, rest = "anthropic", parts[3:]
        elif parts[:2] in (["v1", "batches"], ["v1", "files"]):
            provider, rest = "openai", parts[1:]
        else:
            return False
        anthropic = provider == "anthropic"
        error = wire.anthropic_error if anthropic else wire.openai_error
        if not self._authorised(provider):
            return True
        base = f"http://{self.headers.get('host') or '127.0.0.1'}"
        try:
            if anthropic:
                self._anthropic_batches(method, rest, query, body, base)
            else:
                self._openai_batches(method, rest, query, body, base)
        except BatchError as exc:
            self._json(exc.status, error(exc.status, str(exc)))
        return True

    def _openai_batches(
        self, method: str, rest: list[str], query: dict[str, list[str]], body: dict[str, Any] | None, base: str
    ) -> None:
        fake = self.server.batches
        resource, ident, tail = rest[0], rest[1] if len(rest) > 1 else None, rest[2:]
        if resource == "files":
            if method == "GET" and ident is None:
                self._json(200, fake.list_files(query))
            elif method == "GET" and ident and not tail:
                self._json(200, fake.file(ident).as_json())
            elif method == "GET" and ident and tail == ["content"]:
                self._raw(200, fake.file(ident).content, "application/octet-stream")
            elif method == "DELETE" and ident and not tail:
                self._json(200, fake.delete_file(ident))
            else:
                raise BatchError(404, f"Invalid URL ({method} /v1/{'/'.join(rest)})")
        elif method == "POST" and ident is None:
            self._create_batch(lambda: fake.check_openai(body or {}), base, "openai")
        elif method == "GET" and ident is None:
            self._json(200, fake.list_batches("openai", query, base))
        elif method == "GET" and ident and not tail:
            self._json(200, fake.retrieve("openai", ident, base))
        elif method == "POST" and ident and tail == ["cancel"]:
            self._json(200, fake.cancel("openai", ident, base))
        else:
            raise BatchError(404, f"Invalid URL ({method} /v1/{'/'.join(rest)})")

    def _anthropic_batches(
        self, method: str, rest: list[str], query: dict[str, list[str]], body: dict[str, Any] | None, base: str
    ) -> None:
        fake = self.server.batches
        ident, tail = rest[0] if rest else None, rest[1:]
        if method == "POST" and ident is None:
            self._create_batch(lambda: fake.check_anthropic(body or {}), base, "anthropic")
        elif method == "GET" and ident is None:
            self._json(200, fake.list_batches("anthropic", query, base))
        elif method == "GET" and ident and not tail:
            self._json(200, fake.retrieve("anthropic", ident, base))
        elif method == "GET" and ident and tail == ["results"]:
            self._raw(200, fake.results(ident), "application/binary")
        elif method == "POST" and ident and tail == ["cancel"]:
            self._json(200, fake.cancel("anthropic", ident, base))
        elif method == "DELETE" and ident and not tail:
            self._json(200, fake.delete(ident))
        else:
            raise BatchError(404, f"Invalid URL ({method} /v1/messages/batches/{'/'.join(rest)})")

    def _create_batch(self, check: Callable[[], Any], base: str, provider: str) -> None:
        """Validate, then take an injected failure if armed, then accept; hold or hang the answer if armed."""
        plan = check()
        state = self.server.state
        failure = state.injected_failure()
        if failure is not None:
            self._refuse(provider, *failure, f"injected {failure[0]}")
            return
        batch = self.server.batches.create(plan)
        state.hold()
        hang = state.hang()
        if hang and self.server.stopping.wait(hang):
            return
        with batch.lock:
            payload = self.server.batches.as_json(batch, base)
        self._json(200, payload)

    def _upload(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not self._authorised("openai"):
            return
        try:
            self._json(200, self.server.batches.upload(self.headers.get("content-type") or "", raw))
        except BatchError as exc:
            self._json(exc.status, wire.openai_error(exc.status, str(exc)))

    # -- creates ---------------------------------------------------------------------------------------------
    def _create(self, kind: str, body: dict[str, Any]) -> None:
        """A model create of `kind` (responses, chat, messages, gemini: its `model` put in from the path)."""
        anthropic = kind == "messages"
        provider = {"messages": "anthropic", "gemini": "gemini"}.get(kind, "openai")
        if kind != "gemini" and not self._authorised(provider):  # Gemini's key was checked by its router
            return
        try:
            intent, prompt = self._check(kind, body)
        except wire.BadRequest as exc:
            self._json(400, _ERRORS[provider](400, str(exc)))
            return
        model = str(body["model"])
        state = self.server.state
        failure = state.injected_failure()
        if failure is not None:
            self._refuse(provider, *failure, f"injected {failure[0]}")
            return
        limit = (
            output_limit(body)
            if kind == "gemini"
            else int(body.get("max_output_tokens") or body.get("max_tokens") or 0)
        )
        wait = state.admit(model, count_tokens(prompt) + limit)
        if wait is not None:
            message = f"Rate limit reached for {model}. Please try again in {wait:.3f}s."
            self._refuse(provider, 429, wait, message, self._limits(model, anthropic) if kind != "gemini" else {})
            return
        started = state.window_of(model)  # the window this request was counted in
        answer = self.server.generator(body)
        call = state.create(kind, model, body, prompt, answer, intent)
        if anthropic and limit > call.output_tokens:
            # Anthropic estimates output tokens from max_tokens and adjusts to what the call produced (its
            # answer is known here); OpenAI keeps max_output_tokens counted.
            state.give_back(model, limit - call.output_tokens, started)
        state.hold()
        hang = state.hang()
        if hang and self.server.stopping.wait(hang):
            return
        headers = self._limits(model, anthropic)
        if kind == "responses" and call.background:
            headers["openai-poll-after-ms"] = str(state.knobs.poll_after_ms)
            if body.get("stream"):
                self._stream(call, -1, headers)
            else:
                self._json(200, wire.response_object(call, call.status(state.now())), headers)
            return
        self._wait_until(call.ends)  # a foreground call answers when its generation ends
        if kind == "gemini":
            self._json(200, wire.gemini_response(call))  # Gemini sends no rate-limit headers
        elif kind == "responses":
            if body.get("stream"):
                self._stream(call, -1, headers)
            else:
                self._json(200, wire.response_object(call, call.status(state.now())), headers)
        elif kind == "chat":
            self._json(200, wire.chat_completion(call), headers)
        else:
            self._json(200, wire.anthropic_message(call), headers)

    def _check(self, kind: str, body: dict[str, Any]) -> tuple[str | None, str]:
        intent, prompt = wire.check_request(kind, body)
        if kind == "chat":
            # OpenAI takes metadata on chat completions only with store=true: clients tag the header instead.
            intent = intent or self.headers.get("x-client-request-id")
        return intent, prompt

    def _refuse(
        self, provider: str, status: int, retry_after: float, message: str, headers: dict[str, str] | None = None
    ) -> None:
        """Answer an injected failure or a rate limit in the provider's envelope; its wait is a `retry-after`
        header, or for Gemini a RetryInfo detail in the body (Google sends no header)."""
        if provider == "gemini":
            self._json(status, wire.gemini_error(status, message, retry_after), headers)
            return
        wait = {"retry-after": retry_after_header(retry_after)}
        self._json(status, _ERRORS[provider](status, message), {**wait, **(headers or {})})

    def _authorised(self, provider: str, query: dict[str, list[str]] | None = None) -> bool:
        if provider == "gemini":
            # Google takes the key in the header or as `?key=`; without one it refuses with 403.
            if self.headers.get("x-goog-api-key") or (query or {}).get("key"):
                return True
            message = "Method doesn't allow unregistered callers (callers without established identity)."
            self._json(403, wire.gemini_error(403, message + " Please use API Key or other form of API consumer."))
            return False
        if provider == "anthropic":
            if not self.headers.get("x-api-key"):
                self._json(401, wire.anthropic_error(401, "x-api-key header is required"))
                return False
            if not self.headers.get("anthropic-version"):
                self._json(400, wire.anthropic_error(400, "anthropic-version: header is required"))
                return False
            return True
        # Azure OpenAI takes its key in `api-key` instead of a bearer token.
        if not (self.headers.get("Authorization") or "").startswith("Bearer ") and not self.headers.get("api-key"):
            self._json(401, wire.openai_error(401, "You didn't provide an API key."))
            return False
        return True

    def _limits(self, model: str, anthropic: bool) -> dict[str, str]:
        figures = self.server.state.rate_headers(model)
        if figures is None:
            return {}
        reset = float(figures["reset_s"])
        headers: dict[str, str] = {}
        # Only the limits that are set (a provider has both; the fake may set one): an unset limit is not 0 left.
        for kind in ("requests", "tokens"):
            if not figures[f"limit_{kind}"]:
                continue
            limit, left = str(figures[f"limit_{kind}"]), str(figures[f"remaining_{kind}"])
            if anthropic:
                at = datetime.now(UTC) + timedelta(seconds=reset)
                headers[f"anthropic-ratelimit-{kind}-limit"] = limit
                headers[f"anthropic-ratelimit-{kind}-remaining"] = left
                headers[f"anthropic-ratelimit-{kind}-reset"] = at.isoformat(timespec="seconds").replace("+00:00", "Z")
            else:
                headers[f"x-ratelimit-limit-{kind}"] = limit
                headers[f"x-ratelimit-remaining-{kind}"] = left
                headers[f"x-ratelimit-reset-{kind}"] = f"{reset:.3f}s"
        return headers

    # -- retrieve, resume, cancel ------------------------------------------------------------------------------
    def _response(self, call_id: str) -> Any:
        """The response `call_id` names, for an authorised caller; else answer 401/404 and return None."""
        if not self._authorised("openai"):
            return None
        call = self.server.state.find(call_id)
        if call is None or call.kind != "responses":
            self._json(404, wire.openai_error(404, f"Response with id '{call_id}' not found."))
            return None
        return call

    def _retrieve(self, call_id: str, query: dict[str, list[str]]) -> None:
        state = self.server.state
        call = self._response(call_id)
        if call is None:
            return
        headers = {"openai-poll-after-ms": str(state.knobs.poll_after_ms)} if call.background else {}
        if query.get("stream", ["false"])[0] == "true":
            if not call.background:
                self._json(400, wire.openai_error(400, "Only background responses can be streamed on retrieve."))
                return
            try:
                after = int(query.get("starting_after", ["-1"])[0])
            except ValueError:
                self._json(400, wire.openai_error(400, "Invalid 'starting_after': expected an integer."))
                return
            with state.lock:
                state.stats.stream_resumes += 1
            self._stream(call, after, headers)
            return
        with state.lock:
            state.stats.polls += 1
        self._json(200, wire.response_object(call, call.status(state.now())), headers)

    def _cancel(self, call_id: str) -> None:
        state = self.server.state
        call = self._response(call_id)
        if call is None:
            return
        if not call.background:
            self._json(400, wire.openai_error(400, "Only responses created with background=true can be cancelled."))
            return
        failing = state.knobs.cancel_status
        if failing:  # a provider whose cancel fails (an outage, a response it no longer finds): nothing is cancelled
            with state.lock:
                state.stats.cancels_refused += 1
            self._json(failing, wire.openai_error(failing, f"The cancel failed ({failing})."))
            return
        state.cancel(call)
        self._json(200, wire.response_object(call, call.status(state.now())))

    def _stream(self, call: Any, after: int, headers: dict[str, str]) -> None:
        """Send the events after `after` as server-sent events, each when it becomes available."""
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("connection", "close")
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.close_connection = True
        try:
            for at, event in wire.stream_events(call)[after + 1 :]:
                if call.cancelled and not call.finished_by_cancel:
                    break
                self._wait_until(at)
                self.wfile.write(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the reader went away (a killed worker): it resumes with starting_after

    # -- plumbing --------------------------------------------------------------------------------------------
    def _wait_until(self, at: float) -> None:
        while not self.server.stopping.is_set():
            left = at - time.monotonic()
            if left <= 0:
                return
            self.server.stopping.wait(min(left, STREAM_TICK_S if left < 1 else left))

    def _target(self) -> tuple[str, dict[str, list[str]]]:
        parts = urlsplit(self.path)
        path = parts.path.rstrip("/")
        if not path.startswith("/_fake/"):
            with self.server.state.lock:
                self.server.state.stats.saw(self.command, self.path, {k.lower(): v for k, v in self.headers.items()})
        # Azure OpenAI's two shapes of the same API: `/openai/v1/...` (the v1 API) and `/openai/...?api-version=`.
        if path.startswith("/openai/v1/"):
            path = path.removeprefix("/openai")
        elif path.startswith("/openai/"):
            path = "/v1/" + path.removeprefix("/openai/")
        return path, parse_qs(parts.query)

    def _body(self) -> dict[str, Any] | None:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b"{}"
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            body = None
        if not isinstance(body, dict):
            self._json(400, wire.openai_error(400, "We could not parse the JSON body of your request."))
            return None
        return body

    def _raw(self, status: int, data: bytes, content_type: str) -> None:
        try:
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the caller was killed while its answer was held: the create still counts


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], state: ProviderState, generator: Generator) -> None:
        super().__init__(address, _Handler)
        self.state = state
        self.generator = generator
        self.batches = FakeBatches(state, generator)
        self.stopping = threading.Event()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Stay quiet when a client vanished (a killed worker resets its connections); report anything else."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class FakeProviderControl:
    """Drives a running fake provider (thread or process) over its `/_fake/*` API; every call is bounded."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("content-type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            raise ValueError(exc.read().decode(errors="replace")) from None

    def stats(self) -> dict[str, Any]:
        """Return the fake's counters now (creates, creates_by_intent, polls, errors_served, held...)."""
        return dict(self._call("GET", "/_fake/stats"))

    def set_knobs(self, **knobs: Any) -> dict[str, Any]:
        """Change knobs (see `Knobs`), all or none; return every knob's value."""
        return dict(self._call("POST", "/_fake/knobs", knobs))

    def release(self) -> int:
        """Release every held create answer and every batch held by `batch_hold`; return how many answers were held."""
        return int(self._call("POST", "/_fake/release", {})["released"])

    def forget(self, call_id: str | None = None) -> int:
        """Drop a call (or all of them), as a provider past its retention does; its retrieve answers 404."""
        return int(self._call("POST", "/_fake/forget", {} if call_id is None else {"id": call_id})["forgotten"])

    def reset(self) -> None:
        """Forget every call and counter; restore the default knobs."""
        self._call("POST", "/_fake/reset", {})

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 10.0) -> dict[str, Any]:
        """Poll the counters until `predicate(stats)` holds; return them, or raise TimeoutError with the last."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if predicate(stats):
                return stats
            if time.monotonic() > deadline:
                raise TimeoutError(f"the fake provider's counters did not reach the condition in {timeout}s: {stats}")
            time.sleep(0.02)


class FakeProvider(FakeProviderControl):
    """A fake provider served from a thread of this process on 127.0.0.1; a context manager that stops it."""

    def __init__(self, knobs: Knobs | None = None, generator: Generator | None = None, port: int = 0) -> None:
        self.state = ProviderState(knobs)
        self._server = _Server(("127.0.0.1", port), self.state, generator or default_generator)
        self.port = int(self._server.server_address[1])
        super().__init__(f"http://127.0.0.1:{self.port}")
        # A short poll interval: `stop` (shutdown) waits for it, 0.5 s by default, at every test's teardown.
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(SHUTDOWN_POLL_S,), name="oncelery-fake-provider", daemon=True
        )

    @property
    def openai_base_url(self) -> str:
        """Return the base URL an OpenAI client takes (`.../v1`)."""
        return self.url + "/v1"

    @property
    def gemini_base_url(self) -> str:
        """Return the base URL a Gemini client takes (`.../v1beta`)."""
        return self.url + "/v1beta"

    def start(self) -> FakeProvider:
        """Start serving; return self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket; held and streaming answers end at once."""
        self._server.stopping.set()
        self.state.release()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> FakeProvider:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(host: str, port: int, knobs: Knobs, ready: Callable[[str], None]) -> None:
    """Serve a fake provider in this thread until interrupted; call `ready(url)` once it listens."""
    server = _Server((host, port), ProviderState(knobs), default_generator)
    ready(f"http://{host}:{server.server_address[1]}")
    try:
        server.serve_forever()
    finally:
        server.stopping.set()
        server.server_close()
