"""The article pipeline: summarize -> keywords -> quality, each a checkpointed, ledgered model call.

Keyed by `article:{article_id}:v{version}`: however often a job is delivered, each step's model call is
paid for once, and the `ArticleScore` row is written once (its `generated_by_run_id` is UNIQUE).
"""

from __future__ import annotations

import os
from typing import Any

from oncelery import IdempotentTask
from oncelery.models.jobs import ArticleScore
from oncelery.tasks.app import app
from oncelery.tasks.ledger import call_llm
from oncelery.tasks.llm import LLMClient, LLMUnavailable, default_client, parse_keywords, parse_quality

STEPS = ("summarize", "keywords", "quality")
_clients: dict[int, LLMClient] = {}


def client() -> LLMClient:
    """This process's model client (the offline LocalModel unless ONCELERY_LLM_BASE_URL is set)."""
    pid = os.getpid()
    if pid not in _clients:
        _clients[pid] = default_client()
    return _clients[pid]


def _model_call(task: str, text: str, temperature: float, seed: int) -> str:
    return call_llm(client(), task, text, temperature=temperature, seed=seed).text


def _meta(task: IdempotentTask, step: str, text: str, temperature: float) -> dict[str, Any]:
    # What the answer depends on: a replay under another model, version or prompt is refused.
    c = client()
    return {
        "model": c.model,
        "model_version": c.model_version,
        "prompt_hash": c.prompt_hash(step, text),
        "temperature": temperature,
        "seed": task.step_seed(step),
    }


@app.task(
    base=IdempotentTask,
    bind=True,
    name="oncelery.score_article",
    idempotency_key="article:{article_id}:v{version}",
    concurrency_key="article:{article_id}",
    lease=60,
    total_steps=len(STEPS),
    autoretry_for=(LLMUnavailable,),
    retry_backoff=True,
    max_retries=5,
)
def score_article(
    self: IdempotentTask, article_id: str, version: int, text: str, temperature: float = 0.0
) -> dict[str, Any]:
    """Summarize, extract keywords and score one article version; exactly one ArticleScore per version."""
    step_results: dict[str, str] = {}
    for step in STEPS:
        # Keywords and quality read the article itself; each step's inputs are in its meta.
        step_results[step] = self.step(
            step, _model_call, step, text, temperature, step_meta=_meta(self, step, text, temperature)
        )
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
