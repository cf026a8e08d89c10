"""A peer for comparison: DBOS Transact 3.4 on the same PostgreSQL, one-step workflows deduplicated by id.

    python bench/dbos_peer.py [--jobs 1000] [--steps 10] [--workflows 200] [--polling-interval 1.0]
                              [--database-url postgresql://postgres@127.0.0.1:5432/oncelery_bench_dbos]
                              [--keep] [--json FILE]

DBOS keeps its system tables in a database of its own (created by DBOS at launch; dropped first, and at the
end unless --keep). One process enqueues the workflows on a DBOS queue and its queue thread runs them
(default queue settings; --polling-interval is the queue's polling_interval_sec, DBOS's default 1 s):

    first      --jobs workflows of one no-op step, workflow id = deduplication id = `<run>-<i>`:
               jobs / (first enqueue -> every workflow SUCCESS in dbos.workflow_status)
    enqueue    the enqueue loop alone of those first executions (jobs/s)
    duplicate  the same workflow ids enqueued again: DBOS returns the finished workflow's handle, nothing runs
               (a duplicate is answered entirely by its enqueue: jobs/s of that loop)
    step cost  --workflows direct calls (SetWorkflowID, synchronous, in this process) of a workflow with
               --steps no-op steps and of one with 1 step: ms per workflow each, and
               (ms of K steps - ms of 1 step) / (K - 1) = ms per extra step checkpoint
               (DBOS publishes 1-2 ms per step; Oncelery's: `python bench/steps.py --k-steps K`)

Step executions are counted in-process: every first execution ran its step once, no duplicate ran it.
Benchmarks are not tests: nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from collections import Counter
from importlib.metadata import version
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.support.harness import admin_engine, drop_database

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/oncelery_bench_dbos"
executions: Counter[str] = Counter()


def define(dbos_cls: Any, k: int) -> dict[str, Any]:
    """Register the benchmark's workflows with DBOS: one no-op step, and `k` no-op steps."""

    @dbos_cls.step()
    def noop_step(i: int) -> int:
        executions["step"] += 1
        return i

    @dbos_cls.workflow()
    def one_step(i: int) -> int:
        return noop_step(i)

    @dbos_cls.workflow()
    def k_steps(i: int) -> int:
        for _ in range(k):
            noop_step(i)
        return i

    return {"one_step": one_step, "k_steps": k_steps}


def count_success(url: str, prefix: str) -> int:
    """Workflows whose id starts with `prefix` that are SUCCESS in DBOS's workflow_status."""
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as conn:
            n = conn.execute(
                text("SELECT count(*) FROM dbos.workflow_status WHERE status = 'SUCCESS' AND workflow_uuid LIKE :p"),
                {"p": prefix + "%"},
            ).scalar_one()
    finally:
        engine.dispose()
    return int(n)


def enqueue_all(queue: Any, workflow: Any, tag: str, jobs: int) -> float:
    """Enqueue `jobs` workflows with ids (= deduplication ids) `<tag>-<i>`; return the seconds taken."""
    from dbos import SetEnqueueOptions, SetWorkflowID

    started = time.perf_counter()
    for i in range(jobs):
        with SetWorkflowID(f"{tag}-{i}"), SetEnqueueOptions(deduplication_id=f"{tag}-{i}"):
            queue.enqueue(workflow, i)
    return time.perf_counter() - started


def queue_rates(url: str, queue: Any, workflow: Any, jobs: int) -> dict[str, float]:
    """First executions through the queue (enqueue + drain) and duplicates of the same ids."""
    tag = uuid.uuid4().hex[:10]
    before = executions["step"]
    started = time.perf_counter()
    enqueue_s = enqueue_all(queue, workflow, tag, jobs)
    while count_success(url, tag) < jobs:
        time.sleep(0.05)
    first_s = time.perf_counter() - started
    first_steps = executions["step"] - before
    before = executions["step"]
    dup_s = enqueue_all(queue, workflow, tag, jobs)
    time.sleep(2 * queue.polling_interval_sec)  # a duplicate that were queued again would run by now
    return {
        "first_jobs_per_s": jobs / first_s,
        "enqueue_jobs_per_s": jobs / enqueue_s,
        "duplicate_jobs_per_s": jobs / dup_s,
        "steps_run_by_first": first_steps,
        "steps_run_by_duplicates": executions["step"] - before,
    }


def step_cost(workflows: dict[str, Any], n: int, k: int) -> dict[str, float]:
    """Median ms of a direct call of the 1-step and the k-step workflow, and ms per extra step."""
    from dbos import SetWorkflowID

    tag = uuid.uuid4().hex[:10]
    took: dict[str, list[float]] = {"one_step": [], "k_steps": []}
    for i in range(n):
        for name in ("one_step", "k_steps"):  # interleaved, so a slow spell of the machine hits both
            started = time.perf_counter()
            with SetWorkflowID(f"{tag}-{name}-{i}"):
                workflows[name](i)
            took[name].append((time.perf_counter() - started) * 1000)
    one, many = statistics.median(took["one_step"]), statistics.median(took["k_steps"])
    return {"one_step_ms": one, "k_steps_ms": many, "k": k, "ms_per_extra_step": (many - one) / (k - 1)}


def main(argv: list[str] | None = None) -> int:
    """Launch DBOS on its own database, measure, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1000, help="workflows enqueued (first, then duplicates)")
    parser.add_argument("--steps", type=int, default=10, help="K: steps of the multi-step workflow (>= 2)")
    parser.add_argument("--workflows", type=int, default=200, help="direct calls of each workflow for the step cost")
    parser.add_argument("--polling-interval", type=float, default=1.0, help="the queue's polling_interval_sec")
    parser.add_argument("--database-url", default=DEFAULT_URL, help="DBOS's system database (the bench's own)")
    parser.add_argument("--keep", action="store_true", help="keep DBOS's database at the end")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    from dbos import DBOS

    name = make_url(args.database_url).database or ""
    admin = admin_engine(args.database_url)
    drop_database(admin, name)
    config: Any = {"name": "oncelery-bench", "system_database_url": args.database_url, "log_level": "WARNING"}
    DBOS(config=config)
    workflows = define(DBOS, args.steps)
    try:
        DBOS.launch()
        queue = DBOS.register_queue("oncelery_bench", polling_interval_sec=args.polling_interval)
        print(f"DBOS {version('dbos')} on {args.database_url}, queue polling {args.polling_interval}s")
        rates = queue_rates(args.database_url, queue, workflows["one_step"], args.jobs)
        cost = step_cost(workflows, args.workflows, args.steps)
    finally:
        DBOS.destroy()
        if not args.keep:
            drop_database(admin, name)
    print(f"\n{'DBOS 3.4, one process':<44} {'value':>10}")
    print("-" * 55)
    print(f"{'first executions, enqueue + drain, jobs/s':<44} {rates['first_jobs_per_s']:>10.1f}")
    print(f"{'  of it the enqueue loop alone, jobs/s':<44} {rates['enqueue_jobs_per_s']:>10.1f}")
    print(f"{'duplicates (same workflow ids), jobs/s':<44} {rates['duplicate_jobs_per_s']:>10.1f}")
    print(f"{'workflow of 1 step, direct call, ms (p50)':<44} {cost['one_step_ms']:>10.2f}")
    print(f"{f'workflow of {args.steps} steps, direct call, ms (p50)':<44} {cost['k_steps_ms']:>10.2f}")
    print(f"{'per extra step checkpoint, ms':<44} {cost['ms_per_extra_step']:>10.2f}")
    print(
        f"step executions: {rates['steps_run_by_first']} by {args.jobs} first executions, "
        f"{rates['steps_run_by_duplicates']} by {args.jobs} duplicates"
    )
    if args.json:
        args.json.write_text(json.dumps({"jobs": args.jobs, **rates, **cost}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
