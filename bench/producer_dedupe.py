"""Producer dedupe: duplicates answered at `.delay()` against plain Celery's enqueue-and-execute rate, and the
latency of a duplicate's `.delay(...).get()` on PostgreSQL with 1 M runs (issue 27 §1).

    python bench/producer_dedupe.py [--rows 1000000] [--jobs 4000] [--producers 2] [--repeat 3] [--ops 2000]
                                    [--concurrency 2] [--admin-url URL]

Creates its own database (`oncelery_bench_producer`, dropped at the end), migrates it, fills task_runs to --rows
(bench/latency.py's rows: 5 other tasks, mostly COMPLETED), then completes --jobs runs of `bench.pdup` (key
`pd:{i}`) by direct calls. Then, in interleaved rounds (--repeat), with --producers producer processes on both
sides:

    plain   --jobs `.delay()` of a plain Celery no-op, split over the producers, while one `celery worker`
            (prefork --concurrency, Redis broker, results ignored) executes them: jobs / (last done - first
            send), the rate at which plain Celery takes a submission through to its execution
    dup     --jobs `.delay()` of duplicates of the completed runs, split over the producers: each is answered
            at the producer (a ProducerReplay; checked): jobs / wall time (process starts included). No worker
            runs; nothing is published. Both tasks ignore results (the plain no-op as in bench/throughput.py).

and the latency of one duplicate's `.delay(...).get()` (one thread, --ops calls after 100 warm-up calls), p50 /
p99 ms: of that task, and of one whose results are stored (the answer is written to the Redis result backend
for its task id, one pipelined round trip, as a default app's would be).

Benchmarks are not tests: nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from sqlalchemy.engine import make_url

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.latency import grow, timed
from bench.support.harness import (
    DEFAULT_BROKER_URL,
    LOG_DIR,
    admin_engine,
    create_database,
    drop_database,
    p50_p99,
    start_worker,
    stop_worker,
    wait_done,
)
from oncelery import IdempotentTask
from oncelery.basetask.producer import ProducerReplay
from oncelery.runs.claims import RunStore
from oncelery.store.schema import upgrade_schema

DATABASE = "oncelery_bench_producer"
RESULTS_DB = 6  # the Redis database of the producer app's result backend


def producer_app(url: str, broker: str, ignore_result: bool = True) -> tuple[Celery, Any]:
    """The producer's app: Redis broker and result backend, a claims database configured; its task ignores results
    as the plain no-op does (`ignore_result=False`: another task, whose answers are stored in the backend)."""
    name = "bench.pdup" if ignore_result else "bench.pdup_stored"
    app = Celery("bench-producer")
    app.conf.update(
        broker_url=broker,
        result_backend=broker.rsplit("/", 1)[0] + f"/{RESULTS_DB}",
        oncelery_database_url=url,
        result_expires=600,
    )

    @app.task(
        shared=False, base=IdempotentTask, bind=True, name=name, idempotency_key="pd:{i}", ignore_result=ignore_result
    )
    def pdup(self: IdempotentTask, i: int) -> dict[str, int]:
        return {"i": i}

    app.finalize()
    return app, pdup


def send_plain(queue: str, run: str, start: int, stop: int) -> None:
    """A producer process of the plain phase: `.delay()` of the plain no-op for i in [start, stop)."""
    from bench.support.bench_app import bench_plain

    for i in range(start, stop):
        bench_plain.apply_async((run, i), queue=queue)


def send_duplicates(url: str, broker: str, start: int, stop: int) -> None:
    """A producer process of the dup phase: `.delay()` of a duplicate for i in [start, stop), each answered there."""
    _app, pdup = producer_app(url, broker)
    for i in range(start, stop):
        if not isinstance(pdup.delay(i), ProducerReplay):
            raise SystemExit(f"pd:{i} was published: not answered at the producer")


def in_processes(target: Any, slices: list[tuple[Any, ...]]) -> float:
    """Run target(*slice) in one forked process per slice; return the wall time from the first start to the last end."""
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=target, args=args) for args in slices]
    t0 = time.perf_counter()
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"a producer process exited with {proc.exitcode}")
    return time.perf_counter() - t0


def split(jobs: int, producers: int) -> list[tuple[int, int]]:
    """[start, stop) slices of range(jobs), one per producer."""
    step = -(-jobs // producers)
    return [(start, min(jobs, start + step)) for start in range(0, jobs, step)]


def plain_round(args: argparse.Namespace, stats: redis.Redis) -> float:
    """One plain round: a worker is ready, the producers send, the worker executes: jobs per second."""
    queue = f"oncelery_bench.pplain.{uuid.uuid4().hex[:8]}"
    prefix = f"bench:{queue}"
    env = {**os.environ, "BENCH_QUEUE": queue, "BENCH_BROKER_URL": args.broker_url, "BENCH_DATABASE_URL": args.url}
    log = LOG_DIR / f"{queue}.log"
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    proc = start_worker(queue, env, log, args.concurrency)
    try:
        deadline = time.monotonic() + 60
        while not stats.exists(f"{prefix}:ready"):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the plain worker did not start: see {log}")
            time.sleep(0.05)
        run = uuid.uuid4().hex[:8]
        t0 = time.time()
        in_processes(send_plain, [(queue, run, a, b) for a, b in split(args.jobs, args.producers)])
        wait_done(proc, stats, prefix, args.jobs, max(120.0, args.jobs / 20), log)
        last = float(stats.get(f"{prefix}:last") or time.time())
    finally:
        stop_worker(proc)
    return args.jobs / (last - t0)


def main(argv: list[str] | None = None) -> int:
    """Create and fill the database, complete the runs, then measure both phases and the latency."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_admin = os.environ.get("ONCELERY_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--admin-url", default=default_admin)
    parser.add_argument("--broker-url", default=DEFAULT_BROKER_URL)
    parser.add_argument("--rows", type=int, default=1_000_000, help="task_runs rows of other tasks")
    parser.add_argument("--jobs", type=int, default=4000, help="jobs per phase and round")
    parser.add_argument("--producers", type=int, default=2, help="producer processes, on both sides")
    parser.add_argument("--concurrency", type=int, default=2, help="the plain worker's prefork children")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ops", type=int, default=2000, help="timed duplicate .delay().get() calls")
    args = parser.parse_args(argv)
    admin = admin_engine(args.admin_url)
    url = args.url = make_url(args.admin_url).set(database=DATABASE).render_as_string(hide_password=False)
    create_database(admin, DATABASE, fresh=True)
    stats = redis.Redis.from_url(args.broker_url)
    try:
        upgrade_schema(url)
        # The identity key first, as on a database Oncelery created: the filled rows are not runs stored before
        # keyed digests (those are judged by the worker's legacy lookup, and a producer publishes them as ever).
        RunStore(url).identity_key()
        took = grow(url, 1, args.rows)
        print(f"task_runs filled to {args.rows:,} rows in {took:.1f} s", flush=True)
        _app, pdup = producer_app(url, args.broker_url)
        _app, stored = producer_app(url, args.broker_url, ignore_result=False)
        for i in range(args.jobs):
            pdup(i)  # a direct call: claimed and completed in this process
            stored(i)
        print(f"{args.jobs} runs of bench.pdup completed", flush=True)

        rng = random.Random(1)

        def duplicate(_i: int) -> None:
            if not isinstance(pdup.delay(rng.randrange(args.jobs)), ProducerReplay):
                raise SystemExit("a duplicate was published")

        def duplicate_get(task: Any) -> Any:
            def call(_i: int) -> None:
                i = rng.randrange(args.jobs)
                if task.delay(i).get(timeout=10) != {"i": i}:
                    raise SystemExit("a wrong answer")

            return call

        latency = timed(args.ops, duplicate_get(pdup))
        latency_stored = timed(args.ops, duplicate_get(stored))
        plain: list[float] = []
        dup: list[float] = []
        for r in range(args.repeat):
            phases = ["plain", "dup"] if r % 2 == 0 else ["dup", "plain"]
            for phase in phases:
                if phase == "plain":
                    plain.append(plain_round(args, stats))
                else:
                    slices = [(url, args.broker_url, a, b) for a, b in split(args.jobs, args.producers)]
                    dup.append(args.jobs / in_processes(send_duplicates, slices))
            print(f"round {r + 1}: plain {plain[-1]:.0f} jobs/s, dup {dup[-1]:.0f} calls/s", flush=True)
        p50, p99 = p50_p99(latency)
        print(
            f"\nproducers {args.producers} (processes, both sides); plain worker prefork {args.concurrency}; "
            f"task_runs {args.rows + args.jobs:,} rows"
        )
        print(f"{'phase':<34} {'median':>10} {'rounds':>30}")
        print(f"{'plain enqueue+execute (jobs/s)':<34} {statistics.median(plain):>10.0f} {plain!s:>30}")
        print(f"{'dup answered at producer (calls/s)':<34} {statistics.median(dup):>10.0f} {dup!s:>30}")
        print(f"{'ratio dup / plain':<34} {statistics.median(dup) / statistics.median(plain):>10.2f}")
        print(f"duplicate .delay().get(): p50 {p50:.3f} ms, p99 {p99:.3f} ms, mean {statistics.fmean(latency):.3f} ms")
        p50, p99 = p50_p99(latency_stored)
        print(f"the same, result stored in the Redis backend: p50 {p50:.3f} ms, p99 {p99:.3f} ms")
        print(f"duplicate .delay() alone (no .get()): p50 {p50_p99(timed(args.ops, duplicate))[0]:.3f} ms")
    finally:
        from oncelery.store.database import dispose_engines

        dispose_engines()
        drop_database(admin, DATABASE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
