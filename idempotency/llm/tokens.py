"""Tokens without a tokenizer: the text a request is billed for, an exact count (the fake provider's own unit)
and a conservative estimate of a real provider's count, for limits, budgets and calls whose bill is unknown.

Standard library only (the fake provider uses it). The estimate errs high: the larger of one token per word or
punctuation mark and one per three UTF-8 bytes (English runs about four bytes per token on OpenAI's and
Anthropic's tokenizers), so a budget or a limit reserved with it is rarely short. Given an OpenAI model, it is
also never below tiktoken's exact count where tiktoken and the model's encoding are at hand without a download
(oncelery.llm.tokenizer: the `oncelery[tokens]` extra, imported only then).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from oncelery.llm.tokenizer import tiktoken_count

_TOKEN = re.compile(r"\w+|[^\w\s]")
BYTES_PER_TOKEN_FLOOR = 3
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


def estimate_tokens(text: str, model: str | None = None) -> int:
    """Return a conservative estimate of a real tokenizer's count of `text`: never below the built-in floor, nor
    below tiktoken's count for an OpenAI `model` where that is at hand offline (see the module's docstring)."""
    floor = max(count_tokens(text), math.ceil(len(text.encode()) / BYTES_PER_TOKEN_FLOOR))
    exact = tiktoken_count(text, model) if model else None
    return floor if exact is None else max(floor, exact)


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
