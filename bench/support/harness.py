"""What every worker benchmark shares: the bench database, a `celery worker` subprocess, CPU and memory from /proc.

Used by bench/throughput.py, bench/embedded.py and bench/memory.py. Nothing here measures by itself.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine, make_url

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from oncelery.models.migrate import upgrade  # noqa: E402
from oncelery.store.database import dispose_engines, get_engine, normalize_url  # noqa: E402

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/oncelery_bench"
DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/13"
LOG_DIR = Path(os.environ.get("BENCH_LOG_DIR", "/tmp/oncelery_bench"))
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- database ------------------------------------------------------------------------------------


def admin_engine(url: str) -> Engine:
    """An AUTOCOMMIT engine on the server's `postgres` database (CREATE DATABASE, pg_stat_database)."""
    admin = make_url(normalize_url(url)).set(database="postgres")
    return create_engine(admin, isolation_level="AUTOCOMMIT")


def create_database(admin: Engine, name: str, fresh: bool) -> None:
    """Create database `name` if missing (drop it first if `fresh`)."""
    with admin.connect() as conn:
        if fresh:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        exists = conn.execute(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}).first()
        if not exists:
            conn.execute(text(f'CREATE DATABASE "{name}"'))


def drop_database(admin: Engine, name: str) -> None:
    """Drop database `name` (this process's pooled connections are closed first)."""
    dispose_engines()
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def prepare_database(url: str, admin: Engine, fresh: bool) -> None:
    """Create the bench database if missing (drop it first if `fresh`), migrate it to head, add the floor's tables."""
    create_database(admin, make_url(url).database or "", fresh)
    upgrade(get_engine(url))
    from bench.support.bench_app import FLOOR_DDL

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
    """The number of COMPLETED runs of `task_name` in `table`."""
    with get_engine(url).connect() as conn:
        n = conn.execute(
            text(f"SELECT count(*) FROM {table} WHERE task_name = :t AND status = 'COMPLETED'"),
            {"t": task_name},
        ).scalar_one()
    dispose_engines()
    return int(n)


def count_replayed(url: str, task_name: str) -> int:
    """The `replayed` deliveries of `task_name` counted in delivery_outcomes (since the last truncate)."""
    with get_engine(url).connect() as conn:
        n = conn.execute(
            text("SELECT coalesce(sum(count), 0) FROM delivery_outcomes WHERE task_name = :t AND outcome = 'replayed'"),
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
    """The (xact_commit, xact_rollback) counters of `dbname` in pg_stat_database."""
    with admin.connect() as conn:
        conn.execute(text("SELECT pg_stat_clear_snapshot()"))
        row = conn.execute(
            text("SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = :d"), {"d": dbname}
        ).one()
    return int(row[0]), int(row[1])


def backend_pids(admin: Engine, dbname: str) -> list[int]:
    """The PIDs of the PostgreSQL backends connected to `dbname` (but this one)."""
    with admin.connect() as conn:
        rows = conn.execute(
            text("SELECT pid FROM pg_stat_activity WHERE datname = :d AND pid <> pg_backend_pid()"), {"d": dbname}
        )
        return [int(r[0]) for r in rows]


# -- processes -----------------------------------------------------------------------------------


def children_of(pid: int) -> list[int]:
    """The direct children of process `pid` (a worker's pool processes)."""
    try:
        raw = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in raw.split()]


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of process `pid`, its live children and the children it has reaped (a server and its backends).

    A backend that exits moves its time into its parent's cutime/cstime once reaped: the total stays whole.
    """
    total = 0.0
    for proc in (pid, *children_of(pid)):
        try:
            fields = Path(f"/proc/{proc}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(f) for f in fields[11:15]) / CLK_TCK  # utime, stime, cutime, cstime
    return total


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (peak RSS), RssAnon, RssFile (/proc/<pid>/status) and Pss, USS (smaps_rollup) in KiB.

    USS = Private_Clean + Private_Dirty: the pages only this process holds (a forked child shares the rest
    with its parent until it writes to them).
    """
    values: dict[str, int] = {}
    for source, wanted in (("status", ("VmRSS", "VmHWM", "RssAnon", "RssFile")), ("smaps_rollup", ("Pss",))):
        for line in Path(f"/proc/{pid}/{source}").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in wanted or name.startswith("Private_"):
                values[name] = values.get(name, 0) + int(rest.split()[0])
    values["USS"] = values.pop("Private_Clean", 0) + values.pop("Private_Dirty", 0)
    for name in [n for n in values if n.startswith("Private_")]:
        del values[name]
    return values


def system_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy (all CPUs, everything but idle and iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(values[:8]) - values[3] - values[4]) / CLK_TCK


def pids_named(name: str) -> list[int]:
    """The PIDs of every process whose command name is `name`."""
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


# -- worker and Redis ----------------------------------------------------------------------------


def start_worker(
    queue: str,
    env: dict[str, str],
    log: Path,
    concurrency: int,
    app: str = "bench.support.bench_app",
    node: str | None = None,
) -> subprocess.Popen[bytes]:
    """Start `celery -A app worker` (prefork, `concurrency` children) consuming `queue`, its output in `log`.

    `node` names the worker (default `<queue>@%h`): several workers on one queue each need their own.
    """
    cmd = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        app,
        "worker",
        "--pool=prefork",
        f"--concurrency={concurrency}",
        "-Q",
        queue,
        "-n",
        node or f"{queue}@%h",
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


def wait_done(
    proc: subprocess.Popen[bytes], stats: redis.Redis, prefix: str, jobs: int, timeout: float, log: Path
) -> float:
    """Wait until the bench counter `prefix:done` reaches `jobs`; return the time seen (raise if the worker died)."""
    t0 = time.time()
    seen_ready = False
    while True:
        done = int(stats.get(f"{prefix}:done") or 0)
        if done >= jobs:
            return time.time()
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited with {proc.returncode}; see {log}")
        if stats.exists(f"{prefix}:ready"):
            seen_ready = True
        elif seen_ready:
            raise RuntimeError(
                f"{prefix}: the bench's Redis keys vanished (another process flushed its Redis database); "
                "use a Redis of the bench's own: --spawn-redis PORT"
            )
        if time.time() - t0 > timeout:
            raise RuntimeError(f"{prefix}: {done}/{jobs} done after {timeout:.0f}s; see {log}")
        time.sleep(0.05)


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


def stop_process(proc: subprocess.Popen[bytes] | None) -> None:
    """Terminate a process this benchmark started (by its PID) and reap it."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        proc.wait()


def noop_task(url: str, name: str, key: str) -> Any:
    """An `IdempotentTask` no-op `name(i)` keyed by template `key` on claims database `url`, for direct calls."""
    from celery import Celery

    from oncelery import IdempotentTask

    app = Celery(f"bench-{name}-{os.getpid()}")
    app.conf.oncelery_database_url = url

    @app.task(shared=False, base=IdempotentTask, bind=True, name=name, idempotency_key=key)
    def noop(self: IdempotentTask, i: int) -> None:
        return None

    app.finalize()
    return noop


def new_database(admin_url: str, prefix: str) -> str:
    """Create a fresh `<prefix>_<random>` database on the admin URL's server (`create_database`); return its URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    create_database(admin_engine(admin_url), name, fresh=True)
    return make_url(admin_url).set(database=name).render_as_string(hide_password=False)


def percentile(values: list[float], q: float) -> float:
    """The `q`-quantile (0..1) of `values`, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def p50_p99(values: list[float]) -> tuple[float, float]:
    """The median and the 99th percentile of `values`."""
    return statistics.median(values), percentile(values, 0.99)
