"""Memory of a worker child: plain Celery tasks vs IdempotentTask, after N jobs and as jobs go on.

    python bench/memory.py [--checkpoints 10000,50000] [--phases plain,idem] [--database-url URL]
                           [--spawn-redis 6397 | --broker-url URL] [--fresh-db] [--json FILE]

Each phase starts one `celery -A bench.support.bench_app worker --pool=prefork --concurrency=1` (Redis broker,
PostgreSQL claims database as bench/throughput.py), so there is one pool child to read. Jobs go in batches:
up to the first checkpoint, wait until the last is done, read the child's /proc/<pid>/status, then the next
batch up to the next checkpoint, and so on (the child is idle at each reading; the same pid is checked).

    ready      VmRSS of the child after worker_ready, before its first job
    @N         VmRSS after N jobs (also kept: VmHWM = peak RSS, RssAnon = heap and the like)
    x plain    idem's VmRSS at the first checkpoint / plain's (the goal: <= 1.15)
    growth     VmRSS at the last checkpoint - at the first, in MiB and % (the goal: none)
    USS        the child's private pages at the first checkpoint (smaps_rollup Private_*), and its ratio
               to plain's: VmRSS also counts pages still shared with the worker's main process

Both phases import the same app module (Celery, SQLAlchemy and Oncelery are loaded in both children), so the
difference is what running claims costs: engines, pools, compiled statements, the heartbeat thread.
Jobs are no-ops (`oncelery.bench_plain` / `oncelery.bench_idem`, a distinct key per job). Benchmarks are not
tests: nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.support.harness import (
    DEFAULT_BROKER_URL,
    DEFAULT_DATABASE_URL,
    LOG_DIR,
    REPO,
    admin_engine,
    children_of,
    memory_kib,
    prepare_database,
    spawn_redis,
    start_worker,
    stop_process,
    stop_worker,
    truncate,
    wait_done,
)


def _task(phase: str) -> Any:
    from bench.support import bench_app

    return {"plain": bench_app.bench_plain, "idem": bench_app.bench_idem, "once": bench_app.bench_once}[phase]


def run_phase(phase: str, checkpoints: list[int], args: argparse.Namespace, stats: redis.Redis) -> dict[str, Any]:
    """Run `phase`'s jobs through one worker child, reading its memory at ready and at each checkpoint."""
    task = _task(phase)
    queue = f"oncelery_bench.mem.{phase}.{uuid.uuid4().hex[:8]}"
    prefix = f"bench:{queue}"
    run_tag = uuid.uuid4().hex[:12]
    if phase == "idem":
        truncate(args.database_url)
    env = {**os.environ, "BENCH_QUEUE": queue, "PYTHONPATH": str(REPO)}
    log = LOG_DIR / f"{queue}.log"
    proc = start_worker(queue, env, log, 1)
    readings: dict[str, dict[str, int]] = {}
    try:
        deadline = time.monotonic() + 60
        while not stats.get(f"{prefix}:ready") and time.monotonic() < deadline:
            time.sleep(0.05)
        (child,) = children_of(proc.pid)
        readings["ready"] = memory_kib(child)
        sent = 0
        for checkpoint in checkpoints:
            with task.app.producer_or_acquire() as producer:
                for i in range(sent, checkpoint):
                    task.apply_async((run_tag, i), queue=queue, producer=producer)
            sent = checkpoint
            wait_done(proc, stats, prefix, checkpoint, max(300.0, checkpoint / 20), log)
            time.sleep(0.5)  # let the child finish its last report and go idle
            if children_of(proc.pid) != [child]:
                raise RuntimeError(f"{phase}: the worker's pool child changed (it was replaced); see {log}")
            readings[str(checkpoint)] = memory_kib(child)
            print(f"  {phase} @{checkpoint}: {json.dumps(readings[str(checkpoint)])} KiB", flush=True)
    finally:
        stop_worker(proc)
    stats.delete(*(f"{prefix}:{k}" for k in ("done", "last", "first", "ready", "db")), queue)
    return {"phase": phase, "pid": child, "readings": readings}


def report(results: dict[str, dict[str, Any]], checkpoints: list[int]) -> dict[str, Any]:
    """Print VmRSS per phase and checkpoint, the ratio to plain and the growth; return the summary."""
    first, last = str(checkpoints[0]), str(checkpoints[-1])
    summary: dict[str, Any] = {}
    cols = ["ready", *map(str, checkpoints)]
    header = f"{'VmRSS MiB':<10}" + "".join(f"{'@' + c if c != 'ready' else c:>10}" for c in cols)
    header += f"{'x plain':>9}{'growth MiB':>12}{'growth %':>10}{'VmHWM MiB':>11}{'USS MiB':>9}{'USS x plain':>12}"
    print("\n" + header + "\n" + "-" * len(header))
    for phase, res in results.items():
        rss = {c: res["readings"][c]["VmRSS"] / 1024 for c in cols}
        plain = results.get("plain")
        ratio = rss[first] / (plain["readings"][first]["VmRSS"] / 1024) if plain else float("nan")
        growth = rss[last] - rss[first]
        hwm = res["readings"][last]["VmHWM"] / 1024
        uss = res["readings"][first]["USS"] / 1024
        uss_ratio = uss / (plain["readings"][first]["USS"] / 1024) if plain else float("nan")
        summary[phase] = {
            "rss_mib": rss,
            "ratio_to_plain": ratio,
            "growth_mib": growth,
            "vm_hwm_mib": hwm,
            "uss_mib": uss,
            "uss_ratio_to_plain": uss_ratio,
        }
        print(
            f"{phase:<10}"
            + "".join(f"{rss[c]:>10.1f}" for c in cols)
            + f"{ratio:>9.3f}{growth:>12.2f}{100 * growth / rss[first]:>9.1f}%{hwm:>11.1f}{uss:>9.1f}{uss_ratio:>12.3f}"
        )
    return summary


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run each phase, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoints", default="10000,50000", help="job counts at which to read the child's memory")
    parser.add_argument("--phases", default="plain,idem", help="comma-separated, of plain, idem, once")
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL, help="PostgreSQL URL of the bench database")
    parser.add_argument("--fresh-db", action="store_true", help="drop and re-create the bench database first")
    parser.add_argument("--broker-url", default=DEFAULT_BROKER_URL, help="Redis broker (use a dedicated db)")
    parser.add_argument("--spawn-redis", type=int, metavar="PORT", help="start a private redis-server as the broker")
    parser.add_argument("--json", type=Path, help="also write the readings and the summary to this file")
    args = parser.parse_args(argv)
    checkpoints = sorted(int(c) for c in args.checkpoints.split(","))
    private_redis = spawn_redis(args.spawn_redis) if args.spawn_redis else None
    if args.spawn_redis:
        args.broker_url = f"redis://127.0.0.1:{args.spawn_redis}/0"
    os.environ["BENCH_BROKER_URL"] = args.broker_url
    os.environ["BENCH_DATABASE_URL"] = args.database_url
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    try:
        prepare_database(args.database_url, admin_engine(args.database_url), args.fresh_db)
        stats = redis.Redis.from_url(args.broker_url)
        print(f"checkpoints {checkpoints}, one worker child (prefork -c 1), broker {args.broker_url}")
        results = {p: run_phase(p, checkpoints, args, stats) for p in args.phases.split(",")}
        summary = report(results, checkpoints)
        if args.json:
            args.json.write_text(json.dumps({"results": results, "summary": summary}, indent=2))
    finally:
        stop_process(private_redis)
    return 0


if __name__ == "__main__":
    sys.exit(main())
