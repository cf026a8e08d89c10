"""Batch APIs: OpenAI's Files + Batch API, Anthropic's Message Batches and Gemini's batch mode, over httpx with no
retries.

What the framework needs of a provider batch, the same for all three: create it, find it again after a crash in the
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
- Gemini (REST v1beta `models.batchGenerateContent`, `batches.get/list/cancel`; a batch is a long-running
  Operation whose `metadata` is the GenerateContentBatch): the requests go inline, each `{request, metadata:
  {key: custom_id}}`, and the batch's required `displayName` is the tag, so a lost batch is found again by listing
  `GET /batches` (`find`). Inline responses come back in input order and without the request's metadata, so
  `results` maps them to custom_ids **by position**: the batcher passes the custom_ids in the order it sent them.
  An expired, cancelled or failed batch returns no responses (its requests are re-queued).

Each request's answer in a result is the JSON its synchronous endpoint returns (a Responses or Chat Completions
body, an Anthropic Message, a GenerateContentResponse), so the synchronous adapters' `usage` reads it. Every
failure is a typed error (`oncelery.llm.errors`), as in `http`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import quote

import httpx

from oncelery.llm.adapters.anthropic_messages import anthropic_transport, message_usage
from oncelery.llm.adapters.base import Usage
from oncelery.llm.adapters.gemini_generate import GeminiAuthAdapter, model_name, request_body
from oncelery.llm.adapters.http import DEFAULT_TIMEOUT_S, HTTPAdapter, OpenAIAuthAdapter, Transport
from oncelery.llm.errors import ProviderRejected, ProviderUnavailable

#: The metadata key that carries the framework's tag of an OpenAI batch.
BATCH_METADATA_KEY = "oncelery_batch"
API_VERSION = "2023-06-01"
OPENAI_ENDED = frozenset({"completed", "failed", "expired", "cancelled"})
#: OpenAI error codes of requests that never ran (the batch expired or was cancelled first): safe to re-queue.
NOT_RUN_CODES = frozenset({"batch_expired", "batch_cancelled"})
PAGE = 100  # the most batches OpenAI lists per page
GEMINI_ENDED = frozenset(
    {"BATCH_STATE_SUCCEEDED", "BATCH_STATE_FAILED", "BATCH_STATE_CANCELLED", "BATCH_STATE_EXPIRED"}
)
GEMINI_PAGE = 100  # batches asked per page of Gemini's list


@dataclass(frozen=True)
class BatchState:
    """What the framework needs of a provider batch, whichever the provider."""

    id: str
    status: str  # the provider's own status string
    ended: bool  # completed/failed/expired/cancelled (OpenAI), ended (Anthropic), or an ended Gemini state
    output_ref: str | None  # OpenAI output_file_id; Anthropic and Gemini: the batch id when results exist
    error_ref: str | None  # OpenAI error_file_id
    metadata: dict[str, str]
    created_at: float  # epoch seconds (OpenAI reports whole seconds)
    counts: dict[str, int]
    poll_after_s: float | None = None
    # Gemini: the inline responses an ended batch carries, in input order (None: none, or another provider).
    inline: list[dict[str, Any]] | None = field(default=None, compare=False, repr=False)


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
        headers: Mapping[str, str] | None = None,
        proxy: str | None = None,
    ) -> None:
        self.provider = provider
        self.http = anthropic_transport(provider, base_url, api_key, timeout_s, headers, proxy)

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

    def usage(self, response: Mapping[str, Any]) -> Usage:
        """The billable tokens of a result's Message (the synchronous adapter's reading: cache tokens included)."""
        return message_usage(response)

    def cancel(self, batch_id: str) -> BatchState:
        """Ask Anthropic to cancel the batch (`canceling`, then `ended`; requests done by then keep their results)."""
        return _anthropic_state(self.http.json("POST", f"/messages/batches/{batch_id}/cancel", {}))


class GeminiBatches(GeminiAuthAdapter):
    """Gemini's batch mode (`models/{model}:batchGenerateContent`, `batches/*`) over httpx: inline requests, the
    tag as the batch's `displayName`, results matched to custom_ids by position (see the module)."""

    #: The batcher passes `results` the custom_ids in the order it sent them: responses carry no key.
    results_in_input_order = True

    def create(self, lines: list[tuple[str, dict[str, Any]]], model: str, tag: str) -> BatchState:
        """Create the batch of GenerateContentRequests (custom_id, request) inline, each with `metadata.key =
        custom_id`, named `displayName = tag` (what `find` looks for); the requests keep their order."""
        name = model_name(model)
        requests = [{"request": request_body(body), "metadata": {"key": custom_id}} for custom_id, body in lines]
        batch = {"model": name, "displayName": tag, "inputConfig": {"requests": {"requests": requests}}}
        return _gemini_state(self.http.json("POST", f"/{name}:batchGenerateContent", {"batch": batch}, model))

    def retrieve(self, batch_id: str) -> BatchState:
        """Return the batch (`batches/<id>`) as it is now; `ResponseGone` if Gemini has no such batch."""
        return _gemini_state(self.http.json("GET", f"/{_batch_name(batch_id)}"))

    def find(self, tag: str, created_after: float | None = None) -> BatchState | None:
        """Return the newest batch whose `displayName` is `tag` (created at or after `created_after`, if given),
        or None. Every page of the list is read: Gemini documents no order of it."""
        found: list[BatchState] = []
        token: str | None = None
        while True:
            query = f"/batches?pageSize={GEMINI_PAGE}" + (f"&pageToken={quote(token, safe='')}" if token else "")
            page = self.http.json("GET", query)
            for operation in page.get("operations") or []:
                if (operation.get("metadata") or {}).get("displayName") == tag:
                    state = _gemini_state(operation)
                    if created_after is None or state.created_at >= created_after:
                        found.append(state)
            token = page.get("nextPageToken") or None
            if not token:
                return max(found, key=lambda state: state.created_at) if found else None

    def results(self, state: BatchState, custom_ids: list[str]) -> Iterator[BatchLine]:
        """Yield each inline response of an ended batch as the line of the custom_id at its position (`custom_ids`
        in the order they were sent); none when the batch returned none (expired, cancelled, failed). A count that
        differs, or a key echoed at the wrong position, raises `ProviderRejected`: the answers could not be matched
        to their requests, and applying one to the wrong step would be worse than failing them."""
        responses = state.inline or []
        if not responses:
            return
        if len(responses) != len(custom_ids):
            raise ProviderRejected.of(
                self.provider, 502,
                f"batch {state.id} answered {len(responses)} responses for {len(custom_ids)} requests: "
                "they cannot be matched to their requests by position",
            )  # fmt: skip
        for position, (custom_id, entry) in enumerate(zip(custom_ids, responses, strict=True)):
            echoed = (entry.get("metadata") or {}).get("key")
            if echoed is not None and echoed != custom_id:
                raise ProviderRejected.of(
                    self.provider, 502, f"batch {state.id}: response {position} is keyed {echoed!r}, not {custom_id!r}"
                )
            yield _gemini_line(custom_id, entry)

    def cancel(self, batch_id: str) -> None:
        """Ask Gemini to cancel the batch (best effort; it answers `{}`: `retrieve` shows BATCH_STATE_CANCELLED)."""
        self.http.json("POST", f"/{_batch_name(batch_id)}:cancel", {})


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


def _batch_name(batch_id: str) -> str:
    return batch_id if batch_id.startswith("batches/") else f"batches/{batch_id}"


def _gemini_state(operation: Mapping[str, Any]) -> BatchState:
    """A Gemini batch Operation (`metadata`: the GenerateContentBatch; `response` once it succeeded)."""
    batch = operation.get("metadata") or {}
    status = str(batch.get("state") or "BATCH_STATE_UNSPECIFIED")
    ended = bool(operation.get("done")) or status in GEMINI_ENDED
    output = (operation.get("response") or {}).get("inlinedResponses") or {}
    inline = output.get("inlinedResponses") if ended else None
    name = str(operation.get("name") or batch.get("name"))
    stats = batch.get("batchStats") or {}
    return BatchState(
        id=name,
        status=status,
        ended=ended,
        output_ref=name if inline else None,
        error_ref=None,
        metadata={k: str(batch[k]) for k in ("displayName", "model") if batch.get(k)},
        created_at=_epoch(batch.get("createTime")),
        counts={str(k): int(v or 0) for k, v in stats.items()},  # int64 counts arrive as JSON strings
        inline=list(inline) if isinstance(inline, list) else None,
    )


def _gemini_line(custom_id: str, entry: Mapping[str, Any]) -> BatchLine:
    response = entry.get("response")
    if isinstance(response, dict) and response.get("candidates"):
        return BatchLine(custom_id, True, response, None)
    if isinstance(response, dict):  # answered, with no candidate: the prompt was blocked
        reason = (response.get("promptFeedback") or {}).get("blockReason") or "no candidate"
        return BatchLine(custom_id, False, None, f"blocked: {reason}")
    error = entry.get("error") or {}
    return BatchLine(custom_id, False, None, f"{error.get('code')}: {error.get('message')}")


def _epoch(value: Any) -> float:
    """RFC 3339 (Anthropic's and Gemini's timestamps) to epoch seconds."""
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
