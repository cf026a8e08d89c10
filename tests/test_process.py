"""`oncelery process` as a real subprocess: exact counts with duplicates, with worker SIGKILLs, on each store.

The command starts its own `celery worker` (a session of its own); every test finds those workers' PIDs
in the command's output and SIGKILLs any that are still alive, however the test ends.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, func, select, text

from oncelery.models import ModelCall, RunStatus, TaskRun
from oncelery.models.jobs import ArticleScore
from tests.services import (
    ONCELERY,
    Done,
    clean_env,
    delete_queue_keys,
    kill_reported_workers,
    live_workers,
    results_url,
    run_to_completion,
    unique_queue,
    worker_pids,
)
from tests.test_articles import SAMPLES, expected, load_articles

TASK = "oncelery.score_article"
STEPS = 3
RUN_TIMEOUT = 150.0  # seconds for one command; the runs below take 10-40 s on a 2-core machine


def process(
    *args: str, cwd: Path, env: Mapping[str, str] | None = None, timeout: float = RUN_TIMEOUT, sample: bool = False
) -> Done:
    """Run `oncelery process <samples> *args` (`--sample`: the packaged copy) to completion; on timeout stop it
    and its workers, and fail."""
    summary_path = cwd / "summary.json"
    argv = [ONCELERY, "process", "--sample" if sample else str(SAMPLES), *args, "--summary-json", str(summary_path)]
    env = dict(env) if env is not None else clean_env()
    code, out, err = run_to_completion(argv, cwd, env, timeout, kill_reported_workers)
    kill_reported_workers(out)  # normally none is left: checked by each test through `live_workers`
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return Done(code, out, err, summary)


def database_state(url: str) -> dict[str, Any]:
    """Return the counts and stored results the proofs check, read straight from the database."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            runs = conn.execute(select(TaskRun.idempotency_key, TaskRun.status, TaskRun.result)).all()
            calls = conn.execute(select(func.count()).select_from(ModelCall)).scalar_one()
            ok_calls = conn.execute(select(func.count()).where(ModelCall.ok.is_(True))).scalar_one()
            per_step = conn.execute(
                select(ModelCall.idempotency_key, ModelCall.step).where(ModelCall.ok.is_(True)).distinct()
            ).all()
            scores = conn.execute(
                select(
                    ArticleScore.article_id,
                    ArticleScore.version,
                    ArticleScore.summary,
                    ArticleScore.keywords,
                    ArticleScore.quality,
                )
            ).all()
    finally:
        engine.dispose()
    return {
        "runs": {key: (status, result) for key, status, result in runs},
        "calls": int(calls),
        "ok_calls": int(ok_calls),
        "steps_called": len(per_step),
        "scores": scores,
    }


def check_exactly_once(state: dict[str, Any], articles: list[dict[str, Any]]) -> None:
    """Every article: one COMPLETED run whose result is the undisturbed model's, one ArticleScore row."""
    assert len(state["runs"]) == len(articles)
    for article in articles:
        want = expected(article)
        status, result = state["runs"][f"article:{article['id']}:v{article['version']}"]
        assert status is RunStatus.COMPLETED, article["id"]
        assert result == want, article["id"]
    assert len(state["scores"]) == len(articles)  # nothing lost, nothing doubled
    by_article = {(a, v): (s, k, q) for a, v, s, k, q in state["scores"]}
    assert len(by_article) == len(articles)
    for article in articles:
        want = expected(article)
        assert by_article[(article["id"], article["version"])] == (want["summary"], want["keywords"], want["quality"])
    assert state["steps_called"] == STEPS * len(articles)  # every step of every article was called


# -- the embedded default: no server at all ------------------------------------------------------------


def test_hundred_articles_with_duplicates_on_the_embedded_default(tmp_path: Path) -> None:
    """From a fresh folder with no settings and no servers: the sample shipped in the package (`--sample`), on the
    embedded broker and ./oncelery.db, is scored exactly once."""
    # Calls answer at once (--call-seconds 0): the kill test below is where their time matters.
    done = process("--limit", "100", "--duplicates", "0.3", "--call-seconds", "0", cwd=tmp_path, sample=True)
    assert done.code == 0, f"{done.out}\n{done.err}"
    assert live_workers(done.out) == [], "the command left its worker running"

    state = database_state(f"sqlite:///{tmp_path / 'oncelery.db'}")
    assert state["calls"] == state["ok_calls"] == 300  # 100 x 3 exactly: no duplicate ever called the model
    check_exactly_once(state, load_articles(100))

    s = done.summary
    assert s["deliveries_sent"] == 130 and s["sent_duplicates"] == 30
    assert s["executed"] == 100 and s["replayed"] == 30 and s["resumed"] == 0
    assert s["in_progress_waits"] >= 1  # copies right behind their first really met it running
    assert s["llm_calls"] == 300 and s["wasted_calls"] == 0
    assert s["llm_calls_saved"] == 90 and s["llm_calls_without_oncelery"] == 390
    assert s["score_rows"] == 100 and s["missing"] == [] and s["worker_kills"] == 0
    assert "exactly once: 100 scores for 100 articles" in done.out
    assert list((tmp_path / ".oncelery" / "broker" / "queue").glob("*.msg")) == []  # every delivery answered


@pytest.mark.crash
@pytest.mark.timeout(240)
def test_worker_sigkills_lose_nothing_and_double_nothing(tmp_path: Path) -> None:
    # --lease 3: a job held by a killed worker is taken over (or swept back by the relay) after 3 s, not 60 s.
    # Copies a killed worker held are not waited for (the command's 11 s settle): this test reads the database.
    env = {**clean_env(), "ONCELERY_PROCESS_SETTLE_S": "1"}
    # Two kills (after 10 and 20 articles) before the 30th is scored: each lands mid-stream, as with more articles.
    articles, every = 30, 10
    done = process(
        "--limit",
        str(articles),
        "--duplicates",
        "0.3",
        "--kill-worker-every",
        str(every),
        "--lease",
        "3",
        "--quiet-seconds",
        "1",
        cwd=tmp_path,
        env=env,
        timeout=200,
    )
    assert done.code == 0, f"{done.out}\n{done.err}"
    assert live_workers(done.out) == [], "the command left a worker running"
    kills = done.summary["worker_kills"]
    assert kills >= 2 and len(re.findall(r"^kill \d+: SIGKILLed", done.out, re.M)) == kills, done.out
    assert done.summary["jobs_interrupted"] >= 1
    assert len(worker_pids(done.out)) == kills + 1  # restarted after every kill

    state = database_state(f"sqlite:///{tmp_path / 'oncelery.db'}")
    check_exactly_once(state, load_articles(articles))  # a score per article, each equal to the no-fault result
    # At most the call in flight at each kill is repeated; finished steps are never called again.
    assert STEPS * articles <= state["calls"] <= STEPS * articles + kills
    assert done.summary["llm_calls"] == state["calls"]
    assert done.summary["wasted_calls"] == state["calls"] - STEPS * articles
    # Every call beyond one per step is labelled: the create window's re-send (with the unknown call's own row).
    repeated = done.summary["repeated_calls"]
    assert done.summary["wasted_calls"] == sum(repeated.values()) - repeated.get("unknown_outcome", 0)


def test_a_malformed_line_names_its_number_and_sends_nothing(tmp_path: Path) -> None:
    lines = SAMPLES.read_text(encoding="utf-8").splitlines()[:5]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([*lines[:2], '{"id": "x", "version": 1, "text": "unterminated', *lines[2:]]) + "\n")
    proc = subprocess.run(
        [ONCELERY, "process", str(bad)], cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0
    assert "bad.jsonl line 3: not valid JSON" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "oncelery.db").exists()  # nothing migrated, no worker, nothing enqueued
    assert list(tmp_path.rglob("*.msg")) == []


# -- Redis + PostgreSQL ----------------------------------------------------------------------------------


def test_redis_and_postgresql_counts_are_exact(tmp_path: Path, redis_url: str, pg_session_url: str) -> None:
    engine = create_engine(pg_session_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "TRUNCATE article_scores, model_calls, llm_intents, step_results, dead_letters, outbox, "
                    "delivery_outcomes, task_runs RESTART IDENTITY"
                )
            )
    finally:
        engine.dispose()
    queue = unique_queue()
    env = clean_env(
        ONCELERY_BROKER_URL=redis_url,
        ONCELERY_RESULT_BACKEND=results_url(redis_url),
        ONCELERY_DATABASE_URL=pg_session_url,
    )
    try:
        done = process(
            "--limit", "30", "--duplicates", "0.3", "--start-worker", "--queue", queue, "--call-seconds", "0",
            cwd=tmp_path, env=env,
        )  # fmt: skip
    finally:
        delete_queue_keys(redis_url, queue)
    assert done.code == 0, f"{done.out}\n{done.err}"
    assert live_workers(done.out) == []
    assert f"queue {queue}" in done.out

    state = database_state(pg_session_url)
    assert state["calls"] == state["ok_calls"] == 90
    check_exactly_once(state, load_articles(30))
    s = done.summary
    assert s["executed"] == 30 and s["replayed"] == 9 and s["deliveries_sent"] == 39
    assert s["llm_calls"] == 90 and s["llm_calls_saved"] == 27 and s["wasted_calls"] == 0
