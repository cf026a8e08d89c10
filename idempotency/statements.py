"""The claim protocol's SQL, built once per dialect with bind parameters.

Building a statement per call costs more CPU than the database round trip on a fast local server
(SQLAlchemy coerces every clause and derives a cache key); a prebuilt statement memoises both.
"""

from __future__ import annotations

from functools import cache
from typing import Any, cast

from oncelery.db import db_now
from oncelery.models import DeliveryOutcome, RunStatus, TaskRun
from sqlalchemy import JSON, Float, Integer, String, Table, and_, bindparam, literal, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql.elements import ColumnElement

RUNS = cast(Table, TaskRun.__table__)
OUTCOMES = cast(Table, DeliveryOutcome.__table__)
OUTCOME_SHARDS = 16  # counter rows per (task, outcome): concurrent completions rarely wait on one row
_SQLITE_TIME_FORMAT = "%Y-%m-%d %H:%M:%f"


def lease_param(dialect: str, seconds: float) -> Any:
    """Return the value of the `p_lease` parameter for a lease of `seconds` on `dialect`."""
    return f"{seconds:+.3f} seconds" if dialect == "sqlite" else float(seconds)


def _lease_until(dialect: str) -> ColumnElement[Any]:
    # The database clock plus the bound lease (see lease_param): a lease never uses a worker's clock.
    from sqlalchemy import func

    if dialect == "sqlite":
        return func.strftime(_SQLITE_TIME_FORMAT, "now", bindparam("p_lease", type_=String))
    return func.clock_timestamp() + func.make_interval(0, 0, 0, 0, 0, 0, bindparam("p_lease", type_=Float))


def _fenced() -> ColumnElement[bool]:
    c = RUNS.c
    return and_(
        c.id == bindparam("p_run_id"),
        c.fencing_token == bindparam("p_token"),
        c.owner == bindparam("p_owner"),
        c.status == RunStatus.RUNNING,
    )


class Statements:
    """Prebuilt statements of one dialect; execute them with the parameters named `p_*`."""

    def __init__(self, dialect: str) -> None:
        self.dialect = dialect
        insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
        now = db_now(dialect)
        until = _lease_until(dialect)
        c = RUNS.c
        self.insert_claim = (
            insert(RUNS)
            .values(
                task_name=bindparam("p_task"),
                idempotency_key=bindparam("p_key"),
                fingerprint=bindparam("p_fingerprint"),
                field_digests=bindparam("p_digests", type_=JSON),
                status=RunStatus.RUNNING,
                fencing_token=1,
                owner=bindparam("p_owner"),
                lease_expires_at=until,
                attempts=1,
                concurrency_key=bindparam("p_entity"),
                celery_task_id=bindparam("p_task_id"),
                message=bindparam("p_message", type_=JSON),
            )
            .on_conflict_do_nothing(index_elements=["task_name", "idempotency_key"])
            .returning(c.id)
        )
        self.takeover = (
            update(RUNS)
            .where(
                c.task_name == bindparam("p_task"),
                c.idempotency_key == bindparam("p_key"),
                # A different payload never takes a run over: that is a conflict, decided by the caller.
                c.fingerprint == bindparam("p_fingerprint"),
                or_(c.status == RunStatus.FAILED, and_(c.status == RunStatus.RUNNING, c.lease_expires_at < now)),
            )
            .values(
                status=RunStatus.RUNNING,
                fencing_token=c.fencing_token + 1,
                owner=bindparam("p_owner"),
                lease_expires_at=until,
                attempts=c.attempts + 1,
                updated_at=now,
                error=None,
                concurrency_key=bindparam("p_entity"),
                celery_task_id=bindparam("p_task_id"),
                message=bindparam("p_message", type_=JSON),
            )
            .returning(c.id, c.fencing_token, c.attempts)
        )
        self.heartbeat = update(RUNS).where(_fenced()).values(lease_expires_at=until)
        self.complete = (
            update(RUNS)
            .where(_fenced())
            .values(
                status=RunStatus.COMPLETED,
                result=bindparam("p_result", type_=JSON),
                finished_at=now,
                updated_at=now,
                lease_expires_at=None,
            )
        )
        self.fail = (
            update(RUNS)
            .where(_fenced())
            .values(status=RunStatus.FAILED, error=bindparam("p_error"), updated_at=now, lease_expires_at=None)
        )
        o = OUTCOMES.c
        self.count_outcome = (
            insert(OUTCOMES)
            .values(task_name=bindparam("p_task"), outcome=bindparam("p_outcome"), shard=bindparam("p_shard"), count=1)
            .on_conflict_do_update(index_elements=["task_name", "outcome", "shard"], set_={"count": o.count + 1})
        )
        self.complete_and_count = self._complete_and_count() if dialect == "postgresql" else None

    def _complete_and_count(self) -> Any:
        # PostgreSQL: the fenced completion and the outcome counter in ONE statement (one round trip):
        # WITH done AS (UPDATE task_runs ... RETURNING id) INSERT INTO delivery_outcomes SELECT ... FROM done.
        # No row returned means the fence refused the completion (LeaseLost) and nothing was written.
        done = self.complete.returning(RUNS.c.id).cte("done")
        o = OUTCOMES.c
        rows = select(
            bindparam("p_task", type_=String),
            bindparam("p_outcome", type_=o.outcome.type),
            bindparam("p_shard", type_=Integer),
            literal(1),
        ).select_from(done)
        return (
            postgresql.insert(OUTCOMES)
            .from_select(["task_name", "outcome", "shard", "count"], rows)
            .on_conflict_do_update(index_elements=["task_name", "outcome", "shard"], set_={"count": o.count + 1})
            .returning(o.count)
            .add_cte(done)
        )


@cache
def statements(dialect: str) -> Statements:
    """Return the prebuilt statements of `dialect` ("postgresql" or "sqlite")."""
    return Statements(dialect)
