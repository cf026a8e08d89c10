"""Runnable example: ten quick edits of one article make one scoring run, on the latest edit.

    python examples/debounce_edits.py      # SQLite file ./oncelery-debounce-example.db, the embedded broker

Every `.delay()` of the burst records the edit (one upsert on the claims database) and returns the same handle:
the run that will carry the latest edit. The relay (here in a thread; in production `oncelery relay`) sends the
burst through the outbox once no edit came for `period` seconds. A fake provider answers the model calls and
counts them: 2 calls (one run x 2 steps), not 20.
"""

from __future__ import annotations

import time
from pathlib import Path

from celery import Celery

from oncelery import (
    CELERY_DELIVERY_DEFAULTS,
    Debounce,
    FakeProvider,
    IdempotentTask,
    OpenAIResponses,
    output_text,
    upgrade_schema,
)
from oncelery.embedded_broker import URL as EMBEDDED_BROKER
from oncelery.testing import in_process_worker, relay_running

HERE = Path("oncelery-debounce-example").resolve()
DB = f"sqlite:///{HERE}.db"
app = Celery("debounce-example")
app.conf.update(
    **CELERY_DELIVERY_DEFAULTS,
    broker_url=EMBEDDED_BROKER,
    broker_transport_options={"data_folder_in": f"{HERE}-broker", "data_folder_out": f"{HERE}-broker"},
    result_backend=f"db+sqlite:///{HERE}-results.db",
    oncelery_database_url=DB,
)
provider = FakeProvider().start()
adapter = OpenAIResponses(provider.openai_base_url, "sk-example")


@app.task(base=IdempotentTask, bind=True, name="oncelery.example_debounce",
          idempotency_key="article:{doc}:v{version}",
          debounce=Debounce(key="article:{doc}", period=1.0, max_wait=10.0, on_running="supersede"))  # fmt: skip
def score_article(self: IdempotentTask, doc: str, version: int, text: str) -> dict[str, object]:
    """summarize -> score, each a model call, on the latest edit of the article only."""
    summary = output_text(self.llm("summarize", adapter=adapter, model="small", input=text, max_output_tokens=60))
    score = output_text(self.llm("score", adapter=adapter, model="small", input=summary, max_output_tokens=10))
    return {"doc": doc, "version": version, "score": score}


if __name__ == "__main__":
    Path(f"{HERE}-broker").mkdir(exist_ok=True)
    upgrade_schema(DB)
    doc = f"doc-{time.time_ns()}"
    handles = [score_article.delay(doc, v, f"Draft {v}: the council approved the budget.") for v in range(1, 11)]
    print("handles:", {h.id for h in handles}, "edits:", [h.debounce_seq for h in handles])
    with in_process_worker(app, concurrency=1), relay_running(app, DB):
        print("result:", handles[-1].get(timeout=60))
    print("model calls:", sum(provider.stats()["creates_by_intent"].values()))
    adapter.close()
    provider.stop()
