"""The adapter contract: create a call carrying its intent id, poll it by reference, cancel it, read its usage.

An adapter is stateless over one HTTP client; the intent (in the database) is the state. Each declares its
`Capabilities`, which the recovery table reads: whether a call runs in the background and can be re-attached,
how a call can be found again after a crash in the create window (`lookup`), and how long the provider keeps a
response for polling (`retention_s`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol


class CallState(enum.Enum):
    """Where the provider says a call is."""

    PENDING = "pending"  # queued or in progress: poll again after `poll_after_s`
    DONE = "done"  # an answer (complete, or cut at the output limit)
    FAILED = "failed"  # the provider ended it with an error (billed or not, per its usage)
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class Capabilities:
    """What an adapter can do for a given request."""

    background: bool  # the create returns a reference at once and the call goes on without us
    stream_resume: bool  # a stream can be re-attached after the last event seen
    lookup: str | None  # how a call lost in the create window is found again; None: it cannot be
    retention_s: float | None  # how long the provider keeps the response for polling; None: not retrievable


@dataclass(frozen=True)
class Usage:
    """Billable tokens of one call, as the provider reported them."""

    input_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True)
class Observed:
    """One look at a call: its state, the provider's reference, the response JSON, and when to look again."""

    state: CallState
    reference: str | None
    response: Mapping[str, Any]
    poll_after_s: float | None = None
    cursor: int | None = None  # the last stream sequence number seen, where the adapter streams

    @property
    def terminal(self) -> bool:
        """Return whether the call has ended (done, failed or cancelled)."""
        return self.state is not CallState.PENDING


class Adapter(Protocol):
    """One provider protocol. Creates are never retried inside: a retry is a new intent, so every create counts."""

    provider: str  # "openai", "anthropic", "gemini", or the name a user gives a compatible server
    endpoint: str  # "responses", "chat.completions", "messages", "generateContent"

    def capabilities(self, request: Mapping[str, Any]) -> Capabilities:
        """Return what this adapter can do for `request` (retention may depend on its `store`)."""
        ...

    def create(self, request: Mapping[str, Any], intent_id: str, *, background: bool) -> Observed:
        """Send the call, tagged with the opaque `intent_id`; in the background where `background` and allowed."""
        ...

    def poll(self, reference: str) -> Observed:
        """Look at a background call again; raise `ResponseGone` when the provider no longer has it."""
        ...

    def cancel(self, reference: str) -> Observed:
        """Ask the provider to stop a background call (idempotent, best effort)."""
        ...

    def usage(self, response: Mapping[str, Any]) -> Usage:
        """Return the billable tokens of a finished response."""
        ...


def output_text(response: Mapping[str, Any]) -> str:
    """Return the answer's text from an OpenAI Response, a Chat Completion, an Anthropic Message or a Gemini
    GenerateContentResponse (its first candidate's text parts, thought summaries left out)."""
    if "output" in response:  # Responses API
        return "".join(
            part.get("text", "")
            for item in response.get("output") or []
            if item.get("type") == "message"
            for part in item.get("content") or []
            if part.get("type") == "output_text"
        )
    if "choices" in response:  # chat completions
        return str((response["choices"][0].get("message") or {}).get("content") or "")
    if "candidates" in response or "usageMetadata" in response:  # Gemini (no candidate: the prompt was blocked)
        candidates = response.get("candidates") or [{}]
        parts = (candidates[0].get("content") or {}).get("parts") or []
        return "".join(str(part.get("text") or "") for part in parts if not part.get("thought"))
    return "".join(b.get("text", "") for b in response.get("content") or [] if b.get("type") == "text")
