"""G4 resume-don't-redo: step checkpoints, seeds, StepMismatch, progress, chain pipelines, entity locks."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, signals
from sqlalchemy import func, select

from oncelery import (
    DeadLetters,
    IdempotentTask,
    LeaseLost,
    ResultNotJSON,
    RunIsDead,
    StepMismatch,
    current_step,
    pipeline,
    step_seed,
)
from oncelery.delivery.steps import StepRunner, load_checkpoints
from oncelery.models import RunStatus, TaskRun
from oncelery.runs.claims import RunStore
from oncelery.runs.keys import Identity
from tests.services import delete_queue_keys, wait_for
from tests.test_metrics import scrape
from tests.test_store_contract import expire_lease


def test_retry_replays_finished_steps_and_executes_only_the_failed_one(
    app: Celery, worker_factory: Any, db_url: str
) -> None:
    calls: Counter[str] = Counter()

    def work(name: str, value: str) -> str:
        calls[name] += 1
        if name == "score" and calls[name] == 1:
            raise RuntimeError("model timed out")
        return f"{name}({value})"

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_steps",
        idempotency_key="doc:{doc}",
        autoretry_for=(RuntimeError,),
        retry_kwargs={"max_retries": 2, "countdown": 0.1},
    )
    def three_steps(self: IdempotentTask, doc: str) -> str:
        a = self.step("summarize", work, "summarize", doc)
        b = self.step("keywords", work, "keywords", a)
        return str(self.step("score", work, "score", b))

    with worker_factory(app):
        assert three_steps.delay("d").get(timeout=60) == "score(keywords(summarize(d)))"

    assert calls == {"summarize": 1, "keywords": 1, "score": 2}
    store = RunStore(db_url)
    run = store.get("oncelery.t_steps", "doc:d")
    assert run is not None and run.status is RunStatus.COMPLETED and run.token == 2
    assert [c.name for c in load_checkpoints(store, run.run_id)] == ["summarize", "keywords", "score"]
    assert three_steps.outcome_counts() == {"failed": 1, "resumed": 1}
    # The exporter's lifetime counters, kept with the outcome counts: 3 checkpointed steps (2 by the failed
    # attempt, 1 by the retry), 2 replayed by the retry, 1 takeover.
    got = scrape(db_url)
    labels = (("name", "oncelery.t_steps"), ("tenant", ""))
    assert got["oncelery_steps_executed_total", labels] == 3
    assert got["oncelery_steps_replayed_total", labels] == 2
    assert got["oncelery_takeovers_total", labels] == 1


def test_changed_step_order_raises_step_mismatch_and_the_run_goes_dead(app: Celery, db_url: str) -> None:
    order = ["extract", "summarize"]

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_mismatch", idempotency_key="m:{n}")
    def evolving(self: IdempotentTask, n: int) -> list[str]:
        out = [self.step(name, str.upper, name) for name in order]
        if order[0] == "extract":
            raise RuntimeError("first attempt dies after its steps")
        return out

    app.finalize()
    with pytest.raises(RuntimeError):
        evolving(1)
    order.reverse()  # the code changed between attempts
    with pytest.raises(StepMismatch, match="'summarize' in this code but 'extract' in the checkpoint"):
        evolving(1)
    run = RunStore(db_url).get("oncelery.t_mismatch", "m:1")
    assert run is not None and run.status is RunStatus.DEAD and "StepMismatch" in (run.error or "")
    with pytest.raises(RunIsDead, match="dlq replay"):  # no delivery runs it again until it is replayed
        evolving(1)


def test_stale_holder_cannot_write_a_step(db_url: str) -> None:
    store = RunStore(db_url)
    zombie = store.claim("oncelery.t_stale", Identity("s", "f", {}), lease=30).claim
    assert zombie is not None
    expire_lease(store, zombie)
    taker = store.claim("oncelery.t_stale", Identity("s", "f", {}), lease=30).claim
    assert taker is not None and taker.token == 2
    calls: list[int] = []
    with pytest.raises(LeaseLost):
        StepRunner(store, zombie, []).run("summarize", lambda: calls.append(1) or "x", (), {})
    assert load_checkpoints(store, zombie.run_id) == []
    assert StepRunner(store, taker, []).run("summarize", lambda: "y", (), {}) == "y"
    assert [c.result for c in load_checkpoints(store, taker.run_id)] == ["y"]


def test_non_json_step_result_is_refused_at_the_step(app: Celery, db_url: str) -> None:
    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_step_json", idempotency_key="j:{n}")
    def bad(self: IdempotentTask, n: int) -> None:
        self.step("embed", lambda: {"vector": {1.0, 2.0}})

    app.finalize()
    with pytest.raises(ResultNotJSON, match="Step 'embed'"):
        bad(1)
    store = RunStore(db_url)
    run = store.get("oncelery.t_step_json", "j:1")
    assert run is not None and load_checkpoints(store, run.run_id) == []


def test_step_seed_is_passed_to_fn_and_equal_across_processes(app: Celery) -> None:
    seeds: list[int] = []

    def sample(text: str, seed: int) -> int:
        seeds.append(seed)
        return seed

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_seed", idempotency_key="seed:{n}")
    def seeded(self: IdempotentTask, n: int) -> int:
        return int(self.step("generate", sample, "t"))

    app.finalize()
    value = seeded(1)
    code = "from idempotency import step_seed; print(step_seed('oncelery.t_seed', 'seed:1', 'generate'))"
    others = [
        int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout)
        for _ in range(2)
    ]
    assert seeds == [value] and others == [value, value]
    assert value == step_seed("oncelery.t_seed", "seed:1", "generate")
    assert step_seed("oncelery.t_seed", "seed:1", "other") != value


def test_progress_state_shows_step_and_replayed_steps(app: Celery, worker_factory: Any) -> None:
    gate = threading.Event()
    retried = threading.Event()
    attempt: list[int] = []

    def first(x: int) -> int:
        return x + 1

    def second(x: int) -> int:
        if not attempt:
            attempt.append(1)
            raise RuntimeError("fail once so the next attempt replays 'first'")
        # The retry can start before the failed attempt's RETRY state is stored (its countdown is short), and
        # that state would then overwrite this attempt's PROGRESS: go on only once it is stored.
        assert retried.wait(60)
        return x * 2

    def blocking(x: int) -> int:
        gate.wait(60)
        return x

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_progress",
        idempotency_key="p:{x}",
        total_steps=3,
        autoretry_for=(RuntimeError,),
        retry_kwargs={"max_retries": 2, "countdown": 0.1},
    )
    def progressing(self: IdempotentTask, x: int) -> int:
        y = self.step("first", first, x)
        z = self.step("second", second, y)
        return int(self.step("third", blocking, z))

    def on_retry(sender: Any = None, **_kwargs: Any) -> None:
        if getattr(sender, "name", None) == "oncelery.t_progress":
            retried.set()  # Celery sends task_retry after it stored the RETRY state

    signals.task_retry.connect(on_retry, weak=False)
    try:
        with worker_factory(app):
            res = progressing.delay(3)
            # Step "second" also reports PROGRESS with "first" replayed: wait for the gated third step.
            info = wait_for(
                lambda: (
                    res.state == "PROGRESS"
                    and res.info.get("replayed") == ["first"]
                    and res.info.get("step") == "third"
                    and res.info
                ),
                timeout=60,
                what="PROGRESS at step 'third' with a replayed step",
            )
            gate.set()
            assert res.get(timeout=60) == 8
    finally:
        signals.task_retry.disconnect(on_retry)
    assert info["step"] == "third" and info["position"] == 2 and info["total"] == 3


def test_chain_pipeline_resumes_from_the_failed_link(app: Celery, worker_factory: Any, db_url: str) -> None:
    calls: Counter[str] = Counter()
    broken = [True]

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_link_summarize")
    def summarize(self: IdempotentTask, text: str) -> str:
        calls["summarize"] += 1
        return text[:20]

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_link_keywords")
    def keywords(self: IdempotentTask, summary: str) -> list[str]:
        calls["keywords"] += 1
        return sorted(set(summary.lower().split()))

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_link_score",
        autoretry_for=(RuntimeError,),
        retry_kwargs={"max_retries": 1, "countdown": 0.1},
    )
    def score(self: IdempotentTask, words: list[str]) -> dict[str, Any]:
        calls["score"] += 1
        if broken[0]:
            raise RuntimeError("scoring model down")
        return {"words": words, "n": len(words)}

    text = "The quick brown fox jumps over the lazy dog"
    with worker_factory(app):
        with pytest.raises(RuntimeError):
            pipeline("article:42:v3", summarize.s(text), keywords.s(), score.s()).delay().get(timeout=60)
        assert calls == {"summarize": 1, "keywords": 1, "score": 2}  # score: first try + 1 retry
        key = "article:42:v3/2:oncelery.t_link_score"
        letters = DeadLetters(db_url).list(task_name="oncelery.t_link_score")
        assert [(x.key, x.reason) for x in letters] == [(key, "retries_exhausted")]  # spent its retries: DEAD
        broken[0] = False
        # The fix is in: replay the dead link; it runs once more and the run completes.
        assert [x.key for x in DeadLetters(db_url).replay(app, letters).replayed] == [key]
        wait_for(lambda: RunStore(db_url).get("oncelery.t_link_score", key).status is RunStatus.COMPLETED, 60)
        result = pipeline("article:42:v3", summarize.s(text), keywords.s(), score.s()).delay().get(timeout=60)
        # A fresh, never-failed pipeline under another key gives the same answer.
        reference = pipeline("article:43:v1", summarize.s(text), keywords.s(), score.s()).delay().get(timeout=60)

    assert result == reference == {"words": ["brown", "fox", "quick", "the"], "n": 4}
    assert calls == {"summarize": 2, "keywords": 2, "score": 4}  # 1 each for the re-run pipeline: only the reference
    store = RunStore(db_url)
    for position, name in enumerate(["summarize", "keywords", "score"]):
        run = store.get(f"oncelery.t_link_{name}", f"article:42:v3/{position}:oncelery.t_link_{name}")
        assert run is not None and run.status is RunStatus.COMPLETED
    assert summarize.outcome_counts() == {"executed": 2, "replayed": 1}


def test_one_running_job_per_entity(app: Celery, worker_factory: Any, db_url: str) -> None:
    store = RunStore(db_url)
    running_seen: list[int] = []
    started = Counter[str]()

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_entity",
        idempotency_key="article:{article_id}:v{version}",
        concurrency_key="article:{article_id}",
    )
    def rescore(self: IdempotentTask, article_id: str, version: int) -> int:
        started[str(version)] += 1
        time.sleep(1.0)
        return version

    def sample() -> None:
        # Both jobs are article 9's (whatever text its concurrency key encodes "9" as): one task, one entity.
        stmt = select(func.count()).where(TaskRun.task_name == rescore.name, TaskRun.status == RunStatus.RUNNING)
        with store.engine.connect() as conn:
            running_seen.append(int(conn.execute(stmt).scalar_one()))

    with worker_factory(app, concurrency=4):
        barrier = threading.Barrier(2)
        results: dict[int, Any] = {}

        def send(version: int) -> None:
            barrier.wait()
            results[version] = rescore.delay("9", version)

        threads = [threading.Thread(target=send, args=(v,)) for v in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)

        def sampled_all_ready() -> bool:
            sample()
            return all(r.ready() for r in results.values())

        wait_for(sampled_all_ready, timeout=60, interval=0.02, what="both rescore jobs of article 9 to finish")
        assert sorted(r.get(timeout=60) for r in results.values()) == [1, 2]

    assert max(running_seen) == 1  # never both RUNNING
    assert started == {"1": 1, "2": 1}
    assert json.dumps(rescore.outcome_counts(), sort_keys=True).count("in_progress") == 1


def test_step_meta_change_is_refused_or_rerun_with_later_steps(app: Celery, db_url: str, redis_url: str) -> None:
    model = {"model": "local-extractive", "version": "1", "prompt_hash": "abc"}
    calls: Counter[str] = Counter()
    fail = [True]
    rerun = [False]
    seen_steps: list[tuple[str, int]] = []

    def generate(text: str, seed: int) -> str:
        info = current_step()
        assert info is not None
        seen_steps.append((info.name, info.position))
        calls["generate"] += 1
        return f"{model['version']}:{text}"

    def polish(text: str) -> str:
        calls["polish"] += 1
        return text + "!"

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_meta", idempotency_key="meta:{n}")
    def job(self: IdempotentTask, n: int) -> str:
        draft = self.step("generate", generate, "t", step_meta=dict(model), rerun_on_change=rerun[0])
        first = self.step("polish", polish, draft)
        if fail[0]:
            raise RuntimeError("dies after both checkpoints")
        return str(first)

    app.finalize()
    with pytest.raises(RuntimeError):
        job(1)
    assert calls == {"generate": 1, "polish": 1}
    fail[0] = False
    model["version"] = "2"  # the model changed between attempts
    with pytest.raises(StepMismatch, match="version changed"):
        job(1)
    rerun[0] = True  # the fix: re-run a step whose model changed; then the dead run is replayed
    replayed = DeadLetters(db_url).replay(app, DeadLetters(db_url).list(task_name="oncelery.t_meta"))
    delete_queue_keys(redis_url, str(app.conf.task_default_queue))  # its message: this test calls the task itself
    assert [x.key for x in replayed.replayed] == ["meta:1"]
    assert job(1) == "2:t!"
    # generate re-ran under the new model and polish, which consumed its old output, re-ran too.
    assert calls == {"generate": 2, "polish": 2}
    assert seen_steps == [("generate", 0), ("generate", 0)]
    store = RunStore(db_url)
    run = store.get("oncelery.t_meta", "meta:1")
    assert run is not None
    assert [(c.name, c.meta["version"] if c.meta else None) for c in load_checkpoints(store, run.run_id)] == [
        ("generate", "2"),
        ("polish", None),
    ]
    assert current_step() is None


def test_runnable_example_resumes(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parent.parent / "examples" / "resume.py"
    out = subprocess.run(
        [sys.executable, str(example)], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert "step executions: {'summarize': 1, 'keywords': 1, 'score': 2}" in out
    assert "conflict:" in out


def test_replaying_a_dead_middle_link_carries_on_down_the_pipeline(
    app: Celery, worker_factory: Any, db_url: str
) -> None:
    """A dead link keeps its chain continuation: `dlq replay` runs it and then the links after it."""
    calls: Counter[str] = Counter()
    broken = [True]

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_mid_first")
    def first(self: IdempotentTask, text: str) -> str:
        calls["first"] += 1
        return text.upper()

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_mid_second", max_retries=0)
    def second(self: IdempotentTask, text: str) -> str:
        calls["second"] += 1
        if broken[0]:
            raise RuntimeError("second link's model is down")
        return text + "!"

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_mid_third")
    def third(self: IdempotentTask, text: str) -> str:
        calls["third"] += 1
        return text * 2

    with worker_factory(app):
        with pytest.raises(RuntimeError):
            pipeline("mid:1", first.s("ab"), second.s(), third.s()).delay().get(timeout=60)
        letters = DeadLetters(db_url).list(task_name="oncelery.t_mid_second")
        assert [x.reason for x in letters] == ["retries_exhausted"] and "chain" in letters[0].message
        broken[0] = False
        assert len(DeadLetters(db_url).replay(app, letters).replayed) == 1
        store = RunStore(db_url)

        def third_done() -> bool:
            run = store.get("oncelery.t_mid_third", "mid:1/2:oncelery.t_mid_third")
            return run is not None and run.status is RunStatus.COMPLETED

        wait_for(third_done, timeout=60, what="the link after the replayed one")
    run = store.get("oncelery.t_mid_third", "mid:1/2:oncelery.t_mid_third")
    assert run is not None and run.result == "AB!AB!"
    assert calls == {"first": 1, "second": 2, "third": 1}
