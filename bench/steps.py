"""Benchmark: what a checkpointed step costs executed vs replayed, and what checkpoints save on retry.

Run: python bench/steps.py [--database-url URL] [--steps 500] [--k-steps 10 --workflows 200] [--json FILE]

SQLite is always measured, then each --database-url. Per database:

    step executed / replayed   p50 of one StepRunner.run of a run's 500 steps, and its statements
    loading all checkpoints    the one SELECT a retried run sends
    5-step pipeline            step executions with and without checkpoints when the last step fails once
    K steps vs 1 step          (--k-steps K) median ms of a direct call of an IdempotentTask whose body runs
                               K no-op self.step() calls vs one, --workflows calls of each (interleaved), and
                               (K - 1)-step difference / (K - 1) = ms per extra step checkpoint: the figure
                               bench/dbos_peer.py measures for DBOS

Figures go to docs/benchmarks.md. Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from celery import Celery
from sqlalchemy import event
from sqlalchemy.engine import make_url

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.support.harness import admin_engine, create_database
from oncelery import IdempotentTask
from oncelery.delivery.steps import StepRunner, load_checkpoints
from oncelery.models.migrate import upgrade
from oncelery.runs.claims import RunStore
from oncelery.runs.keys import Identity
from oncelery.store.database import get_engine


class StatementCounter:
    """Counts SQL statements sent on an engine (database round trips)."""

    def __init__(self, *engines: Any) -> None:
        self.count = 0
        pools: set[int] = set()
        for engine in engines:  # the store reads, claims and writes on engines that may share a pool
            if id(engine.pool) not in pools:
                pools.add(id(engine.pool))
                event.listen(engine, "before_cursor_execute", self._on_execute)

    def _on_execute(self, *_: Any) -> None:
        self.count += 1


def step_costs(url: str, n: int) -> dict[str, float]:
    """Time n executed steps and n replayed steps of one run; count statements of each."""
    store = RunStore(url)
    counter = StatementCounter(store.engine, store.read_engine, store.db.fast_engine)
    claim = store.claim("bench.steps", Identity(f"bench-{time.time_ns()}", "f", {}), lease=600).claim
    assert claim is not None
    runner = StepRunner(store, claim, [])
    executed: list[float] = []
    before = counter.count
    for i in range(n):
        t0 = time.perf_counter()
        runner.run(f"s{i}", lambda i=i: {"i": i}, (), {})
        executed.append(time.perf_counter() - t0)
    exec_statements = (counter.count - before) / n
    # A later attempt: one query loads every checkpoint, then each step replays from memory.
    before = counter.count
    t0 = time.perf_counter()
    checkpoints = load_checkpoints(store, claim.run_id)
    load_s = time.perf_counter() - t0
    load_statements = counter.count - before
    replayer = StepRunner(store, claim, checkpoints)
    replayed: list[float] = []
    before = counter.count
    for i in range(n):
        t0 = time.perf_counter()
        replayer.run(f"s{i}", lambda: None, (), {})
        replayed.append(time.perf_counter() - t0)
    return {
        "executed_p50_us": statistics.median(executed) * 1e6,
        "executed_statements": exec_statements,
        "replayed_p50_us": statistics.median(replayed) * 1e6,
        "replayed_statements": (counter.count - before) / n,
        "load_all_checkpoints_us": load_s * 1e6,
        "load_statements": float(load_statements),
    }


def retry_savings(url: str, steps: int = 5) -> dict[str, int]:
    """Run a `steps`-step pipeline that fails at its last step once, with and without checkpoints."""
    app = Celery("bench-steps")
    app.conf.oncelery_database_url = url
    calls: Counter[str] = Counter()
    fail = [True]

    def work(i: int, value: int) -> int:
        calls[f"step{i}"] += 1
        if i == steps - 1 and fail[0]:
            fail[0] = False
            raise RuntimeError("transient model error at the last step")
        return value + i

    @app.task(shared=False, base=IdempotentTask, bind=True, name="bench.pipeline", idempotency_key="p:{n}")
    def checkpointed(self: IdempotentTask, n: int) -> int:
        value = n
        for i in range(steps):
            value = self.step(f"step{i}", work, i, value)
        return value

    app.finalize()
    key = time.time_ns()
    for _ in range(2):  # first attempt fails at the last step, the retry resumes
        try:
            checkpointed(key)
            break
        except RuntimeError:
            continue
    with_checkpoints = sum(calls.values())

    calls.clear()
    fail[0] = True

    def plain(n: int) -> int:
        value = n
        for i in range(steps):
            value = work(i, value)
        return value

    for _ in range(2):
        try:
            plain(key)
            break
        except RuntimeError:
            continue
    return {"steps": steps, "executions_with_checkpoints": with_checkpoints, "executions_without": sum(calls.values())}


def k_steps_cost(url: str, k: int, n: int) -> dict[str, float]:
    """Median ms of a direct call of a K-step and of a 1-step IdempotentTask, and ms per extra step."""
    app = Celery("bench-k-steps")
    app.conf.oncelery_database_url = url

    def noop(i: int) -> int:
        return i

    def make(name: str, steps: int) -> Any:
        @app.task(shared=False, base=IdempotentTask, bind=True, name=name, idempotency_key="k:{tag}:{i}")
        def body(self: IdempotentTask, tag: str, i: int) -> int:
            for s in range(steps):
                self.step(f"s{s}", noop, i)
            return i

        return body

    tasks = {"one": make("bench.one_step", 1), "k": make("bench.k_steps", k)}
    app.finalize()
    tag = str(time.time_ns())
    took: dict[str, list[float]] = {"one": [], "k": []}
    for i in range(n):
        for name, task in tasks.items():  # interleaved, so a slow spell of the machine hits both
            t0 = time.perf_counter()
            task(tag, i)
            took[name].append((time.perf_counter() - t0) * 1000)
    one, many = statistics.median(took["one"]), statistics.median(took["k"])
    return {"one_step_ms": one, "k_steps_ms": many, "k": k, "ms_per_extra_step": (many - one) / (k - 1)}


def main() -> None:
    """Print the figures for SQLite and (if given) another database URL."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", action="append", default=[])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--k-steps", type=int, default=0, help="K >= 2: also time K-step vs 1-step tasks")
    parser.add_argument("--workflows", type=int, default=200, help="direct calls of each task for --k-steps")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    urls = [f"sqlite:///{tmp / 'bench.db'}", *args.database_url]
    figures: dict[str, Any] = {}
    for url in urls:
        if url.startswith("postgres"):  # the bench's own database: created if missing
            create_database(admin_engine(url), make_url(url).database or "", fresh=False)
        upgrade(get_engine(url))
        costs = step_costs(url, args.steps)
        savings = retry_savings(url)
        name = get_engine(url).dialect.name
        figures[name] = {**costs, **savings}
        if args.k_steps >= 2:
            figures[name]["k_steps"] = k = k_steps_cost(url, args.k_steps, args.workflows)
            print(
                f"[{name}] task of 1 step: p50 {k['one_step_ms']:.2f} ms, of {args.k_steps} steps: "
                f"{k['k_steps_ms']:.2f} ms -> {k['ms_per_extra_step']:.2f} ms per extra step checkpoint"
            )
        print(
            f"[{name}] step executed: p50 {costs['executed_p50_us']:.0f} us, {costs['executed_statements']:.1f} stmts"
        )
        print(
            f"[{name}] step replayed: p50 {costs['replayed_p50_us']:.1f} us, {costs['replayed_statements']:.1f} stmts"
        )
        print(
            f"[{name}] loading all {args.steps} checkpoints on a retry: {costs['load_all_checkpoints_us']:.0f} us, "
            f"{costs['load_statements']:.0f} statement(s)"
        )
        print(
            f"[{name}] {savings['steps']}-step pipeline failing once at step {savings['steps']}: "
            f"{savings['executions_with_checkpoints']} step executions with checkpoints, "
            f"{savings['executions_without']} without"
        )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
