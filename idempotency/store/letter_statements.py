"""The dead letters' SQL: a run's letter and a conflicting payload's letter, built once per dialect.

Built by `statements.Statements` (as `letter` and `conflict_letter`), executed with the parameters named `p_*`.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, String, bindparam, func, select, text
from sqlalchemy.sql.elements import ColumnElement

from oncelery.store.tables import LETTERS, RUNS

__all__ = [
    "conflict_letter",
    "letter",
]


def conflict_letter(insert: Any, now: ColumnElement[Any]) -> Any:
    """The conflict letter's upsert: one row per (task, tenant, key, fingerprint), counting each further delivery."""
    # One letter per (task, tenant, key, payload fingerprint): each further conflicting delivery of the same
    # payload counts in `attempts` and refreshes the last time, instead of adding a row with its payload.
    d = LETTERS.c
    stmt = insert(LETTERS).values(
        task_name=bindparam("p_task"),
        tenant=bindparam("p_tenant"),
        idempotency_key=bindparam("p_key"),
        fingerprint=bindparam("p_fingerprint"),
        reason="conflict",
        error=bindparam("p_error", type_=String),
        attempts=1,
        message=bindparam("p_letter", type_=JSON),
        first_failed_at=now,
        last_failed_at=now,
    )
    return stmt.on_conflict_do_update(
        index_elements=["task_name", "tenant", "idempotency_key", "fingerprint"],
        index_where=text("reason = 'conflict'"),  # the partial index's own predicate, literally (inference)
        set_={"attempts": d.attempts + 1, "last_failed_at": now, "error": stmt.excluded.error},
    )


def letter(insert: Any, now: ColumnElement[Any]) -> Any:
    """A run's dead letter upsert: one row per run, its first failure kept, the rest refreshed on a later death."""
    # The dead letter of a run, written in the transaction that makes it DEAD: one row per run, its
    # first failure kept and the rest refreshed if it dies again after a replay. INSERT ... SELECT takes
    # the task, key, attempts and first failure from the run itself (the WHERE also lets SQLite parse
    # the ON CONFLICT clause).
    c = RUNS.c
    rows = select(
        c.id,
        c.task_name,
        c.tenant,
        c.idempotency_key,
        bindparam("p_reason", type_=String),
        bindparam("p_error", type_=String),
        bindparam("p_traceback", type_=String),
        c.attempts,
        bindparam("p_letter", type_=JSON),
        func.coalesce(c.first_failed_at, now),
        now,
    ).where(c.id == bindparam("p_run_id"))
    cols = [
        "run_id",
        "task_name",
        "tenant",
        "idempotency_key",
        "reason",
        "error",
        "traceback",
        "attempts",
        "message",
        "first_failed_at",
        "last_failed_at",
    ]
    stmt = insert(LETTERS).from_select(cols, rows)
    x = stmt.excluded
    return stmt.on_conflict_do_update(
        index_elements=["run_id"],
        set_={
            "reason": x.reason,
            "error": x.error,
            "traceback": x.traceback,
            "attempts": x.attempts,
            "message": x.message,
            "last_failed_at": x.last_failed_at,
            "replayed_at": None,
        },
    )
