"""How close `oncelery fork --dry-run`'s preview is to what the fork then costs, on two LocalModel configurations.

    python bench/fork_preview.py [--docs 20]     # SQLite in a temp folder, Redis on 127.0.0.1:6379, in-process worker

The fake provider answers with the demo's LocalModel (real extractive algorithms, tokens = words); each model
name is a LocalModel configuration with its own price. The source runs use `local-3` (3 summary sentences, 8
keywords); each is forked to `local-5` (5 sentences, 12 keywords) and to `local-2` (2 sentences, 5 keywords),
from each step. The preview prices the source's tokens at the new model's price; the fork's ledger holds what
it cost. Printed: per (configuration, from-step), the total preview, the total actual and their ratio.
Goal (docs/benchmarks.md): within +-10 %.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from celery import Celery
from sqlalchemy import func, select

from oncelery import (
    CELERY_DELIVERY_DEFAULTS,
    FakeProvider,
    IdempotentTask,
    OpenAIResponses,
    fork_run,
    output_text,
    preview_fork,
    upgrade_schema,
)
from oncelery.store.database import get_engine
from oncelery.store.tables import CALLS
from oncelery.tasks.llm.base import INSTRUCTIONS
from oncelery.tasks.llm.local import LocalModel
from oncelery.testing import in_process_worker

MODELS = {"local-3": LocalModel(), "local-5": LocalModel(summary_sentences=5, keyword_count=12),
          "local-2": LocalModel(summary_sentences=2, keyword_count=5)}  # fmt: skip
PRICES = {"local-3": {"input": 0.4, "output": 1.6}, "local-5": {"input": 3.0, "output": 12.0},
          "local-2": {"input": 0.1, "output": 0.4}}  # fmt: skip
STEPS = ("summarize", "keywords", "quality")
_TASK_OF = {text: task for task, text in INSTRUCTIONS.items()}


def answer(request: Mapping[str, Any]) -> str:
    """The fake provider's answer: the request's model (a LocalModel configuration) on the step's task."""
    model = MODELS[str(request.get("model"))]
    return model.complete(_TASK_OF[str(request.get("instructions"))], str(request.get("input") or "")).text


def main() -> None:
    """Run the sources, fork them, print preview vs actual per configuration and from-step."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, default=20)
    opts = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="oncelery-fork-bench-"))
    db = f"sqlite:///{folder / 'claims.db'}"
    upgrade_schema(db)
    provider = FakeProvider(generator=answer).start()
    adapter = OpenAIResponses(provider.openai_base_url, "sk")
    app = Celery("fork-bench")
    app.conf.update(**CELERY_DELIVERY_DEFAULTS, broker_url="redis://127.0.0.1:6379/0", result_backend="redis://127.0.0.1:6379/0",
                    oncelery_database_url=db, oncelery_prices=PRICES, task_default_queue=f"fork-bench-{folder.name}",
                    oncelery_producer_dedupe=False)  # fmt: skip

    @app.task(base=IdempotentTask, bind=True, name="oncelery.bench_fork", idempotency_key="doc:{doc}",
              keep_arguments=True)  # fmt: skip
    def article(self: IdempotentTask, doc: str, text: str) -> dict[str, str]:
        out = {}
        for step in STEPS:
            request = {"model": "local-3", "instructions": INSTRUCTIONS[step], "input": text, "max_output_tokens": 256}
            text = output_text(self.llm(step, adapter=adapter, **request))
            out[step] = text
        return out

    docs = [json.loads(line) for line in Path("samples/articles.jsonl").read_text().splitlines() if line.strip()]
    docs = (docs * (opts.docs // max(1, len(docs)) + 1))[: opts.docs]
    engine = get_engine(db)
    print(f"{'model':8} {'from':10} {'preview USD':>12} {'actual USD':>12} {'ratio':>6}")
    with in_process_worker(app, concurrency=2):
        for i, doc in enumerate(docs):
            article.delay(f"d{i}", str(doc.get("text") or doc.get("body") or doc)).get(timeout=120)
        for model in ("local-5", "local-2"):
            for step in STEPS:
                change = {s: {"model": model} for s in STEPS[STEPS.index(step) :]}
                seen, forks = 0, []
                for i in range(len(docs)):
                    seen += preview_fork(app, article, f"doc:d{i}", from_step=step, overrides=change).total_micros
                    forks.append(fork_run(app, article, f"doc:d{i}", from_step=step, overrides=change))
                for handle in forks:
                    handle.get(timeout=120)
                with engine.connect() as conn:
                    keys = [h.key for h in forks]
                    actual = conn.execute(
                        select(func.sum(CALLS.c.cost_micros)).where(CALLS.c.idempotency_key.in_(keys))
                    ).scalar_one()
                ratio = seen / actual if actual else float("nan")
                print(f"{model:8} {step:10} {seen / 1e6:12.6f} {int(actual) / 1e6:12.6f} {ratio:6.3f}")
    adapter.close()
    provider.stop()


if __name__ == "__main__":
    main()
