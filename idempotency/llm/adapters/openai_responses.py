"""OpenAI's Responses API: background creates, polling, stream resume, cancel; also any server of the same shape
(vLLM, LiteLLM's proxy).

Retention (developers.openai.com/docs/guides/background, read 2026-12-01): a background response is kept for
polling "roughly 10 minutes" when `store` is false or omitted, and longer only with `store=true` explicitly;
stored responses are kept 30 days. There is no endpoint that lists responses, so a call lost in the create window
cannot be found again (`lookup` None).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import closing
from typing import Any

from oncelery.llm.adapters.base import CallState, Capabilities, Observed, Usage
from oncelery.llm.adapters.http import OpenAIAuthAdapter
from oncelery.llm.errors import ProviderUnavailable

#: The metadata key that carries the intent id (opaque: never a key or a tenant).
INTENT_METADATA_KEY = "oncelery_intent"
BACKGROUND_RETENTION_S = 600.0  # "roughly 10 minutes" without store=true
STORED_RETENTION_S = 30 * 86400.0
_STATES = {
    "queued": CallState.PENDING,
    "in_progress": CallState.PENDING,
    "completed": CallState.DONE,
    "incomplete": CallState.DONE,
    "failed": CallState.FAILED,
    "cancelled": CallState.CANCELLED,
}


def observed(response: Mapping[str, Any], poll_after_ms: str | None = None, cursor: int | None = None) -> Observed:
    """Read a Response object (and the poll-after hint) into an `Observed`."""
    status = str(response.get("status"))
    if status not in _STATES:
        raise ProviderUnavailable.of("openai", f"unknown response status {status!r}", maybe_sent=True)
    wait = float(poll_after_ms) / 1000 if poll_after_ms and poll_after_ms.isdigit() else None
    return Observed(_STATES[status], str(response.get("id") or "") or None, response, wait, cursor)


class OpenAIResponses(OpenAIAuthAdapter):
    """`POST /v1/responses` and friends over httpx: background by default where the step allows it."""

    endpoint = "responses"

    def capabilities(self, request: Mapping[str, Any]) -> Capabilities:
        """Background and stream resume; no lookup; retention by `store` (see the module's docstring)."""
        keep = STORED_RETENTION_S if request.get("store") is True else BACKGROUND_RETENTION_S
        return Capabilities(background=True, stream_resume=True, lookup=None, retention_s=keep)

    def create(self, request: Mapping[str, Any], intent_id: str, *, background: bool) -> Observed:
        """Create the response tagged with `intent_id`; with `stream`, return at its first event (its id)."""
        metadata = {**(request.get("metadata") or {}), INTENT_METADATA_KEY: intent_id}
        body = {**request, "background": background, "metadata": metadata}
        model = str(request.get("model", ""))
        if body.get("stream") and background:
            # The first event carries the id; closing the connection leaves a background response running,
            # and `follow` picks the stream up after the last sequence number seen.
            with closing(self.http.events("/responses", body, model)) as events:
                for event in events:
                    if event.get("type") == "response.created":
                        return observed(event["response"], cursor=int(event["sequence_number"]))
            raise ProviderUnavailable.of(self.provider, "the stream ended before response.created", True)
        body.pop("stream", None)
        answer = self.http.send("POST", "/responses", body, model)
        return observed(answer.json(), answer.headers.get("openai-poll-after-ms"))

    def poll(self, reference: str) -> Observed:
        """Retrieve the response; `ResponseGone` once OpenAI no longer keeps it."""
        answer = self.http.send("GET", f"/responses/{reference}")
        return observed(answer.json(), answer.headers.get("openai-poll-after-ms"))

    def follow(self, reference: str, after: int) -> Iterator[Observed]:
        """Re-attach to a background stream after sequence number `after`; yield a look at each event's end."""
        with closing(self.http.events(f"/responses/{reference}?stream=true&starting_after={after}")) as events:
            for event in events:
                if "response" in event:
                    yield observed(event["response"], cursor=int(event["sequence_number"]))

    def cancel(self, reference: str) -> Observed:
        """Cancel the background response (idempotent, best effort: it may still complete)."""
        return observed(self.http.json("POST", f"/responses/{reference}/cancel", {}))

    def usage(self, response: Mapping[str, Any]) -> Usage:
        """Return `usage.input_tokens` and `usage.output_tokens`."""
        usage = response.get("usage") or {}
        return Usage(int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0))
