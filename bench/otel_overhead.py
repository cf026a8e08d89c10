"""The CPU OpenTelemetry tracing adds per job: bench/throughput.py's `idem` phase with tracing off and on.

    python bench/otel_overhead.py [--jobs 5000] [--repeat 4] [--database-url URL] [--spawn-redis PORT] [--fresh-db]
                                  [--concurrency 2] [--settle 30] [--json FILE]

Each round runs a phase (N first executions of an IdempotentTask no-op on a real `celery worker`, prefork,
Redis broker, PostgreSQL) twice: once as is, once with BENCH_OTEL=1, where `oncelery_otel` is on and each pool
process has the OpenTelemetry SDK (a BatchSpanProcessor and a PeriodicExportingMetricReader whose exporters drop
what they get: bench/support/otel_sdk.py). The order alternates by round (off/on, on/off, ...), so a slow spell of
the shared machine hits both alike. Reported: the worker's CPU per job (its main process and pool children, from
/proc), medians over the rounds, and the overhead (on - off) / off. The goal (issue 28) is at most 5 %.

Two jobs, each in both halves of every round: `idem` (no step: tracing adds one run span per job) and `steps` (the
no-op in three checkpointed steps: a run span and three step spans per job). Model calls are not in it (their cost
is the provider's round trips; the fake provider's CPU would swamp the figure).
Benchmarks are not tests: nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from bench import throughput
from bench.support.harness import LOG_DIR, admin_engine, prepare_database, spawn_redis, stop_process
from bench.support.otel_sdk import SPANS_KEY

_ORIGINAL_ENV = throughput.worker_env
_TRACING = {"on": False}
# bench/throughput.py's `idem` (a no-op: one run span per job) and `steps` (bench_app's bench_steps: the no-op in three
# checkpointed steps, so a run span and three step spans per job).
JOBS = ("idem", "steps")


def _worker_env(phase: str, args: argparse.Namespace, queue: str, cache_url: str) -> dict[str, str]:
    """bench/throughput.py's worker environment, with BENCH_OTEL set while the round's `on` half runs."""
    env = _ORIGINAL_ENV(phase, args, queue, cache_url)
    env["BENCH_OTEL"] = "1" if _TRACING["on"] else ""
    return env


def worker_ms(res: Any) -> float:
    """CPU ms per job of the worker (main process and pool children): where tracing runs."""
    return float(res.cpu_ms["main"] + res.cpu_ms["children"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """bench/throughput.py's options, with the phases fixed to `idem` and fewer jobs by default."""
    args, _ = throughput.parse_args([*(argv or []), "--phases", "idem"])
    if "--jobs" not in (argv or []):
        args.jobs = 5000
    if "--repeat" not in (argv or []):
        args.repeat = 4
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the interleaved rounds and print the per-job CPU of each half and the overhead."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = parse_args(sys.argv[1:] if argv is None else argv)
    private = None
    if args.spawn_redis:
        private = spawn_redis(args.spawn_redis)
        args.broker_url = args.stats_url = f"redis://127.0.0.1:{args.spawn_redis}/0"
    throughput.worker_env = _worker_env  # run_phase builds each worker's environment through it
    try:
        return run(args)
    finally:
        stop_process(private)


def run(args: argparse.Namespace) -> int:
    """Rounds of (off, on) or (on, off); print each run and the medians."""
    for name, value in (
        ("BENCH_BROKER_URL", args.broker_url), ("BENCH_STATS_URL", args.stats_url),
        ("BENCH_QUEUE_TYPE", args.queue_type), ("BENCH_DATABASE_URL", args.database_url),
    ):  # fmt: skip
        os.environ[name] = value
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    admin = admin_engine(args.database_url)
    prepare_database(args.database_url, admin, args.fresh_db)
    stats = redis.Redis.from_url(args.stats_url)
    runs: dict[str, list[dict[str, float]]] = {f"{job} {half}": [] for job in JOBS for half in ("off", "on")}
    print(f"{args.jobs} jobs x {args.repeat} rounds, prefork -c {args.concurrency}, {os.cpu_count()} CPUs")
    for r in range(args.repeat):
        for job, half in [(j, h) for j in JOBS for h in (("off", "on") if r % 2 == 0 else ("on", "off"))]:
            _TRACING["on"] = half == "on"
            stats.delete(SPANS_KEY)
            res = throughput.run_phase(job, uuid.uuid4().hex[:12], args, admin, stats, None)
            row = {"round": r, "worker_ms": worker_ms(res), "total_ms": sum(res.cpu_ms.values()),
                   "jobs_s": res.rate_ready, "spans_per_job": int(stats.get(SPANS_KEY) or 0) / res.jobs}  # fmt: skip
            runs[f"{job} {half}"].append(row)
            print(
                f"round {r} {job:5} tracing {half:3}: worker CPU {row['worker_ms']:.3f} ms/job, "
                f"all CPU {row['total_ms']:.3f} ms/job, {row['jobs_s']:.0f} jobs/s, "
                f"spans exported {row['spans_per_job']:.2f}/job {res.verified}",
                flush=True,
            )
    med = {name: {k: statistics.median(x[k] for x in rows) for k in ("worker_ms", "total_ms", "jobs_s")}
           for name, rows in runs.items()}  # fmt: skip
    overhead = {}
    for job in JOBS:
        off, on = med[f"{job} off"], med[f"{job} on"]
        overhead[job] = (on["worker_ms"] - off["worker_ms"]) / off["worker_ms"]
        print(
            f"{job:5}: median worker CPU per job off {off['worker_ms']:.3f} ms, on {on['worker_ms']:.3f} ms: "
            f"{overhead[job]:+.1%} (goal <= 5 %); all CPU per job off {off['total_ms']:.3f} ms, "
            f"on {on['total_ms']:.3f} ms"
        )
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "medians": med, "overhead": overhead}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
