"""The debounce dispatcher: sends each due burst's latest edit through the outbox, once (runs/debounce.py).

The relay runs it every round (`Relay.run_once`, before publishing), so a due burst is usually published in the
same round. No long countdown is ever put on the broker: a burst waits in its row, with a wake time on the
database clock, and holds no worker slot (Redis redelivers ETA tasks past its visibility timeout; RabbitMQ's
consumer_timeout closes the channel).

A burst is taken and its outbox row written in one transaction, under the burst's task id (the outbox's unique
celery_task_id): a dispatcher killed at any point either sent it (the outbox relays it, at least once, and the
claim absorbs copies) or left it pending for the next round. Never both, never neither.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery

from oncelery.relay.outbox import enqueue
from oncelery.runs.debounce import any_due, take_due
from oncelery.runs.faults import fault_point
from oncelery.settings import HEADER_DEBOUNCE_KEY, HEADER_DEBOUNCE_SEQ, HEADER_KEY, HEADER_TENANT
from oncelery.store.database import Database

__all__ = ["dispatch_due"]

logger = logging.getLogger("oncelery.debounce")  # a stable name (users filter on it)


def dispatch_due(app: Celery, db: Database, batch: int = 100) -> int:
    """Move up to `batch` due bursts into the outbox in one transaction; return how many were moved."""
    if not any_due(db):
        return 0
    with db.begin() as conn:
        bursts = take_due(conn, db, batch)
        for burst in bursts:
            headers: dict[str, Any] = dict(burst.headers)
            key, tenant = headers.pop(HEADER_KEY, None), headers.pop(HEADER_TENANT, None)
            headers[HEADER_DEBOUNCE_KEY] = burst.debounce_key
            headers[HEADER_DEBOUNCE_SEQ] = burst.seq
            options: dict[str, Any] = {"task_id": burst.task_id, "headers": headers}
            if key is not None:
                options["idempotency_key"] = key
            options["tenant"] = tenant if tenant is not None else (burst.tenant or None)
            sig = app.signature(burst.task_name, args=burst.args, kwargs=burst.kwargs, **options)
            enqueue(conn, sig)
        fault_point("debounce_dispatched", rows=len(bursts))
    if bursts:
        logger.info("debounce: %d bursts due, sent through the outbox", len(bursts))
    return len(bursts)
