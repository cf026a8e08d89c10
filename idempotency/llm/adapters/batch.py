"""Batch APIs: OpenAI's Files + Batch API and Anthropic's Message Batches, over httpx with no retries.

What the framework needs of a provider batch, the same for both: create it, find it again after a crash in the
create window, poll it to its end, read its results line by line (`BatchLine`, keyed by `custom_id`), cancel it.

- OpenAI (openai-python `resources/batches.py`, `resources/files.py`): the requests go up as a JSONL file
  (`purpose=batch`), one `{custom_id, method, url, body}` per line; the batch carries `metadata` (16 pairs), so a
  batch whose id was lost is found again by listing `GET /batches?after=` (newest first) for its tag (`find`).
  A crash between the upload and the create leaves a file behind: `uploaded_files(prefix)` finds it by the name it
  was given, to reuse or delete. Results: the output file (succeeded requests) and the error file (failed,
  expired or cancelled ones).
- Anthropic (anthropic-sdk-python `resources/messages/batches.py`): the requests go inline; a batch has no
  metadata, so a lost batch can only be found by listing batches created since a time (`list_since`) and matching
  the custom_ids in their results. Results are one JSONL document, available once the batch has ended.

Each request's answer in a result is the JSON its synchronous endpoint returns (a Responses or Chat Completions
body, an Anthropic Message), so the synchronous adapters' `usage` reads it. Every failure is a typed error
(`oncelery.llm.errors`), as in `http`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx

from oncelery.llm.adapters.http import DEFAULT_TIMEOUT_S, HTTPAdapter, OpenAIAuthAdapter, Transport
from oncelery.llm.errors import ProviderUnavailable

#: The metadata key that carries the framework's tag of an OpenAI batch.
BATCH_METADATA_KEY = "oncelery_batch"
API_VERSION = "2023-06-01"
OPENAI_ENDED = frozenset({"completed", "failed", "expired", "cancelled"})
#: OpenAI error codes of requests that never ran (the batch expired or was cancelled first): safe to re-queue.
NOT_RUN_CODES = frozenset({"batch_expired", "batch_cancelled"})
PAGE = 100  # the most batches OpenAI lists per page


@dataclass(frozen=True)
class BatchState:
    """What the framework needs of a provider batch, whichever the provider."""

    id: str
    status: str  # the provider's own status string
    ended: bool  # completed/failed/expired/cancelled (OpenAI) or ended (Anthropic)
    output_ref: str | None  # OpenAI output_file_id; Anthropic: the batch id when results exist
    error_ref: str | None  # OpenAI error_file_id
    metadata: dict[str, str]
    created_at: float  # epoch seconds (OpenAI reports whole seconds)
    counts: dict[str, int]
    poll_after_s: float | None = None


@dataclass(frozen=True)
class BatchLine:
    """One request's result in a batch."""

    custom_id: str
    ok: bool
    response: dict[str, Any] | None  # the same response JSON a synchronous call returns (when ok)
    error: str | None
    expired: bool = False  # expired or cancelled before it ran: safe to re-queue


class OpenAIBatches(OpenAIAuthAdapter):
    """OpenAI's Files and Batch APIs (`/files`, `/batches`) over httpx, or any server of the same shape."""

    #: The batch endpoint of each synchronous adapter's endpoint (`OpenAIResponses.endpoint`, `OpenAIChat.endpoint`).
    endpoint_for_sync = {
        "responses": "/v1/responses",
        "chat": "/v1/chat/completions",
        "chat.completions": "/v1/chat/completions",
    }

    def submit_file(self, lines: list[tuple[str, dict[str, Any]]], endpoint: str, filename: str) -> str:
        """Upload the requests (custom_id, body) as one JSONL file of purpose `batch`; return its file id."""
        url = self.endpoint_for_sync.get(endpoint, endpoint)
        content = b"".join(
            json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}).encode() + b"\n"
            for custom_id, body in lines
        )
        files = {"file": (filename, content, "application/jsonl")}
        answer = _send(self.http, "POST", "/files", data={"purpose": "batch"}, files=files)
        return str(_object(self.http, answer)["id"])

    def create(self, file_id: str, endpoint: str, tag: str) -> BatchState:
        """Create the batch over an uploaded file, tagged `metadata.oncelery_batch = tag` (what `find` looks for)."""
        body = {
            "input_file_id": file_id,
            "endpoint": self.endpoint_for_sync.get(endpoint, endpoint),
            "completion_window": "24h",
            "metadata": {BATCH_METADATA_KEY: tag},
        }
        return _openai_state(self.http.json("POST", "/batches", body))

    def retrieve(self, batch_id: str) -> BatchState:
        """Return the batch as it is now; `ResponseGone` if OpenAI has no such batch."""
        return _openai_state(self.http.json("GET", f"/batches/{batch_id}"))

    def find(self, tag: str, created_after: float | None = None) -> BatchState | None:
        """Return the newest batch tagged `tag`, listing back to `created_after` (to the second), or None if none is."""
        floor = math.floor(created_after) if created_after is not None else None
        after: str | None = None
        while True:
            page = self.http.json("GET", f"/batches?limit={PAGE}" + (f"&after={after}" if after else ""))
            data = page.get("data") or []
            for batch in data:
                if (batch.get("metadata") or {}).get(BATCH_METADATA_KEY) == tag:
                    return _openai_state(batch)
                if floor is not None and float(batch.get("created_at") or 0) < floor:
                    return None
            if not page.get("has_more") or not data:
                return None
            after = str(page.get("last_id") or data[-1]["id"])

    def uploaded_files(self, prefix: str) -> list[tuple[str, str]]:
        """Return (file id, filename) of every `purpose=batch` file whose name starts with `prefix`, newest first."""
        found: list[tuple[str, str]] = []
        after: str | None = None
        while True:
            page = self.http.json("GET", "/files?purpose=batch" + (f"&after={after}" if after else ""))
            data = page.get("data") or []
            found += [(str(f["id"]), str(f.get("filename") or "")) for f in data]
            if not page.get("has_more") or not data:
                return [(i, name) for i, name in found if name.startswith(prefix)]
            after = str(page.get("last_id") or data[-1]["id"])

    def delete_file(self, file_id: str) -> None:
        """Delete the file; a file already gone counts as deleted (the call is safe to repeat)."""
        answer = _request(self.http, "DELETE", f"/files/{file_id}")
        if answer.status_code != 404:
            self.http.check(answer, "DELETE", f"/files/{file_id}", "")

    def results(self, state: BatchState) -> Iterator[BatchLine]:
        """Yield every line of the batch's output file, then of its error file (each file streamed once)."""
        for file_id in (state.output_ref, state.error_ref):
            if file_id:
                for line in _jsonl_lines(self.http, f"/files/{file_id}/content", f"/files/{file_id}"):
                    yield _openai_line(line)

    def cancel(self, batch_id: str) -> BatchState:
        """Ask OpenAI to cancel the batch (`cancelling`, then `cancelled`; requests done by then keep their results)."""
        return _openai_state(self.http.json("POST", f"/batches/{batch_id}/cancel", {}))


class AnthropicBatches(HTTPAdapter):
    """Anthropic's Message Batches (`/messages/batches`) over httpx."""

    def __init__(
        self,
        base_url: str = "https://api.anthropic.com/v1",
        api_key: str | None = None,
        *,
        provider: str = "anthropic",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.provider = provider
        key = api_key if api_key is not None else os.environ.get("ANTHROPIC_API_KEY", "")
        self.http = Transport(provider, base_url, {"x-api-key": key, "anthropic-version": API_VERSION}, timeout_s)

    def create(self, requests: list[tuple[str, dict[str, Any]]]) -> BatchState:
        """Create the batch of Messages requests (custom_id, params); it carries no tag (find it with `list_since`)."""
        body = {"requests": [{"custom_id": custom_id, "params": params} for custom_id, params in requests]}
        return _anthropic_state(self.http.json("POST", "/messages/batches", body))

    def retrieve(self, batch_id: str) -> BatchState:
        """Return the batch as it is now; `ResponseGone` if Anthropic has no such batch."""
        return _anthropic_state(self.http.json("GET", f"/messages/batches/{batch_id}"))

    def list_since(self, created_after: float) -> list[BatchState]:
        """Return every batch created at or after `created_after` (epoch seconds), newest first, all pages."""
        found: list[BatchState] = []
        after: str | None = None
        while True:
            page = self.http.json("GET", "/messages/batches?limit=1000" + (f"&after_id={after}" if after else ""))
            data = page.get("data") or []
            for batch in data:
                state = _anthropic_state(batch)
                if state.created_at < created_after:
                    return found
                found.append(state)
            if not page.get("has_more") or not data:
                return found
            after = str(page.get("last_id") or data[-1]["id"])

    def results(self, state: BatchState) -> Iterator[BatchLine]:
        """Yield every result of an ended batch (none before it has results), streamed once."""
        if not state.output_ref:
            return
        path = f"/messages/batches/{state.output_ref}/results"
        for line in _jsonl_lines(self.http, path, f"/messages/batches/{state.output_ref}"):
            yield _anthropic_line(line)

    def cancel(self, batch_id: str) -> BatchState:
        """Ask Anthropic to cancel the batch (`canceling`, then `ended`; requests done by then keep their results)."""
        return _anthropic_state(self.http.json("POST", f"/messages/batches/{batch_id}/cancel", {}))


# -- reading the providers' objects ---------------------------------------------------------------------------------
def _openai_state(batch: Mapping[str, Any]) -> BatchState:
    status = str(batch.get("status"))
    counts = batch.get("request_counts") or {}
    return BatchState(
        id=str(batch["id"]),
        status=status,
        ended=status in OPENAI_ENDED,
        output_ref=batch.get("output_file_id") or None,
        error_ref=batch.get("error_file_id") or None,
        metadata={str(k): str(v) for k, v in (batch.get("metadata") or {}).items()},
        created_at=float(batch.get("created_at") or 0),
        counts={str(k): int(v or 0) for k, v in counts.items()},
    )


def _anthropic_state(batch: Mapping[str, Any]) -> BatchState:
    status = str(batch.get("processing_status"))
    ended = status == "ended"
    return BatchState(
        id=str(batch["id"]),
        status=status,
        ended=ended,
        output_ref=str(batch["id"]) if ended and batch.get("results_url") else None,
        error_ref=None,
        metadata={},
        created_at=_epoch(batch.get("created_at")),
        counts={str(k): int(v or 0) for k, v in (batch.get("request_counts") or {}).items()},
    )


def _epoch(value: Any) -> float:
    """RFC 3339 (Anthropic's timestamps) to epoch seconds."""
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _openai_line(line: Mapping[str, Any]) -> BatchLine:
    custom_id = str(line.get("custom_id"))
    response = line.get("response") or None
    error = line.get("error") or None
    status = int(response.get("status_code") or 0) if response else 0
    if response and 200 <= status < 300 and not error:
        return BatchLine(custom_id, True, response.get("body"), None)
    if error:
        code = str(error.get("code") or "")
        return BatchLine(custom_id, False, None, f"{code}: {error.get('message')}", expired=code in NOT_RUN_CODES)
    body = (response or {}).get("body") or {}
    detail = body.get("error") if isinstance(body, dict) else None
    message = detail.get("message") if isinstance(detail, dict) else body
    return BatchLine(custom_id, False, None, f"{status}: {message}")


def _anthropic_line(line: Mapping[str, Any]) -> BatchLine:
    custom_id = str(line.get("custom_id"))
    result = line.get("result") or {}
    kind = str(result.get("type"))
    if kind == "succeeded":
        return BatchLine(custom_id, True, result.get("message"), None)
    if kind in ("expired", "canceled"):
        return BatchLine(custom_id, False, None, kind, expired=True)
    envelope: dict[str, Any] = result.get("error") or {}
    inner = envelope.get("error")  # the error envelope {type: "error", error: {type, message}}
    detail: dict[str, Any] = inner if isinstance(inner, dict) else envelope
    return BatchLine(custom_id, False, None, f"{detail.get('type')}: {detail.get('message')}")


# -- transport beyond JSON: multipart uploads, deletes that may 404, JSONL downloads --------------------------------
def _request(http: Transport, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """Send one request (no retry); map a network failure to `ProviderUnavailable`, leave the status to the caller."""
    try:
        return http.client.request(method, path, **kwargs)
    except httpx.ConnectError as exc:
        raise ProviderUnavailable.of(http.provider, f"cannot connect ({exc})", maybe_sent=False) from exc
    except httpx.HTTPError as exc:
        raise ProviderUnavailable.of(http.provider, f"{type(exc).__name__}: {exc}", maybe_sent=True) from exc


def _send(http: Transport, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """Send one request and return its 2xx answer; every other outcome is the typed error `Transport` maps."""
    answer = _request(http, method, path, **kwargs)
    http.check(answer, method, path, "")
    return answer


def _object(http: Transport, answer: httpx.Response) -> dict[str, Any]:
    try:
        data = answer.json()
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise ProviderUnavailable.of(http.provider, f"{answer.request.url.path} answered no JSON object", True)
    return data


def _jsonl_lines(http: Transport, path: str, reference: str) -> Iterator[dict[str, Any]]:
    """Stream a JSONL download line by line; a 404 is `ResponseGone` for `reference` (the file or batch)."""
    try:
        with http.client.stream("GET", path) as answer:
            if not answer.is_success:
                answer.read()
            http.check(answer, "GET", reference, "")
            for text in answer.iter_lines():
                if not text.strip():
                    continue
                try:
                    line = json.loads(text)
                except ValueError as exc:
                    raise ProviderUnavailable.of(
                        http.provider, f"{path}: a line is not JSON ({text[:80]!r})", True
                    ) from exc
                if isinstance(line, dict):
                    yield line
    except httpx.ConnectError as exc:
        raise ProviderUnavailable.of(http.provider, f"cannot connect ({exc})", maybe_sent=False) from exc
    except httpx.HTTPError as exc:
        raise ProviderUnavailable.of(http.provider, f"{type(exc).__name__}: {exc}", maybe_sent=True) from exc
