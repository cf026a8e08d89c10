"""A small demo job: scores a document once per (doc_id, version), however often it is delivered."""

from __future__ import annotations

import hashlib
import re
import time
from typing import Any

from oncelery import IdempotentTask
from oncelery.tasks.app import app

_WORD = re.compile(r"[A-Za-z']+")


@app.task(
    base=IdempotentTask,
    bind=True,
    name="oncelery.demo_score",
    idempotency_key="doc:{doc_id}:v{version}",
    fingerprint=("doc_id", "version", "text"),
    lease=30,
)
def demo_score(self: IdempotentTask, doc_id: str, version: int, text: str, work_seconds: float = 0.0) -> dict[str, Any]:
    """Score a document's readability; runs once per (doc_id, version) even when delivered many times."""
    if work_seconds:
        time.sleep(work_seconds)  # stands in for a slow model call
    words = _WORD.findall(text)
    sentences = max(1, len(re.findall(r"[.!?]+", text)))
    avg_sentence = len(words) / sentences
    avg_word = sum(map(len, words)) / max(1, len(words))
    score = round(max(0.0, 100.0 - 1.5 * avg_sentence - 8.0 * (avg_word - 4.0)), 2)
    return {
        "doc_id": doc_id,
        "version": version,
        "words": len(words),
        "score": score,
        "digest": hashlib.sha256(text.encode()).hexdigest()[:12],
    }
