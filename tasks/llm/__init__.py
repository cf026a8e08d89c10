"""LLM clients of Oncelery's AI jobs: the `LLMClient` contract, an OpenAI-compatible client, an offline model."""

from __future__ import annotations

import os

from oncelery.tasks.llm.base import TASKS, LLMClient, LLMResult, parse_keywords, parse_quality
from oncelery.tasks.llm.errors import LLMError, LLMHTTPError, LLMMalformedReply, LLMUnavailable, UnsupportedTask
from oncelery.tasks.llm.local import LocalModel
from oncelery.tasks.llm.openai_compat import ENV_BASE_URL, OpenAICompatibleClient


def default_client() -> LLMClient:
    """Return the OpenAI-compatible client when ONCELERY_LLM_BASE_URL is set, else the offline LocalModel."""
    if os.environ.get(ENV_BASE_URL):
        return OpenAICompatibleClient.from_env()
    return LocalModel()


__all__ = [
    "TASKS",
    "LLMClient",
    "LLMError",
    "LLMHTTPError",
    "LLMMalformedReply",
    "LLMResult",
    "LLMUnavailable",
    "LocalModel",
    "OpenAICompatibleClient",
    "UnsupportedTask",
    "default_client",
    "parse_keywords",
    "parse_quality",
]
