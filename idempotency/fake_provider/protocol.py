"""The wire shapes: request validation and the JSON (and server-sent events) each provider answers with.

Shapes follow the providers' API references: OpenAI's Response object and its streaming events (each with a
`sequence_number`), the Chat Completion object, Anthropic's Message object, Gemini's GenerateContentResponse (REST
v1beta), and each one's error envelope.
"""

from __future__ import annotations

from typing import Any

from oncelery.fake_provider.state import ANTHROPIC_INTENT_PREFIX, INTENT_KEY, Call
from oncelery.token_count import request_text

# Request fields each create accepts; anything else is refused, as the providers refuse unknown arguments.
RESPONSES_FIELDS = frozenset(
    {
        "model", "input", "instructions", "background", "stream", "store", "metadata", "max_output_tokens",
        "temperature", "top_p", "tools", "tool_choice", "text", "reasoning", "previous_response_id", "user",
        "parallel_tool_calls", "truncation", "include", "service_tier", "prompt_cache_key", "safety_identifier",
        "stream_options",
    }
)  # fmt: skip
CHAT_FIELDS = frozenset(
    {
        "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "n",
        "metadata", "store", "tools", "tool_choice", "response_format", "user", "stream", "presence_penalty",
        "frequency_penalty", "logprobs", "top_logprobs", "service_tier", "parallel_tool_calls",
    }
)  # fmt: skip
MESSAGES_FIELDS = frozenset(
    {
        "model", "messages", "max_tokens", "system", "metadata", "temperature", "top_p", "top_k",
        "stop_sequences", "stream", "tools", "tool_choice", "thinking", "service_tier",
    }
)  # fmt: skip
# Gemini's GenerateContentRequest (Google's JSON takes each field's snake_case name as well); `model` is in the path.
GEMINI_FIELDS = frozenset(
    {
        "model", "contents", "tools", "toolConfig", "tool_config", "safetySettings", "safety_settings",
        "systemInstruction", "system_instruction", "generationConfig", "generation_config", "cachedContent",
        "cached_content",
    }
)  # fmt: skip
#: google.rpc.Code names of the HTTP statuses the fake answers Gemini calls with.
GOOGLE_STATUS = {
    400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
    429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED",
}  # fmt: skip
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's metadata limits


class BadRequest(Exception):
    """Raised for a request the provider would refuse with 400 (its message is the provider's kind of text)."""


def check_fields(body: dict[str, Any], allowed: frozenset[str], required: tuple[str, ...]) -> None:
    """Refuse a missing required field or an argument the endpoint does not take."""
    for name in required:
        if body.get(name) in (None, "", []):
            raise BadRequest(f"Missing required parameter: '{name}'.")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"Unrecognized request argument supplied: {unknown[0]}")


def check_request(kind: str, body: dict[str, Any]) -> tuple[str | None, str]:
    """Validate a create of `kind` (responses, chat, messages, gemini); return its metadata's intent and its billed
    prompt.

    Chat's intent comes from metadata only here: the server also reads the `x-client-request-id` header. A Gemini
    request carries no intent: generateContent has no metadata.
    """
    if kind == "gemini":
        return None, _check_gemini(body)
    if kind == "responses":
        check_fields(body, RESPONSES_FIELDS, ("model", "input"))
        return openai_intent(body), "\n".join(
            filter(None, [request_text(body.get("instructions")), request_text(body["input"])])
        )
    if kind == "chat":
        check_fields(body, CHAT_FIELDS, ("model", "messages"))
        if body.get("stream"):
            raise BadRequest("stream=true is not served by the fake's chat completions")
        return openai_intent(body), request_text(body["messages"])
    check_fields(body, MESSAGES_FIELDS, ("model", "messages", "max_tokens"))
    if body.get("stream"):
        raise BadRequest("stream=true is not served by the fake's messages endpoint")
    return anthropic_intent(body), "\n".join(
        filter(None, [request_text(body.get("system")), request_text(body["messages"])])
    )


def _check_gemini(body: dict[str, Any]) -> str:
    """Validate a GenerateContentRequest as Gemini does (unknown fields refused, `contents` required) and return
    its billed prompt: the system instruction's text, then the contents' text."""
    unknown = sorted(set(body) - GEMINI_FIELDS)
    if unknown:
        raise BadRequest(f'Invalid JSON payload received. Unknown name "{unknown[0]}": Cannot find field.')
    contents = body.get("contents")
    if not isinstance(contents, list) or not contents:
        raise BadRequest("* GenerateContentRequest.contents: contents is not specified")
    config = body.get("generationConfig", body.get("generation_config")) or {}
    limit = config.get("maxOutputTokens", config.get("max_output_tokens")) if isinstance(config, dict) else None
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise BadRequest("* GenerationConfig.max_output_tokens: must be a positive integer")
    system = body.get("systemInstruction", body.get("system_instruction"))
    return "\n".join(filter(None, [request_text(system), request_text(contents)]))


def openai_intent(body: dict[str, Any]) -> str | None:
    """Check OpenAI metadata (16 string pairs, bounded lengths) and return the intent id it carries, if any."""
    metadata = body.get("metadata")
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > METADATA_PAIRS:
        raise BadRequest(f"Invalid 'metadata': expected an object of at most {METADATA_PAIRS} pairs.")
    for key, value in metadata.items():
        if not isinstance(value, str) or len(key) > METADATA_KEY_CHARS or len(value) > METADATA_VALUE_CHARS:
            raise BadRequest(f"Invalid 'metadata.{key}': keys up to 64 characters, string values up to 512.")
    intent = metadata.get(INTENT_KEY)
    return str(intent) if intent else None


def anthropic_intent(body: dict[str, Any]) -> str | None:
    """Check Anthropic metadata (only `user_id` is allowed) and return the intent id it carries, if any."""
    metadata = body.get("metadata")
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or set(metadata) - {"user_id"}:
        extra = sorted(set(metadata) - {"user_id"}) if isinstance(metadata, dict) else ["metadata"]
        raise BadRequest(f"metadata.{extra[0]}: Extra inputs are not permitted")
    user_id = str(metadata.get("user_id") or "")
    return user_id.removeprefix(ANTHROPIC_INTENT_PREFIX) if user_id.startswith(ANTHROPIC_INTENT_PREFIX) else None


def openai_error(status: int, message: str, kind: str | None = None) -> dict[str, Any]:
    """Return OpenAI's error envelope."""
    kinds = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error"}
    default = "requests" if status == 429 else "server_error"
    return {"error": {"message": message, "type": kind or kinds.get(status, default), "param": None, "code": None}}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Return Anthropic's error envelope."""
    kinds = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        429: "rate_limit_error",
        529: "overloaded_error",
    }
    return {"type": "error", "error": {"type": kinds.get(status, "api_error"), "message": message}}


def gemini_error(status: int, message: str, retry_after_s: float | None = None) -> dict[str, Any]:
    """Return Google's error envelope (a google.rpc.Status); a 429 carries its wait as a RetryInfo detail, which
    Gemini sends instead of a `retry-after` header."""
    error: dict[str, Any] = {"code": status, "message": message, "status": GOOGLE_STATUS.get(status, "UNKNOWN")}
    if status == 429 and retry_after_s is not None:
        delay = f"{max(0.0, retry_after_s):.3f}s"
        error["details"] = [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": delay}]
    return {"error": error}


def gemini_response(call: Call) -> dict[str, Any]:
    """Return Gemini's GenerateContentResponse for a finished `call` (one candidate, its usage, its id)."""
    return {
        "candidates": [
            {
                "content": {"parts": [{"text": call.text}], "role": "model"},
                "finishReason": "MAX_TOKENS" if call.truncated else "STOP",
                "index": 0,
            }
        ],
        "usageMetadata": {
            "promptTokenCount": call.input_tokens,
            "candidatesTokenCount": call.output_tokens,
            "totalTokenCount": call.input_tokens + call.output_tokens,
        },
        "modelVersion": call.model,
        "responseId": call.id,
    }


def response_object(call: Call, status: str) -> dict[str, Any]:
    """Return OpenAI's Response object for `call` as it is at `status` (output and usage once it has ended)."""
    done = status in ("completed", "incomplete") or (status == "cancelled" and call.finished_by_cancel)
    req = call.request
    return {
        "id": call.id,
        "object": "response",
        "created_at": call.created_at,
        "status": status,
        "background": call.background,
        "model": call.model,
        "instructions": req.get("instructions"),
        "max_output_tokens": req.get("max_output_tokens"),
        "metadata": req.get("metadata") or {},
        "store": call.store,
        "temperature": req.get("temperature", 1.0),
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "output": [_message_item(call)] if done else [],
        "usage": _usage(call) if done else None,
    }


def _message_item(call: Call) -> dict[str, Any]:
    return {
        "type": "message",
        "id": "msg_" + call.id.removeprefix("resp_"),
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": call.text, "annotations": []}],
    }


def _usage(call: Call) -> dict[str, Any]:
    return {
        "input_tokens": call.input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": call.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": call.input_tokens + call.output_tokens,
    }


_EMPTY_PART = {"type": "output_text", "text": ""}


def stream_events(call: Call) -> list[tuple[float, dict[str, Any]]]:
    """Return every streaming event of `call` with the monotonic time it becomes available, numbered from 0.

    The text arrives in word deltas spread over the generation time, so a reader that reconnects with
    `starting_after=N` gets exactly the events after N, whenever it comes back.
    """
    item = _message_item(call)
    start, span = call.created, max(0.0, call.ends - call.created)
    words = call.text.split(" ")
    deltas = [w if i == 0 else " " + w for i, w in enumerate(words)]
    ids = {"item_id": item["id"], "output_index": 0}
    events: list[tuple[float, dict[str, Any]]] = [
        (start, {"type": "response.created", "response": response_object(call, "queued")}),
        (start, {"type": "response.in_progress", "response": response_object(call, "in_progress")}),
        (start, {"type": "response.output_item.added", "output_index": 0, "item": {**item, "content": []}}),
        (start, {"type": "response.content_part.added", **ids, "content_index": 0, "part": _EMPTY_PART}),
    ]
    for i, delta in enumerate(deltas):
        at = start + span * (i + 1) / len(deltas)
        events.append((at, {"type": "response.output_text.delta", **ids, "content_index": 0, "delta": delta}))
    end = call.ends
    final = "incomplete" if call.truncated else "completed"
    events += [
        (end, {"type": "response.output_text.done", **ids, "content_index": 0, "text": call.text}),
        (end, {"type": "response.content_part.done", **ids, "content_index": 0, "part": item["content"][0]}),
        (end, {"type": "response.output_item.done", "output_index": 0, "item": item}),
        (end, {"type": f"response.{final}", "response": response_object(call, final)}),
    ]
    for n, (_, event) in enumerate(events):
        event["sequence_number"] = n
    return events


def chat_completion(call: Call) -> dict[str, Any]:
    """Return OpenAI's Chat Completion object for a finished `call`."""
    return {
        "id": call.id,
        "object": "chat.completion",
        "created": call.created_at,
        "model": call.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": call.text, "refusal": None},
                "finish_reason": "length" if call.truncated else "stop",
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": call.input_tokens,
            "completion_tokens": call.output_tokens,
            "total_tokens": call.input_tokens + call.output_tokens,
        },
    }


def anthropic_message(call: Call) -> dict[str, Any]:
    """Return Anthropic's Message object for a finished `call`."""
    return {
        "id": call.id,
        "type": "message",
        "role": "assistant",
        "model": call.model,
        "content": [{"type": "text", "text": call.text}],
        "stop_reason": "max_tokens" if call.truncated else "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": call.input_tokens,
            "output_tokens": call.output_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }
