"""The SQLite floor of `bench/embedded.py`: the two transactions of a first execution, on bare sqlite3.

`celery -A bench.support.sqlite_floor worker` is bench.support.bench_app's app (same broker settings, same
finished-job counter) with one more task, `oncelery.bench_sqlite_floor`: a plain Celery task, not Oncelery,
that writes what an `IdempotentTask` first execution writes on the embedded default, statement for statement
(traced with sqlite3's trace callback, 2026-12-02), in the same SQLite file and tables, with Oncelery's
connection settings (oncelery.store.dialects.SQLite) and no SQLAlchemy, key derivation or decision table:

    claim       BEGIN IMMEDIATE; INSERT INTO task_runs ... ON CONFLICT DO NOTHING RETURNING id; COMMIT
                on a connection with synchronous=NORMAL (Oncelery's claim engine: no fsync at commit)
    completion  BEGIN IMMEDIATE; UPDATE task_runs SET status='COMPLETED' ... WHERE id, fencing token, owner and
                status='RUNNING'; INSERT INTO delivery_outcomes ... ON CONFLICT DO UPDATE (count + 1); COMMIT
                on a connection with SQLite's default synchronous=FULL (durable: the WAL is fsynced)

Both connections: WAL, busy_timeout, foreign_keys=ON, autocommit mode (isolation_level=None) so BEGIN
IMMEDIATE takes the write lock up front, as Oncelery's. The run row keeps the message (its args), as on the
embedded broker by default. A claim that finds the key taken is an error here: the floor measures first
executions only.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import uuid
from typing import Any

from sqlalchemy.engine import make_url

from bench.support.bench_app import app, database_url
from oncelery.settings import sqlite_busy_timeout_ms
from oncelery.store.tables import OUTCOME_SHARDS

__all__ = ["SQLITE_FLOOR_TASK", "app", "bench_sqlite_floor"]

SQLITE_FLOOR_TASK = "oncelery.bench_sqlite_floor"
_NOW = "strftime('%Y-%m-%d %H:%M:%f', 'now')"  # oncelery.store.dialects.SQLITE_TIME_FORMAT, as SQL
_CLAIM = f"""
INSERT INTO task_runs (task_name, tenant, idempotency_key, fingerprint, field_digests, status, fencing_token, owner,
                       lease_expires_at, attempts, concurrency_key, celery_task_id, message, created_at, updated_at)
VALUES (?, '', ?, ?, ?, 'RUNNING', 1, ?, strftime('%Y-%m-%d %H:%M:%f', 'now', '+60.000 seconds'), 1, NULL, ?, ?,
        {_NOW}, {_NOW})
ON CONFLICT (task_name, tenant, idempotency_key) DO NOTHING
RETURNING id
"""
_COMPLETE = f"""
UPDATE task_runs SET status = 'COMPLETED', lease_expires_at = NULL, not_before = NULL, result = 'null',
                     message = 'null', updated_at = {_NOW}, finished_at = {_NOW}
WHERE id = ? AND fencing_token = 1 AND owner = ? AND coalesce(status, '') = 'RUNNING'
"""
_COUNT = """
INSERT INTO delivery_outcomes (task_name, tenant, outcome, shard, count, steps_executed, steps_replayed, takeovers,
                               saved_calls, saved_input_tokens, saved_output_tokens, saved_cost_micros, at_producer)
VALUES (?, '', 'executed', ?, 1, 0, 0, 0, 0, 0, 0, 0, 0)
ON CONFLICT (task_name, tenant, outcome, shard) DO UPDATE SET count = delivery_outcomes.count + 1,
    steps_executed = delivery_outcomes.steps_executed + excluded.steps_executed,
    steps_replayed = delivery_outcomes.steps_replayed + excluded.steps_replayed,
    takeovers = delivery_outcomes.takeovers + excluded.takeovers,
    saved_calls = delivery_outcomes.saved_calls + excluded.saved_calls,
    saved_input_tokens = delivery_outcomes.saved_input_tokens + excluded.saved_input_tokens,
    saved_output_tokens = delivery_outcomes.saved_output_tokens + excluded.saved_output_tokens,
    saved_cost_micros = delivery_outcomes.saved_cost_micros + excluded.saved_cost_micros,
    at_producer = delivery_outcomes.at_producer + excluded.at_producer
"""
_conns: dict[tuple[int, bool], sqlite3.Connection] = {}


def _conn(fast: bool) -> sqlite3.Connection:
    """This process's connection for claims (`fast`: synchronous=NORMAL) or completions (synchronous=FULL)."""
    key = (os.getpid(), fast)
    conn = _conns.get(key)
    if conn is None:
        path = make_url(database_url()).database or ""
        busy_ms = sqlite_busy_timeout_ms()
        conn = sqlite3.connect(path, timeout=busy_ms / 1000, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA busy_timeout={busy_ms}")
        conn.execute("PRAGMA foreign_keys=ON")
        if fast:
            conn.execute("PRAGMA synchronous=NORMAL")
        _conns[key] = conn
    return conn


@app.task(name=SQLITE_FLOOR_TASK, bind=True, ignore_result=True)
def bench_sqlite_floor(self: Any, run: str, i: int) -> None:
    """Yardstick: the claim transaction and the completion transaction of a first execution, around a no-op."""
    owner = uuid.uuid4().hex
    message = json.dumps(
        {"args": [run, i], "kwargs": {}, "headers": {}, "queue": self.request.delivery_info.get("routing_key")}
    )
    claim = _conn(fast=True)
    claim.execute("BEGIN IMMEDIATE")
    try:
        row = claim.execute(
            _CLAIM, (SQLITE_FLOOR_TASK, f"bench:{run}:{i}", "0" * 64, "{}", owner, self.request.id, message)
        ).fetchall()  # all rows before COMMIT: a statement still stepping would hold it
        claim.execute("COMMIT")
    except BaseException:
        claim.execute("ROLLBACK")
        raise
    if not row:
        raise RuntimeError(f"sqlite floor: key bench:{run}:{i} already claimed (the floor runs first executions)")
    done = _conn(fast=False)
    done.execute("BEGIN IMMEDIATE")
    try:
        if done.execute(_COMPLETE, (row[0][0], owner)).rowcount != 1:
            raise RuntimeError("sqlite floor: lease lost")
        done.execute(_COUNT, (SQLITE_FLOOR_TASK, random.randrange(OUTCOME_SHARDS)))
        done.execute("COMMIT")
    except BaseException:
        done.execute("ROLLBACK")
        raise
