"""What retention changes in the run rows: a finished run deleted with its rows, a completed run's kept arguments
cleared. Which runs, how many per transaction and what an application's foreign key keeps: relay/retention.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, column, delete, table, update

from oncelery.models import RunStatus
from oncelery.store.clock import stored_message
from oncelery.store.database import Database
from oncelery.store.tables import BATCH_ITEMS, INTENTS, LETTERS, RUNS, STEPS

__all__ = [
    "clear_kept_arguments",
    "delete_runs_txn",
]


def clear_kept_arguments(db: Database, older_than: float) -> int:
    """Clear the arguments completed runs kept (`keep_arguments=`) once they finished `older_than` seconds ago
    (database clock); the runs themselves stay. Returns how many runs it cleared."""
    r = RUNS.c
    dia = db.dialect
    with db.begin() as conn:
        cleared = conn.execute(
            update(RUNS)
            .where(r.status == RunStatus.COMPLETED, stored_message(r.message), r.finished_at < dia.lease_until("p_age"))
            .values(message=None),
            {"p_age": dia.lease_param(-older_than)},
        )
        return int(cleared.rowcount or 0)


def delete_runs_txn(conn: Connection, ids: Sequence[int], ledgers: Sequence[str]) -> dict[str, int]:
    """Delete runs `ids` with every row they own, in the caller's transaction; return the rows deleted per kind
    (steps, dead_letters, intents, batch_items, ledger, runs). `ledgers`: the ledger tables present (by run_id).

    The caller chose runs that are finished; an application's foreign key that refuses one raises IntegrityError
    here, and the caller's savepoint keeps it."""
    ids = list(ids)
    counts: dict[str, int] = {}
    counts["steps"] = conn.execute(delete(STEPS).where(STEPS.c.run_id.in_(ids))).rowcount or 0
    counts["dead_letters"] = conn.execute(delete(LETTERS).where(LETTERS.c.run_id.in_(ids))).rowcount or 0
    # A finished run's call intents (digests and references only) go with it: nothing is left to re-attach.
    counts["intents"] = conn.execute(delete(INTENTS).where(INTENTS.c.run_id.in_(ids))).rowcount or 0
    # Their batch items too (done or failed, request and answer already cleared): no row outlives its run.
    counts["batch_items"] = conn.execute(delete(BATCH_ITEMS).where(BATCH_ITEMS.c.run_id.in_(ids))).rowcount or 0
    counts["ledger"] = 0
    for name in ledgers:
        ledger: Any = table(name, column("run_id"))
        counts["ledger"] += conn.execute(delete(ledger).where(ledger.c.run_id.in_(ids))).rowcount or 0
    counts["runs"] = conn.execute(delete(RUNS).where(RUNS.c.id.in_(ids))).rowcount or 0
    return counts
