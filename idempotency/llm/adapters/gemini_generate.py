"""Gemini's generateContent (`POST /v1beta/models/{model}:generateContent`): synchronous only.

The request is Gemini's GenerateContentRequest (`contents`, `systemInstruction`, `generationConfig`
{`maxOutputTokens`, ...}, `tools`, `safetySettings`...) plus the `model` every `self.llm()` call names: the model
goes in the path, the rest is the body. The answer is a GenerateContentResponse (`candidates[0].content.parts[]`,
`finishReason`, `usageMetadata`, `responseId`).

**The call carries no tag**: generateContent has no metadata field (and no idempotency key), so the intent id
cannot reach the provider, and a call lost in the create window cannot be found again: it is re-sent labelled
`sync_unknown` (or dead-lettered with `llm_at_most_once=True`), as an Anthropic Messages call is. Gemini's batch
mode (`oncelery.llm.adapters.batch.GeminiBatches`) does carry a tag: the batch's `displayName`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from oncelery.llm.adapters.base import CallState, Capabilities, Observed, Usage
from oncelery.llm.adapters.http import DEFAULT_TIMEOUT_S, HTTPAdapter, Transport, with_extra
from oncelery.llm.errors import ProviderRejected

BASE_URL = "https://generativelanguage.googleapis.com/v1beta"
API_KEY_HEADER = "x-goog-api-key"


def api_key_of(api_key: str | None) -> str:
    """The key given, else $GEMINI_API_KEY, else $GOOGLE_API_KEY (the variables Google's SDK reads)."""
    if api_key is not None:
        return api_key
    return os.environ.get("GEMINI_API_KEY") or os.environ.get("GOOGLE_API_KEY") or ""


def model_name(model: str) -> str:
    """A model's resource name, `models/<id>`, whether it was given with its prefix or without."""
    return model if model.startswith("models/") else f"models/{model}"


def request_body(request: Mapping[str, Any]) -> dict[str, Any]:
    """The GenerateContentRequest body: the request without its `model` (the path names it)."""
    return {name: value for name, value in request.items() if name != "model"}


def gemini_usage(response: Mapping[str, Any]) -> Usage:
    """Billable tokens of a GenerateContentResponse: the prompt (cached and tool-use prompt tokens included) and
    the candidates plus the thinking tokens (Gemini bills thoughts as output)."""
    meta = response.get("usageMetadata") or {}
    prompt = int(meta.get("promptTokenCount") or 0) + int(meta.get("toolUsePromptTokenCount") or 0)
    output = int(meta.get("candidatesTokenCount") or 0) + int(meta.get("thoughtsTokenCount") or 0)
    return Usage(prompt, output)


class GeminiAuthAdapter(HTTPAdapter):
    """An adapter of Gemini's REST API: its base URL, and the key in `x-goog-api-key` ($GEMINI_API_KEY if none);
    `headers=` adds headers to every request (never logged), `proxy=` sends them through an HTTP(S) proxy."""

    def __init__(
        self,
        base_url: str = BASE_URL,
        api_key: str | None = None,
        *,
        provider: str = "gemini",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        headers: Mapping[str, str] | None = None,
        proxy: str | None = None,
    ) -> None:
        self.provider = provider
        own = {API_KEY_HEADER: api_key_of(api_key)}
        self.http = Transport(provider, base_url, with_extra(own, headers), timeout_s, proxy=proxy)


class GeminiGenerateContent(GeminiAuthAdapter):
    """`POST {base}/models/{model}:generateContent` over httpx, never streamed, carrying no tag (see the module)."""

    endpoint = "generateContent"

    def capabilities(self, request: Mapping[str, Any]) -> Capabilities:
        """Synchronous: no background, no resume, no lookup (no tag to look for), nothing retrievable."""
        return Capabilities(background=False, stream_resume=False, lookup=None, retention_s=None)

    def create(self, request: Mapping[str, Any], intent_id: str, *, background: bool) -> Observed:
        """Make the call and return the GenerateContentResponse (`background` is ignored: this protocol has none;
        `intent_id` cannot be sent: generateContent has no field for it). A response with no candidate (a blocked
        prompt) ends the call failed."""
        model = str(request.get("model") or "")
        if not model:
            raise ProviderRejected.of(self.provider, 400, "a generateContent call needs model=")
        if request.get("stream"):
            # Streaming is another method (streamGenerateContent): a durable call reads one whole answer.
            raise ProviderRejected.of(self.provider, 400, "stream=true is not supported for a durable Gemini call")
        path = f"/{model_name(model)}:generateContent"
        body = self.http.json("POST", path, request_body(request), model)
        state = CallState.DONE if body.get("candidates") else CallState.FAILED
        return Observed(state, str(body.get("responseId") or "") or None, body)

    def poll(self, reference: str) -> Observed:
        """Never called: a synchronous call has nothing to poll."""
        raise ProviderRejected.of(self.provider, 400, "generateContent answers cannot be retrieved by reference")

    def cancel(self, reference: str) -> Observed:
        """Never called: a synchronous call cannot be cancelled."""
        raise ProviderRejected.of(self.provider, 400, "generateContent calls cannot be cancelled")

    def usage(self, response: Mapping[str, Any]) -> Usage:
        """Return `usageMetadata`'s billable input and output tokens (see `gemini_usage`)."""
        return gemini_usage(response)
