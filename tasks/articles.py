"""The article pipeline: summarize -> keywords -> quality, each a model call made as a durable step (`self.llm`).

Keyed by `article:{article_id}:v{version}`: however often a job is delivered, each step's model call is
paid for once where the provider allows it (a worker killed mid-call leaves the call running; the next holder
re-attaches to it), and the `ArticleScore` row is written once (its `generated_by_run_id` is UNIQUE).
"""

from __future__ import annotations

from typing import Any

from oncelery import IdempotentTask, ProviderCallFailed, ProviderRateLimited, ProviderUnavailable, output_text
from oncelery.models.jobs import ArticleScore
from oncelery.tasks.app import app
from oncelery.tasks.llm import parse_keywords, parse_quality
from oncelery.tasks.llm.served import BATCH, adapter, batched, request

STEPS = ("summarize", "keywords", "quality")


@app.task(
    base=IdempotentTask,
    bind=True,
    name="oncelery.score_article",
    idempotency_key="article:{article_id}:v{version}",
    concurrency_key="article:{article_id}",
    lease=60,
    total_steps=len(STEPS),
    autoretry_for=(ProviderUnavailable, ProviderRateLimited, ProviderCallFailed),
    retry_backoff=True,
    max_retries=5,
)
def score_article(
    self: IdempotentTask, article_id: str, version: int, text: str, temperature: float = 0.0
) -> dict[str, Any]:
    """Summarize, extract keywords and score one article version; exactly one ArticleScore per version."""
    step_results: dict[str, str] = {}
    # `oncelery process --batch`: each step an item of a provider batch (about half the price), the run WAITING
    # without a worker slot until the batch returns. The request is the same either way.
    mode = {"mode": "batch", "batch": BATCH} if batched() else {}
    for step in STEPS:
        # Keywords and quality read the article itself; each step's request is in its intent's digest.
        answer = self.llm(step, adapter=adapter(), **mode, **request(step, text, temperature, self.step_seed(step)))
        step_results[step] = output_text(answer)
    keywords = parse_keywords(step_results["keywords"])
    quality = parse_quality(step_results["quality"])
    with self.effects() as session:
        session.add(
            ArticleScore(
                article_id=article_id,
                version=version,
                generated_by_run_id=self.run_id,
                summary=step_results["summarize"],
                keywords=keywords,
                quality=quality,
            )
        )
    return {
        "article_id": article_id,
        "version": version,
        "summary": step_results["summarize"],
        "keywords": keywords,
        "quality": quality,
    }
