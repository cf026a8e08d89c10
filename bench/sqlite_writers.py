"""How first executions on one SQLite file scale with processes: the embedded default's claims database.

    python bench/sqlite_writers.py [--calls 2000] [--processes 1,2] [--repeat 2] [--folder DIR]

For each process count, that many forked processes each run `--calls` first executions (direct calls of an
`IdempotentTask` no-op, new keys) on one SQLite file, all at once. Prints, per run, the calls per second of
all processes together and each process's wall and CPU ms per call. SQLite has one writer per file: a
first execution is two write transactions (the claim; the completion and its count, with the durable
commit's fsync), so what a second process adds depends on how much of a call is spent outside them.
Benchmarks are not tests: nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.support.harness import noop_task
from oncelery.store.schema import upgrade_schema


def run_calls(url: str, base: int, calls: int, ready: Any, start: Any, out: Any) -> None:
    """In a forked process: warm up, wait for the start signal, time `calls` first executions."""
    noop = noop_task(url, "bench.sqlite_writers", "w:{i}")
    for i in range(base - 200, base):  # warm: engines, compiled statements
        noop(i)
    ready.release()
    start.wait()
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(base, base + calls):
        noop(i)
    out.put(((time.perf_counter() - wall) / calls * 1e3, (time.process_time() - cpu) / calls * 1e3))


def one_run(folder: str, processes: int, calls: int) -> tuple[float, list[tuple[float, float]]]:
    """Start `processes` writers on a fresh file; return (calls/s of all together, per-process wall and CPU ms)."""
    path = Path(tempfile.mkdtemp(dir=folder)) / "claims.db"
    url = f"sqlite:///{path}"
    upgrade_schema(url)
    ctx = mp.get_context("fork")
    ready, start, out = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=run_calls, args=(url, (k + 1) * 1_000_000, calls, ready, start, out))
        for k in range(processes)
    ]
    for proc in procs:
        proc.start()
    for _ in procs:
        if not ready.acquire(timeout=120):
            raise SystemExit("a writer process did not get ready in 120 s")
    began = time.perf_counter()
    start.set()
    per_process = [out.get(timeout=600) for _ in procs]
    elapsed = time.perf_counter() - began
    for proc in procs:
        proc.join(60)
    return processes * calls / elapsed, per_process


def main(argv: list[str] | None = None) -> int:
    """Run each process count `--repeat` times, interleaved, and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="first executions per process")
    parser.add_argument("--processes", default="1,2", help="comma-separated process counts")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--folder", default=None, help="where the SQLite files go (default: the temp folder)")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.processes.split(",")]
    for r in range(args.repeat):
        for n in counts:
            rate, per_process = one_run(args.folder or tempfile.gettempdir(), n, args.calls)
            each = ", ".join(f"{wall:.3f}/{cpu:.3f}" for wall, cpu in per_process)
            print(f"round {r + 1}: {n} process(es): {rate:7.0f} calls/s together; wall/CPU ms per call: {each}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
