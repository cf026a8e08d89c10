"""A batch create of each provider, validated into a `Plan` before anything is counted (the shapes are in `batches`).

A refused create raises `BatchError` with the status and message the provider would send. Each request's own
params are checked later, as it runs (`FakeBatches`), except OpenAI's input lines, refused here (a simplification:
OpenAI accepts the batch and ends it `failed`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from oncelery.fake_provider import protocol as wire
from oncelery.fake_provider.batch_records import BatchError, Plan
from oncelery.fake_provider.state import ProviderState

#: The endpoints a batch of the fake may target, and the synchronous kind each one is.
OPENAI_ENDPOINTS = {"/v1/responses": "responses", "/v1/chat/completions": "chat"}
BATCH_FIELDS = frozenset({"input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after"})
GEMINI_BATCH_FIELDS = frozenset(
    {"model", "name", "displayName", "display_name", "inputConfig", "input_config", "priority"}
)
MAX_ANTHROPIC_REQUESTS = 100_000
MAX_GEMINI_REQUESTS = 100_000
_CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_LINE_FIELDS = frozenset({"custom_id", "method", "url", "body"})


def check_openai(state: ProviderState, body: dict[str, Any]) -> Plan:
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
    with state.lock:
        stored = state.files.get(file_id)
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
    return Plan("openai", OPENAI_ENDPOINTS[endpoint], lines, endpoint, file_id, metadata)


def check_anthropic(body: dict[str, Any]) -> Plan:
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
    return Plan("anthropic", "messages", lines)


def check_gemini(model: str, body: dict[str, Any]) -> Plan:
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
    return Plan("gemini", "gemini", lines, model=model, display_name=display)


def _unique(custom_ids: list[str]) -> None:
    seen: set[str] = set()
    for custom_id in custom_ids:
        if custom_id in seen:
            raise BatchError(400, f"Duplicate custom_id {custom_id!r}: each request of a batch needs its own.")
        seen.add(custom_id)
