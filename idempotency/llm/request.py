"""A model request's identity: which fields make two requests the same call, and the digest an intent stores.

The digest covers what shapes the answer: the model, the input (input, messages, instructions, system; Gemini's
contents, systemInstruction and cachedContent), the tools and their choice, the sampling parameters and the output
limits and format (Gemini's generationConfig and safetySettings). It leaves out how the call travels: timeouts,
metadata, `background`, `stream`, `store`, `user`/`safety_identifier`, service tier and cache keys. So a replay
that changes only a timeout or the transport still replays; one that changes a prompt raises `StepMismatch` (a
changed step, as a changed `args_digest` does).

Prompt text is never stored: only this digest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from oncelery.runs.encoding import canonical_json

#: The request fields that enter the digest, whatever the endpoint (absent fields are simply absent).
DIGEST_FIELDS = frozenset(
    {
        # what is asked
        "model", "input", "messages", "instructions", "system", "previous_response_id",
        # what the model may do
        "tools", "tool_choice", "parallel_tool_calls", "reasoning", "thinking",
        # how it samples and how long it may answer
        "temperature", "top_p", "top_k", "seed", "stop", "stop_sequences", "n", "presence_penalty",
        "frequency_penalty", "max_output_tokens", "max_tokens", "max_completion_tokens",
        # the shape of the answer
        "text", "response_format", "logprobs", "top_logprobs", "include", "truncation",
        # Gemini's generateContent (each also in the snake_case Google's JSON takes): what is asked, the tools'
        # settings, the safety thresholds, and the sampling, output limit and format (generationConfig)
        "contents", "systemInstruction", "system_instruction", "cachedContent", "cached_content", "toolConfig",
        "tool_config", "safetySettings", "safety_settings", "generationConfig", "generation_config",
    }
)  # fmt: skip


def request_digest(request: Mapping[str, Any]) -> str:
    """Return sha256 over the canonical JSON of the request's answer-shaping fields (see `DIGEST_FIELDS`)."""
    shaped = {name: value for name, value in request.items() if name in DIGEST_FIELDS}
    return hashlib.sha256(canonical_json(shaped).encode()).hexdigest()
