"""The LLM client contract: `LLMClient`, its `LLMResult`, the three tasks' prompts and reply parsers."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Final, Protocol, runtime_checkable

from oncelery.tasks.llm.errors import LLMMalformedReply, UnsupportedTask

TASKS: Final = ("summarize", "keywords", "quality")
# Bump when an instruction below changes: the prompt hash (and so a step's checkpoint meta) changes with it.
PROMPT_VERSION: Final = "1"
INSTRUCTIONS: Final = {
    "summarize": "Summarize the article in at most three sentences. Reply with the summary only.",
    "keywords": (
        "List the eight most important keywords or key phrases of the text, lowercase, separated by commas. "
        "Reply with the list only."
    ),
    "quality": (
        "Rate the writing quality of the text from 0 (unreadable) to 100 (excellent), judging readability, "
        "structure and coherence. Reply with the number only."
    ),
}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class LLMResult:
    """One model answer with what it cost: tokens as the model reports them and wall-clock latency."""

    text: str
    input_tokens: int
    output_tokens: int
    latency_ms: float
    model: str
    model_version: str


@runtime_checkable
class LLMClient(Protocol):
    """A model that answers the article pipeline's tasks; `prompt_hash` identifies what determines an answer."""

    model: str
    model_version: str

    def prompt_hash(self, task: str, text: str) -> str:
        """Return the sha256 hex of the exact rendered prompt, model and the parameters that fix the answer."""
        ...

    def complete(
        self, task: str, text: str, *, temperature: float = 0.0, seed: int | None = None, max_tokens: int = 256
    ) -> LLMResult:
        """Answer `task` for `text` (one real model call); raise an `LLMError` subclass on failure."""
        ...


def check_task(task: str) -> str:
    """Return `task` if it is one of TASKS, else raise UnsupportedTask naming the valid ones."""
    if task not in TASKS:
        raise UnsupportedTask(f"Unknown LLM task {task!r}: use one of {', '.join(TASKS)}", task=task)
    return task


def hash_payload(payload: dict[str, Any]) -> str:
    """Return the sha256 hex of `payload` as canonical JSON (sorted keys, no whitespace): stable everywhere."""
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def parse_keywords(reply: str) -> list[str]:
    """Return the reply's keywords: comma- or newline-separated, stripped of bullets, lowercased, de-duplicated."""
    seen: dict[str, None] = {}
    for part in re.split(r"[,\n;]", reply):
        word = part.strip().strip("-*•0123456789.) \t\"'").lower()
        if word:
            seen.setdefault(word, None)
    return list(seen)


def parse_quality(reply: str) -> float:
    """Return the first number in the reply if it lies in 0..100, else raise LLMMalformedReply."""
    match = _NUMBER.search(reply)
    if match is None:
        raise LLMMalformedReply(f"Quality reply has no number: {reply[:200]!r}", reply=reply[:200])
    value = float(match.group())
    if not 0.0 <= value <= 100.0:
        raise LLMMalformedReply(f"Quality reply {value} is outside 0..100", reply=reply[:200])
    return value
