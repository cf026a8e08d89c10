"""The batch APIs' HTTP routes: OpenAI's Files and Batch, Anthropic's Message Batches, and a batch create of any
provider (Gemini's batch routes are in `handler`, with the rest of `/v1beta/`).

OpenAI's `/v1/files` (multipart upload, list, retrieve, content, delete) and `/v1/batches` (create, retrieve, list,
cancel); Anthropic's `/v1/messages/batches` (create, retrieve, list, cancel, results, delete). A batch create takes
`fail_next`, `hold_creates` and `hang_next` like any create. What the routes serve is `FakeBatches`' and
`FakeFiles`'; a `BatchError` they raise is answered in the provider's error envelope.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from oncelery.fake_provider import protocol as wire
from oncelery.fake_provider.batch_checks import check_anthropic, check_openai
from oncelery.fake_provider.batch_records import BatchError
from oncelery.fake_provider.batch_shapes import batch_json
from oncelery.fake_provider.exchange import Exchange


class BatchRoutes(Exchange):
    """The Files and batch routes of a request (the handler's routing calls them first)."""

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
                self._json(200, fake.files.list_files(query))
            elif method == "GET" and ident and not tail:
                self._json(200, fake.files.file(ident).as_json())
            elif method == "GET" and ident and tail == ["content"]:
                self._raw(200, fake.files.file(ident).content, "application/octet-stream")
            elif method == "DELETE" and ident and not tail:
                self._json(200, fake.files.delete_file(ident))
            else:
                raise BatchError(404, f"Invalid URL ({method} /v1/{'/'.join(rest)})")
        elif method == "POST" and ident is None:
            self._create_batch(lambda: check_openai(self.server.state, body or {}), base, "openai")
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
            self._create_batch(lambda: check_anthropic(body or {}), base, "anthropic")
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
            payload = batch_json(batch, base)
        self._json(200, payload)

    def _upload(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not self._authorised("openai"):
            return
        try:
            self._json(200, self.server.batches.files.upload(self.headers.get("content-type") or "", raw))
        except BatchError as exc:
            self._json(exc.status, wire.openai_error(exc.status, str(exc)))
