"""One HTTP exchange with the fake, below its routes: reading a request, and answering it as its provider would.

Every answer leaves through here: JSON and raw bodies, server-sent events (a stream resumes with
`starting_after`), each provider's error envelope with its wait (a `retry-after` header, or Gemini's RetryInfo
detail), its rate-limit headers and its API-key check. A client that went away mid-answer is not an error: its
create still counts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from oncelery.fake_provider import protocol as wire
from oncelery.fake_provider.state import retry_after_header

if TYPE_CHECKING:  # the server module imports the handler built on this class: a type-only cycle
    from oncelery.fake_provider.server import ProviderServer

# Each provider's error envelope: (HTTP status, message) -> the JSON body.
ERRORS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "openai": wire.openai_error,
    "anthropic": wire.anthropic_error,
    "gemini": wire.gemini_error,
}
STREAM_TICK_S = 0.02  # how often a streaming answer looks for its next available event


class Exchange(BaseHTTPRequestHandler):
    """One request, read and answered in its provider's shapes; `server` is the fake's `ProviderServer`."""

    server: ProviderServer
    protocol_version = "HTTP/1.1"
    # Headers and body leave in two writes: without TCP_NODELAY, Nagle and the client's delayed ACK add ~40 ms
    # to every answer, which a provider does not.
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        """Stay quiet: the counters are the record."""

    # -- answers in the provider's shapes -----------------------------------------------------------------------
    def _refuse(
        self, provider: str, status: int, retry_after: float, message: str, headers: dict[str, str] | None = None
    ) -> None:
        """Answer an injected failure or a rate limit in the provider's envelope; its wait is a `retry-after`
        header, or for Gemini a RetryInfo detail in the body (Google sends no header)."""
        if provider == "gemini":
            self._json(status, wire.gemini_error(status, message, retry_after), headers)
            return
        wait = {"retry-after": retry_after_header(retry_after)}
        self._json(status, ERRORS[provider](status, message), {**wait, **(headers or {})})

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
