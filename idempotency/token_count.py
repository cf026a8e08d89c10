"""What a request is billed for: its billed text, its output limit, and an exact, repeatable token count of it.

Standard library only, below every room: the call layer (`oncelery.llm.tokens` builds its conservative estimate
on this count and reads a request's billed text and output limit here) and the fake provider (which bills by it)
share it, so the fake bills exactly what a call reserved for: one rule, written once, owned by neither.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_TOKEN = re.compile(r"\w+|[^\w\s]")
#: The request fields whose text is billed as input (Gemini's `systemInstruction` and `contents` too; Google's
#: JSON also takes each field's snake_case name).
INPUT_FIELDS = ("instructions", "system", "systemInstruction", "system_instruction", "input", "messages", "contents")
#: Where a request sets its output limit: OpenAI's and Anthropic's top-level fields, then Gemini's generationConfig.
OUTPUT_LIMIT_FIELDS = ("max_output_tokens", "max_tokens", "max_completion_tokens")
GEMINI_LIMIT_FIELDS = (("generationConfig", "maxOutputTokens"), ("generation_config", "max_output_tokens"))


def count_tokens(text: str) -> int:
    """Return the fake's token count of `text`: one per word and one per punctuation mark (exact, repeatable)."""
    return len(_TOKEN.findall(text))


def truncate_tokens(text: str, limit: int) -> str:
    """Return the longest prefix of `text` holding at most `limit` tokens (what `max_output_tokens` keeps)."""
    matches = list(_TOKEN.finditer(text))
    if len(matches) <= limit:
        return text
    return text[: matches[limit - 1].end()] if limit > 0 else ""


def request_text(value: Any) -> str:
    """Flatten a request's input (a string, messages, content parts) into the text whose tokens are billed."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(request_text(item) for item in value)
    if isinstance(value, dict):
        # Messages ({"role", "content"}), content parts ({"type": "input_text", "text"}) and Gemini's Content
        # ({"role", "parts": [{"text"}]}) alike.
        for key in ("content", "text", "parts"):
            if key in value:
                return request_text(value[key])
    return ""


def input_text(request: Mapping[str, Any]) -> str:
    """Return the billed input text of a request, whatever the endpoint (instructions/system first)."""
    return "\n".join(filter(None, (request_text(request.get(name)) for name in INPUT_FIELDS)))


def output_limit(request: Mapping[str, Any]) -> int:
    """Return the request's output token limit (0: none given), Gemini's `generationConfig.maxOutputTokens` too."""
    for name in OUTPUT_LIMIT_FIELDS:
        if request.get(name):
            return int(request[name])
    for config, name in GEMINI_LIMIT_FIELDS:
        settings = request.get(config)
        if isinstance(settings, Mapping) and settings.get(name):
            return int(settings[name])
    return 0
