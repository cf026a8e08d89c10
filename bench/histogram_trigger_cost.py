"""Benchmark: what migration 0012's run-duration trigger costs a completion on PostgreSQL.

Run: python bench/histogram_trigger_cost.py [--admin-url URL] [--runs 5000] [--rounds 8]
Creates its own database (dropped at the end), inserts `--runs` RUNNING runs per round, and completes them one by
one in a server-side loop (UPDATE ... status = 'COMPLETED', as a worker's completion), with the trigger enabled
and disabled in alternate rounds. `--commit-each` commits each completion (synchronous_commit off, so the WAL
flush is not timed), as workers do; without it the loop is one transaction, where every completion updates the
same few bucket rows again (an upper bound). Prints microseconds per completion per round and checks that the
histogram counted exactly the completions of the enabled rounds. Figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

from sqlalchemy import text
from sqlalchemy.engine import make_url

from oncelery.store.database import dispose_engines, get_engine
from oncelery.store.schema import upgrade_schema

_FILL = (
    "INSERT INTO task_runs (task_name, tenant, idempotency_key, fingerprint, field_digests, status, fencing_token, "
    "attempts) SELECT 'bench.t', '', 'k' || i, 'f', '{}', 'RUNNING', 1, 1 "
    "FROM generate_series(CAST(:first AS int), CAST(:last AS int)) i"
)


def _loop(runs: int, first_id: int, commit_each: bool) -> str:
    commit = "COMMIT;" if commit_each else ""
    return f"""
DO $$ DECLARE i int; BEGIN
  PERFORM set_config('synchronous_commit', 'off', false);
  FOR i IN 0..{runs - 1} LOOP
    UPDATE task_runs SET status = 'COMPLETED', finished_at = clock_timestamp(), updated_at = clock_timestamp()
    WHERE id = i + {first_id} AND status = 'RUNNING';
    {commit}
  END LOOP; END $$
"""


def main() -> None:
    """Time completions with the trigger on and off, alternately, and print the figures."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--admin-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--runs", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--commit-each", action="store_true")
    args = parser.parse_args()
    name = f"histogram_bench_{uuid.uuid4().hex[:10]}"
    admin = get_engine(args.admin_url)
    with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(args.admin_url).set(database=name).render_as_string(hide_password=False)
    figures: dict[str, list[float]] = {"on": [], "off": []}
    try:
        upgrade_schema(url)
        engine = get_engine(url)
        for round_ in range(args.rounds):
            mode = "on" if round_ % 2 == 0 else "off"
            with engine.begin() as conn:
                first = round_ * args.runs + 1
                conn.execute(text(_FILL), {"first": first, "last": first + args.runs - 1})
                first_id = conn.execute(text("SELECT min(id) FROM task_runs WHERE status = 'RUNNING'")).scalar_one()
                switch = "ENABLE" if mode == "on" else "DISABLE"
                conn.execute(text(f"ALTER TABLE task_runs {switch} TRIGGER oncelery_histogram_run_duration"))
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                started = time.perf_counter()
                conn.execute(text(_loop(args.runs, first_id, args.commit_each)))
                figures[mode].append((time.perf_counter() - started) / args.runs * 1e6)
        with engine.connect() as conn:
            counted = conn.execute(text("SELECT sum(count) FROM histogram_buckets WHERE family = 'run_duration'"))
            observed = int(counted.scalar_one() or 0)
        for mode, values in figures.items():
            rounded = ", ".join(f"{v:.1f}" for v in values)
            print(f"trigger {mode}: median {statistics.median(values):.1f} us per completion ({rounded})")
        expected = args.runs * len(figures["on"])
        print(f"completions observed by the histogram: {observed} (expected {expected}): {observed == expected}")
    finally:
        dispose_engines()
        with get_engine(args.admin_url).connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


if __name__ == "__main__":
    main()
