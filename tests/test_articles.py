"""The article pipeline end to end: duplicates absorbed, one model call per step, one score per article."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from celery import Celery
from sqlalchemy import func, select

import oncelery.tasks.articles  # noqa: F401  (registers oncelery.score_article as a shared task)
from oncelery.models import ModelCall
from oncelery.models.jobs import ArticleScore
from oncelery.runs.claims import RunStore
from oncelery.tasks.llm import LocalModel, parse_keywords, parse_quality
from tests.conftest import ON_POSTGRESQL

SAMPLES = Path(__file__).resolve().parent.parent / "samples" / "articles.jsonl"


def load_articles(n: int) -> list[dict[str, Any]]:
    """The first `n` sample articles."""
    with SAMPLES.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()][:n]


def expected(article: dict[str, Any]) -> dict[str, Any]:
    """What an unfailed, undisturbed run returns at temperature 0 (the model called directly)."""
    model = LocalModel()
    text = article["text"]
    return {
        "article_id": article["id"],
        "version": article["version"],
        "summary": model.complete("summarize", text).text,
        "keywords": parse_keywords(model.complete("keywords", text).text),
        "quality": parse_quality(model.complete("quality", text).text),
    }


# On PostgreSQL: the same pipeline runs on SQLite in tests/test_process.py (the embedded default, 100 articles).
@ON_POSTGRESQL
def test_hundred_articles_with_thirty_percent_duplicates(app: Celery, worker_factory: Any, db_url: str) -> None:
    articles = load_articles(100)
    assert len(articles) == 100
    score = app.tasks["oncelery.score_article"]
    rng = random.Random(7)
    deliveries = articles + rng.sample(articles, 30)
    rng.shuffle(deliveries)

    with worker_factory(app, concurrency=4):
        pending = [(a, score.delay(a["id"], a["version"], a["text"])) for a in deliveries]
        results = [(a, r.get(timeout=120)) for a, r in pending]

    for article, result in results:
        assert result == expected(article), article["id"]
    engine = RunStore(db_url).engine
    with engine.connect() as conn:
        calls = conn.execute(select(func.count()).select_from(ModelCall)).scalar_one()
        ok_calls = conn.execute(select(func.count()).where(ModelCall.ok.is_(True))).scalar_one()
        scores = conn.execute(select(func.count()).select_from(ArticleScore)).scalar_one()
        distinct = conn.execute(select(func.count(func.distinct(ArticleScore.article_id)))).scalar_one()
    assert calls == ok_calls == 300  # 100 articles x 3 steps, never a duplicate call
    assert scores == distinct == 100
    counts = score.outcome_counts()
    assert counts["executed"] == 100
    assert counts.get("replayed", 0) == 30  # every duplicate ends answered from the stored result
