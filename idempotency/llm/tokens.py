"""Tokens without a tokenizer: the text a request is billed for, an exact count (the fake provider's own unit)
and a conservative estimate of a real provider's count, for limits, budgets and calls whose bill is unknown.

Standard library only (the fake provider uses it). The estimate errs high: the larger of one token per word or
punctuation mark and one per three UTF-8 bytes (English runs about four bytes per token on OpenAI's and
Anthropic's tokenizers), so a budget or a limit reserved with it is rarely short.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

_TOKEN = re.compile(r"\w+|[^\w\s]")
BYTES_PER_TOKEN_FLOOR = 3
#: The request fields whose text is billed as input.
INPUT_FIELDS = ("instructions", "system", "input", "messages")


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
        # Messages ({"role", "content"}) and content parts ({"type": "input_text", "text"}) alike.
        for key in ("content", "text"):
            if key in value:
                return request_text(value[key])
    return ""


def input_text(request: Mapping[str, Any]) -> str:
    """Return the billed input text of a request, whatever the endpoint (instructions/system first)."""
    return "\n".join(filter(None, (request_text(request.get(name)) for name in INPUT_FIELDS)))


def estimate_tokens(text: str) -> int:
    """Return a conservative estimate of a real tokenizer's count of `text` (see the module's docstring)."""
    return max(count_tokens(text), math.ceil(len(text.encode()) / BYTES_PER_TOKEN_FLOOR))


def output_limit(request: Mapping[str, Any]) -> int:
    """Return the request's output token limit (0: none given)."""
    for name in ("max_output_tokens", "max_tokens", "max_completion_tokens"):
        if request.get(name):
            return int(request[name])
    return 0
