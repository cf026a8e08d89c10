"""The batch APIs, time compressed: OpenAI's Files and Batch APIs, Anthropic's Message Batches and Gemini's batch
mode.

Wire shapes, as the providers' references give them (checked with the search tool, 2026-12):

- OpenAI Batch object (openai-python `types/batch.py`; API reference "Batch", developers.openai.com): `id`
  (`batch_...`), `object: "batch"`, `endpoint`, `input_file_id`, `completion_window: "24h"`, `status` validating,
  failed, in_progress, finalizing, completed, expired, cancelling or cancelled, `output_file_id`, `error_file_id`,
  `created_at`, `in_progress_at`, `expires_at`, `finalizing_at`, `completed_at`, `failed_at`, `expired_at`,
  `cancelling_at`, `cancelled_at` (Unix seconds or null), `request_counts {total, completed, failed}`, `metadata`
  (16 pairs: keys up to 64 characters, values up to 512), `errors`. Create: `{input_file_id, endpoint,
  completion_window, metadata, output_expires_after}`. List: `GET /v1/batches?after=&limit=` (default 20, 1 to
  100), newest first, `{object: "list", data, first_id, last_id, has_more}`. Cancel: `cancelling` (up to 10
  minutes), then `cancelled`; the requests done by then stay in the output file.
- Its JSONL lines: input `{custom_id, method: "POST", url, body}`; output and error files (OpenAPI
  `BatchRequestOutput`) `{id, custom_id, response: {status_code, request_id, body} | null, error: {code, message} |
  null}`. A request the endpoint answered with a 4xx/5xx is a `response` with that status and `error` null; a
  request that never ran has `response` null and `error.code` `batch_expired` or `batch_cancelled`
  (`BatchRequestOutputError`).
- Files (API reference "Files"): `POST /v1/files` multipart (`purpose`, `file`) -> File object `{id, object: "file",
  bytes, created_at, filename, purpose, status, expires_at, status_details}`; `GET /v1/files?purpose=&limit=&after=
  &order=` (newest first by default; limit up to 10,000) -> `{object: "list", data, first_id, last_id, has_more}`;
  `GET /v1/files/{id}/content`; `DELETE /v1/files/{id}` -> `{id, object: "file", deleted: true}`. A batch's output
  and error files have purpose `batch_output`.
- Anthropic MessageBatch (platform.claude.com API reference "Message Batches"; anthropic-sdk-python
  `resources/messages/batches.py`): `id` (`msgbatch_...`), `type: "message_batch"`, `processing_status`
  in_progress, canceling or ended, `request_counts {processing, succeeded, errored, canceled, expired}`, `created_at`,
  `expires_at` (24 h after creation), `ended_at`, `cancel_initiated_at`, `archived_at` (RFC 3339 strings),
  `results_url` (null until ended). Create `{requests: [{custom_id, params}]}`, custom_ids unique, 1 to 64 of
  `[a-zA-Z0-9_-]`; no metadata. List `?limit=` (default 20, 1 to 1000) `&after_id=&before_id=`, newest first,
  `{data, has_more, first_id, last_id}`. Results: JSONL `{custom_id, result}` with `result` `{type: "succeeded",
  message}`, `{type: "errored", error: <the error envelope>}`, `{type: "canceled"}` or `{type: "expired"}`, in any
  order. A request's params are validated while the batch runs: a bad one ends `errored`.
- Gemini batch mode (ai.google.dev/api/batch-api, REST v1beta): `POST /v1beta/models/{model}:batchGenerateContent`
  with `{batch: {displayName (required), model, inputConfig: {requests: {requests: [{request, metadata}]}}}}`
  answers an Operation `{name: "batches/<id>", metadata: <GenerateContentBatch>, done}`; the GenerateContentBatch
  has `@type`, `name`, `model`, `displayName`, `createTime`, `updateTime`, `endTime`, `batchStats`
  (`requestCount`, `successfulRequestCount`, `failedRequestCount`, `pendingRequestCount`: int64 as JSON strings)
  and `state` BATCH_STATE_PENDING, RUNNING, SUCCEEDED, FAILED, CANCELLED or EXPIRED. `GET /v1beta/batches/<id>`
  (the Operation), `GET /v1beta/batches?pageSize=&pageToken=` (`{operations, nextPageToken}`),
  `POST /v1beta/batches/<id>:cancel` (answers `{}`). Once done, a succeeded batch's Operation has `response:
  {@type: GenerateContentBatchOutput, inlinedResponses: {inlinedResponses: [{response} | {error}]}}` in input
  order, without the requests' metadata (not echoed back, as ../shared/PROVIDERS.md notes); a cancelled or
  expired one has an `error` (google.rpc.Status) and no response. Auth: the `x-goog-api-key` header.

Time is compressed: a batch moves only when it is retrieved. After its create (OpenAI `validating`, Anthropic
`in_progress`), each retrieve advances it: `in_progress` for `Knobs.batch_polls` retrieves (its requests done in
input order, a share per retrieve), then OpenAI's `finalizing` for one retrieve, then it ends (`completed`, or
`expired` with `batch_expire`; Anthropic `ended`). A cancel makes it `cancelling`/`canceling`; the next retrieve
ends it `cancelled`/`ended`, the requests not yet done canceled. A batch created while `batch_hold` is armed
stays in progress (none of its requests runs, its retrieves not counted) until the next `release`, then moves as
any other. Knobs are read when a batch is created. A Gemini
batch goes PENDING, then RUNNING for `batch_polls` retrieves, then SUCCEEDED (or EXPIRED with `batch_expire`:
none of its requests runs, and it returns no response); a cancel ends it CANCELLED at the next retrieve.
`batch_shuffle` does not apply to Gemini: its output order is how responses are matched to requests.

Each request's answer is the one the synchronous endpoint gives (the same generator, token counts and response
JSON, ids aside), billed to `batch_billed_*_tokens` when it succeeds, not to the synchronous bill.

Simplifications: a malformed input line (or a duplicate custom_id) is refused with 400 at the create, where OpenAI
accepts the batch and ends it `failed`; the fake serves only the `/v1/responses` and `/v1/chat/completions`
endpoints; cancelling an ended batch answers the batch as it is; nothing is archived or expires on the clock;
Gemini batches take inline requests only (no `fileName`), and a Gemini request without a `metadata.key` counts
under the key "" in `items_by_custom_id`.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email import policy
from email.parser import BytesParser
from typing import Any, TypeVar

from oncelery.llm.fake import protocol as wire
from oncelery.llm.fake.generate import Generator
from oncelery.llm.fake.state import ProviderState, new_call

DAY_S = 86400
#: The endpoints a batch of the fake may target, and the synchronous kind each one is.
OPENAI_ENDPOINTS = {"/v1/responses": "responses", "/v1/chat/completions": "chat"}
BATCH_FIELDS = frozenset({"input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after"})
FILE_PURPOSES = frozenset({"assistants", "batch", "fine-tune", "vision", "user_data", "evals"})
OPENAI_ENDED = frozenset({"completed", "failed", "expired", "cancelled"})
GEMINI_ENDED = frozenset(
    {"BATCH_STATE_SUCCEEDED", "BATCH_STATE_FAILED", "BATCH_STATE_CANCELLED", "BATCH_STATE_EXPIRED"}
)
GEMINI_TYPE = "type.googleapis.com/google.ai.generativelanguage.v1main."
GEMINI_BATCH_FIELDS = frozenset(
    {"model", "name", "displayName", "display_name", "inputConfig", "input_config", "priority"}
)
MAX_ANTHROPIC_REQUESTS = 100_000
MAX_GEMINI_REQUESTS = 100_000
_CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_LINE_FIELDS = frozenset({"custom_id", "method", "url", "body"})
_T = TypeVar("_T")
_NOT_RUN = {
    "expired": ("batch_expired", "This request could not be executed before the completion window expired."),
    "canceled": ("batch_cancelled", "This request was not executed because the batch was cancelled."),
}


class BatchError(Exception):
    """A batch or file request the provider refuses: the HTTP status and the message its error envelope carries."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class StoredFile:
    """An uploaded file (purpose `batch`...) or a batch's output or error file (purpose `batch_output`)."""

    id: str
    filename: str
    purpose: str
    content: bytes
    created_at: int
    seq: int

    def as_json(self) -> dict[str, Any]:
        """Return OpenAI's File object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": len(self.content),
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }


@dataclass
class Item:
    """One request of a batch and, once done, its outcome."""

    position: int
    custom_id: str
    body: dict[str, Any]
    fail: bool = False  # an injected failure (batch_fail_ids, batch_fail_first), decided at the create
    outcome: str | None = None  # succeeded, errored, expired or canceled; None while not done
    status_code: int = 200
    response: dict[str, Any] | None = None  # the answer's JSON, or the error envelope when errored
    line_id: str = field(default_factory=lambda: "batch_req_" + uuid.uuid4().hex)
    request_id: str = field(default_factory=lambda: "req_" + uuid.uuid4().hex)


@dataclass
class Batch:
    """A batch of any provider: its requests, where it is, and its knobs as they were at its create."""

    id: str
    provider: str  # "openai" | "anthropic" | "gemini"
    kind: str  # the synchronous kind of its requests: responses, chat, messages or gemini
    items: list[Item]
    created_at: float  # epoch seconds
    seq: int  # creation order (newest first in lists)
    polls: int
    expire: bool
    shuffle: bool
    endpoint: str = ""
    input_file_id: str = ""
    metadata: dict[str, str] | None = None
    model: str = ""  # Gemini: the model its requests run on (the batch's path names it)
    display_name: str = ""  # Gemini: the batch's displayName
    status: str = "validating"
    retrieves: int = 0
    times: dict[str, float] = field(default_factory=dict)  # status (or event) -> epoch seconds it was reached
    output_file_id: str | None = None
    error_file_id: str | None = None
    hold: int | None = None  # held (`batch_hold`): in progress until the state's release count passes this
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def ended(self) -> bool:
        """Whether the batch has ended (nothing in it moves any more)."""
        return self.status in OPENAI_ENDED or self.status == "ended" or self.status in GEMINI_ENDED


@dataclass
class _Plan:
    """A validated create, not yet accepted: what the batch will be made of."""

    provider: str
    kind: str
    lines: list[tuple[str, dict[str, Any]]]
    endpoint: str = ""
    input_file_id: str = ""
    metadata: dict[str, str] | None = None
    model: str = ""
    display_name: str = ""


class FakeBatches:
    """Files and batches of every provider over the fake's `ProviderState`; the server turns `BatchError` into 4xx.

    Locks: a batch's own lock, then the state's lock (never the other way round), so that a retrieve generating
    answers does not hold up the rest of the fake.
    """

    def __init__(self, state: ProviderState, generator: Generator) -> None:
        self.state = state
        self.generator = generator

    # -- OpenAI files ----------------------------------------------------------------------------------------------
    def upload(self, content_type: str, raw: bytes) -> dict[str, Any]:
        """Store a multipart upload (`purpose`, `file`) and return its File object."""
        head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode()
        message = BytesParser(policy=policy.HTTP).parsebytes(head + raw)
        if not content_type.startswith("multipart/form-data") or not message.is_multipart():
            raise BatchError(400, "Expected a multipart/form-data body with 'purpose' and 'file'.")
        fields: dict[str, str] = {}
        upload: tuple[str, bytes] | None = None
        for part in message.walk():
            if part.is_multipart():
                continue
            name = part.get_param("name", header="content-disposition")
            payload = part.get_payload(decode=True)
            data = payload if isinstance(payload, bytes) else b""
            if name == "file":
                upload = (part.get_filename() or "file", data)
            elif isinstance(name, str):
                fields[name] = data.decode(errors="replace")
        purpose = fields.get("purpose")
        if not purpose:
            raise BatchError(400, "Missing required parameter: 'purpose'.")
        if purpose not in FILE_PURPOSES:
            raise BatchError(400, f"Invalid value for 'purpose': {purpose!r}.")
        if upload is None:
            raise BatchError(400, "Missing required parameter: 'file'.")
        with self.state.lock:
            stored = self._store(upload[0], purpose, upload[1])
            self.state.stats.files_uploaded += 1
            return stored.as_json()

    def list_files(self, query: dict[str, list[str]]) -> dict[str, Any]:
        """Return a page of files, newest first unless `order=asc`, of one `purpose` if given."""
        purpose = _arg(query, "purpose")
        limit = _limit(query, "limit", 10_000, 10_000)
        order = _arg(query, "order") or "desc"
        if order not in ("asc", "desc"):
            raise BatchError(400, f"Invalid value for 'order': {order!r}.")
        with self.state.lock:
            files = sorted(self.state.files.values(), key=lambda f: f.seq, reverse=order == "desc")
            rows = [f for f in files if purpose is None or f.purpose == purpose]
            page, more = _page(rows, lambda f: f.id, _arg(query, "after"), None, limit)
            return _list([f.as_json() for f in page], more, openai=True)

    def file(self, file_id: str) -> StoredFile:
        """Return a stored file, or refuse with 404."""
        with self.state.lock:
            stored = self.state.files.get(file_id)
        if stored is None:
            raise BatchError(404, f"No such File object: {file_id}")
        return stored

    def delete_file(self, file_id: str) -> dict[str, Any]:
        """Delete a file (404 when there is none); return OpenAI's deletion answer."""
        with self.state.lock:
            if self.state.files.pop(file_id, None) is None:
                raise BatchError(404, f"No such File object: {file_id}")
            self.state.stats.files_deleted += 1
        return {"id": file_id, "object": "file", "deleted": True}

    # -- creates ---------------------------------------------------------------------------------------------------
    def check_openai(self, body: dict[str, Any]) -> _Plan:
        """Validate an OpenAI batch create and its input file; refuse with 400 what the provider would refuse."""
        try:
            wire.check_fields(body, BATCH_FIELDS, ("input_file_id", "endpoint", "completion_window"))
            wire.openai_intent(body)  # metadata: 16 string pairs of bounded lengths
        except wire.BadRequest as exc:
            raise BatchError(400, str(exc)) from None
        endpoint = str(body["endpoint"])
        if endpoint not in OPENAI_ENDPOINTS:
            raise BatchError(400, f"Invalid 'endpoint': the fake batches {sorted(OPENAI_ENDPOINTS)} only.")
        if body["completion_window"] != "24h":
            raise BatchError(400, "Invalid 'completion_window': only '24h' is supported.")
        file_id = str(body["input_file_id"])
        with self.state.lock:
            stored = self.state.files.get(file_id)
        if stored is None:
            raise BatchError(400, f"Invalid 'input_file_id': no such File object: {file_id}")
        if stored.purpose != "batch":
            raise BatchError(400, f"Invalid 'input_file_id': file {file_id} has purpose {stored.purpose!r}, not batch.")
        lines: list[tuple[str, dict[str, Any]]] = []
        for number, text in enumerate(stored.content.decode(errors="replace").splitlines(), start=1):
            if not text.strip():
                continue
            try:
                line = json.loads(text)
            except ValueError:
                raise BatchError(400, f"Line {number} of the input file is not valid JSON.") from None
            if not isinstance(line, dict) or set(line) != _LINE_FIELDS:
                raise BatchError(400, f"Line {number}: expected exactly the fields {sorted(_LINE_FIELDS)}.")
            custom_id, body_ = line["custom_id"], line["body"]
            if not isinstance(custom_id, str) or not custom_id:
                raise BatchError(400, f"Line {number}: 'custom_id' must be a non-empty string.")
            if line["method"] != "POST":
                raise BatchError(400, f"Line {number}: 'method' must be POST.")
            if line["url"] != endpoint:
                raise BatchError(400, f"Line {number}: 'url' {line['url']!r} does not match the batch's {endpoint}.")
            if not isinstance(body_, dict):
                raise BatchError(400, f"Line {number}: 'body' must be an object.")
            lines.append((custom_id, body_))
        if not lines:
            raise BatchError(400, "The input file has no requests.")
        _unique([c for c, _ in lines])
        metadata = body.get("metadata")
        return _Plan("openai", OPENAI_ENDPOINTS[endpoint], lines, endpoint, file_id, metadata)

    def check_anthropic(self, body: dict[str, Any]) -> _Plan:
        """Validate an Anthropic batch create (each request's params are checked later, as it runs)."""
        try:
            wire.check_fields(body, frozenset({"requests"}), ("requests",))
        except wire.BadRequest as exc:
            raise BatchError(400, str(exc)) from None
        requests = body["requests"]
        if not isinstance(requests, list) or len(requests) > MAX_ANTHROPIC_REQUESTS:
            raise BatchError(400, f"requests: expected a list of 1 to {MAX_ANTHROPIC_REQUESTS} requests")
        lines: list[tuple[str, dict[str, Any]]] = []
        for n, request in enumerate(requests):
            if not isinstance(request, dict) or set(request) != {"custom_id", "params"}:
                raise BatchError(400, f"requests.{n}: expected exactly 'custom_id' and 'params'")
            custom_id, params = request["custom_id"], request["params"]
            if not isinstance(custom_id, str) or not _CUSTOM_ID.fullmatch(custom_id):
                raise BatchError(400, f"requests.{n}.custom_id: 1 to 64 letters, digits, '_' or '-'")
            if not isinstance(params, dict):
                raise BatchError(400, f"requests.{n}.params: expected an object")
            lines.append((custom_id, params))
        _unique([c for c, _ in lines])
        return _Plan("anthropic", "messages", lines)

    def check_gemini(self, model: str, body: dict[str, Any]) -> _Plan:
        """Validate a Gemini batchGenerateContent of inline requests (each request is checked as it runs)."""
        batch = body.get("batch")
        if set(body) != {"batch"} or not isinstance(batch, dict):
            raise BatchError(400, "Invalid JSON payload received: expected exactly {'batch': {...}}.")
        unknown = sorted(set(batch) - GEMINI_BATCH_FIELDS)
        if unknown:
            raise BatchError(400, f"Invalid JSON payload received. Unknown name \"{unknown[0]}\" at 'batch'.")
        display = batch.get("displayName", batch.get("display_name"))
        if not isinstance(display, str) or not display:
            raise BatchError(400, "* GenerateContentBatch.display_name: display_name is required")
        if batch.get("model") not in (None, f"models/{model}"):
            raise BatchError(400, f"batch.model {batch.get('model')!r} does not match the path's models/{model}")
        source = batch.get("inputConfig", batch.get("input_config"))
        if not isinstance(source, dict) or not source:
            raise BatchError(400, "* GenerateContentBatch.input_config: input_config is required")
        if "fileName" in source or "file_name" in source:
            raise BatchError(400, "The fake serves inline requests only (inputConfig.requests), not fileName.")
        requests = (source.get("requests") or {}).get("requests") if isinstance(source.get("requests"), dict) else None
        if not isinstance(requests, list) or not 1 <= len(requests) <= MAX_GEMINI_REQUESTS:
            raise BatchError(400, f"inputConfig.requests.requests: expected 1 to {MAX_GEMINI_REQUESTS} requests")
        lines: list[tuple[str, dict[str, Any]]] = []
        for n, inlined in enumerate(requests):
            if not isinstance(inlined, dict) or not isinstance(inlined.get("request"), dict):
                raise BatchError(400, f"requests[{n}]: expected an object with 'request' (a GenerateContentRequest)")
            if set(inlined) - {"request", "metadata"}:
                raise BatchError(400, f"requests[{n}]: only 'request' and 'metadata' are allowed")
            metadata = inlined.get("metadata") or {}
            if not isinstance(metadata, dict):
                raise BatchError(400, f"requests[{n}].metadata: expected an object")
            lines.append((str(metadata.get("key") or ""), inlined["request"]))
        return _Plan("gemini", "gemini", lines, model=model, display_name=display)

    def create(self, plan: _Plan) -> Batch:
        """Accept a validated create: count it (per custom_id too), decide its injected failures, and keep it."""
        with self.state.lock:
            knobs, stats = self.state.knobs, self.state.stats
            items = []
            for position, (custom_id, body) in enumerate(plan.lines):
                stats.items_by_custom_id[custom_id] += 1
                fail = (
                    custom_id in knobs.batch_fail_ids or stats.items_by_custom_id[custom_id] <= knobs.batch_fail_first
                )
                items.append(Item(position, custom_id, body, fail))
            hold = None
            if knobs.batch_hold > 0:  # held until the next `release` (of held creates and batches alike)
                knobs.batch_hold -= 1
                hold = self.state.released
            ids = {"openai": "batch_" + uuid.uuid4().hex, "gemini": uuid.uuid4().hex[:24]}
            batch = Batch(
                id=ids.get(plan.provider) or ("msgbatch_01" + uuid.uuid4().hex[:24]),
                provider=plan.provider,
                kind=plan.kind,
                items=items,
                created_at=time.time(),
                seq=next(self.state.sequence),
                polls=max(0, knobs.batch_polls),
                expire=knobs.batch_expire,
                shuffle=knobs.batch_shuffle,
                endpoint=plan.endpoint,
                input_file_id=plan.input_file_id,
                metadata=plan.metadata,
                model=plan.model,
                display_name=plan.display_name,
                status={"openai": "validating", "gemini": "BATCH_STATE_PENDING"}.get(plan.provider, "in_progress"),
                hold=hold,
            )
            self.state.batches[batch.id] = batch
            stats.batches_created[plan.provider] += 1
            stats.batches_submitted += 1
            return batch

    # -- retrieve, cancel, list ------------------------------------------------------------------------------------
    def batch(self, provider: str, batch_id: str) -> Batch:
        """Return a batch of `provider`, or refuse with 404."""
        with self.state.lock:
            batch = self.state.batches.get(batch_id)
        if batch is None or batch.provider != provider:
            raise BatchError(404, f"No batch found with id '{batch_id}'.")
        return batch

    def retrieve(self, provider: str, batch_id: str, base_url: str) -> dict[str, Any]:
        """Advance the batch by one retrieve (see the module's docstring) and return it."""
        batch = self.batch(provider, batch_id)
        with batch.lock:
            self._advance(batch)
            with self.state.lock:
                self.state.stats.batch_retrieves += 1
            return self.as_json(batch, base_url)

    def cancel(self, provider: str, batch_id: str, base_url: str) -> dict[str, Any]:
        """Start cancelling the batch (the next retrieve ends it); an ended batch is answered as it is. Gemini has
        no cancelling state: its batch keeps its state until then, and the cancel answers `{}`."""
        batch = self.batch(provider, batch_id)
        with batch.lock:
            if not batch.ended and "cancelling" not in batch.times:
                batch.times["cancelling"] = time.time()
                if provider != "gemini":
                    batch.status = "cancelling" if provider == "openai" else "canceling"
            return {} if provider == "gemini" else self.as_json(batch, base_url)

    def delete(self, batch_id: str) -> dict[str, Any]:
        """Delete an ended Anthropic batch (400 while it runs)."""
        batch = self.batch("anthropic", batch_id)
        with batch.lock:
            if not batch.ended:
                raise BatchError(400, f"Batch {batch_id} cannot be deleted while it is processing; cancel it first.")
            with self.state.lock:
                self.state.batches.pop(batch_id, None)
        return {"id": batch_id, "type": "message_batch_deleted"}

    def list_batches(self, provider: str, query: dict[str, list[str]], base_url: str) -> dict[str, Any]:
        """Return a page of the provider's batches, newest first (`after`/`after_id`, `before_id`, `limit`; Gemini:
        `pageSize`, and `pageToken`, the opaque `nextPageToken` of the page before)."""
        if provider == "gemini":
            return self._list_gemini(query, base_url)
        openai = provider == "openai"
        limit = _limit(query, "limit", 20, 100 if openai else 1000)
        with self.state.lock:
            rows = sorted((b for b in self.state.batches.values() if b.provider == provider), key=lambda b: -b.seq)
        after = _arg(query, "after" if openai else "after_id")
        before = None if openai else _arg(query, "before_id")
        page, more = _page(rows, lambda b: b.id, after, before, limit)
        data = []
        for batch in page:
            with batch.lock:
                data.append(self.as_json(batch, base_url))
        return _list(data, more, openai)

    def _list_gemini(self, query: dict[str, list[str]], base_url: str) -> dict[str, Any]:
        limit = _limit(query, "pageSize", 50, 1000)
        with self.state.lock:
            rows = sorted((b for b in self.state.batches.values() if b.provider == "gemini"), key=lambda b: -b.seq)
        token = _arg(query, "pageToken")
        if token is not None and token not in {b.id for b in rows}:
            raise BatchError(400, "Invalid page token.")
        page, more = _page(rows, lambda b: b.id, token, None, limit)
        operations = []
        for batch in page:
            with batch.lock:
                operations.append(self.as_json(batch, base_url))
        # The token is the last batch of the page (opaque to the client, as Google's are).
        return {"operations": operations, **({"nextPageToken": page[-1].id} if more and page else {})}

    def results(self, batch_id: str) -> bytes:
        """Return an ended Anthropic batch's results as JSONL (400 before it ends)."""
        batch = self.batch("anthropic", batch_id)
        with batch.lock:
            if not batch.ended:
                raise BatchError(400, f"Batch {batch_id} has not ended: its results are not available yet.")
            return _jsonl(self._anthropic_line(batch.items[p]) for p in _output_order(batch))

    # -- how a batch moves -----------------------------------------------------------------------------------------
    def _advance(self, batch: Batch) -> None:
        if batch.ended:
            return
        gemini = batch.provider == "gemini"
        if batch.hold is not None and "cancelling" not in batch.times:
            with self.state.lock:
                held = self.state.released == batch.hold
            if held:  # running, and not moving: a retrieve while held does not count towards `batch_polls`
                self._reach(batch, "BATCH_STATE_RUNNING" if gemini else "in_progress")
                return
            batch.hold = None
        batch.retrieves += 1
        if "cancelling" in batch.times:
            self._end(batch, "canceled")
            return
        # An expiring batch runs its even positions (Gemini's none: an expired Gemini batch returns no response).
        order = [i for i in batch.items if not batch.expire or (i.position % 2 == 0 and not gemini)]
        if batch.retrieves <= batch.polls:
            self._reach(batch, "BATCH_STATE_RUNNING" if gemini else "in_progress")
            self._run_all(batch, order[: len(order) * batch.retrieves // (batch.polls + 1)])
        elif batch.expire:
            self._end(batch, "expired")
        elif batch.provider == "openai" and batch.status != "finalizing":
            self._run_all(batch, order)
            self._reach(batch, "finalizing")
        else:
            self._end(batch, "completed")

    def _reach(self, batch: Batch, status: str) -> None:
        batch.status = status
        batch.times.setdefault(status, time.time())

    def _end(self, batch: Batch, how: str) -> None:
        """End the batch: `completed` runs what is left; `expired` runs the even positions (Gemini's: none);
        `canceled` runs none."""
        gemini = batch.provider == "gemini"
        if how == "completed" or (how == "expired" and not gemini):
            self._run_all(batch, [i for i in batch.items if how == "completed" or i.position % 2 == 0])
        for item in batch.items:
            if item.outcome is None:
                item.outcome = "expired" if how == "expired" else "canceled"
        if gemini:
            states = {"completed": "SUCCEEDED", "expired": "EXPIRED", "canceled": "CANCELLED"}
            self._reach(batch, f"BATCH_STATE_{states[how]}")
            batch.times.setdefault("ended", time.time())
            return
        openai = batch.provider == "openai"
        self._reach(batch, {"completed": "completed", "expired": "expired", "canceled": "cancelled"}[how])
        if not openai:
            batch.status = "ended"
            batch.times.setdefault("ended", time.time())
            return
        order = [batch.items[p] for p in _output_order(batch)]
        done = [i for i in order if i.outcome == "succeeded"]
        failed = [i for i in order if i.outcome != "succeeded"]
        with self.state.lock:
            if done:
                batch.output_file_id = self._store(
                    f"{batch.id}_output.jsonl", "batch_output", _jsonl(self._openai_line(i) for i in done)
                ).id
            if failed:
                batch.error_file_id = self._store(
                    f"{batch.id}_error.jsonl", "batch_output", _jsonl(self._openai_line(i) for i in failed)
                ).id

    def _run_all(self, batch: Batch, items: Sequence[Item]) -> None:
        for item in items:
            if item.outcome is None:
                self._run(batch, item)

    def _run(self, batch: Batch, item: Item) -> None:
        """Answer one request as its synchronous endpoint would (or fail it, when injected or invalid)."""
        errors: dict[str, Callable[[int, str], dict[str, Any]]] = {
            "openai": wire.openai_error,
            "gemini": wire.gemini_error,
        }
        error = errors.get(batch.provider, wire.anthropic_error)
        # A Gemini request names no model: the batch's path does, and the answer is the synchronous one's.
        body = {**item.body, "model": batch.model} if batch.provider == "gemini" else item.body
        try:
            _, prompt = wire.check_request(batch.kind, body)
            if item.body.get("stream") or item.body.get("background"):
                raise wire.BadRequest("stream and background are not supported in a batch request")
        except wire.BadRequest as exc:
            item.outcome, item.status_code, item.response = "errored", 400, error(400, str(exc))
            return
        if item.fail:
            message = "The server had an error while processing your request (injected)."
            item.outcome, item.status_code, item.response = "errored", 500, error(500, message)
            return
        answer = self.generator(body)
        call = new_call(batch.kind, str(body["model"]), body, prompt, answer, time.monotonic(), _no_wait)
        if batch.kind == "responses":
            response = wire.response_object(call, "incomplete" if call.truncated else "completed")
        elif batch.kind == "chat":
            response = wire.chat_completion(call)
        elif batch.kind == "gemini":
            response = wire.gemini_response(call)
        else:
            response = wire.anthropic_message(call)
        item.outcome, item.status_code, item.response = "succeeded", 200, response
        with self.state.lock:
            self.state.stats.batch_billed_input_tokens += call.input_tokens
            self.state.stats.batch_billed_output_tokens += call.output_tokens

    def _store(self, filename: str, purpose: str, content: bytes) -> StoredFile:
        """Keep a file (the caller holds the state's lock)."""
        stored = StoredFile(
            id="file-" + uuid.uuid4().hex[:22],
            filename=filename,
            purpose=purpose,
            content=content,
            created_at=int(time.time()),
            seq=next(self.state.sequence),
        )
        self.state.files[stored.id] = stored
        return stored

    # -- wire shapes -----------------------------------------------------------------------------------------------
    def as_json(self, batch: Batch, base_url: str) -> dict[str, Any]:
        """Return the provider's batch object (OpenAI Batch, Anthropic MessageBatch or Gemini's batch Operation) as
        it is now."""
        outcomes = [i.outcome for i in batch.items]
        if batch.provider == "gemini":
            return self._gemini_operation(batch, outcomes)
        if batch.provider == "anthropic":
            at = {name: _rfc3339(t) for name, t in batch.times.items()}
            return {
                "id": batch.id,
                "type": "message_batch",
                "processing_status": batch.status,
                "request_counts": {
                    "processing": outcomes.count(None),
                    "succeeded": outcomes.count("succeeded"),
                    "errored": outcomes.count("errored"),
                    "canceled": outcomes.count("canceled"),
                    "expired": outcomes.count("expired"),
                },
                "ended_at": at.get("ended"),
                "created_at": _rfc3339(batch.created_at),
                "expires_at": _rfc3339(batch.created_at + DAY_S),
                "archived_at": None,
                "cancel_initiated_at": at.get("cancelling"),
                "results_url": f"{base_url}/v1/messages/batches/{batch.id}/results" if batch.ended else None,
            }
        seconds = {name: int(t) for name, t in batch.times.items()}
        validating = batch.status == "validating" or (batch.status == "cancelling" and "in_progress" not in seconds)
        succeeded = outcomes.count("succeeded")
        failed = len(outcomes) - succeeded - outcomes.count(None)
        return {
            "id": batch.id,
            "object": "batch",
            "endpoint": batch.endpoint,
            "errors": None,
            "input_file_id": batch.input_file_id,
            "completion_window": "24h",
            "status": batch.status,
            "output_file_id": batch.output_file_id,
            "error_file_id": batch.error_file_id,
            "created_at": int(batch.created_at),
            "in_progress_at": seconds.get("in_progress"),
            "expires_at": int(batch.created_at) + DAY_S,
            "finalizing_at": seconds.get("finalizing"),
            "completed_at": seconds.get("completed"),
            "failed_at": None,
            "expired_at": seconds.get("expired"),
            "cancelling_at": seconds.get("cancelling"),
            "cancelled_at": seconds.get("cancelled"),
            "request_counts": {
                "total": 0 if validating else len(outcomes),
                "completed": succeeded,
                "failed": failed,
            },
            "metadata": batch.metadata,
        }

    def _gemini_operation(self, batch: Batch, outcomes: list[str | None]) -> dict[str, Any]:
        """The batch as a long-running Operation: its GenerateContentBatch as `metadata`; once done, `response`
        (inline responses in input order, no metadata echoed) or, cancelled or expired, `error`."""
        name = f"batches/{batch.id}"
        succeeded = outcomes.count("succeeded")
        failed = outcomes.count("errored")
        at = {state: _rfc3339(t) for state, t in batch.times.items()}
        metadata: dict[str, Any] = {
            "@type": GEMINI_TYPE + "GenerateContentBatch",
            "model": f"models/{batch.model}",
            "name": name,
            "displayName": batch.display_name,
            "createTime": _rfc3339(batch.created_at),
            "updateTime": _rfc3339(max([batch.created_at, *batch.times.values()])),
            "batchStats": {
                "requestCount": str(len(outcomes)),
                "successfulRequestCount": str(succeeded),
                "failedRequestCount": str(failed),
                "pendingRequestCount": str(outcomes.count(None)),
            },
            "state": batch.status,
        }
        if "ended" in at:
            metadata["endTime"] = at["ended"]
        operation: dict[str, Any] = {"name": name, "metadata": metadata, "done": batch.ended}
        if batch.status == "BATCH_STATE_SUCCEEDED":
            entries = [self._gemini_entry(item) for item in batch.items]  # input order: the order is the mapping
            operation["response"] = {
                "@type": GEMINI_TYPE + "GenerateContentBatchOutput",
                "inlinedResponses": {"inlinedResponses": entries},
            }
        elif batch.status == "BATCH_STATE_CANCELLED":
            operation["error"] = {"code": 1, "message": "The batch was cancelled."}
        elif batch.status == "BATCH_STATE_EXPIRED":
            operation["error"] = {"code": 4, "message": "The batch expired before its requests ran."}
        return operation

    @staticmethod
    def _gemini_entry(item: Item) -> dict[str, Any]:
        if item.outcome == "succeeded":
            return {"response": item.response}
        return {"error": (item.response or {}).get("error") or {"code": 13, "message": str(item.outcome)}}

    def _openai_line(self, item: Item) -> dict[str, Any]:
        line: dict[str, Any] = {"id": item.line_id, "custom_id": item.custom_id, "response": None, "error": None}
        if item.outcome in _NOT_RUN:
            code, message = _NOT_RUN[str(item.outcome)]
            line["error"] = {"code": code, "message": message}
        else:
            line["response"] = {"status_code": item.status_code, "request_id": item.request_id, "body": item.response}
        return line

    def _anthropic_line(self, item: Item) -> dict[str, Any]:
        result: dict[str, Any] = {"type": item.outcome}
        if item.outcome == "succeeded":
            result["message"] = item.response
        elif item.outcome == "errored":
            result["error"] = item.response
        return {"custom_id": item.custom_id, "result": result}


def _no_wait(answer: str) -> float:
    return 0.0


def _unique(custom_ids: list[str]) -> None:
    seen: set[str] = set()
    for custom_id in custom_ids:
        if custom_id in seen:
            raise BatchError(400, f"Duplicate custom_id {custom_id!r}: each request of a batch needs its own.")
        seen.add(custom_id)


def _output_order(batch: Batch) -> list[int]:
    """The positions in the order the results come out: input order, or shuffled (never as input) with the knob."""
    order = list(range(len(batch.items)))
    if batch.shuffle and len(order) > 1:
        random.Random(batch.id).shuffle(order)
        if order == sorted(order):
            order.reverse()
    return order


def _jsonl(lines: Iterable[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _rfc3339(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _arg(query: dict[str, list[str]], name: str) -> str | None:
    values = query.get(name)
    return values[0] if values else None


def _limit(query: dict[str, list[str]], name: str, default: int, most: int) -> int:
    text = _arg(query, name)
    if text is None:
        return default
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise BatchError(400, f"Invalid '{name}': expected an integer from 1 to {most}.")
    return int(text)


def _page(
    rows: list[_T], key: Callable[[_T], str], after: str | None, before: str | None, limit: int
) -> tuple[list[_T], bool]:
    """One page of `rows` (already in list order) after or before a cursor id; an unknown cursor gives no rows."""
    ids = [key(r) for r in rows]
    if before is not None:
        if before not in ids:
            return [], False
        upto = ids.index(before)
        start = max(0, upto - limit)
        return rows[start:upto], start > 0
    start = 0
    if after is not None:
        if after not in ids:
            return [], False
        start = ids.index(after) + 1
    return rows[start : start + limit], start + limit < len(rows)


def _list(data: list[dict[str, Any]], more: bool, openai: bool) -> dict[str, Any]:
    page = {
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }
    return {"object": "list", **page} if openai else page
