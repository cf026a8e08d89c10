"""Tokens without a tokenizer: the text a request is billed for, an exact count (the fake provider's own unit)
and a conservative estimate of a real provider's count, for limits, budgets and calls whose bill is unknown.

The billed text, the output limit and the exact count are the fake provider's rules
(`oncelery.token_count`, standard library only), so that the fake bills what a call reserved for; this
module adds the estimate. It errs high: the larger of one token per word or punctuation mark and one per three
UTF-8 bytes (English runs about four bytes per token on OpenAI's and Anthropic's tokenizers), so a budget or a
limit reserved with it is rarely short. Given an OpenAI model, it is also never below tiktoken's exact count where
tiktoken and the model's encoding are at hand without a download (oncelery.llm.tokenizer: the `oncelery[tokens]`
extra, imported only then).
"""

from __future__ import annotations

import math

from oncelery.llm.tokenizer import tiktoken_count
from oncelery.token_count import count_tokens, input_text, output_limit

__all__ = ["count_tokens", "estimate_tokens", "input_text", "output_limit"]

BYTES_PER_TOKEN_FLOOR = 3


def estimate_tokens(text: str, model: str | None = None) -> int:
    """Return a conservative estimate of a real tokenizer's count of `text`: never below the built-in floor, nor
    below tiktoken's count for an OpenAI `model` where that is at hand offline (see the module's docstring)."""
    floor = max(count_tokens(text), math.ceil(len(text.encode()) / BYTES_PER_TOKEN_FLOOR))
    exact = tiktoken_count(text, model) if model else None
    return floor if exact is None else max(floor, exact)
