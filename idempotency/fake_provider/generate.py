"""Deterministic text and exact token counts: the same request always gets the same answer and the same bill."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

from oncelery.token_count import input_text, truncate_tokens

#: What writes the answer of a create: the request (JSON) -> the answer's text. The demo plugs its LocalModel in.
Generator = Callable[[Mapping[str, Any]], str]

_SOURCE = (
    "the model reads each article and writes a short faithful summary of its main points while keeping names "
    "numbers and dates exactly as the source gives them"
)
_WORDS = tuple(_SOURCE.split(" "))


def generate_text(model: str, prompt: str, max_tokens: int | None = None) -> str:
    """Return a deterministic answer for `prompt` on `model`: 12 to 43 words picked by the prompt's digest."""
    digest = hashlib.sha256(f"{model}\n{prompt}".encode()).digest()
    n = 12 + digest[0] % 32
    words = [_WORDS[(digest[i % len(digest)] + i) % len(_WORDS)] for i in range(n)]
    text = " ".join(words).capitalize() + "."
    return text if max_tokens is None else truncate_tokens(text, max_tokens)


def default_generator(request: Mapping[str, Any]) -> str:
    """Answer a create request with `generate_text` over its model and billed input text."""
    return generate_text(str(request.get("model", "")), input_text(request))
