"""The database clock's rule for leases: a lease is live while it has not expired by the database's `now()`.

Every query that judges a lease composes these expressions (claims, takeovers, the sweeper, the read side), so the
rule is written once. Times are the database's, never a worker's: workers' clocks drift, the database's is one.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import String, and_, cast, func, not_
from sqlalchemy.sql.elements import ColumnElement

from oncelery.models import TaskRun

__all__ = ["lease_expired", "lease_live", "stored_message"]


def lease_live(now: ColumnElement[Any]) -> ColumnElement[bool]:
    """THE liveness rule: a run's lease is live while `lease_expires_at >= now` by the database clock.

    Only a RUNNING run has a lease; completion and failure clear it (NULL), which is never live.
    """
    expires = TaskRun.__table__.c.lease_expires_at
    return and_(expires.is_not(None), expires >= now)


def lease_expired(now: ColumnElement[Any]) -> ColumnElement[bool]:
    """The negation of `lease_live`: what a takeover of a RUNNING run requires."""
    return not_(lease_live(now))


def stored_message(column: Any) -> Any:
    """SQL: the run keeps a message (neither SQL NULL nor JSON null: completion clears it to the latter)."""
    return func.coalesce(cast(column, String), "null") != "null"
