"""OpenAI-compatible chat completions (OpenAI, vLLM, LiteLLM, Ollama...): synchronous only.

A chat completion cannot be re-attached: if the worker dies during the call, the provider may have made (and
billed) it, and nothing can be looked up. The intent id travels in the `X-Client-Request-Id` header, not in
`metadata` (OpenAI takes metadata on chat completions only with `store=true`, and compatible servers may refuse it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oncelery.llm.adapters.base import CallState, Capabilities, Observed, Usage
from oncelery.llm.adapters.http import OpenAIAuthAdapter
from oncelery.llm.errors import ProviderRejected

INTENT_HEADER = "X-Client-Request-Id"


class OpenAIChat(OpenAIAuthAdapter):
    """`POST /v1/chat/completions` over httpx, never streamed, never in the background."""

    endpoint = "chat.completions"

    def capabilities(self, request: Mapping[str, Any]) -> Capabilities:
        """Synchronous: no background, no resume, no lookup, nothing retrievable."""
        return Capabilities(background=False, stream_resume=False, lookup=None, retention_s=None)

    def create(self, request: Mapping[str, Any], intent_id: str, *, background: bool) -> Observed:
        """Make the call and return its answer (`background` is ignored: this protocol has none)."""
        if request.get("stream"):
            raise ProviderRejected.of(self.provider, 400, "stream=true is not supported for a durable chat call")
        response = self.http.client.post("/chat/completions", json=dict(request), headers={INTENT_HEADER: intent_id})
        self.http.check(response, "POST", "/chat/completions", str(request.get("model", "")))
        body = response.json()
        return Observed(CallState.DONE, str(body.get("id") or "") or None, body)

    def poll(self, reference: str) -> Observed:
        """Never called: a synchronous call has nothing to poll."""
        raise ProviderRejected.of(self.provider, 400, "chat completions cannot be retrieved by reference")

    def cancel(self, reference: str) -> Observed:
        """Never called: a synchronous call cannot be cancelled."""
        raise ProviderRejected.of(self.provider, 400, "chat completions cannot be cancelled")

    def usage(self, response: Mapping[str, Any]) -> Usage:
        """Return `usage.prompt_tokens` and `usage.completion_tokens`."""
        usage = response.get("usage") or {}
        return Usage(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))
