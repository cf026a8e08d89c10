"""py-spy profiles of a benchmark worker's children (`bench/throughput.py --profile DIR`), and their summary.

Two samplers per child: `py-spy record --idle` (wall time, including waits for PostgreSQL and the next job)
and `py-spy record` (running samples only). `summarize_profile` attributes each sample of a child's main
thread to the first matching operation below and prints milliseconds per job.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import redis

from bench.support.harness import children_of

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
    ("celery-once lock (Redis)", ("celery_once/",)),
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


def print_profile(folder: Path, jobs: int) -> None:
    """Print the wall, PostgreSQL-wait and CPU milliseconds per job of one profiled phase run."""
    print(f"\npy-spy {folder}: worker children's time per job, ms (summed over children)")
    print(f"  {'':<56} {'wall':>7} {'PG wait':>8} {'CPU':>7}")
    cpu = {name: ms for name, ms, _ in summarize_profile(folder, jobs, "cpu")}
    for name, ms, wait in summarize_profile(folder, jobs, "wall"):
        print(f"  {name:<56} {ms:7.3f} {wait:8.3f} {cpu.get(name, 0.0):7.3f}")
