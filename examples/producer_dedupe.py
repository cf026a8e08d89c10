"""Runnable example: a duplicate `.delay()` answered where it is made, without reaching the broker.

    python examples/producer_dedupe.py     # SQLite file ./oncelery-example.db, no server, no worker

The first call runs the job (a direct call, to keep the example free of a worker). Then the producer has a claims
database configured, so `.delay()` of the same call asks it first: the duplicate is answered with the stored
result, and nothing is published (the broker URL below points at nothing and is never used). A call with the
same key and another payload raises IdempotencyConflict right there, at the caller.
"""

from __future__ import annotations

import time
from pathlib import Path

from celery import Celery

from oncelery import IdempotencyConflict, IdempotentTask, outcome_of, upgrade_schema

DB = f"sqlite:///{Path('oncelery-example.db').resolve()}"
app = Celery("example", broker="redis://127.0.0.1:1/0")  # port 1: nothing listens, nothing is sent
app.conf.oncelery_database_url = DB
app.conf.task_ignore_result = True  # no result backend either: the handle holds the answer
runs = {"n": 0}


@app.task(base=IdempotentTask, bind=True, name="oncelery.example_summary", idempotency_key="doc:{doc_id}")
def summarize(self: IdempotentTask, doc_id: str, text: str) -> dict[str, object]:
    """A model call would be here; it runs once per document."""
    runs["n"] += 1
    return {"doc": doc_id, "summary": text.split(".")[0]}


if __name__ == "__main__":
    upgrade_schema(DB)
    app.finalize()
    doc = f"doc-{time.time_ns()}"  # a fresh key per run of this script
    text = "Brokers deliver at least once. Oncelery makes effects happen once."
    print("first run:", summarize(doc, text))
    started = time.perf_counter()
    duplicate = summarize.delay(doc, text)  # answered from the claims database: nothing is published
    took = (time.perf_counter() - started) * 1000
    print(f"duplicate .delay(): {duplicate.get()} ({outcome_of(duplicate).value}, {took:.1f} ms, not published)")
    print("body runs:", runs["n"])  # 1
    try:
        summarize.delay(doc, "Another text under the same key.")
    except IdempotencyConflict as exc:
        print("conflict at the caller:", exc)
