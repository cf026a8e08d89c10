"""What the relay writes on the outbox rows it handles: marked sent, backed off, re-published, or given up.

The statements and writes of `relay.Relay`'s rounds, in their transaction; the relay decides which rows get which.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import Connection, bindparam, update
from sqlalchemy.sql.elements import ColumnElement

from oncelery.models import OutboxStatus
from oncelery.runs.decisions import REASON_REPUBLISH_CAP
from oncelery.store.dialects import Dialect
from oncelery.store.tables import LETTERS, OUTBOX

__all__ = [
    "back_off",
    "give_up",
    "mark_republished",
    "mark_sent",
    "sent_params",
]

# The outbox's logger, as before the relay had a module of its own.
logger = logging.getLogger("oncelery.outbox")


def mark_sent(dialect: Dialect, now: ColumnElement[Any]) -> Any:
    """The update marking a published row SENT (parameters of `sent_params`): not re-published before it is due."""
    o = OUTBOX.c
    return (
        update(OUTBOX)
        .where(o.id == bindparam("p_id"))
        .values(
            status=OutboxStatus.SENT,
            sent_at=now,
            # When the job is due on the broker (its countdown): not re-published before that.
            next_attempt_at=dialect.lease_until("p_eta"),
            attempts=o.attempts + 1,
            publishes=o.publishes + 1,
            last_error=None,
        )
    )


def sent_params(dialect: Dialect, row: Any) -> dict[str, Any]:
    """The parameters of `mark_sent` and `mark_republished` for `row`: its id and when its job is due (countdown)."""
    countdown = float((row.options or {}).get("countdown") or 0)
    return {"p_id": row.id, "p_eta": dialect.lease_param(max(0.0, countdown))}


def back_off(conn: Connection, dialect: Dialect, row: Any, error: str, max_attempts: int) -> int:
    """Record a failed publish: try again after an exponential delay, or mark the row DEAD after N."""
    attempts = row.attempts + 1
    dead = attempts >= max_attempts
    delay = min(300.0, 0.5 * 2 ** min(attempts, 16))
    o = OUTBOX.c
    values: dict[str, Any] = {"attempts": attempts, "last_error": error[:2000]}
    if dead:
        values["status"] = OutboxStatus.DEAD
        logger.error("outbox row %s (%s) is DEAD after %d failed publishes: %s", row.id, row.task_name, attempts, error)
    else:
        values["next_attempt_at"] = dialect.lease_until("p_delay")
    conn.execute(
        update(OUTBOX).where(o.id == row.id).values(**values),
        {"p_delay": dialect.lease_param(delay)} if not dead else {},
    )
    return int(dead)


def mark_republished(dialect: Dialect, now: ColumnElement[Any]) -> Any:
    """The update of a row published again (parameters of `sent_params`): one more publish, due again later."""
    o = OUTBOX.c
    return (
        update(OUTBOX)
        .where(o.id == bindparam("p_id"))
        .values(sent_at=now, next_attempt_at=dialect.lease_until("p_eta"), publishes=o.publishes + 1)
    )


def give_up(conn: Connection, rows: list[Any], max_publishes: int) -> int:
    """Mark rows published `max_publishes` times with no run finishing DEAD, each with a dead letter."""
    why = f"published {max_publishes} times and its run never finished; see `oncelery dlq show`"
    conn.execute(
        update(OUTBOX).where(OUTBOX.c.id.in_([row.id for row in rows])).values(status=OutboxStatus.DEAD, last_error=why)
    )
    for row in rows:
        message = {"args": row.args, "kwargs": row.kwargs, "headers": {}, "options": row.options}
        conn.execute(
            LETTERS.insert().values(
                task_name=row.task_name,
                tenant=row.tenant,
                idempotency_key=row.idempotency_key,
                reason=REASON_REPUBLISH_CAP,
                error=why,
                attempts=row.publishes,
                message=message,
            )
        )
        logger.error("outbox row %s (%s[%s]): %s", row.id, row.task_name, row.idempotency_key, why)
    return len(rows)
