"""A model call's ledger row, written idempotently: a row written twice is counted once.

`add_call`: `INSERT INTO model_calls ... ON CONFLICT (call_id) DO NOTHING`, then the running totals
(`ledger_totals`) and the run's sums, added ONLY when that insert inserted, in the caller's transaction. The
call id is chosen when the call starts, so writing the same row again (a retry after a lost answer to COMMIT, a
spool replayed twice, a row later written in a run's result transaction) never counts the call twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import BigInteger, Connection, bindparam, update

from oncelery.store.database import Database
from oncelery.store.dialects import Dialect
from oncelery.store.tables import CALLS, LABEL_TOTALS, RUNS, TOTALS

__all__ = ["add_call", "write_call"]

_TOTAL_FIGURES = ("calls", "failed_calls", "input_tokens", "output_tokens", "cost_micros", "unpriced_calls")
# The run's ok calls (what each of its replays saves), added as each is recorded. The one write to a run row
# outside runs/ and store/ (tests/test_only_the_runs_room_changes_a_run.py allows it): it adds to the run's cost
# sums, never its state (status, lease, wake, token), and must commit in the ledger row's own statement group;
# the ledger room sits below runs/, so it cannot call a runs/ function.
_ADD_TO_RUN = (
    update(RUNS)
    .where(RUNS.c.id == bindparam("p_run_id"))
    .values(
        llm_calls=RUNS.c.llm_calls + 1,
        llm_input_tokens=RUNS.c.llm_input_tokens + bindparam("p_input", type_=BigInteger),
        llm_output_tokens=RUNS.c.llm_output_tokens + bindparam("p_output", type_=BigInteger),
        llm_cost_micros=RUNS.c.llm_cost_micros + bindparam("p_cost", type_=BigInteger),
    )
)
_inserts: dict[str, Any] = {}  # per dialect: INSERT INTO model_calls ... ON CONFLICT (call_id) DO NOTHING RETURNING


def add_call(conn: Connection, dialect: Dialect, row: Mapping[str, Any]) -> bool:
    """Add one call's row, and to the totals and its run only if the row is new; in the caller's transaction.

    Return whether it was new. The same `call_id` written again changes nothing, whatever transaction wrote it
    first (its own, a spool replay, or later a run's result transaction).
    """
    stmt = _inserts.get(dialect.name)
    if stmt is None:
        # RETURNING says whether it inserted (a single-row insert returns its id, so rowcount is not reported).
        insert_new = dialect.insert(CALLS).on_conflict_do_nothing(index_elements=["call_id"])
        stmt = _inserts[dialect.name] = insert_new.returning(CALLS.c.id)
    if conn.execute(stmt, dict(row)).first() is None:
        return False
    cost = row.get("cost_micros")  # integer micro-USD (oncelery.models.money), None: the model had no price
    figures = {
        "calls": 1,
        "failed_calls": 0 if row["ok"] else 1,
        "input_tokens": row["input_tokens"],
        "output_tokens": row["output_tokens"],
        "cost_micros": cost or 0,
        "unpriced_calls": 1 if cost is None else 0,
    }
    totals = dialect.insert(TOTALS).values(
        task_name=row.get("task_name") or "", tenant=row.get("tenant") or "", model=row["model"], **figures
    )
    added = {name: TOTALS.c[name] + totals.excluded[name] for name in _TOTAL_FIGURES}
    conn.execute(totals.on_conflict_do_update(index_elements=["task_name", "tenant", "model"], set_=added))
    if row["ok"] and row.get("run_id") is not None:
        params = {"p_run_id": row["run_id"], "p_input": row["input_tokens"], "p_output": row["output_tokens"]}
        conn.execute(_ADD_TO_RUN, {**params, "p_cost": cost or 0})
    for label in (row.get("reason"), "reattached" if row.get("reattached") else None):
        if label:  # few rows carry one: a repeated call, a call of unknown outcome, a re-attached call
            _count_label(conn, dialect, row, label)
    return True


def _count_label(conn: Connection, dialect: Dialect, row: Mapping[str, Any], label: str) -> None:
    key = {"task_name": row.get("task_name") or "", "tenant": row.get("tenant") or "", "model": row["model"]}
    stmt = dialect.insert(LABEL_TOTALS).values(**key, label=label, calls=1)
    added = {"calls": LABEL_TOTALS.c.calls + stmt.excluded.calls}
    conn.execute(stmt.on_conflict_do_update(index_elements=["task_name", "tenant", "model", "label"], set_=added))


def write_call(db: Database, row: Mapping[str, Any]) -> bool:
    """Commit one call's row in a transaction of its own (`add_call`); return whether it was new.

    Tried once more on a fresh connection if a killed pooled one failed it (`Database.write`): harmless, the
    call id makes the repeat a no-op. Raises StoreUnavailable when the database cannot take it now.
    """
    new = [False]

    def body(conn: Connection) -> None:
        new[0] = add_call(conn, db.dialect, row)

    db.write(body)
    return new[0]
