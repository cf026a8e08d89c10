"""Throughput on the embedded default's transport: plain Celery vs IdempotentTask vs a SQLite floor, all on
kombu's filesystem broker, the claims in a SQLite file (no server at all, as `oncelery process` runs by default).

    python bench/embedded.py [--jobs 1000] [--repeat 3] [--phases plain,idem,floor] [--concurrency 2]
                             [--polling-interval S] [--stock-transport] [--spawn-redis 6398 | --stats-url URL]
                             [--json FILE]

The broker settings are the embedded default's own, read from oncelery.celeryconfig (oncelery.embedded_broker,
kombu's filesystem transport woken by acks; --stock-transport: kombu's own filesystem transport), spool
under a temporary $ONCELERY_DATA_DIR, polling_interval 0.1 s unless --polling-interval); the claims database
is a fresh SQLite file migrated with `upgrade_schema`; the worker is `celery -A bench.support.sqlite_floor
worker --pool=prefork` (bench.support.bench_app's app and the floor task; acks_late, prefetch 1, results ignored
in every phase). A job is the same no-op as in bench/throughput.py:

    plain  N jobs of `oncelery.bench_plain`
    idem   N jobs of `oncelery.bench_idem`, each a distinct key (first executions; the run row keeps the
           message, as on the embedded broker by default)
    floor  N jobs of `oncelery.bench_sqlite_floor`, a plain Celery task doing the two SQLite transactions of
           idem's first execution (claim; completion + outcome count) on bare sqlite3, in the same file and
           tables, with Oncelery's pragmas (bench/support/sqlite_floor.py): a yardstick, not Oncelery

Phases run in interleaved rounds (--repeat R; the order rotates). Each phase enqueues all of its jobs,
then starts a fresh worker and waits for the last one. The bench counts finished jobs in a Redis of its own
(one MULTI per job in both phases, spawned on --spawn-redis PORT): only the measuring instrument, not part
of the embedded stack. Printed per phase, median over rounds:

    jobs/s (start)   jobs / (last done - worker process start)
    jobs/s (ready)   jobs / (last done - worker_ready)
    x plain          jobs/s (ready) / plain's
    x floor          jobs/s (ready) / floor's (issue 27 section 3's goal for idem: >= 0.8)
    CPU ms/job       worker main process and pool children, from /proc (steadier than jobs/s on a shared
                     machine: --repeat 3 at least)

kombu's stock virtual transport sleeps `polling_interval` whenever a worker's prefetch window is full, so with
prefetch 1 it caps a worker near concurrency / polling_interval jobs/s (--stock-transport shows it); the
embedded default's transport wakes on the ack instead. Benchmarks are not tests: nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.support.harness import (
    LOG_DIR,
    REPO,
    children_of,
    cpu_seconds,
    spawn_redis,
    start_worker,
    stop_process,
    stop_worker,
    wait_done,
)

PHASES = ("plain", "idem", "floor")
WORKER_APP = "bench.support.sqlite_floor"  # bench_app's app with the floor task: one worker app for every phase


def run_phase(
    phase: str, jobs: int, args: argparse.Namespace, env: dict[str, str], stats: redis.Redis
) -> dict[str, Any]:
    """Enqueue `jobs` no-ops of `phase` on the filesystem broker, drain them with a fresh worker, return the rates."""
    from bench.support.bench_app import bench_idem, bench_plain
    from bench.support.sqlite_floor import bench_sqlite_floor

    task = {"plain": bench_plain, "idem": bench_idem, "floor": bench_sqlite_floor}[phase]
    queue = f"oncelery_bench.{phase}.{uuid.uuid4().hex[:8]}"
    prefix = f"bench:{queue}"
    run_tag = uuid.uuid4().hex[:12]
    started = time.perf_counter()
    with task.app.producer_or_acquire() as producer:
        for i in range(jobs):
            task.apply_async((run_tag, i), queue=queue, producer=producer)
    enqueue_s = time.perf_counter() - started
    log = LOG_DIR / f"{queue}.log"
    t0 = time.time()
    proc = start_worker(queue, {**env, "BENCH_QUEUE": queue}, log, args.concurrency, app=WORKER_APP)
    try:
        wait_done(proc, stats, prefix, jobs, max(300.0, jobs / 2), log)
        cpu = {"main": cpu_seconds(proc.pid), "children": sum(cpu_seconds(p) for p in children_of(proc.pid))}
    finally:
        stop_worker(proc)
    ready = float(stats.get(f"{prefix}:ready") or t0)
    last = float(stats.get(f"{prefix}:last") or 0)
    stats.delete(*(f"{prefix}:{k}" for k in ("done", "last", "first", "ready", "db")))
    return {
        "phase": phase,
        "jobs": jobs,
        "rate_start": jobs / (last - t0),
        "rate_ready": jobs / (last - ready),
        "boot_s": ready - t0,
        "enqueue_rate": jobs / enqueue_s,
        "cpu_ms": {k: 1000 * v / jobs for k, v in cpu.items()},
    }


def report(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Print medians, the ratio idem/plain and every run; return the summary."""
    summary: dict[str, Any] = {}
    for phase, results in runs.items():
        summary[phase] = {
            k: statistics.median(r[k] for r in results) for k in ("rate_start", "rate_ready", "boot_s", "enqueue_rate")
        }
        summary[phase]["cpu_ms"] = {k: statistics.median(r["cpu_ms"][k] for r in results) for k in ("main", "children")}
    header = (
        f"{'phase':<6} {'jobs/s start':>13} {'jobs/s ready':>13} {'x plain':>8} {'x floor':>8} {'boot s':>7} "
        f"{'CPU ms/job main':>16} {'children':>9}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for phase, s in summary.items():
        ratio = s["rate_ready"] / summary["plain"]["rate_ready"] if "plain" in summary else float("nan")
        of_floor = s["rate_ready"] / summary["floor"]["rate_ready"] if "floor" in summary else float("nan")
        s["ratio_ready"], s["ratio_floor"] = ratio, of_floor
        print(
            f"{phase:<6} {s['rate_start']:>13.1f} {s['rate_ready']:>13.1f} {ratio:>8.3f} {of_floor:>8.3f} "
            f"{s['boot_s']:>7.2f} {s['cpu_ms']['main']:>16.2f} {s['cpu_ms']['children']:>9.2f}"
        )
    for phase, results in runs.items():
        each = ", ".join(f"{r['rate_start']:.1f}/{r['rate_ready']:.1f}" for r in results)
        print(f"  {phase} runs (start/ready jobs/s): {each}")
    if "idem" in runs and "floor" in runs:
        # Each round's idem against the same round's floor: the two ran minutes apart at most, so a load that
        # other processes put on the machine meanwhile moves both (the medians above may come from other rounds).
        rounds = [i["rate_ready"] / f["rate_ready"] for i, f in zip(runs["idem"], runs["floor"], strict=True)]
        summary["idem"]["ratio_floor_rounds"] = rounds
        print(
            f"  idem / floor by round (ready): {', '.join(f'{r:.3f}' for r in rounds)}; "
            f"median {statistics.median(rounds):.3f} (goal >= 0.8)"
        )
    return summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1000, help="jobs per phase")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of every phase; medians reported")
    parser.add_argument(
        "--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)} (default: all)"
    )
    parser.add_argument("--concurrency", type=int, default=2, help="worker processes (prefork -c)")
    parser.add_argument("--polling-interval", type=float, help="override the embedded broker's polling_interval (s)")
    parser.add_argument(
        "--stock-transport",
        action="store_true",
        help="kombu's own filesystem transport instead of the embedded default's (oncelery.embedded_broker)",
    )
    parser.add_argument(
        "--prefetch",
        type=int,
        help="override worker_prefetch_multiplier (an experiment: see docs/benchmarks-history.md)",
    )
    parser.add_argument("--spawn-redis", type=int, default=6398, metavar="PORT", help="private Redis for the counters")
    parser.add_argument("--stats-url", help="use this Redis for the bench's counters instead of spawning one")
    parser.add_argument("--json", type=Path, help="also write every run and the summary to this file")
    args = parser.parse_args(argv)
    args.phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = sorted(set(args.phases) - set(PHASES))
    if unknown or not args.phases:
        parser.error(f"--phases: {', '.join(unknown) or 'none given'}; choose from {', '.join(PHASES)}")
    return args


def bench_env(args: argparse.Namespace, data_dir: Path, stats_url: str) -> dict[str, str]:
    """The BENCH_* (and ONCELERY_DATA_DIR) variables bench.support.bench_app reads, for these options."""
    env = {
        "BENCH_BROKER_URL": "embedded",
        "BENCH_STATS_URL": stats_url,
        "BENCH_DATABASE_URL": f"sqlite:///{data_dir / 'oncelery.db'}",
        "ONCELERY_DATA_DIR": str(data_dir),
        "PYTHONPATH": str(REPO),
    }
    if args.polling_interval is not None:
        env["BENCH_POLLING_INTERVAL"] = str(args.polling_interval)
    if args.prefetch is not None:
        env["BENCH_PREFETCH"] = str(args.prefetch)
    if args.stock_transport:
        env["BENCH_TRANSPORT"] = "filesystem"
    return env


def run_rounds(args: argparse.Namespace, stats: redis.Redis) -> dict[str, list[dict[str, Any]]]:
    """Run every phase `--repeat` times, rotating which goes first; print each run."""
    runs: dict[str, list[dict[str, Any]]] = {phase: [] for phase in args.phases}
    for r in range(args.repeat):
        shift = r % len(args.phases)
        for phase in args.phases[shift:] + args.phases[:shift]:
            res = run_phase(phase, args.jobs, args, {**os.environ}, stats)
            runs[phase].append(res)
            print(
                f"[{r + 1}/{args.repeat}] {phase:<5} {res['rate_start']:6.1f} jobs/s from start, "
                f"{res['rate_ready']:6.1f} ready (boot {res['boot_s']:.2f}s, enqueue {res['enqueue_rate']:.0f}/s) "
                f"cpu ms/job {json.dumps({k: round(v, 2) for k, v in res['cpu_ms'].items()})}",
                flush=True,
            )
    return runs


def main(argv: list[str] | None = None) -> int:
    """Parse the options, set up the embedded stack, run the rounds, print the table."""
    args = parse_args(argv)
    data_dir = Path(tempfile.mkdtemp(prefix="oncelery_embedded_"))
    private_redis = None if args.stats_url else spawn_redis(args.spawn_redis)
    stats_url = args.stats_url or f"redis://127.0.0.1:{args.spawn_redis}/0"
    env = bench_env(args, data_dir, stats_url)
    # bench.support.bench_app reads them at import, in this process (the producer) as in the worker.
    os.environ.update(env)
    os.environ.pop("ONCELERY_BROKER_URL", None)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    try:
        from oncelery.store.schema import upgrade_schema

        upgrade_schema(env["BENCH_DATABASE_URL"])
        from bench.support.bench_app import app

        print(
            f"{args.jobs} jobs x {args.repeat} rounds, broker {app.conf.broker_url} "
            f"(polling_interval {app.conf.broker_transport_options.get('polling_interval')} s), "
            f"claims {env['BENCH_DATABASE_URL']}, prefork -c {args.concurrency}"
        )
        runs = run_rounds(args, redis.Redis.from_url(stats_url))
        summary = report(runs)
        if args.json:
            args.json.write_text(json.dumps({"runs": runs, "summary": summary, "jobs": args.jobs}, indent=2))
    finally:
        stop_process(private_redis)
        shutil.rmtree(data_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
