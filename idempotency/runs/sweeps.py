"""The runs the relay sends again, marked before it sends them: lost runs, due WAITING runs, a wake made due now.

Every mark is one guarded UPDATE on the database clock. A run is marked (`swept_at`) in one transaction and its
message sent after the commit (relay/sweeper.py): a sweeper that dies in between sends it again once `age` has
passed, and a copy that arrives twice is absorbed by the claim.

    lost, message kept         RUNNING with its lease expired, or FAILED with a retry due for `age` nobody took
    lost, message not kept     RUNNING with its lease expired and a Celery task id (Redis: its unacked message)
    waiting, due               WAITING with its wake time come
    (each: not swept within `age`)                                          -> swept_at = now, returned
    a waiting run made due     WAITING with its wake in the future          -> not_before = now, swept_at cleared
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, and_, or_, select, update

from oncelery.models import RunStatus
from oncelery.store.clock import lease_expired, stored_message
from oncelery.store.database import Database
from oncelery.store.tables import RUNS

__all__ = [
    "make_waiting_run_due_txn",
    "mark_due_waiting_runs",
    "mark_lost_kept_runs",
    "mark_lost_unkept_runs",
]


def mark_lost_kept_runs(db: Database, interval: float, batch: int) -> list[Any]:
    """Mark swept up to `batch` lost runs that kept their message (RUNNING with its lease expired, or FAILED with a
    retry due for `interval` that no delivery took), not swept within `interval`; return their rows to re-send."""
    r = RUNS.c
    dia = db.dialect
    now = dia.now()
    past_interval = dia.lease_until("p_age")  # the database clock, `interval` ago
    due = and_(
        or_(
            and_(r.status == RunStatus.RUNNING, lease_expired(now)),  # its holder vanished
            # A retry due for an interval that nobody took: demoted for an entity (its message died with its
            # holder), or a retry whose message the broker lost.
            and_(r.status == RunStatus.FAILED, r.not_before.is_not(None), r.not_before < past_interval),
        ),
        stored_message(r.message),
        or_(r.swept_at.is_(None), r.swept_at < past_interval),
    )
    return _mark_due(db, due, r.lease_expires_at, interval, batch)


def mark_lost_unkept_runs(db: Database, interval: float, batch: int) -> list[Any]:
    """Mark swept up to `batch` RUNNING runs whose lease expired, that kept no message and have a Celery task id,
    not swept within `interval`; return their rows (their unacked messages go back on Redis)."""
    r = RUNS.c
    dia = db.dialect
    due = and_(
        r.status == RunStatus.RUNNING,
        lease_expired(dia.now()),
        ~stored_message(r.message),
        r.celery_task_id.is_not(None),
        or_(r.swept_at.is_(None), r.swept_at < dia.lease_until("p_age")),
    )
    return _mark_due(db, due, r.lease_expires_at, interval, batch)


def mark_due_waiting_runs(db: Database, rewake_after: float, batch: int) -> list[Any]:
    """Mark swept up to `batch` WAITING runs whose wake time has come, not swept within `rewake_after`; return their
    rows to re-send (the park clears swept_at, so each park wakes as soon as it is due)."""
    r = RUNS.c
    dia = db.dialect
    due = and_(
        r.status == RunStatus.WAITING,
        r.not_before <= dia.now(),
        stored_message(r.message),
        or_(r.swept_at.is_(None), r.swept_at < dia.lease_until("p_age")),
    )
    return _mark_due(db, due, r.not_before, rewake_after, batch)


def _mark_due(db: Database, due: Any, order: Any, age: float, batch: int) -> list[Any]:
    """Mark up to `batch` runs matching `due` (whose `p_age` is `age` seconds ago) swept now; return them."""
    r = RUNS.c
    params = {"p_age": db.dialect.lease_param(-age)}
    with db.read() as conn:  # an idle round never takes SQLite's writer lock (workers are writing)
        if conn.execute(select(r.id).where(due).limit(1), params).first() is None:
            return []
    # Two relays never re-send the same run in one round (rows another one holds are skipped).
    ids = db.dialect.locked_rows(select(r.id).where(due).order_by(order).limit(batch))
    stmt = (
        update(RUNS)
        .where(r.id.in_(ids.scalar_subquery()), due)
        .values(swept_at=db.dialect.now())
        .returning(r.id, r.task_name, r.tenant, r.idempotency_key, r.celery_task_id, r.message)
    )
    with db.begin() as conn:
        return list(conn.execute(stmt, params).all())


def make_waiting_run_due_txn(conn: Connection, db: Database, run_id: int) -> None:
    """Make a WAITING run due now (the relay's waker re-sends it), in the caller's transaction; nothing if it is not
    waiting, or if its wake is already due (the waker sends it, or sent it: clearing its mark would send a second
    copy)."""
    r = RUNS.c
    now = db.dialect.now()
    conn.execute(
        update(RUNS)
        .where(r.id == run_id, r.status == RunStatus.WAITING, r.not_before > now)
        .values(not_before=now, swept_at=None)
    )
