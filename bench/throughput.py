"""End-to-end throughput of a plain Celery no-op vs the same no-op under celery-once and as an `IdempotentTask`.

    python bench/throughput.py [--jobs 10000] [--repeat 3] [--database-url URL] [--broker-url URL]
                               [--fresh-db] [--spawn-redis PORT] [--concurrency 2] [--phases ...]
                               [--what-if ...] [--profile DIR] [--json FILE]
                               [--stats-url URL] [--queue-type classic|quorum] [--first-round R]

e.g. `python bench/throughput.py --spawn-redis 6399 --fresh-db --repeat 2 --phases plain,once,idem,dup`.
Every phase runs against a real `celery -A bench.support.bench_app worker` subprocess (prefork, concurrency 2 or
--concurrency, Redis broker, JSON, acks_late, prefetch 1, results ignored):

    plain  N jobs of `oncelery.bench_plain`
    once   N jobs of `oncelery.bench_once`: the same no-op as a celery-once `QueueOnce` task (Redis lock per
           job key, taken by the producer's apply_async and released by the worker after the run; graceful)
    idem   N jobs of `oncelery.bench_idem`, each a distinct key: every job is a first execution
    dup    N jobs repeating the keys the idem phase just completed: every job is answered from the stored result
    floor  N jobs of `oncelery.bench_floor`: the cheapest database claim, a yardstick (not Oncelery)
    floordup  N jobs of `oncelery.bench_floordup` on the keys floor just completed: the least a duplicate
           answered by the database can cost (one raw statement reads the result and counts it), a yardstick

The phases run in interleaved rounds (--repeat R): round r runs every phase once, the order rotated by r
(dup always right after its idem, whose keys it answers), so a slow spell of the shared machine hits every
phase alike. Each phase enqueues all of its jobs to a fresh queue first, then starts the worker and waits
until the last job is done (an exact Redis counter incremented after each delivery; for idem also the
COMPLETED rows in task_runs, for once the locks left in Redis). Reported per phase, median over rounds:

    jobs/s (start)   jobs / (last done - worker process start)          includes the worker's boot
    jobs/s (ready)   jobs / (last done - worker_ready signal)           queue throughput, no boot
    x plain          jobs/s (ready) / plain's jobs/s (ready)
    enq/s            jobs/s of the producer's apply_async loop (celery-once's lock is taken there)
    stmts/job ...    SQL statements, commits, rollbacks (SQLAlchemy events) and pre-pings per job, counted
                     in the worker children; RT/job = wire round trips to PostgreSQL (see bench/support/bench_app.py)
    xact/job         xact_commit + xact_rollback delta of the bench database in pg_stat_database
    CPU ms/job       CPU time of the worker's main process and of its pool children, of this phase's
                     PostgreSQL backends, of redis-server, and of everything else, from /proc;
                     util = busy share of all CPUs

On RabbitMQ (`--broker-url amqp://...`; bench/brokers.py runs Redis and both RabbitMQ queue types side by side),
the bench's counters stay in a Redis (`--stats-url`), each phase's queue is declared `--queue-type` classic or
quorum (Celery's `task_create_missing_queue_type`) and deleted after the phase, and the CPU table adds the
RabbitMQ node's (`rabbitmq`: the beam.smp processes of `--rabbitmq-pids`, else every beam.smp; `--redis-pids`
likewise narrows the `redis` column to one server).

`--profile DIR` attaches two `py-spy record` to each worker child (bench/support/pyspy.py) and prints where the
children's time goes per job (profiled runs are slower: take the throughput figures from a run without it).

Benchmarks are not tests: nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis
from kombu import Queue
from sqlalchemy import text
from sqlalchemy.engine import Engine, make_url

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.support.harness import (
    DEFAULT_BROKER_URL,
    DEFAULT_DATABASE_URL,
    LOG_DIR,
    REPO,
    admin_engine,
    backend_pids,
    children_of,
    count_completed,
    count_replayed,
    cpu_seconds,
    pids_named,
    prepare_database,
    spawn_redis,
    start_worker,
    stop_process,
    stop_worker,
    system_busy_seconds,
    truncate,
    wait_done,
    wait_no_backends,
    wait_quiet,
    xact_counts,
)
from bench.support.pyspy import attach_py_spy, print_profile
from bench.support.report import PhaseResult, report, write_json
from bench.support.what_if import BROWSE_INDEXES
from oncelery.store.database import dispose_engines, get_engine

PHASES = ("plain", "once", "idem", "dup", "floor", "floordup", "idemc", "dupc", "cachedup")
# A phase that answers the keys another phase just completed runs right after it.
ANSWERS = {"dup": "idem", "floordup": "floor", "dupc": "idemc"}
# The bench_app task each phase sends, where it is not `bench_<phase>`.
TASKS = {"dup": "bench_idem", "idemc": "bench_idem", "dupc": "bench_idem"}
# Phases whose worker runs with the replay cache (oncelery_replay_cache: the broker's Redis, database 5).
CACHED = ("idemc", "dupc")


def round_order(phases: list[str], r: int) -> list[str]:
    """The phases of round `r`: rotated by r, dup kept right after idem (it answers idem's keys)."""
    units = [[p] for p in phases if p not in ANSWERS]
    for answer, first in ANSWERS.items():
        if answer in phases:
            next(u for u in units if u[0] == first).append(answer)
    shift = r % len(units)
    return [p for unit in units[shift:] + units[:shift] for p in unit]


def enqueue(phase: str, run_tag: str, n: int, queue: str) -> tuple[int, float]:
    """Send the phase's jobs to `queue`; return (jobs accepted, jobs/s of the send loop)."""
    from bench.support import bench_app

    # dup: every key of idem again, all COMPLETED by now (as many jobs as the other phases: a fair rate)
    ids = range(n)
    # By name: bench_once exists only where celery-once is installed.
    task = getattr(bench_app, TASKS.get(phase, f"bench_{phase}"))
    count = 0
    started = time.perf_counter()
    with task.app.producer_or_acquire() as producer:
        for i in ids:
            result = task.apply_async((run_tag, i), queue=queue, producer=producer)
            count += getattr(result, "state", "") != "REJECTED"  # celery-once refused it: already queued
    return count, count / (time.perf_counter() - started)


def reset_for_first_executions(phase: str, url: str, cache_url: str) -> None:
    """Empty the claims tables (and the replay cache for cached phases) before a phase of first executions."""
    if phase not in ANSWERS:
        truncate(url)
        if phase in CACHED:
            redis.Redis.from_url(cache_url).flushdb()  # no entry of an earlier round answers a first execution


def worker_env(phase: str, args: argparse.Namespace, queue: str, cache_url: str) -> dict[str, str]:
    """The worker's environment: the BENCH_* variables bench.support.bench_app reads."""
    return {
        **os.environ,
        "BENCH_BROKER_URL": args.broker_url,
        "BENCH_STATS_URL": args.stats_url,
        "BENCH_QUEUE_TYPE": args.queue_type,
        "BENCH_DATABASE_URL": args.database_url,
        "BENCH_QUEUE": queue,
        "BENCH_WHAT_IF": args.what_if,
        "BENCH_REPLAY_CACHE": cache_url if phase in CACHED else "",
        "PYTHONPATH": str(REPO),
    }


def service_pids(args: argparse.Namespace) -> dict[str, list[int]]:
    """The processes of the services beside the worker: Redis (--redis-pids, else every redis-server) and
    the RabbitMQ node (--rabbitmq-pids, else every beam.smp when the broker is RabbitMQ)."""

    def given(pids: str | None) -> list[int] | None:
        return [int(p) for p in pids.split(",")] if pids else None

    amqp = args.broker_url.startswith(("amqp", "pyamqp"))
    return {
        "redis": given(args.redis_pids) or pids_named("redis-server"),
        "rabbitmq": given(args.rabbitmq_pids) or (pids_named("beam.smp") if amqp else []),
    }


def worker_cpu(
    proc: subprocess.Popen[bytes],
    admin: Engine,
    dbname: str,
    services: dict[str, list[int]],
    services0: dict[str, float],
    busy: float,
) -> dict[str, float]:
    """CPU seconds of the worker's main process, its children, the database's backends, Redis, RabbitMQ, the rest."""
    cpu = {
        "main": cpu_seconds(proc.pid),
        "children": sum(cpu_seconds(p) for p in children_of(proc.pid)),
        "postgres": sum(cpu_seconds(p) for p in backend_pids(admin, dbname)),
        **{name: sum(cpu_seconds(p) for p in pids) - services0[name] for name, pids in services.items()},
    }
    cpu["other"] = max(0.0, busy - sum(cpu.values()))
    return cpu


def drop_queue(queue: str) -> None:
    """Delete the phase's queue on the broker (a Redis list, or a RabbitMQ queue) and its bindings."""
    from bench.support import bench_app

    with bench_app.app.connection_for_write() as conn:
        Queue(queue).bind(conn.default_channel).delete()


def stop_spies(spies: list[subprocess.Popen[bytes]]) -> None:
    """Wait for each py-spy to write its profile; SIGINT one that has not within 30 s."""
    for spy in spies:
        try:
            spy.wait(timeout=30)
        except subprocess.TimeoutExpired:
            spy.send_signal(signal.SIGINT)
            spy.wait()


def verify(phase: str, url: str, stats: redis.Redis) -> str:
    """What the database (or Redis) holds after the phase: COMPLETED rows, counted replays, locks left."""
    if phase in ("idem", "idemc", "floor"):
        table = "bench_floor_runs" if phase == "floor" else "task_runs"
        name = "oncelery.bench_floor" if phase == "floor" else "oncelery.bench_idem"
        return f"{count_completed(url, name, table)} COMPLETED rows"
    if phase in ("dup", "dupc"):
        # Exact G7 counts: with the cache, the replays were counted in the children's memory and written by
        # their flushers (the last ones at the children's shutdown).
        return f"{count_replayed(url, 'oncelery.bench_idem')} replays counted"
    if phase == "once":
        return f"{sum(1 for _ in stats.scan_iter(match='qo_oncelery.bench_once*', count=1000))} locks left"
    return ""


def run_phase(
    phase: str,
    run_tag: str,
    args: argparse.Namespace,
    admin: Engine,
    stats: redis.Redis,
    profile_dir: Path | None,
) -> PhaseResult:
    """Run one phase against a fresh worker and return its measurements."""
    url = args.database_url
    dbname = make_url(url).database or ""
    queue = f"oncelery_bench.{phase}.{uuid.uuid4().hex[:8]}"
    prefix = f"bench:{queue}"
    cache_url = args.stats_url.rsplit("/", 1)[0] + "/5"
    reset_for_first_executions(phase, url, cache_url)
    jobs, enqueue_rate = enqueue(phase, run_tag, args.jobs, queue)
    env = worker_env(phase, args, queue, cache_url)
    wait_no_backends(admin, dbname)
    c0, r0 = xact_counts(admin, dbname)
    idle_load = wait_quiet(args.settle) if args.settle > 0 else 0.0
    log = LOG_DIR / f"{queue}.log"
    services = service_pids(args)
    services0 = {name: sum(cpu_seconds(p) for p in pids) for name, pids in services.items()}
    busy0 = system_busy_seconds()
    t0 = time.time()
    proc = start_worker(queue, env, log, args.concurrency)
    spies: list[subprocess.Popen[bytes]] = []
    try:
        if profile_dir is not None:
            spies = attach_py_spy(proc, prefix, stats, profile_dir / phase)
        t_end = wait_done(proc, stats, prefix, jobs, max(120.0, jobs / 20), log)
        busy = system_busy_seconds() - busy0
        cpu = worker_cpu(proc, admin, dbname, services, services0, busy)
    finally:
        stop_worker(proc)
        stop_spies(spies)
    ready = float(stats.get(f"{prefix}:ready") or t0)
    last = float(stats.get(f"{prefix}:last") or 0)
    db = {k.decode(): int(v) for k, v in stats.hgetall(f"{prefix}:db").items()}
    wait_no_backends(admin, dbname)
    c1, r1 = xact_counts(admin, dbname)
    verified = verify(phase, url, stats)
    stats.delete(*(f"{prefix}:{k}" for k in ("done", "last", "first", "ready", "db")))
    drop_queue(queue)
    return PhaseResult(
        phase=phase,
        jobs=jobs,
        boot_s=ready - t0,
        wall_s=last - t0,
        rate_start=jobs / (last - t0),
        rate_ready=jobs / (last - ready),
        enqueue_rate=enqueue_rate,
        db={k: v / jobs for k, v in db.items()},
        xact_commit=c1 - c0,
        xact_rollback=r1 - r0,
        verified=verified,
        cpu_ms={k: 1000 * v / jobs for k, v in cpu.items()},
        cpu_utilization=busy / ((t_end - t0) * (os.cpu_count() or 1)),
        idle_load_before=idle_load,
    )


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The command line, and the phases it asks for (checked)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=10_000, help="jobs per phase")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (each runs every phase once); medians reported")
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL, help="PostgreSQL URL of the bench database")
    parser.add_argument(
        "--fresh-db", action="store_true", help="drop and re-create the bench database first (it must be the bench's)"
    )
    parser.add_argument(
        "--broker-url", default=DEFAULT_BROKER_URL, help="Redis (use a dedicated db) or RabbitMQ (amqp://) broker"
    )
    parser.add_argument(
        "--stats-url", help="Redis of the bench's counters (default: the broker; required for a RabbitMQ broker)"
    )
    parser.add_argument(
        "--queue-type",
        choices=("classic", "quorum"),
        default="classic",
        help="RabbitMQ: the type each phase's queue is declared with",
    )
    parser.add_argument(
        "--redis-pids", help="comma-separated PIDs of the Redis CPU column (default: every redis-server)"
    )
    parser.add_argument("--rabbitmq-pids", help="comma-separated PIDs of the RabbitMQ node (default: every beam.smp)")
    parser.add_argument(
        "--first-round", type=int, default=0, help="number the rounds from R (their phase order rotates by it)"
    )
    parser.add_argument(
        "--spawn-redis",
        type=int,
        metavar="PORT",
        help="start a private redis-server on PORT for the run and use it as the broker (overrides --broker-url)",
    )
    parser.add_argument("--concurrency", type=int, default=2, help="worker processes (prefork -c)")
    parser.add_argument(
        "--settle",
        type=float,
        default=30.0,
        help="before each phase wait up to this many seconds for the machine to be idle (0: don't)",
    )
    parser.add_argument("--json", type=Path, help="also write every run and the summary to this file")
    parser.add_argument("--profile", type=Path, help="py-spy the worker children into this folder")
    parser.add_argument(
        "--phases",
        default="plain,once,idem,dup",
        help=f"comma-separated, of {', '.join(PHASES)} (dup needs idem; once needs `pip install -e '.[bench]'`)",
    )
    parser.add_argument(
        "--what-if",
        default="",
        help="comma-separated experiments patched into the worker, see bench/support/what_if.py "
        "(no-heartbeat, no-pre-ping, async-claim, all-async, floor-async-claim)",
    )
    args = parser.parse_args(argv)
    phases = args.phases.split(",")
    if args.stats_url is None and not args.spawn_redis:
        if not args.broker_url.startswith(("redis", "rediss")):
            parser.error("--stats-url: give a Redis for the bench's counters when the broker is not Redis")
        args.stats_url = args.broker_url
    if unknown := [p for p in phases if p not in PHASES]:
        parser.error(f"unknown phase(s) {unknown}; choose from {PHASES}")
    for answer, first in ANSWERS.items():
        if answer in phases and first not in phases:
            parser.error(f"the {answer} phase answers keys of the {first} phase")
    if "once" in phases:
        try:
            import celery_once  # noqa: F401
        except ImportError:
            parser.error("the once phase needs celery-once: pip install -e '.[bench]'")
    return args, phases


def main(argv: list[str] | None = None) -> int:
    """Run the rounds, print the tables, write --json."""
    # Stop cleanly (workers and a spawned Redis by PID) on SIGTERM, and on SIGINT even when started in
    # the background of a non-interactive shell, which ignores SIGINT.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    args, phases = parse_args(argv)
    private_redis = None
    if args.spawn_redis:
        private_redis = spawn_redis(args.spawn_redis)
        args.broker_url = args.stats_url = f"redis://127.0.0.1:{args.spawn_redis}/0"
    try:
        return run(args, phases)
    finally:
        stop_process(private_redis)


def run(args: argparse.Namespace, phases: list[str]) -> int:
    """Run `args.repeat` interleaved rounds of `phases`; print and return 0."""
    # bench.support.bench_app reads these at import, in this process (the producer) as in the worker.
    os.environ["BENCH_BROKER_URL"] = args.broker_url
    os.environ["BENCH_STATS_URL"] = args.stats_url
    os.environ["BENCH_QUEUE_TYPE"] = args.queue_type
    os.environ["BENCH_DATABASE_URL"] = args.database_url
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    admin = admin_engine(args.database_url)
    prepare_database(args.database_url, admin, args.fresh_db)
    if "no-browse-indexes" in (args.what_if or "").split(","):
        with get_engine(args.database_url).begin() as conn:
            for name in BROWSE_INDEXES:
                conn.execute(text(f'DROP INDEX IF EXISTS "{name}"'))
        dispose_engines()
    stats = redis.Redis.from_url(args.stats_url)
    by_phase: dict[str, list[PhaseResult]] = {p: [] for p in phases}
    print(
        f"{args.jobs} jobs x {args.repeat} rounds, worker prefork -c {args.concurrency}, {os.cpu_count()} CPUs, "
        f"broker {args.broker_url.split(':', 1)[0]}"
        + (f" ({args.queue_type} queues)" if args.broker_url.startswith(("amqp", "pyamqp")) else "")
        + (f", what-if: {args.what_if}" if args.what_if else "")
    )
    for r in range(args.first_round, args.first_round + args.repeat):
        run_tag = uuid.uuid4().hex[:12]
        for position, phase in enumerate(round_order(phases, r)):
            profile = args.profile / f"r{r}" if args.profile else None
            res = run_phase(phase, run_tag, args, admin, stats, profile)
            res.round, res.order = r, position
            by_phase[phase].append(res)
            print(res.line(args.first_round + args.repeat), flush=True)
    summary = report(by_phase)
    if args.profile:
        for phase in phases:
            for res in by_phase[phase]:
                print_profile(args.profile / f"r{res.round}" / phase, res.jobs)
    if args.json:
        write_json(args.json, by_phase, summary, jobs=args.jobs, rounds=args.repeat, concurrency=args.concurrency)
    return 0


if __name__ == "__main__":
    sys.exit(main())
