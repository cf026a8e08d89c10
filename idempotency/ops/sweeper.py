"""Lost-job recovery from the database: re-send the stored message of a run whose holder vanished.

On the embedded (filesystem) broker a SIGKILLed worker's in-flight messages are gone; on Redis they come back
only after the visibility timeout. A run that kept its message (embedded broker, or `store_message=True`)
and is RUNNING with a lease expired by the database clock is sent again by the sweeper, at most once per
`interval` (its `swept_at`). So is a FAILED run whose retry has been due for an `interval` with no delivery
taking it: a run demoted because its entity's holder vanished, or a retry whose message the broker lost. The
claim absorbs the copy if the broker redelivers the original as well.

On Redis, a RUNNING run that kept no message has its unacked message put back on its queue instead, as soon as
its lease has expired (oncelery.ops.unacked): a killed worker's job is back within the lease, not the
visibility timeout, and nothing of it is kept at rest for that.

The waker (`wake_waiting_runs`) re-sends a WAITING run's message when its wake time comes: the one way a parked
run (a model call still running) wakes. The sweeper runs inside `oncelery relay` (and `oncelery process`), never
inside a worker: a worker that is down cannot sweep, and one sweeper is enough for any number of workers.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from celery import Celery
from kombu.exceptions import OperationalError
from sqlalchemy import and_, or_, select, update

from oncelery.models import RunStatus
from oncelery.ops.outbox import CONTINUATION, send_keyed
from oncelery.ops.unacked import on_redis, restore_unacked
from oncelery.settings import HEADER_WOKEN
from oncelery.store.clock import lease_expired, stored_message
from oncelery.store.database import Database
from oncelery.store.tables import RUNS

__all__ = [
    "stored_message",
    "sweep_lost_runs",
    "wake_waiting_runs",
]

logger = logging.getLogger("oncelery.sweeper")  # a stable name (users filter on it)


def sweep_lost_runs(app: Celery, db: Database, interval: float, batch: int = 100) -> int:
    """Re-send the stored messages of up to `batch` lost runs (RUNNING with its lease expired, or FAILED with a
    retry due for `interval` that no delivery took); return how many."""
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
    rows = _mark_due(db, due, r.lease_expires_at, interval, batch)
    # Marked first, sent after the commit: a sweeper that dies in between re-sends after `interval`.
    sent = sum(_resend(app, row) for row in rows)
    if sent:
        logger.warning("sweeper: re-sent %d jobs whose worker was lost (lease expired, message kept)", sent)
    return sent + _restore_lost_on_redis(app, db, interval, batch)


def _restore_lost_on_redis(app: Celery, db: Database, interval: float, batch: int) -> int:
    """Put back the unacked Redis messages of up to `batch` RUNNING runs whose lease expired and that kept no
    message (oncelery.ops.unacked); return how many messages went back."""
    if not _on_redis(app):
        return 0
    r = RUNS.c
    dia = db.dialect
    due = and_(
        r.status == RunStatus.RUNNING,
        lease_expired(dia.now()),
        ~stored_message(r.message),
        r.celery_task_id.is_not(None),
        or_(r.swept_at.is_(None), r.swept_at < dia.lease_until("p_age")),
    )
    rows = _mark_due(db, due, r.lease_expires_at, interval, batch)
    if not rows:
        return 0
    try:
        restored = restore_unacked(app, [row.celery_task_id for row in rows])
    except (OperationalError, redis.RedisError, OSError) as exc:  # Redis down: the next sweep after `interval`
        logger.warning(
            "sweeper: could not put back %d lost jobs on Redis (%s); retrying in %.0fs", len(rows), exc, interval
        )
        return 0
    if restored:
        logger.warning("sweeper: put back %d jobs whose worker was lost (lease expired) from Redis's unacked", restored)
    return restored


def _on_redis(app: Celery) -> bool:
    """Whether the app's broker is Redis, asked once per app configuration (a connection object is not free)."""
    seen = app.__dict__.get("_oncelery_on_redis")
    if seen is None or seen[0] is not app.conf:
        seen = (app.conf, on_redis(app))
        app.__dict__["_oncelery_on_redis"] = seen
    return bool(seen[1])


def wake_waiting_runs(app: Celery, db: Database, rewake_after: float, batch: int = 100) -> int:
    """Re-send the stored messages of up to `batch` WAITING runs whose wake time has come; return how many.

    Marked first (swept_at), sent after the commit: a waker that dies in between wakes the run again once
    `rewake_after` has passed, and a copy that arrives twice is absorbed by the claim (one takes the run over,
    the other finds it held). The park clears swept_at, so each park wakes as soon as it is due.
    """
    r = RUNS.c
    dia = db.dialect
    now = dia.now()
    due = and_(
        r.status == RunStatus.WAITING,
        r.not_before <= now,
        stored_message(r.message),
        or_(r.swept_at.is_(None), r.swept_at < dia.lease_until("p_age")),
    )
    rows = _mark_due(db, due, r.not_before, rewake_after, batch)
    woken = sum(_resend(app, row, woken=True) for row in rows)
    if woken:
        logger.info("waker: woke %d waiting runs (their model calls are due a poll)", woken)
    return woken


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


def _resend(app: Celery, row: Any, woken: bool = False) -> int:
    message = row.message if isinstance(row.message, dict) else {}
    # Where it ran, what follows it in a pipeline, and the headers it came with.
    options = {name: message[name] for name in ("queue", "headers", *CONTINUATION) if message.get(name)}
    if woken:  # the woken delivery polls its call once (HEADER_WOKEN), then parks again if it is not done
        options["headers"] = {**(options.get("headers") or {}), HEADER_WOKEN: 1}
    job = (row.task_name, message.get("args"), message.get("kwargs"), row.celery_task_id)
    # A broker that is down: the next sweep after the interval tries again.
    return int(send_keyed(app, *job, row.idempotency_key, row.tenant, options) is None)
