"""Runnable example: a 3-step job that fails at step 3, then resumes without redoing steps 1-2.

    python examples/resume.py          # SQLite file ./oncelery-example.db, no server, no worker

Calls the task directly (in-process) to keep the example small; under a worker the same happens on
each retry or redelivery.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from celery import Celery

from oncelery import IdempotencyConflict, IdempotentTask, upgrade_schema

DB_FILE = Path("oncelery-example.db").resolve()
DB = f"sqlite:///{DB_FILE}"
app = Celery("example")
app.conf.oncelery_database_url = DB
calls: Counter[str] = Counter()
flaky = {"down": True}


def summarize(text: str) -> str:
    calls["summarize"] += 1
    return text.split(".")[0]


def keywords(summary: str, seed: int) -> list[str]:
    calls["keywords"] += 1  # `seed` is the step's deterministic seed: same in every process and retry
    return sorted({w.lower() for w in summary.split() if len(w) > 4})


def score(words: list[str]) -> int:
    calls["score"] += 1
    if flaky["down"]:
        flaky["down"] = False
        raise RuntimeError("scoring model timed out")
    return len(words)


@app.task(base=IdempotentTask, bind=True, name="oncelery.example_article", idempotency_key="article:{doc_id}:v1")
def article(self: IdempotentTask, doc_id: str, text: str) -> dict[str, object]:
    """Three checkpointed steps; a retry replays finished steps from their checkpoints."""
    s = self.step("summarize", summarize, text)
    k = self.step("keywords", keywords, s)
    return {"summary": s, "keywords": k, "score": self.step("score", score, k)}


if __name__ == "__main__":
    upgrade_schema(DB)
    app.finalize()
    doc = f"doc-{time.time_ns()}"  # a fresh key per run of this script
    text = "Celery delivers messages at least once. Oncelery makes effects happen once."
    try:
        article(doc, text)
    except RuntimeError as exc:
        print("attempt 1 failed:", exc)
    print("attempt 2:", article(doc, text))
    print("attempt 3 (a duplicate):", article(doc, text))
    print("step executions:", dict(calls))  # summarize 1, keywords 1, score 2
    try:
        article(doc, "Same key, different text.")
    except IdempotencyConflict as exc:
        print("conflict:", exc)
