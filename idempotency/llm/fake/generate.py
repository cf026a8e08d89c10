"""Deterministic text and exact token counts: the same request always gets the same answer and the same bill."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from typing import Any

#: A generator the demo may plug in: (model, input text, max output tokens) -> answer text.
Generator = Callable[[str, str, int | None], str]

_TOKEN = re.compile(r"\w+|[^\w\s]")
_SOURCE = (
    "the model reads each article and writes a short faithful summary of its main points while keeping names "
    "numbers and dates exactly as the source gives them"
)
_WORDS = tuple(_SOURCE.split(" "))


def count_tokens(text: str) -> int:
    """Return the fake's token count of `text`: one per word and one per punctuation mark (exact, repeatable)."""
    return len(_TOKEN.findall(text))


def truncate_tokens(text: str, limit: int) -> str:
    """Return the longest prefix of `text` holding at most `limit` tokens (what `max_output_tokens` keeps)."""
    matches = list(_TOKEN.finditer(text))
    if len(matches) <= limit:
        return text
    return text[: matches[limit - 1].end()] if limit > 0 else ""


def generate_text(model: str, prompt: str, max_tokens: int | None = None) -> str:
    """Return a deterministic answer for `prompt` on `model`: 12 to 43 words picked by the prompt's digest."""
    digest = hashlib.sha256(f"{model}\n{prompt}".encode()).digest()
    n = 12 + digest[0] % 32
    words = [_WORDS[(digest[i % len(digest)] + i) % len(_WORDS)] for i in range(n)]
    text = " ".join(words).capitalize() + "."
    return text if max_tokens is None else truncate_tokens(text, max_tokens)


def prompt_text(value: Any) -> str:
    """Flatten a request's input (a string, messages, content parts) into the text whose tokens are billed."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(prompt_text(item) for item in value)
    if isinstance(value, dict):
        # Messages ({"role", "content"}) and content parts ({"type": "input_text", "text"}) alike.
        for key in ("content", "text"):
            if key in value:
                return prompt_text(value[key])
    return ""
