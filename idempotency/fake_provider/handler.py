"""The fake provider's routes: which provider's API a request is, its model creates, and the `/_fake/*` control API.

OpenAI: `POST /v1/responses` (foreground, background, streamed; `GET /v1/responses/{id}` retrieves, with
`?stream=true&starting_after=` resumes, `POST .../cancel` cancels) and `POST /v1/chat/completions`; Azure
OpenAI's `/openai/v1/...` and `/openai/...?api-version=` paths are the same routes. Anthropic: `POST /v1/messages`.
The batch APIs' routes are `batch_routes`'.

Gemini (REST v1beta, the `x-goog-api-key` header): `POST /v1beta/models/{model}:generateContent` answers a
GenerateContentResponse; its errors are Google's envelope, and a 429 says its wait in a RetryInfo detail, not a
`retry-after` header (Gemini sends no rate-limit headers). Its batch mode: `/v1beta/models/{model}:batchGenerateContent`
and `/v1beta/batches` (get, list, `:cancel`).

Control endpoints (JSON): `GET /_fake/stats`, `POST /_fake/knobs` (a partial `Knobs`), `POST /_fake/release`
(held answers, and batches held by `batch_hold`), `POST /_fake/forget` (one call, or all: past retention now),
`POST /_fake/reset`, `GET /_fake/health`. They drive a fake run as a thread or as a process alike.
"""

from __future__ import annotations

from typing import Any

from oncelery.fake_provider import protocol as wire
from oncelery.fake_provider.batch_checks import check_gemini
from oncelery.fake_provider.batch_records import BatchError
from oncelery.fake_provider.batch_routes import BatchRoutes
from oncelery.fake_provider.exchange import ERRORS
from oncelery.fake_provider.state import KnobError
from oncelery.token_count import count_tokens, output_limit


class Handler(BatchRoutes):
    """One request to the fake, routed to its provider's API; `server.state` and `server.generator` are the fake's."""

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
                    self._create_batch(lambda: check_gemini(model, body or {}), base, "gemini")
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
            self._json(400, ERRORS[provider](400, str(exc)))
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
