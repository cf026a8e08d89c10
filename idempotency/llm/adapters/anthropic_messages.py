"""Anthropic's Messages API: synchronous only (no background mode for a single call; Message Batches are another
step kind).

Anthropic's `metadata` takes only `user_id`; the intent id travels there as `oncelery-intent:<id>` unless the
request sets its own `user_id` (then the call carries no intent tag, and the provider side cannot count it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from oncelery.llm.adapters.base import CallState, Capabilities, Observed, Usage
from oncelery.llm.adapters.http import DEFAULT_TIMEOUT_S, HTTPAdapter, Transport, with_extra
from oncelery.llm.errors import ProviderRejected

INTENT_USER_PREFIX = "oncelery-intent:"
API_VERSION = "2023-06-01"


def anthropic_transport(
    provider: str,
    base_url: str,
    api_key: str | None,
    timeout_s: float,
    headers: Mapping[str, str] | None,
    proxy: str | None,
) -> Transport:
    """The wire of an Anthropic adapter: `x-api-key` ($ANTHROPIC_API_KEY unless given), `anthropic-version`, the
    caller's extra `headers` (never logged), through `proxy` if given."""
    key = api_key if api_key is not None else os.environ.get("ANTHROPIC_API_KEY", "")
    own = {"x-api-key": key, "anthropic-version": API_VERSION}
    return Transport(provider, base_url, with_extra(own, headers), timeout_s, proxy=proxy)


class AnthropicMessages(HTTPAdapter):
    """`POST /v1/messages` over httpx, never streamed; `headers=` adds headers to every request (never logged),
    `proxy=` sends them through an HTTP(S) proxy."""

    endpoint = "messages"

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

    def capabilities(self, request: Mapping[str, Any]) -> Capabilities:
        """Synchronous: no background, no resume, no lookup, nothing retrievable."""
        return Capabilities(background=False, stream_resume=False, lookup=None, retention_s=None)

    def create(self, request: Mapping[str, Any], intent_id: str, *, background: bool) -> Observed:
        """Make the call and return the Message (`background` is ignored: this protocol has none)."""
        if request.get("stream"):
            raise ProviderRejected.of(self.provider, 400, "stream=true is not supported for a durable messages call")
        metadata = dict(request.get("metadata") or {})
        metadata.setdefault("user_id", INTENT_USER_PREFIX + intent_id)
        body = self.http.json("POST", "/messages", {**request, "metadata": metadata}, str(request.get("model", "")))
        state = CallState.DONE if body.get("type") == "message" else CallState.FAILED
        return Observed(state, str(body.get("id") or "") or None, body)

    def poll(self, reference: str) -> Observed:
        """Never called: a synchronous call has nothing to poll."""
        raise ProviderRejected.of(self.provider, 400, "messages cannot be retrieved by reference")

    def cancel(self, reference: str) -> Observed:
        """Never called: a synchronous call cannot be cancelled."""
        raise ProviderRejected.of(self.provider, 400, "messages cannot be cancelled")

    def usage(self, response: Mapping[str, Any]) -> Usage:
        """Return input tokens (cache reads and writes included: they are billed) and output tokens."""
        return message_usage(response)


def message_usage(response: Mapping[str, Any]) -> Usage:
    """An Anthropic Message's billable tokens: input (cache reads and writes included) and output."""
    usage = response.get("usage") or {}
    cached = int(usage.get("cache_creation_input_tokens") or 0) + int(usage.get("cache_read_input_tokens") or 0)
    return Usage(int(usage.get("input_tokens") or 0) + cached, int(usage.get("output_tokens") or 0))
