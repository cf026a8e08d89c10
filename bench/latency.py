"""Claim and duplicate-answer latency against PostgreSQL as task_runs grows: 10 k, 100 k and 1 M rows.

    python bench/latency.py [--sizes 10000,100000,1000000] [--ops 2000] [--admin-url URL] [--keep] [--json FILE]
                            [--replay-cache redis://127.0.0.1:6379/5]

Creates its own database (`oncelery_bench_latency`, dropped at the end unless --keep), migrates it with the
project's migrations (`upgrade_schema`), and grows task_runs to each size in turn with INSERT ... SELECT
generate_series (the rows of bench/metrics_scrape.py: 5 tasks, 0.1 % RUNNING, 1 % FAILED, 0.5 % DEAD, the
rest COMPLETED), then VACUUM ANALYZE (what autovacuum would have done by then). At each size it times,
in-process, one thread, --ops calls of each (after 100 unrecorded warm-up calls), p50 / p99 / mean in ms:

    store claim (new key)        RunStore.claim of a key never seen: the worker's first statement per job
    store complete               RunStore.complete of that claim (completion + outcome counter, durable)
    store duplicate              RunStore.claim of a random COMPLETED key among the filled rows: on
                                 PostgreSQL ONE statement claims, reads the stored result and counts the
                                 replay (outcome counter + the run's `replays`); where the claim did not count
                                 it (SQLite), record_outcome(REPLAYED) follows, inside the timing
    task first execution         a direct call of an IdempotentTask no-op with a new key: the whole delivery
                                 path a worker runs (key + fingerprint, claim, heartbeat, body, completion)
    task duplicate               the same call again with a key just completed: answered from the stored result
    task duplicate (cache)       with --replay-cache URL: the same, on a task whose app has the replay cache on
                                 (after as many first executions, which wrote the entries): no database trip

PostgreSQL runs on the same host; Celery's own trace and the broker are not in these figures (see
bench/throughput.py for end to end). Benchmarks are not tests: nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import make_url

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.metrics_scrape import FILL_RUNS, TASKS
from bench.support.harness import admin_engine, create_database, drop_database, p50_p99
from oncelery.models import Outcome
from oncelery.runs.claims import RunStore
from oncelery.runs.decisions import Decision
from oncelery.runs.keys import Identity
from oncelery.store.database import get_engine
from oncelery.store.schema import upgrade_schema

DATABASE = "oncelery_bench_latency"
WARMUP = 100
FILLED_FINGERPRINT = "f" * 64  # what FILL_RUNS stores, so a claim of a filled key is a duplicate, not a conflict
GROW_RUNS = FILL_RUNS.replace("generate_series(1, {runs})", "generate_series({first}, {runs})")
if GROW_RUNS == FILL_RUNS:
    raise SystemExit("bench/metrics_scrape.py's FILL_RUNS changed: update GROW_RUNS here")


def grow(url: str, first: int, size: int) -> float:
    """Insert the filled rows first..size into task_runs and VACUUM ANALYZE it; return the seconds taken."""
    started = time.perf_counter()
    with get_engine(url).begin() as conn:
        conn.execute(text(GROW_RUNS.format(first=first, runs=size, tasks=TASKS)))
    with get_engine(url).connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE task_runs"))
    return time.perf_counter() - started


def completed_filled_key(rng: random.Random, size: int) -> tuple[str, str]:
    """A random (task name, key) among the filled rows 1..size whose status is COMPLETED (see FILL_RUNS)."""
    while True:
        i = rng.randint(1, size)
        if i % 1000 != 0 and i % 100 != 1 and i % 200 != 2:
            return f"bench.task_{i % TASKS}", f"key-{i}"


def timed(ops: int, call: Callable[[int], Any]) -> list[float]:
    """Milliseconds of `ops` calls of call(i), after WARMUP calls that are not recorded."""
    for i in range(WARMUP):
        call(-1 - i)
    took = []
    for i in range(ops):
        started = time.perf_counter()
        call(i)
        took.append((time.perf_counter() - started) * 1000)
    return took


def idempotent_noop(url: str, cache: str | None = None) -> Any:
    """An IdempotentTask no-op (key `lat:{run}:{i}`) of an in-process app on `url`, for direct calls."""
    from celery import Celery

    from oncelery import IdempotentTask

    app = Celery("bench-latency")
    app.conf.oncelery_database_url = url
    app.conf.oncelery_replay_cache = cache
    name = "bench.latency_cached" if cache else "bench.latency"

    @app.task(shared=False, base=IdempotentTask, bind=True, name=name, idempotency_key="lat:{run}:{i}")
    def noop(self: IdempotentTask, run: str, i: int) -> None:
        return None

    app.finalize()
    return noop


def measure(url: str, size: int, ops: int, task: Any, cached: Any = None) -> dict[str, list[float]]:
    """Time every operation of the module docstring at the current size."""
    store = RunStore(url)
    rng = random.Random(size)
    tag = uuid.uuid4().hex[:10]
    claims: dict[int, Any] = {}

    def claim_new(i: int) -> None:
        res = store.claim("bench.latency_store", Identity(f"new-{tag}-{i}", "0" * 64, {}), lease=60)
        if res.decision is not Decision.CLAIMED:
            raise RuntimeError(f"expected a new claim, got {res.decision}")
        claims[i] = res.claim

    def complete(i: int) -> None:
        store.complete(claims.pop(i), None)

    def duplicate(i: int) -> None:
        task_name, key = completed_filled_key(rng, size)
        res = store.claim(task_name, Identity(key, FILLED_FINGERPRINT, {}), lease=60)
        if res.decision is not Decision.COMPLETED or res.run is None:
            raise RuntimeError(f"expected a COMPLETED run for {key}, got {res.decision}")
        if not res.counted:
            store.record_outcome(task_name, Outcome.REPLAYED, "", res.run.run_id)

    figures = {
        "store claim (new key)": timed(ops, claim_new),
        "store complete": timed(ops, complete),
        "store duplicate": timed(ops, duplicate),
        "task first execution": timed(ops, lambda i: task(tag, i)),
        "task duplicate": timed(ops, lambda i: task(tag, i)),
    }
    if cached is not None:
        figures["task first (cache on)"] = timed(ops, lambda i: cached(tag, i))
        figures["task duplicate (cache)"] = timed(ops, lambda i: cached(tag, i))
    return figures


def main(argv: list[str] | None = None) -> int:
    """Create, grow and measure the database at each size; print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_admin = os.environ.get("ONCELERY_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--admin-url", default=default_admin, help="a PostgreSQL server to create the database on")
    parser.add_argument("--sizes", default="10000,100000,1000000", help="task_runs sizes, ascending")
    parser.add_argument("--ops", type=int, default=2000, help="timed calls per operation and size")
    parser.add_argument("--keep", action="store_true", help="keep the filled database")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    parser.add_argument("--replay-cache", metavar="URL", help="also time duplicates answered by this replay cache")
    args = parser.parse_args(argv)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    admin = admin_engine(args.admin_url)
    url = make_url(args.admin_url).set(database=DATABASE).render_as_string(hide_password=False)
    create_database(admin, DATABASE, fresh=True)
    rows: list[dict[str, Any]] = []
    try:
        upgrade_schema(url)
        task = idempotent_noop(url)
        cached = idempotent_noop(url, args.replay_cache) if args.replay_cache else None
        filled = 0
        for size in sizes:
            took = grow(url, filled + 1, size)
            filled = size
            print(f"task_runs filled to {size:,} rows (+ runs of earlier sizes' calls) in {took:.1f} s", flush=True)
            for op, values in measure(url, size, args.ops, task, cached).items():
                p50, p99 = p50_p99(values)
                rows.append({"rows": size, "op": op, "n": len(values), "p50_ms": p50, "p99_ms": p99,
                             "mean_ms": statistics.fmean(values)})  # fmt: skip
        header = f"{'task_runs':>10}  {'operation':<26} {'n':>6} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}"
        print("\n" + header + "\n" + "-" * len(header))
        for row in rows:
            print(
                f"{row['rows']:>10,}  {row['op']:<26} {row['n']:>6} {row['p50_ms']:>8.3f} {row['p99_ms']:>8.3f} "
                f"{row['mean_ms']:>8.3f}"
            )
        if args.json:
            args.json.write_text(json.dumps({"ops": args.ops, "rows": rows}, indent=2))
    finally:
        if args.replay_cache:
            from oncelery.runs.outcomes import flush_replays

            flush_replays()  # the cached replays' counts, before the database goes
        if args.keep:
            print(f"kept: {url}")
        else:
            drop_database(admin, DATABASE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
