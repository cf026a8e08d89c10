"""Lost-job recovery from the database: re-send the stored message of a run whose holder vanished.

On the embedded (filesystem) broker a SIGKILLed worker's in-flight messages are gone; on Redis they come back
only after the visibility timeout. A run that kept its message (embedded broker, or `store_message=True`)
and is RUNNING with a lease expired by the database clock is sent again by the sweeper, at most once per
`interval` (its `swept_at`). So is a FAILED run whose retry has been due for an `interval` with no delivery
taking it: a run demoted because its entity's holder vanished, or a retry whose message the broker lost. The
claim absorbs the copy if the broker redelivers the original as well.

On Redis, a RUNNING run that kept no message has its unacked message put back on its queue instead, as soon as
its lease has expired (oncelery.relay.unacked): a killed worker's job is back within the lease, not the
visibility timeout, and nothing of it is kept at rest for that.

Its sibling, the waker (oncelery.relay.waker), wakes WAITING runs. The sweeper runs inside `oncelery relay` (and
`oncelery process`), never inside a worker: a worker that is down cannot sweep, and one sweeper is enough for any
number of workers.
"""

from __future__ import annotations

import logging

import redis
from celery import Celery
from kombu.exceptions import OperationalError

from oncelery.relay.outbox import resend_kept
from oncelery.relay.unacked import on_redis, restore_unacked
from oncelery.runs.sweeps import mark_lost_kept_runs, mark_lost_unkept_runs
from oncelery.store.clock import stored_message
from oncelery.store.database import Database

__all__ = [
    "stored_message",
    "sweep_lost_runs",
]

logger = logging.getLogger("oncelery.sweeper")  # a stable name (users filter on it)


def sweep_lost_runs(app: Celery, db: Database, interval: float, batch: int = 100) -> int:
    """Re-send the stored messages of up to `batch` lost runs (RUNNING with its lease expired, or FAILED with a
    retry due for `interval` that no delivery took); return how many."""
    rows = mark_lost_kept_runs(db, interval, batch)
    # Marked first, sent after the commit: a sweeper that dies in between re-sends after `interval`.
    sent = sum(resend_kept(app, row) for row in rows)
    if sent:
        logger.warning("sweeper: re-sent %d jobs whose worker was lost (lease expired, message kept)", sent)
    return sent + _restore_lost_on_redis(app, db, interval, batch)


def _restore_lost_on_redis(app: Celery, db: Database, interval: float, batch: int) -> int:
    """Put back the unacked Redis messages of up to `batch` RUNNING runs whose lease expired and that kept no
    message (oncelery.relay.unacked); return how many messages went back."""
    if not _on_redis(app):
        return 0
    rows = mark_lost_unkept_runs(db, interval, batch)
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
