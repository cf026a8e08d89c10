"""What measuring a call's payload costs at apply_async (oncelery_warn/max_payload_bytes), in-process.

    python bench/payload_size.py [--calls 20000] [--rounds 5] [--json FILE]

The check measures the JSON the call-time checks already encode (its length: kombu's JSON escapes non-ASCII,
so characters are bytes) and compares it with the two settings, read once per app configuration. Per payload
size (100 B, 10 KiB, 1 MiB of arguments), three ways, interleaved rounds, medians over rounds, microseconds
per call:

    check       the size check alone (`_check_payload_size` on the encoded body)
    call-time   all of apply_async's call-time checks (encode, size check, decode, key and fingerprint),
                with the size check
    without     the same on a task whose size check does nothing: `call-time - without` is its cost
    re-encode   what a second encoding would have cost instead (`json.dumps` of the same arguments)

No broker, no database: the app is on memory:// and the task has an explicit key template. Benchmarks are not
tests: nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from celery import Celery

from oncelery import IdempotentTask

SIZES = {"100 B": 100, "10 KiB": 10 << 10, "1 MiB": 1 << 20}
WAYS = ("check", "call-time", "without", "re-encode")


class Unchecked(IdempotentTask):
    """An IdempotentTask without the payload-size check (the `without` way)."""

    def _check_payload_size(self, body: str | bytes) -> None:
        return None


def make_tasks() -> tuple[Any, Any]:
    """Two IdempotentTasks (with and without the size check) on a memory:// app, keyed by a template (no
    content digest, so no database)."""
    app = Celery("bench-payload", broker="memory://", set_as_current=False)
    app.conf.oncelery_warn_payload_bytes = 4 << 20  # above every size here: nothing is logged
    app.conf.oncelery_max_payload_bytes = 8 << 20

    @app.task(shared=False, base=IdempotentTask, bind=True, name="bench.payload", idempotency_key="doc:{n}")
    def job(self: IdempotentTask, n: int, doc: str) -> int:
        return n

    @app.task(shared=False, base=Unchecked, bind=True, name="bench.payload_unchecked", idempotency_key="doc:{n}")
    def unchecked(self: IdempotentTask, n: int, doc: str) -> int:
        return n

    app.finalize()
    return job, unchecked


def per_call_us(fn: Callable[[], Any], calls: int) -> float:
    """Microseconds per call of `fn`, over `calls` calls."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000, help="calls per way, per round (fewer for 1 MiB)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    opts = parser.parse_args()

    task, unchecked = make_tasks()
    check_size = task._check_payload_size
    figures: dict[str, dict[str, float]] = {}
    for label, size in SIZES.items():
        args, kwargs = (1,), {"doc": "x" * size}
        body = json.dumps([list(args), kwargs])
        calls = max(20, opts.calls * 100 // max(100, size // 100))  # ~the same seconds per size

        def check(body: str = body) -> None:
            check_size(body)

        def call_time(args: Any = args, kwargs: Any = kwargs) -> None:
            task._check_at_call_time(args, kwargs, None, None, None)

        def without(args: Any = args, kwargs: Any = kwargs) -> None:
            unchecked._check_at_call_time(args, kwargs, None, None, None)

        def re_encode(args: Any = args, kwargs: Any = kwargs) -> None:
            json.dumps([list(args), kwargs])

        fns = {"check": check, "call-time": call_time, "without": without, "re-encode": re_encode}
        samples: dict[str, list[float]] = {way: [] for way in WAYS}
        for r in range(opts.rounds):
            order = WAYS[r % len(WAYS) :] + WAYS[: r % len(WAYS)]
            for way in order:
                samples[way].append(per_call_us(fns[way], calls))
        figures[label] = {way: statistics.median(values) for way, values in samples.items()}

    print(f"{'payload':>8} | {'check':>8} | {'call-time':>10} | {'without':>9} | {'re-encode':>10}  (us per call)")
    for label, row in figures.items():
        print(
            f"{label:>8} | {row['check']:8.3f} | {row['call-time']:10.2f} | {row['without']:9.2f} | "
            f"{row['re-encode']:10.2f}"
        )
    if opts.json:
        opts.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
