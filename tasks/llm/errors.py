"""Typed errors of the LLM clients: one root under OnceleryError, each picklable with its fields."""

from __future__ import annotations

from oncelery import OnceleryError


class LLMError(OnceleryError):
    """Root of every error an LLM client raises."""


class UnsupportedTask(LLMError):
    """Raised when a client is asked for a task other than "summarize", "keywords" or "quality"."""


class LLMHTTPError(LLMError):
    """Raised on a 4xx (or redirect) reply: bad API key, unknown model, rejected request; never retried."""


class LLMUnavailable(LLMError):
    """Raised when the model server kept failing (5xx, 429, timeouts, refused connections) after every retry."""


class LLMMalformedReply(LLMError):
    """Raised when a reply is not the expected shape (non-JSON body, no choices/message/content, bad number)."""
