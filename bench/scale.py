"""Scale: how many worker processes one PostgreSQL carries, direct and through PgBouncer (issue 27, section 4).

    python bench/scale.py [--workers 2,4,8,16] [--jobs 3000] [--hosts 2] [--modes direct,pgbouncer]
                          [--pool-size 8] [--json FILE]

Everything is the run's own, started and stopped by PID: a throwaway PostgreSQL cluster (tests/pg_cluster.py) that
writes as a production server does (fsync and full-page writes on; checkpoint_timeout 1 h and max_wal_size 8 GB, so
no checkpoint falls inside a phase and the WAL figures are the steady state, without the full-page images that
follow a checkpoint), a redis-server on a free port as the broker, and a pgbouncer in transaction mode in front of
the cluster (tests/pgbouncer.py; its rows are skipped, with the reason, when the program is missing).

For each worker count N and mode (direct: `postgresql://...`; pgbouncer: `...?oncelery_pgbouncer=1`, through it;
unprepared: that flag straight to PostgreSQL, which splits PgBouncer's cost into its hop and Oncelery's way through it),
`--hosts` `celery -A bench.support.bench_app worker` processes of N / hosts prefork children each (N worker
processes in all, as on `hosts` machines) run two phases, each on a fresh queue:

    idem  4 N warm-up jobs, then --jobs jobs of `oncelery.bench_idem`, every key new: first executions
    dup   the same keys again: duplicates answered by the database (the replay cache off)

Measured per phase (bench/support/scale_cells.py prints them):

    jobs/s      jobs after the warm-up / (last done - warm-up done). The 2 cores run the workers, Redis, pgbouncer
                and PostgreSQL together, so this saturates: it is not the database's capacity
    PG ms       CPU of every PostgreSQL process (the postmaster's tree, reaped backends included: backends, WAL
                writer, autovacuum...) but the bench's sampling backend, after the warm-up, per job; `bk ms`: the
                client backends of the bench database only
    WAL B, rec, FPI, flush
                pg_current_wal_insert_lsn() and pg_stat_wal deltas over the whole phase (warm-up included: opening a
                connection writes no WAL), per job; flush = wal_sync, the WAL's fsyncs (group commit shares them)
    xact        transactions committed in the bench database per job (pg_stat_database)
    lock, lock%, LWL
                pg_stat_activity sampled every 0.1 s: backends waiting on a heavyweight lock (mean per sample, share of
                samples with one), on an LWLock (mean); deadlocks (pg_stat_database) are printed when not 0
    conns, /proc
                the bench database's client backends (max sampled), per worker process. Through PgBouncer these are
                its server connections; `clients` its clients (cl_active + cl_waiting) and `cl_wait` the mean
                waiting for a server connection
    worker ms, pgb ms
                CPU of the worker processes (mains and children), and of pgbouncer, per job

Then the model docs/scaling.md uses: claims per second per PostgreSQL core = 1000 / PG ms per job (median over N).
Benchmarks are not tests: nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import text
from sqlalchemy.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.support.harness import (
    LOG_DIR,
    REPO,
    admin_engine,
    children_of,
    count_completed,
    count_replayed,
    cpu_seconds,
    prepare_database,
    spawn_redis,
    start_worker,
    stop_process,
    stop_worker,
    tree_cpu_seconds,
    wait_no_backends,
)
from bench.support.scale_cells import Cell, print_cells, print_model
from bench.throughput import enqueue
from oncelery.store.database import dispose_engines
from oncelery.store.pgbouncer import PGBOUNCER_FLAG
from tests.pg_cluster import PgCluster, free_port, missing_binaries, postgres_bindir
from tests.pgbouncer import PgBouncer, missing_pgbouncer

DBNAME = "oncelery_scale"
IDEM_TASK = "oncelery.bench_idem"
# A production server's writes (the test cluster's default is fsync off), and no checkpoint inside a phase.
SERVER = {
    "fsync": "on",
    "full_page_writes": "on",
    "shared_buffers": "128MB",
    "max_connections": "300",
    "checkpoint_timeout": "1h",
    "max_wal_size": "8GB",
}
SAMPLE = """
SELECT count(*) FILTER (WHERE backend_type = 'client backend' AND datname = %(d)s),
       count(*) FILTER (WHERE datname = %(d)s AND wait_event_type = 'Lock'),
       count(*) FILTER (WHERE datname = %(d)s AND wait_event_type = 'LWLock'),
       string_agg(wait_event_type || ':' || wait_event, ' ') FILTER (WHERE datname = %(d)s
                                                              AND wait_event_type IN ('Lock', 'LWLock'))
FROM pg_stat_activity WHERE pid <> pg_backend_pid()
"""
COUNTERS = """
SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint AS lsn, w.wal_records, w.wal_fpi, w.wal_sync,
       d.xact_commit, d.deadlocks
FROM pg_stat_wal w, pg_stat_database d WHERE d.datname = :d
"""


class Sampler(threading.Thread):
    """Samples pg_stat_activity (and PgBouncer's pools) every 0.1 s on connections of its own."""

    def __init__(self, cluster: PgCluster, bouncer: PgBouncer | None) -> None:
        import psycopg

        super().__init__(daemon=True)
        self.conn = psycopg.connect(
            f"host=127.0.0.1 port={cluster.port} user=postgres dbname=postgres", autocommit=True
        )
        self.backend = self.conn.info.backend_pid  # its CPU is the bench's, not the workload's
        self.bouncer = bouncer
        self.admin = bouncer.admin() if bouncer is not None else None
        self.rows: list[tuple[int, int, int]] = []
        self.waits: Counter[str] = Counter()  # which locks the waiters waited on
        self.pools: list[tuple[int, int]] = []  # (clients, clients waiting for a server)
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.1):
            row = self.conn.execute(SAMPLE, {"d": DBNAME}).fetchone()
            self.rows.append((int(row[0]), int(row[1]), int(row[2])) if row else (0, 0, 0))
            self.waits.update((row[3] or "").split() if row else ())
            if self.bouncer is not None:
                for pool in self.bouncer.show("POOLS", self.admin):
                    if pool["database"] == DBNAME:
                        waiting = int(pool["cl_waiting"])
                        self.pools.append((int(pool["cl_active"]) + waiting, waiting))

    def stop(self) -> None:
        self.halt.set()
        if self.ident is not None:
            self.join()
        self.conn.close()
        if self.admin is not None:
            self.admin.close()


def backend_cpu(postmaster: int) -> dict[int, float]:
    """CPU seconds of each client backend of the bench database (by its process title), by PID."""
    found = {}
    for pid in children_of(postmaster):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if f" {DBNAME} " in title:
            found[pid] = cpu_seconds(pid)
    return found


def cpu_now(postmaster: int, workers: list[Any], sampler: Sampler, bouncer: PgBouncer | None) -> dict[str, Any]:
    """The CPU seconds used so far by PostgreSQL (all, its sampler backend, each bench backend), workers, pgbouncer."""
    return {
        "pg": tree_cpu_seconds(postmaster),
        "sampler": cpu_seconds(sampler.backend),
        "backends": backend_cpu(postmaster),
        "workers": sum(cpu_seconds(p.pid) + sum(cpu_seconds(c) for c in children_of(p.pid)) for p in workers),
        "bouncer": cpu_seconds(bouncer.pid) if bouncer is not None and bouncer.pid else 0.0,
    }


def counters(admin: Engine) -> dict[str, int]:
    """WAL position and pg_stat_wal, the bench database's commits and deadlocks."""
    with admin.connect() as conn:
        conn.execute(text("SELECT pg_stat_clear_snapshot()"))
        return {k: int(v) for k, v in conn.execute(text(COUNTERS), {"d": DBNAME}).one()._mapping.items()}


def wait_count(stats: redis.Redis, key: str, target: int, workers: list[Any], log: Path) -> int:
    """Wait until the bench counter `key` reaches `target`; return it (raise if a worker died or 300 s passed)."""
    deadline = time.monotonic() + 300
    while True:
        done = int(stats.get(key) or 0)
        if done >= target:
            return done
        if any(w.poll() is not None for w in workers):
            raise RuntimeError(f"a worker exited; see {log}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{key}: {done}/{target} after 300 s; see {log}")
        time.sleep(0.02)


class Run:
    """The run's private services and the phases measured on them."""

    def __init__(self, args: argparse.Namespace, cluster: PgCluster, broker: str, bouncer: PgBouncer | None) -> None:
        self.args = args
        self.cluster = cluster
        self.broker = broker
        self.bouncer = bouncer
        self.url = cluster.database_url(DBNAME)
        self.admin = admin_engine(self.url)
        self.stats = redis.Redis.from_url(broker)
        from bench.support import bench_app  # it reads BENCH_* at import: main set them

        # Every duplicate goes to a worker, answered by its claim (bench/producer_dedupe.py measures the producer's).
        bench_app.app.conf.oncelery_producer_dedupe = False

    def database_url(self, mode: str) -> str:
        """The workers' claims URL in `mode`."""
        if mode == "unprepared":  # PgBouncer's dialect straight to PostgreSQL: what its way costs without the hop
            return f"{self.url}?{PGBOUNCER_FLAG}=1"
        return self.url if mode == "direct" or self.bouncer is None else self.bouncer.url(self.url)

    def verify(self, phase: str, before: int) -> tuple[int, str]:
        """The phase's count (COMPLETED runs, or replays counted) and its text, given the count before."""
        count = count_completed(self.url, IDEM_TASK) if phase == "idem" else count_replayed(self.url, IDEM_TASK)
        return count, f"{count - before} {'COMPLETED' if phase == 'idem' else 'replays counted'}"

    def phase(self, workers: int, mode: str, phase: str, run_tag: str, jobs: int) -> Cell:
        """Run one phase of `jobs` jobs (after the warm-up) on fresh worker processes; return its measurements."""
        queue = f"oncelery_scale.{mode}.{workers}.{phase}.{uuid.uuid4().hex[:6]}"
        key = f"bench:{queue}:done"
        warm = 4 * workers
        total = warm + jobs
        seen, _ = self.verify(phase, 0)
        enqueue(phase, run_tag, total, queue)
        env = {**os.environ, "BENCH_BROKER_URL": self.broker, "BENCH_DATABASE_URL": self.database_url(mode)}
        env.update(BENCH_QUEUE=queue, BENCH_WHAT_IF="", BENCH_REPLAY_CACHE="", PYTHONPATH=str(REPO))
        before = counters(self.admin)
        log = LOG_DIR / f"{queue}.log"
        postmaster = self.cluster.pid() or 0
        procs = [
            start_worker(queue, env, log, workers // self.args.hosts, node=f"h{h}.{queue}@%h")
            for h in range(self.args.hosts)
        ]
        sampler = Sampler(self.cluster, self.bouncer if mode == "pgbouncer" else None)
        try:
            wait_count(self.stats, key, warm, procs, log)
            sampler.start()
            t0, cpu0 = time.time(), cpu_now(postmaster, procs, sampler, sampler.bouncer)
            d0 = int(self.stats.get(key) or 0)
            wait_count(self.stats, key, total, procs, log)
            cpu1 = cpu_now(postmaster, procs, sampler, sampler.bouncer)
        finally:
            try:
                sampler.stop()
            finally:
                for proc in procs:
                    stop_worker(proc)
        if mode == "pgbouncer" and self.bouncer is not None:
            # An idle backend may keep its statistics up to 10 s: closing them flushes them now.
            self.bouncer.reconnect(DBNAME)
        wait_no_backends(self.admin, DBNAME)
        time.sleep(1.0)  # the WAL writer reports its own syncs about once a second
        after = counters(self.admin)
        _, verified = self.verify(phase, seen)
        last = float(self.stats.get(f"bench:{queue}:last") or time.time())
        measured = total - d0
        rows, pools = sampler.rows or [(0, 0, 0)], sampler.pools or [(0, 0)]
        pg_ms = 1000 * ((cpu1["pg"] - cpu0["pg"]) - (cpu1["sampler"] - cpu0["sampler"])) / measured
        bk = sum(s - cpu0["backends"].get(pid, 0.0) for pid, s in cpu1["backends"].items())
        delta = {k: after[k] - before[k] for k in after}
        return Cell(
            workers=workers,
            mode=mode,
            phase=phase,
            jobs=measured,
            rate=measured / max(1e-6, last - t0),
            pg_ms=pg_ms,
            backend_ms=1000 * bk / measured,
            worker_ms=1000 * (cpu1["workers"] - cpu0["workers"]) / measured,
            bouncer_ms=1000 * (cpu1["bouncer"] - cpu0["bouncer"]) / measured,
            wal_bytes=delta["lsn"] / total,
            wal_records=delta["wal_records"] / total,
            wal_fpi=delta["wal_fpi"] / total,
            wal_sync=delta["wal_sync"] / total,
            xact=delta["xact_commit"] / total,
            deadlocks=delta["deadlocks"],
            lock_mean=sum(r[1] for r in rows) / len(rows),
            lock_share=sum(1 for r in rows if r[1]) / len(rows),
            lwlock_mean=sum(r[2] for r in rows) / len(rows),
            conns=max(r[0] for r in rows),
            clients=max(p[0] for p in pools),
            clients_waiting=sum(p[1] for p in pools) / len(pools),
            waits=dict(sampler.waits.most_common(3)),
            verified=verified,
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--workers", default="2,4,8,16", help="worker process counts (comma-separated)")
    parser.add_argument("--jobs", type=int, default=3000, help="jobs per phase after the warm-up")
    parser.add_argument(
        "--hosts", type=int, default=2, help="`celery worker` processes per cell, N / hosts children each"
    )
    parser.add_argument(
        "--modes", default="direct,pgbouncer", help="of direct, pgbouncer, unprepared (comma-separated)"
    )
    parser.add_argument("--pool-size", type=int, default=8, help="pgbouncer's default_pool_size (server connections)")
    parser.add_argument("--json", type=Path, help="also write every cell and the model to this file")
    args = parser.parse_args(argv)
    args.workers = [int(n) for n in args.workers.split(",")]
    args.modes = args.modes.split(",")
    if bad := [n for n in args.workers if n % args.hosts]:
        parser.error(f"worker counts {bad} are not a multiple of --hosts {args.hosts}")
    if bad := [m for m in args.modes if m not in ("direct", "pgbouncer", "unprepared")]:
        parser.error(f"unknown mode(s) {bad}: direct, pgbouncer, unprepared")
    return args


def main(argv: list[str] | None = None) -> int:
    """Start the private services, run every cell, print the tables and the model."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    args = parse_args(argv)
    bindir = postgres_bindir()
    if bindir is None or missing_binaries():
        print(f"no throwaway PostgreSQL cluster here: {missing_binaries()}")
        return 1
    if "pgbouncer" in args.modes and (why := missing_pgbouncer()):
        print(f"PgBouncer rows skipped: {why}")
        args.modes.remove("pgbouncer")
        if not args.modes:
            return 0
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    cluster = PgCluster(bindir, settings=SERVER)
    redis_port = free_port()
    broker = f"redis://127.0.0.1:{redis_port}/0"
    private_redis = bouncer = None
    cells: list[Cell] = []
    try:
        cluster.start()
        private_redis = spawn_redis(redis_port)
        os.environ.update(BENCH_BROKER_URL=broker, BENCH_DATABASE_URL=cluster.database_url(DBNAME))
        run = Run(args, cluster, broker, None)
        prepare_database(run.url, run.admin, fresh=True)
        cluster.execute("CHECKPOINT")
        if "pgbouncer" in args.modes:
            run.bouncer = bouncer = PgBouncer("127.0.0.1", cluster.port, pool_size=args.pool_size).start()
        print(
            f"{args.jobs} jobs per phase, worker processes {args.workers} as {args.hosts} `celery worker` each, "
            f"modes {args.modes}, pgbouncer pool {args.pool_size}, {os.cpu_count()} CPUs"
        )
        # Unmeasured: the fresh database's one-time costs (its first pages and catalog rows after the checkpoint).
        run.phase(args.hosts, "direct", "idem", uuid.uuid4().hex[:12], 300)
        for workers in args.workers:
            for mode in args.modes:
                run_tag = uuid.uuid4().hex[:12]
                for phase in ("idem", "dup"):
                    cell = run.phase(workers, mode, phase, run_tag, args.jobs)
                    cells.append(cell)
                    print(cell.line(), flush=True)
        print_cells(cells)
        model = print_model(cells)
        if args.json:
            args.json.write_text(json.dumps({"cells": [asdict(c) for c in cells], "model": model}, indent=2))
    finally:
        if bouncer is not None:
            bouncer.stop()
        stop_process(private_redis)
        dispose_engines()
        cluster.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
