"""The waker: re-send a WAITING run's kept message when its wake time comes, the one way a parked run wakes.

A run parks WAITING (a model call still running, a limit or budget window, a parked batch item) with a wake time
on the database clock and holds no worker slot; the relay calls `wake_waiting_runs` every round. No countdown is
ever put on the broker for it (Redis redelivers ETA tasks past its visibility timeout; RabbitMQ's
consumer_timeout closes the channel).
"""

from __future__ import annotations

import logging

from celery import Celery

from oncelery.relay.outbox import resend_kept
from oncelery.runs.sweeps import mark_due_waiting_runs
from oncelery.store.database import Database

__all__ = ["wake_waiting_runs"]

logger = logging.getLogger("oncelery.sweeper")  # the sweeper's name, kept: users filter on it


def wake_waiting_runs(app: Celery, db: Database, rewake_after: float, batch: int = 100) -> int:
    """Re-send the stored messages of up to `batch` WAITING runs whose wake time has come; return how many.

    Marked first (swept_at), sent after the commit: a waker that dies in between wakes the run again once
    `rewake_after` has passed, and a copy that arrives twice is absorbed by the claim (one takes the run over,
    the other finds it held). The park clears swept_at, so each park wakes as soon as it is due.
    """
    rows = mark_due_waiting_runs(db, rewake_after, batch)
    woken = sum(resend_kept(app, row, woken=True) for row in rows)
    if woken:
        logger.info("waker: woke %d waiting runs (their model calls are due a poll)", woken)
    return woken
