"""The CPU OpenTelemetry tracing adds per job, in one process: direct calls of the same jobs with tracing off and on.

    python bench/otel_in_process.py [--calls 2000] [--rounds 6] [--database-url URL] [--json FILE]

bench/otel_overhead.py measures whole workers, whose CPU per job moves by more than the effect when the shared
machine is busy. Here the same two jobs as there (`idem`: a no-op; `steps`: the no-op in three checkpointed steps)
are called directly (the worker's delivery path without Celery's trace and broker) on one PostgreSQL database, by
two apps that differ only in `oncelery_otel`, in interleaved rounds (the order alternating), this process's CPU
measured around each batch of calls. On: the SDK installed as an application would (a BatchSpanProcessor and a
PeriodicExportingMetricReader whose exporters drop what they get). Reported: CPU us per job, medians over rounds,
and what tracing adds (on - off); divide it by a worker's CPU per job (bench/otel_overhead.py) for the overhead.
Benchmarks are not tests: nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.support.harness import DEFAULT_DATABASE_URL, admin_engine, prepare_database

JOBS = ("idem", "steps")


def _nothing(i: int) -> int:
    return i


def tasks(url: str, traced: bool) -> dict[str, Any]:
    """The two jobs of one app (tracing on or off), as the worker would call them (the registered task objects)."""
    from celery import Celery

    from oncelery import IdempotentTask

    app = Celery(f"otel-bench-{'on' if traced else 'off'}")
    app.conf.oncelery_database_url = url
    app.conf.oncelery_otel = traced
    half = "on" if traced else "off"

    @app.task(shared=False, base=IdempotentTask, bind=True, name=f"bench.otel_idem_{half}", idempotency_key="i:{k}")
    def idem(self: IdempotentTask, k: str) -> None:
        return None

    @app.task(shared=False, base=IdempotentTask, bind=True, name=f"bench.otel_steps_{half}", idempotency_key="s:{k}")
    def steps(self: IdempotentTask, k: str) -> None:
        for name in ("first", "second", "third"):
            self.step(name, _nothing, 1)

    app.finalize()
    return {"idem": app.tasks[idem.name], "steps": app.tasks[steps.name]}


def install_sdk() -> None:
    """The SDK with exporters that drop, as bench/support/otel_sdk.py installs it in a worker's pool processes."""
    from bench.support import otel_sdk

    otel_sdk._install()


def main(argv: list[str] | None = None) -> int:
    """Run the interleaved rounds; print CPU us per job and what tracing adds."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL.replace("oncelery_bench", "oncelery_bench_otel"))
    parser.add_argument("--calls", type=int, default=2000, help="calls per job and half per round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    prepare_database(args.database_url, admin_engine(args.database_url), False)
    install_sdk()
    by_half = {"off": tasks(args.database_url, False), "on": tasks(args.database_url, True)}
    for half in by_half.values():  # warm: engines, prepared statements, the tracer
        for task in half.values():
            for _ in range(50):
                task(uuid.uuid4().hex)
    cpu: dict[str, list[float]] = {f"{job} {half}": [] for job in JOBS for half in ("off", "on")}
    for r in range(args.rounds):
        for job in JOBS:
            for half in ("off", "on") if r % 2 == 0 else ("on", "off"):
                task, tag = by_half[half][job], uuid.uuid4().hex[:8]
                started = time.process_time()
                for i in range(args.calls):
                    task(f"{tag}-{i}")
                per_job = (time.process_time() - started) / args.calls * 1e6
                cpu[f"{job} {half}"].append(per_job)
                print(f"round {r} {job:5} tracing {half:3}: {per_job:.0f} us CPU per job", flush=True)
    med = {name: statistics.median(values) for name, values in cpu.items()}
    added = {job: med[f"{job} on"] - med[f"{job} off"] for job in JOBS}
    for job in JOBS:
        pairs = [on - off for on, off in zip(cpu[f"{job} on"], cpu[f"{job} off"], strict=True)]
        print(
            f"{job:5}: median CPU per job off {med[f'{job} off']:.0f} us, on {med[f'{job} on']:.0f} us: tracing adds "
            f"{added[job]:.0f} us (paired rounds {min(pairs):.0f}..{max(pairs):.0f} us)"
        )
    if args.json:
        args.json.write_text(json.dumps({"cpu_us": cpu, "medians": med, "added_us": added}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
