"""Where a first execution's time goes, in-process: Oncelery, Oncelery's own two statements bare, and the floor.

    python bench/hot_path.py [--calls 3000] [--rounds 4] [--database-url URL] [--json FILE]

Four ways to do one first execution of a no-op, on one PostgreSQL database, interleaved rounds:

    oncelery    a direct call of an `IdempotentTask` no-op: key and fingerprint, the claim, the body, the
                completion (the worker's delivery path without Celery's trace and broker)
    statements  Oncelery's two statements exactly as that call sends them (SQL and parameters captured from
                one call), run bare through psycopg, prepared, on two autocommit connections: the claim on a
                `synchronous_commit=off` one, the completion on a durable one (as Oncelery's engines do)
    insert      the same, with Oncelery's plain claim (`Statements.insert_claim`, `INSERT .. ON CONFLICT DO
                NOTHING RETURNING id`, what SQLite runs) instead of the claim that also answers a duplicate
    floor       bench_app's yardstick (bench/throughput.py's floor phase): the least a claim + fenced
                completion can be, on tables of its own with two indexes

So `oncelery - statements` is the Python around the statements (framework, pool, parameter conversion), and
`statements - floor` is what the statements and the schema carry beyond the floor (the claim that also
answers a duplicate in the same round trip, the outcome counters, five indexes on task_runs); `statements -
insert` is the part of it that answering a duplicate in the claim's round trip costs a first execution.

Each round runs every way `--calls` times on new keys, in an order rotated by round; the figures are
medians over rounds, per call: wall ms, this process's CPU ms, and the CPU ms of every `postgres` process
(so the machine should be otherwise idle). Creates its own database (`oncelery_bench_hot_path`, dropped at
the end). Benchmarks are not tests: nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.support import bench_app
from bench.support.harness import admin_engine, cpu_seconds, drop_database, noop_task, pids_named, prepare_database
from oncelery.store.database import dispose_engines, get_engine
from oncelery.store.dialects import MODE_FAST
from oncelery.store.driver import driver_statement, statement_listeners
from oncelery.store.statements import statements as prebuilt

DATABASE = "oncelery_bench_hot_path"
WAYS = ("oncelery", "statements", "insert", "floor")


def postgres_cpu() -> float:
    """CPU seconds of every postgres process (backends, WAL writer, checkpointer)."""
    return sum(cpu_seconds(pid) for pid in pids_named("postgres"))


def build(url: str) -> tuple[dict[str, Callable[[int], None]], Callable[[], None]]:
    """The four ways, each a function of a fresh key number; and a function that closes their connections."""
    import psycopg

    noop = noop_task(url, "bench.hot_path", "h:{i}")
    # Oncelery's two statements, as one first execution sends them.
    sent: list[tuple[str, dict[str, Any]]] = []
    statement_listeners.append(lambda sql, values: sent.append((sql, dict(values))))
    try:
        noop(-1)
    finally:
        statement_listeners.pop()
    if len(sent) != 2:
        raise SystemExit(f"expected a claim and a completion, the call sent {len(sent)} statements")
    (claim_sql, claim_params), (done_sql, done_params) = sent
    dsn = url.replace("postgresql+psycopg://", "postgresql://", 1)
    fast = psycopg.connect(dsn, autocommit=True, prepare_threshold=0)
    fast.execute("SET synchronous_commit = off")
    durable = psycopg.connect(dsn, autocommit=True, prepare_threshold=0)

    def statements(i: int) -> None:
        params = {**claim_params, "p_key": f"s:{i}", "p_owner": uuid.uuid4().hex}
        row = fast.execute(claim_sql, params).fetchone()
        if row is None or row[0] is None:
            raise RuntimeError(f"the claim of s:{i} inserted nothing")
        done = {**done_params, "p_run_id": row[0], "p_owner": params["p_owner"]}
        if durable.execute(done_sql, done).fetchone() is None:
            raise RuntimeError(f"the completion of s:{i} matched nothing")

    insert_claim = driver_statement(prebuilt("postgresql").insert_claim, get_engine(url, MODE_FAST))
    insert_sql = insert_claim.sql
    given = {name: getattr(value, "obj", value) for name, value in claim_params.items()}  # unwrap psycopg's Json

    def insert(i: int) -> None:
        params = insert_claim.params({**given, "p_key": f"i:{i}", "p_owner": uuid.uuid4().hex})
        row = fast.execute(insert_sql, params).fetchone()
        if row is None:
            raise RuntimeError(f"the plain claim of i:{i} inserted nothing")
        done = {**done_params, "p_run_id": row[0], "p_owner": params["p_owner"]}
        if durable.execute(done_sql, done).fetchone() is None:
            raise RuntimeError(f"the completion of i:{i} matched nothing")

    floor_claim = psycopg.connect(dsn, autocommit=True, prepare_threshold=0)
    floor_claim.execute("SET synchronous_commit = off")  # as Oncelery's claim (floor-async-claim)

    def floor(i: int) -> None:
        params = {"task": "bench.floor", "key": f"f:{i}", "fp": "0" * 64, "owner": uuid.uuid4().hex, "shard": 1}
        row = floor_claim.execute(bench_app._FLOOR_CLAIM, params).fetchone()
        if row is None:
            raise RuntimeError(f"the floor's claim of f:{i} inserted nothing")
        if durable.execute(bench_app._FLOOR_COMPLETE, {**params, "id": row[0]}).fetchone() is None:
            raise RuntimeError(f"the floor's completion of f:{i} matched nothing")

    def close() -> None:
        for conn in (fast, durable, floor_claim):
            conn.close()

    return {"oncelery": noop, "statements": statements, "insert": insert, "floor": floor}, close


def main(argv: list[str] | None = None) -> int:
    """Create the database, run the interleaved rounds, print the medians and the decomposition."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = os.environ.get("ONCELERY_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--database-url", default=default, help="a PostgreSQL server to create the database on")
    parser.add_argument("--calls", type=int, default=3000, help="calls per way per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    url = make_url(args.database_url).set(database=DATABASE).render_as_string(hide_password=False)
    admin = admin_engine(url)
    prepare_database(url, admin, fresh=True)
    ways, close = build(url)
    figures: dict[str, list[tuple[float, float, float]]] = {way: [] for way in WAYS}
    try:
        for i in range(300):  # warm: prepared statements, pools, the first pages
            for way in WAYS:
                ways[way](-2 - i)
        base = 0
        for r in range(args.rounds):
            for way in WAYS[r % len(WAYS) :] + WAYS[: r % len(WAYS)]:
                wall, cpu, pg = time.perf_counter(), time.process_time(), postgres_cpu()
                for i in range(base, base + args.calls):
                    ways[way](i)
                wall, cpu, pg = time.perf_counter() - wall, time.process_time() - cpu, postgres_cpu() - pg
                per_call = (wall / args.calls * 1e3, cpu / args.calls * 1e3, pg / args.calls * 1e3)
                figures[way].append(per_call)
                print(f"round {r + 1} {way:<10} wall {per_call[0]:.3f} ms  cpu {per_call[1]:.3f}  pg {per_call[2]:.3f}")
            base += args.calls
    finally:
        close()
        dispose_engines()
        drop_database(admin, DATABASE)
    med = {way: [statistics.median(f[k] for f in figures[way]) for k in range(3)] for way in WAYS}
    print(f"\nmedians of {args.rounds} rounds x {args.calls} first executions, ms per call")
    print(f"{'way':<12}{'wall':>8}{'cpu':>8}{'pg cpu':>8}{'x floor wall':>14}")
    for way in WAYS:
        wall, cpu, pg = med[way]
        print(f"{way:<12}{wall:>8.3f}{cpu:>8.3f}{pg:>8.3f}{wall / med['floor'][0]:>14.2f}")
    gap = [med["oncelery"][k] - med["floor"][k] for k in range(3)]
    python = [med["oncelery"][k] - med["statements"][k] for k in range(3)]
    shape = [med["statements"][k] - med["floor"][k] for k in range(3)]
    print("\ngap to the floor (wall / cpu / pg cpu): " + " / ".join(f"{v:.3f}" for v in gap))
    print("  Python around the statements:        " + " / ".join(f"{v:.3f}" for v in python))
    print("  the statements and schema themselves: " + " / ".join(f"{v:.3f}" for v in shape))
    one_trip = [med["statements"][k] - med["insert"][k] for k in range(3)]
    print("    of which the duplicate's answer in the claim: " + " / ".join(f"{v:.3f}" for v in one_trip))
    if args.json:
        args.json.write_text(json.dumps({"rounds": figures, "medians": med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
