"""End-to-end throughput of a plain Celery no-op vs the same no-op as an `IdempotentTask`.

    python bench/throughput.py [--jobs 10000] [--repeat 3] [--database-url URL] [--broker-url URL]
                               [--fresh-db] [--spawn-redis PORT] [--concurrency 2] [--phases ...]
                               [--what-if ...] [--profile DIR] [--json FILE]

Each repeat runs three phases, each against a real `celery -A bench.bench_app worker` subprocess
(prefork, concurrency 2 or --concurrency, Redis broker, JSON, acks_late, prefetch 1, results ignored):

    plain  N jobs of `oncelery.bench_plain`
    idem   N jobs of `oncelery.bench_idem`, each a distinct key: every job is a first execution
    dup    N/10 jobs repeating keys the idem phase just completed: every job is answered from the stored result
    floor  (only with --phases) N jobs of `oncelery.bench_floor`: the cheapest database claim, a yardstick

Every phase enqueues all of its jobs to a fresh queue first, then starts the worker and waits until the
last job is done (an exact Redis counter incremented after each delivery; for idem also the COMPLETED
rows in task_runs). Reported per phase, median over repeats:

    jobs/s (start)   jobs / (last done - worker process start)          includes the worker's boot
    jobs/s (ready)   jobs / (last done - worker_ready signal)           queue throughput, no boot
    stmts/job ...    SQL statements, commits, rollbacks (SQLAlchemy events) and pre-pings per job, counted
                     in the worker children; RT/job = wire round trips to PostgreSQL: statements, psycopg's
                     own BEGIN before a statement outside a transaction, COMMIT/ROLLBACK sent inside one,
                     and pool_pre_ping's `;` per checkout
    xact/job         xact_commit + xact_rollback delta of the bench database in pg_stat_database
                     (exact, server side; read from the `postgres` database after the worker exited)

    CPU ms/job       CPU time of the worker's main process and of its pool children, of this phase's
                     PostgreSQL backends, of redis-server, and of everything else, from /proc;
                     util = busy share of all CPUs

`--profile DIR` attaches two `py-spy record` to each worker child (with `--idle`: wall time, including
waits for PostgreSQL and for the next job; without: CPU only) and prints where the children's time goes
per job (profiled runs are slower: take the throughput figures from a run without it).

Benchmarks are not tests: nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine, make_url

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from oncelery.models.migrate import upgrade  # noqa: E402
from oncelery.store import dispose_engines, get_engine, normalize_url  # noqa: E402

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/oncelery_bench"
DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/13"
LOG_DIR = Path(os.environ.get("BENCH_LOG_DIR", "/tmp/oncelery_bench"))


@dataclass
class PhaseResult:
    """The measurements of one phase run."""

    phase: str
    jobs: int
    boot_s: float
    wall_s: float
    rate_start: float
    rate_ready: float
    db: dict[str, float] = field(default_factory=dict)
    xact_commit: int = 0
    xact_rollback: int = 0
    verified: str = ""
    # CPU milliseconds per job: worker main process, pool children, this phase's PostgreSQL backends, redis-server,
    # everything else on the machine (bench driver, py-spy, PostgreSQL background processes, other users).
    cpu_ms: dict[str, float] = field(default_factory=dict)
    cpu_utilization: float = 0.0
    idle_load_before: float = 0.0


# -- database ------------------------------------------------------------------------------------


def admin_engine(url: str) -> Engine:
    """An AUTOCOMMIT engine on the server's `postgres` database (CREATE DATABASE, pg_stat_database)."""
    admin = make_url(normalize_url(url)).set(database="postgres")
    return create_engine(admin, isolation_level="AUTOCOMMIT")


def prepare_database(url: str, admin: Engine, fresh: bool) -> None:
    """Create the bench database if missing (drop it first if `fresh`) and migrate it to head."""
    name = make_url(url).database
    with admin.connect() as conn:
        if fresh:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        exists = conn.execute(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}).first()
        if not exists:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    upgrade(get_engine(url))
    from bench.bench_app import FLOOR_DDL

    with get_engine(url).begin() as conn:
        for ddl in FLOOR_DDL:
            conn.execute(text(ddl))
    dispose_engines()


def truncate(url: str) -> None:
    """Empty every table the migrations created but their version table (no ANALYZE: DESIGN.md, Performance)."""
    with get_engine(url).begin() as conn:
        names = conn.execute(
            text(
                "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() AND tablename NOT LIKE '%alembic%'"
            )
        ).scalars()
        tables = ", ".join(f'"{name}"' for name in names)
        if tables:
            conn.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    dispose_engines()


def count_completed(url: str, task_name: str, table: str = "task_runs") -> int:
    with get_engine(url).connect() as conn:
        n = conn.execute(
            text(f"SELECT count(*) FROM {table} WHERE task_name = :t AND status = 'COMPLETED'"),
            {"t": task_name},
        ).scalar_one()
    dispose_engines()
    return int(n)


def wait_no_backends(admin: Engine, dbname: str, timeout: float = 30.0) -> None:
    """Wait until no session is connected to `dbname`, so its transaction counters are flushed."""
    deadline = time.monotonic() + timeout
    with admin.connect() as conn:
        while time.monotonic() < deadline:
            n = conn.execute(
                text("SELECT count(*) FROM pg_stat_activity WHERE datname = :d AND pid <> pg_backend_pid()"),
                {"d": dbname},
            ).scalar_one()
            if n == 0:
                break
            time.sleep(0.05)
    time.sleep(0.3)  # a backend flushes its statistics as it exits


def xact_counts(admin: Engine, dbname: str) -> tuple[int, int]:
    with admin.connect() as conn:
        conn.execute(text("SELECT pg_stat_clear_snapshot()"))
        row = conn.execute(
            text("SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = :d"), {"d": dbname}
        ).one()
    return int(row[0]), int(row[1])


# -- worker --------------------------------------------------------------------------------------


def children_of(pid: int) -> list[int]:
    try:
        raw = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in raw.split()]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def system_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy (all CPUs, everything but idle and iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(values[:8]) - values[3] - values[4]) / CLK_TCK


def pids_named(name: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if (proc / "comm").read_text().strip() == name:
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def wait_quiet(max_wait: float, threshold: float = 0.15) -> float:
    """Wait (up to `max_wait` s) until the machine is idle: < `threshold` CPUs busy over 1 s; return that load.

    Other processes on a 2-core machine (a test suite, a build) change the figures a lot: every run also
    reports the CPU used outside the benchmark ("other").
    """
    deadline = time.monotonic() + max_wait
    while True:
        b0, t0 = system_busy_seconds(), time.monotonic()
        time.sleep(1.0)
        load = (system_busy_seconds() - b0) / (time.monotonic() - t0)
        if load < threshold or time.monotonic() > deadline:
            return load


def backend_pids(admin: Engine, dbname: str) -> list[int]:
    with admin.connect() as conn:
        rows = conn.execute(
            text("SELECT pid FROM pg_stat_activity WHERE datname = :d AND pid <> pg_backend_pid()"), {"d": dbname}
        )
        return [int(r[0]) for r in rows]


def start_worker(queue: str, env: dict[str, str], log: Path, concurrency: int) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "bench.bench_app",
        "worker",
        "--pool=prefork",
        f"--concurrency={concurrency}",
        "-Q",
        queue,
        "-n",
        f"{queue}@%h",
        "--loglevel=WARNING",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def stop_worker(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Warm-shutdown the worker by its PID, then kill by PID whatever of it is left."""
    kids = children_of(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 5
    for kid in kids:
        while alive(kid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if alive(kid):
            os.kill(kid, signal.SIGKILL)


# -- phases --------------------------------------------------------------------------------------


def enqueue(phase: str, run_tag: str, n: int, queue: str, first_n: int) -> int:
    from bench.bench_app import bench_floor, bench_idem, bench_plain

    if phase == "plain":
        task, ids = bench_plain, range(n)
    elif phase == "idem":
        task, ids = bench_idem, range(n)
    elif phase == "floor":
        task, ids = bench_floor, range(n)
    else:  # dup: every 10th key of the idem phase, all COMPLETED by now
        task, ids = bench_idem, range(0, first_n, 10)
    count = 0
    with task.app.producer_or_acquire() as producer:
        for i in ids:
            task.apply_async((run_tag, i), queue=queue, producer=producer)
            count += 1
    return count


def run_phase(
    phase: str,
    run_tag: str,
    n: int,
    args: argparse.Namespace,
    admin: Engine,
    stats: redis.Redis,
    profile_dir: Path | None,
) -> PhaseResult:
    url = args.database_url
    dbname = make_url(url).database or ""
    queue = f"oncelery_bench.{phase}.{uuid.uuid4().hex[:8]}"
    prefix = f"bench:{queue}"
    if phase != "dup":
        truncate(url)
    jobs = enqueue(phase, run_tag, n, queue, n)
    env = {
        **os.environ,
        "BENCH_BROKER_URL": args.broker_url,
        "BENCH_DATABASE_URL": url,
        "BENCH_QUEUE": queue,
        "BENCH_WHAT_IF": args.what_if,
        "PYTHONPATH": str(REPO),
    }
    wait_no_backends(admin, dbname)
    c0, r0 = xact_counts(admin, dbname)
    idle_load = wait_quiet(args.settle) if args.settle > 0 else 0.0
    log = LOG_DIR / f"{queue}.log"
    timeout = max(120.0, jobs / 20)
    redis_pids = pids_named("redis-server")
    redis0 = sum(cpu_seconds(p) for p in redis_pids)
    busy0 = system_busy_seconds()
    t0 = time.time()
    proc = start_worker(queue, env, log, args.concurrency)
    spies: list[subprocess.Popen[bytes]] = []
    seen_ready = False
    try:
        if profile_dir is not None:
            spies = attach_py_spy(proc, prefix, stats, profile_dir / phase)
        while True:
            done = int(stats.get(f"{prefix}:done") or 0)
            if done >= jobs:
                break
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited with {proc.returncode}; see {log}")
            if stats.exists(f"{prefix}:ready"):
                seen_ready = True
            elif seen_ready:
                raise RuntimeError(
                    f"{phase}: the bench's Redis keys vanished (another process flushed {args.broker_url}); "
                    "use a Redis of the bench's own: --spawn-redis PORT"
                )
            if time.time() - t0 > timeout:
                raise RuntimeError(f"{phase}: {done}/{jobs} done after {timeout:.0f}s; see {log}")
            time.sleep(0.05)
        t_end = time.time()
        busy = system_busy_seconds() - busy0
        cpu = {
            "main": cpu_seconds(proc.pid),
            "children": sum(cpu_seconds(p) for p in children_of(proc.pid)),
            "postgres": sum(cpu_seconds(p) for p in backend_pids(admin, dbname)),
            "redis": sum(cpu_seconds(p) for p in redis_pids) - redis0,
        }
        cpu["other"] = max(0.0, busy - sum(cpu.values()))
    finally:
        stop_worker(proc)
        for spy in spies:
            try:
                spy.wait(timeout=30)
            except subprocess.TimeoutExpired:
                spy.send_signal(signal.SIGINT)
                spy.wait()
    ready = float(stats.get(f"{prefix}:ready") or t0)
    last = float(stats.get(f"{prefix}:last") or 0)
    db = {k.decode(): int(v) for k, v in stats.hgetall(f"{prefix}:db").items()}
    wait_no_backends(admin, dbname)
    c1, r1 = xact_counts(admin, dbname)
    verified = ""
    if phase in ("idem", "floor"):
        table = "bench_floor_runs" if phase == "floor" else "task_runs"
        completed = count_completed(url, f"oncelery.bench_{phase}", table)
        verified = f"{completed} COMPLETED rows"
    stats.delete(*(f"{prefix}:{k}" for k in ("done", "last", "first", "ready", "db")), queue)
    per_job = {k: v / jobs for k, v in db.items()}
    return PhaseResult(
        phase=phase,
        jobs=jobs,
        boot_s=ready - t0,
        wall_s=last - t0,
        rate_start=jobs / (last - t0),
        rate_ready=jobs / (last - ready),
        db=per_job,
        xact_commit=c1 - c0,
        xact_rollback=r1 - r0,
        verified=verified,
        cpu_ms={k: 1000 * v / jobs for k, v in cpu.items()},
        cpu_utilization=busy / ((t_end - t0) * (os.cpu_count() or 1)),
        idle_load_before=idle_load,
    )


# -- profiling -----------------------------------------------------------------------------------

PY_SPY_RATE = 200  # samples per second per worker child


def attach_py_spy(
    proc: subprocess.Popen[bytes], prefix: str, stats: redis.Redis, out: Path
) -> list[subprocess.Popen[bytes]]:
    """Start `py-spy record` on each worker child once the worker is ready: wall (--idle) and CPU samples."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + 60
    while not stats.get(f"{prefix}:ready") and time.monotonic() < deadline:
        time.sleep(0.01)
    spies = []
    for kid in children_of(proc.pid):
        for mode, extra in (("wall", ["--idle"]), ("cpu", [])):
            cmd = [py_spy, "record", "--pid", str(kid), *extra, "--nonblocking", "--rate", str(PY_SPY_RATE)]
            cmd += ["--format", "raw", "--output", str(out / f"{kid}.{mode}.txt")]
            spies.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return spies


# What a worker child's main thread is doing in a sample: first match over its frames ("Class.func (file").
# The RunStore method names are those of the store at the time of writing (older ones kept for old runs).
OPERATIONS: list[tuple[str, tuple[str, ...]]] = [
    ("heartbeat start + stop", ("Heartbeat.start (", "Heartbeat.stop (")),
    ("claim INSERT .. ON CONFLICT txn", ("RunStore._insert_claim (",)),
    ("claim takeover UPDATE txn", ("RunStore._takeover (",)),
    ("claim SELECT of the run", ("RunStore.get (",)),
    ("replayed: outcome upsert txn", ("RunStore.record_outcome (",)),
    ("completion txn", ("RunStore.complete (",)),
    ("claim statements", ("RunStore.claim (",)),
    ("key + fingerprint (JSON, sha256)", ("KeyBuilder.identity (",)),
    ("result JSON round trip", ("encode_result (",)),
    ("other IdempotentTask code", ("idempotency/",)),
    ("bench counter (Redis MULTI)", ("_job_done (",)),
    ("Celery: trace, task body", ("fast_trace_task (",)),
    ("idle: waiting for the next job", ("Worker._make_protected_receive",)),
    ("Celery: report done to main", ("_SimpleQueue.put (", "Worker.workloop (")),
]
# Inside a database operation: which part of the round trips.
DB_PARTS: list[tuple[str, tuple[str, ...]]] = [
    ("pre-ping", ("do_ping (",)),
    ("COMMIT", ("_do_commit (", "Transaction.commit (", "do_commit (")),
    ("pool checkout", ("Pool.connect (", "_ConnectionFairy._checkout")),
    ("statement (+ BEGIN if any)", ("Cursor.execute (",)),
    ("SQLAlchemy build/compile", ("",)),
]
DB_OPERATIONS = {name for name, _ in OPERATIONS if "txn" in name or "SELECT" in name or "statements" in name}


def _match(frames: list[str], table: list[tuple[str, tuple[str, ...]]]) -> str | None:
    for name, needles in table:
        if any(needle in frame for frame in frames for needle in needles):
            return name
    return None


def summarize_profile(folder: Path, jobs: int, mode: str = "wall") -> list[tuple[str, float, float]]:
    """Return (part, ms of worker-child wall time per job, of it waiting on PostgreSQL) from py-spy raw files.

    Only the children's main thread while in the job loop counts (heartbeat threads and shutdown are left
    out). In "wall" mode idle samples are included, so waiting for PostgreSQL, Redis or the next job shows up;
    "cpu" mode counts only samples where the child was running.
    """
    wall: Counter[str] = Counter()
    pg_wait: Counter[str] = Counter()
    for path in folder.glob(f"*.{mode}.txt"):
        for line in path.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            frames = stack.split(";")
            if not n.isdigit() or not any(f.startswith("Worker.workloop (") for f in frames):
                continue
            op = _match(frames, OPERATIONS) or "other"
            if op in DB_OPERATIONS:
                op = f"{op}: {_match(frames, DB_PARTS)}"
            wall[op] += int(n)
            if frames[-1].startswith("Connection.wait (psycopg"):
                pg_wait[op] += int(n)
    per_job = 1000 / PY_SPY_RATE / jobs
    rows = [(op, wall[op] * per_job, pg_wait[op] * per_job) for op in sorted(wall, key=lambda o: -wall[o])]
    return [*rows, ("total", sum(wall.values()) * per_job, sum(pg_wait.values()) * per_job)]


# -- report --------------------------------------------------------------------------------------


def median(results: list[PhaseResult], attr: str) -> float:
    return statistics.median(getattr(r, attr) for r in results)


def median_db(results: list[PhaseResult], key: str) -> float:
    return statistics.median(r.db.get(key, 0.0) for r in results)


def report(by_phase: dict[str, list[PhaseResult]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for phase, results in by_phase.items():
        per_job_xact = [(r.xact_commit + r.xact_rollback) / r.jobs for r in results]
        summary[phase] = {
            "jobs": results[0].jobs,
            "rate_start": median(results, "rate_start"),
            "rate_ready": median(results, "rate_ready"),
            "boot_s": median(results, "boot_s"),
            "statements": median_db(results, "statements"),
            "commits": median_db(results, "commits"),
            "rollbacks": median_db(results, "rollbacks"),
            "checkouts": median_db(results, "checkouts"),
            "pings": median_db(results, "pings"),
            "round_trips": median_db(results, "round_trips"),
            "xact_commit": statistics.median(r.xact_commit / r.jobs for r in results),
            "xact_rollback": statistics.median(r.xact_rollback / r.jobs for r in results),
            "xact": statistics.median(per_job_xact),
            "cpu_ms": {k: statistics.median(r.cpu_ms.get(k, 0.0) for r in results) for k in results[0].cpu_ms},
            "cpu_utilization": median(results, "cpu_utilization"),
        }
    phases = list(by_phase)
    if "plain" in summary:
        for phase in phases:
            summary[phase]["ratio_start"] = summary[phase]["rate_start"] / summary["plain"]["rate_start"]
            summary[phase]["ratio_ready"] = summary[phase]["rate_ready"] / summary["plain"]["rate_ready"]

    print()
    header = (
        f"{'phase':<6} {'jobs':>6} {'jobs/s start':>13} {'jobs/s ready':>13} {'boot s':>7} "
        f"{'stmts/job':>9} {'commits':>8} {'rollbk':>7} {'pings':>6} {'RT/job':>7} {'xact/job':>9}"
    )
    print(header)
    print("-" * len(header))
    for phase in phases:
        s = summary[phase]
        print(
            f"{phase:<6} {s['jobs']:>6} {s['rate_start']:>13.1f} {s['rate_ready']:>13.1f} {s['boot_s']:>7.2f} "
            f"{s['statements']:>9.2f} {s['commits']:>8.2f} {s['rollbacks']:>7.2f} {s['pings']:>6.2f} "
            f"{s['round_trips']:>7.2f} {s['xact']:>9.2f}"
        )
    print()
    for phase in phases:
        if phase != "plain" and "plain" in summary:
            s = summary[phase]
            print(f"ratio {phase}/plain: {s['ratio_start']:.3f} (from worker start), {s['ratio_ready']:.3f} (ready)")
    print()
    print(
        f"{'CPU ms/job':<10} {'main':>7} {'children':>8} {'postgres':>9} {'redis':>6} {'other':>6} "
        f"{'total':>6} {'util':>5}"
    )
    for phase in phases:
        c = summary[phase]["cpu_ms"]
        print(
            f"{phase:<10} {c['main']:>7.2f} {c['children']:>8.2f} {c['postgres']:>9.2f} {c['redis']:>6.2f} "
            f"{c['other']:>6.2f} {sum(c.values()):>6.2f} {summary[phase]['cpu_utilization']:>5.0%}"
        )
    print()
    for phase, results in by_phase.items():
        print(
            f"  {phase} runs: "
            + ", ".join(
                f"{r.rate_start:.0f}/{r.rate_ready:.0f} jobs/s" + (f" [{r.verified}]" if r.verified else "")
                for r in results
            )
        )
    return summary


def spawn_redis(port: int) -> subprocess.Popen[bytes]:
    """Start a private, non-persistent redis-server on `port` (a shared Redis may be flushed by tests)."""
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            return proc
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    # Stop cleanly (workers and a spawned Redis by PID) on SIGTERM, and on SIGINT even when started in
    # the background of a non-interactive shell, which ignores SIGINT.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=10_000, help="jobs per phase (duplicates: jobs/10)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each phase; the median is reported")
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL, help="PostgreSQL URL of the bench database")
    parser.add_argument(
        "--fresh-db",
        action="store_true",
        help="drop and re-create the bench database first (it must be the bench's own)",
    )
    parser.add_argument("--broker-url", default=DEFAULT_BROKER_URL, help="Redis broker (use a dedicated db)")
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
    parser.add_argument("--profile", type=Path, help="py-spy the idem/dup worker children into this folder")
    parser.add_argument(
        "--phases",
        default="plain,idem,dup",
        help="comma-separated, in order: plain, idem, dup (needs idem before it), floor (a raw-SQL yardstick)",
    )
    parser.add_argument(
        "--what-if",
        default="",
        help="comma-separated experiments patched into the worker, see bench/bench_app.py "
        "(no-heartbeat, no-pre-ping, async-claim, all-async, floor-async-claim)",
    )
    args = parser.parse_args(argv)
    private_redis = None
    if args.spawn_redis:
        private_redis = spawn_redis(args.spawn_redis)
        args.broker_url = f"redis://127.0.0.1:{args.spawn_redis}/0"
    try:
        return run(args, parser)
    finally:
        if private_redis is not None:
            private_redis.terminate()
            private_redis.wait()


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:

    # bench.bench_app reads these at import, in this process (the producer) as in the worker.
    os.environ["BENCH_BROKER_URL"] = args.broker_url
    os.environ["BENCH_DATABASE_URL"] = args.database_url
    LOG_DIR.mkdir(parents=True, exist_ok=True)

    admin = admin_engine(args.database_url)
    prepare_database(args.database_url, admin, args.fresh_db)
    stats = redis.Redis.from_url(args.broker_url)
    phases = args.phases.split(",")
    if "dup" in phases and "idem" not in phases:
        parser.error("the dup phase answers keys of the idem phase")
    by_phase: dict[str, list[PhaseResult]] = {p: [] for p in phases}
    print(
        f"{args.jobs} jobs x {args.repeat} repeats, worker prefork -c {args.concurrency}, {os.cpu_count()} CPUs"
        + (f", what-if: {args.what_if}" if args.what_if else "")
    )
    for r in range(args.repeat):
        run_tag = uuid.uuid4().hex[:12]
        for phase in phases:
            profile = args.profile / f"r{r}" if args.profile else None
            res = run_phase(phase, run_tag, args.jobs, args, admin, stats, profile)
            by_phase[phase].append(res)
            print(
                f"[{r + 1}/{args.repeat}] {phase:<5} {res.jobs} jobs: {res.rate_start:7.1f} jobs/s from start, "
                f"{res.rate_ready:7.1f} from ready (boot {res.boot_s:.2f}s) "
                f"db/job {json.dumps({k: round(v, 2) for k, v in res.db.items()})} "
                f"xact/job {(res.xact_commit + res.xact_rollback) / res.jobs:.2f} "
                f"cpu ms/job {json.dumps({k: round(v, 2) for k, v in res.cpu_ms.items()})} "
                f"util {res.cpu_utilization:.0%} (load before {res.idle_load_before:.2f} CPUs) {res.verified}",
                flush=True,
            )
    summary = report(by_phase)
    if args.profile:
        for phase in phases:
            for r, res in enumerate(by_phase[phase]):
                folder = args.profile / f"r{r}" / phase
                print(f"\npy-spy {folder}: worker children's time per job, ms (summed over children)")
                print(f"  {'':<56} {'wall':>7} {'PG wait':>8} {'CPU':>7}")
                cpu = {name: ms for name, ms, _ in summarize_profile(folder, res.jobs, "cpu")}
                for name, ms, wait in summarize_profile(folder, res.jobs, "wall"):
                    print(f"  {name:<56} {ms:7.3f} {wait:8.3f} {cpu.get(name, 0.0):7.3f}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"runs": {p: [asdict(r) for r in rs] for p, rs in by_phase.items()}, "summary": summary}, indent=2
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
