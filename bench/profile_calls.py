"""Where the Python of one delivery goes: direct calls of an IdempotentTask no-op under cProfile.

    python bench/profile_calls.py [--calls 3000] [--what duplicate|first] [--top 30] [--admin-url URL]

Creates its own PostgreSQL database (`oncelery_bench_profile`, dropped at the end), runs `--calls` first
executions, then times `--calls` more calls unprofiled (duplicates of those keys, or new keys), then the same
again under cProfile, and prints ms per call and the `--top` functions by own time. A direct call is the
worker's delivery path without Celery's trace and broker: key and fingerprint, claim, body, completion or
replay. Benchmarks are not tests: nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.engine import make_url

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.support.harness import noop_task
from oncelery.store.database import dispose_engines, get_engine
from oncelery.store.schema import upgrade_schema

DATABASE = "oncelery_bench_profile"


def main(argv: list[str] | None = None) -> int:
    """Create the database, time and profile the calls, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_admin = os.environ.get("ONCELERY_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--admin-url", default=default_admin, help="a PostgreSQL server to create the database on")
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--what", choices=("duplicate", "first"), default="duplicate")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    admin = get_engine(args.admin_url)
    with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{DATABASE}"'))
    url = make_url(args.admin_url).set(database=DATABASE).render_as_string(hide_password=False)
    try:
        upgrade_schema(url)
        noop = noop_task(url, "bench.profile", "p:{i}")
        n = args.calls
        for i in range(n):
            noop(i)  # the keys the duplicates repeat (and a warm pool)
        start = n if args.what == "first" else 0
        began = time.perf_counter()
        for i in range(start, start + n):
            noop(i)
        print(f"{args.what}: {(time.perf_counter() - began) / n * 1000:.3f} ms per call (unprofiled, {n} calls)")
        start = 2 * n if args.what == "first" else 0
        profile = cProfile.Profile()
        profile.enable()
        for i in range(start, start + n):
            noop(i)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)
    finally:
        dispose_engines()
        with get_engine(args.admin_url).connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)'))
    return 0


if __name__ == "__main__":
    sys.exit(main())
