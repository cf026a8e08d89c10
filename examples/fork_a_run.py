"""Runnable example: fork a finished 3-step run from its last step with another model, preview the cost first.

    python examples/fork_a_run.py      # SQLite file ./oncelery-fork-example.db, the embedded broker, no server

A fake provider (a real HTTP server on 127.0.0.1) answers the model calls and counts them: the fork replays
steps 1-2 from the source run's checkpoints and pays exactly one call, step 3 on the other model. Its effects
are `dry` (rolled back): production's table keeps its one row.
"""

from __future__ import annotations

import time
from pathlib import Path

from celery import Celery
from sqlalchemy import Column, Integer, MetaData, String, Table, func, select

from oncelery import (
    CELERY_DELIVERY_DEFAULTS,
    FakeProvider,
    IdempotentTask,
    OpenAIResponses,
    fork_diff,
    fork_run,
    output_text,
    preview_fork,
    upgrade_schema,
)
from oncelery.embedded_broker import URL as EMBEDDED_BROKER
from oncelery.store.database import Database, get_engine
from oncelery.testing import in_process_worker

HERE = Path("oncelery-fork-example").resolve()
DB = f"sqlite:///{HERE}.db"
app = Celery("fork-example")
app.conf.update(
    **CELERY_DELIVERY_DEFAULTS,
    broker_url=EMBEDDED_BROKER,
    broker_transport_options={"data_folder_in": f"{HERE}-broker", "data_folder_out": f"{HERE}-broker"},
    result_backend=f"db+sqlite:///{HERE}-results.db",
    oncelery_database_url=DB,
    oncelery_prices={"small": {"input": 0.15, "output": 0.60}, "large": {"input": 2.0, "output": 8.0}},
)
scores = Table("example_scores", MetaData(), Column("id", Integer, primary_key=True), Column("doc", String(64)))
provider = FakeProvider().start()
adapter = OpenAIResponses(provider.openai_base_url, "sk-example")


@app.task(base=IdempotentTask, bind=True, name="oncelery.example_fork", idempotency_key="article:{doc}",
          keep_arguments=True)  # fmt: skip
def article(self: IdempotentTask, doc: str, text: str) -> dict[str, str]:
    """summarize -> keywords -> quality, each a model call; one effect row at the end."""
    out: dict[str, str] = {}
    for step in ("summarize", "keywords", "quality"):
        text = output_text(self.llm(step, adapter=adapter, model="small", input=text, max_output_tokens=80))
        out[step] = text
    with self.effects() as session:
        session.execute(scores.insert().values(doc=doc))
    return out


def effect_rows() -> int:
    with get_engine(DB).connect() as conn:
        return int(conn.execute(select(func.count()).select_from(scores)).scalar_one())


if __name__ == "__main__":
    Path(f"{HERE}-broker").mkdir(exist_ok=True)
    upgrade_schema(DB)
    scores.create(get_engine(DB), checkfirst=True)
    doc = f"doc-{time.time_ns()}"
    with in_process_worker(app, concurrency=1):
        source = article.delay(doc, "Celery delivers at least once. Oncelery makes effects happen once.")
        print("source run:", source.get(timeout=60))
        change = {"quality": {"model": "large"}}
        seen = preview_fork(app, article, f"article:{doc}", from_step="quality", overrides=change)
        print(f"preview: {seen.total_micros / 1e6:.6f} USD", seen.steps)
        calls, rows = sum(provider.stats()["creates_by_intent"].values()), effect_rows()
        fork = fork_run(app, article, f"article:{doc}", from_step="quality", overrides=change, effects="dry")
        print("fork", fork.id, "run", fork.key, "->", fork.get(timeout=60))
    print("model calls the fork made:", sum(provider.stats()["creates_by_intent"].values()) - calls)  # 1
    print("production effect rows added by the dry fork:", effect_rows() - rows)  # 0
    for step in fork_diff(Database(DB), fork.id):
        print(step.step, "replayed" if step.replayed else "re-run", f"cost delta {step.cost_delta_micros} micro-USD")
    adapter.close()
    provider.stop()
