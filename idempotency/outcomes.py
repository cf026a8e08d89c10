"""Delivery outcomes (G7): every delivery records exactly one, counted in the database, exact across hosts.

Counters are sharded rows summed on read, so concurrent workers rarely queue on one counter row.
"""

from __future__ import annotations

import random
from typing import Any

from sqlalchemy import Connection, func, select
from sqlalchemy.orm import Session

from oncelery.models import Outcome
from oncelery.statements import OUTCOME_SHARDS, OUTCOME_TOTALS, OUTCOMES, statements
from oncelery.store import Database

__all__ = ["Outcome", "counter_shard", "outcome_counts", "outcome_params", "record_outcome", "record_outcome_txn"]


def outcome_params(task_name: str, outcome: Outcome, tenant: str = "", **totals: float) -> dict[str, Any]:
    """The parameters of one counter increment (a random shard), adding `totals` (OUTCOME_TOTALS, default 0)."""
    params: dict[str, Any] = {f"p_{name}": totals.pop(name, 0) for name in OUTCOME_TOTALS}
    if totals:
        raise TypeError(f"not an outcome total: {sorted(totals)}")
    return {"p_task": task_name, "p_tenant": tenant, "p_outcome": outcome, "p_shard": counter_shard(), **params}


def counter_shard() -> int:
    """A random shard of an outcome counter (concurrent workers rarely queue on one counter row)."""
    return random.randrange(OUTCOME_SHARDS)


def record_outcome_txn(
    conn: Connection | Session, dialect: str, task_name: str, outcome: Outcome, tenant: str = ""
) -> None:
    """Count one delivery outcome inside the caller's transaction (it commits or rolls back with it)."""
    conn.execute(statements(dialect).count_outcome, outcome_params(task_name, outcome, tenant))


def record_outcome(
    db: Database, task_name: str, outcome: Outcome, tenant: str = "", replayed_run: int | None = None
) -> None:
    """Count one delivery outcome in its own durable transaction.

    `replayed_run`: the COMPLETED run whose stored result answered this delivery; its `replays` grows by one in
    the same transaction (one statement on PostgreSQL).
    """
    sql = statements(db.dialect.name)
    params = outcome_params(task_name, outcome, tenant)
    if replayed_run is None:
        db.one(sql.count_outcome, params)
        return
    params["p_run_id"] = replayed_run
    if sql.count_replay is not None:
        db.one(sql.count_replay, params)
        return
    with db.begin() as conn:
        run = conn.execute(sql.count_replay_on_run, params).first()
        if run is not None:  # purged meanwhile: the replay is counted, saving nothing known
            calls, input_tokens, output_tokens, cost = run
            params.update(
                p_saved_calls=calls,
                p_saved_input_tokens=input_tokens,
                p_saved_output_tokens=output_tokens,
                p_saved_cost=cost,
            )
        conn.execute(sql.count_outcome, params)


def outcome_counts(db: Database, task_name: str | None = None, tenant: str | None = None) -> dict[str, int]:
    """Return {outcome: count} summed over all tasks (and tenants), or one task's, or one tenant's."""
    c = OUTCOMES.c
    stmt = select(c.outcome, func.sum(c.count)).group_by(c.outcome)
    if task_name is not None:
        stmt = stmt.where(c.task_name == task_name)
    if tenant is not None:
        stmt = stmt.where(c.tenant == tenant)
    with db.read() as conn:
        return {o.value: int(n) for o, n in conn.execute(stmt)}
