"""The read side: runs, their checkpointed steps and outcome counts, for commands, tools and tests.

Reads never write and never create a database file; liveness is judged by `leases.lease_live`, the one rule.
"""

from __future__ import annotations

import builtins
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import Select, and_, func, select

from oncelery.models import RunStatus
from oncelery.models.money import usd
from oncelery.runs.outcomes import outcome_counts
from oncelery.settings import PASS_THROUGH_SEEN
from oncelery.store.clock import lease_live
from oncelery.store.database import Database
from oncelery.store.tables import CALLS, RUNS, SECRETS, STEPS

__all__ = [
    "CallView",
    "RunView",
    "Runs",
    "StepView",
    "run_view",
]


@dataclass(frozen=True)
class RunView:
    """A read-only snapshot of one run (a task_runs row), with whether its lease is live right now."""

    run_id: int
    task_name: str
    key: str
    status: RunStatus
    fingerprint: str
    field_digests: dict[str, str]
    token: int
    owner: str | None
    attempts: int
    result: Any
    error: str | None
    lease_live: bool
    lease_expires_at: datetime | None = None
    concurrency_key: str | None = None
    celery_task_id: str | None = None
    message: Any = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    finished_at: datetime | None = None
    tenant: str = ""
    retries: int = 0
    not_before: datetime | None = None
    retry_wait: bool = False  # FAILED, and Celery's retry countdown has not passed (database clock)
    lost: int = 0  # deliveries whose holder vanished (counted towards max_deliveries)
    replays: int = 0  # duplicate deliveries answered from this run's stored result


@dataclass(frozen=True)
class StepView:
    """A checkpointed step of a run: position, name, the fencing token that saved it, and when."""

    position: int
    name: str
    token: int
    created_at: datetime | None
    seconds: float | None = None  # how long the step's function ran in the holder that saved it (None: before 0012)


@dataclass(frozen=True)
class CallView:
    """A model call recorded for a run (a model_calls row): model, prompt name, tokens, latency, ok, USD."""

    call_id: int
    step: str | None
    model: str
    prompt: str | None
    input_tokens: int
    output_tokens: int
    latency_ms: float
    ok: bool
    error: str | None
    cost: Decimal | None  # exact USD (stored as micro-USD); None: the model had no price when recorded
    token: int | None  # the fencing token of the attempt that made the call
    created_at: datetime | None
    # The row's `call_id`: for a `self.llm` call, its intent's public id (`llm_intents.public_id`).
    ledger_call_id: str | None = None
    reason: str | None = None  # the ledger's label: why it was made again (create_window, lost...), unknown_outcome
    reattached: bool = False  # a later holder took this call's answer instead of paying again


def _runs_query(db: Database) -> Select[Any]:
    now = db.dialect.now()
    retry_wait = and_(RUNS.c.not_before.is_not(None), RUNS.c.not_before > now)
    return select(RUNS, lease_live(now).label("lease_live"), retry_wait.label("retry_wait"))


def run_view(row: Any) -> RunView:
    """The RunView of a row holding statements.RUN_VIEW_COLUMNS, lease_live and retry_wait."""
    return RunView(
        run_id=row.id,
        task_name=row.task_name,
        key=row.idempotency_key,
        status=RunStatus(row.status),  # a driver row holds the text
        fingerprint=row.fingerprint,
        field_digests=row.field_digests,
        token=row.fencing_token,
        owner=row.owner,
        attempts=row.attempts,
        result=row.result,
        error=row.error,
        lease_live=bool(row.lease_live),
        lease_expires_at=row.lease_expires_at,
        concurrency_key=row.concurrency_key,
        celery_task_id=row.celery_task_id,
        message=row.message,
        created_at=row.created_at,
        updated_at=row.updated_at,
        finished_at=row.finished_at,
        tenant=row.tenant,
        retries=row.retries,
        not_before=row.not_before,
        retry_wait=bool(row.retry_wait),
        lost=row.lost,
        replays=row.replays,
    )


class Runs:
    """Reads runs, steps and outcome counts from one claims database; never writes."""

    def __init__(self, url: str) -> None:
        self.db = Database(url)

    @property
    def url(self) -> str:
        """The database URL read from."""
        return self.db.url

    def pass_through_seen(self) -> str | None:
        """When and where a worker last started with $ONCELERY_PASS_THROUGH on (runs then went unclaimed)."""
        stmt = select(SECRETS.c.value).where(SECRETS.c.name == PASS_THROUGH_SEEN)
        with self.db.read() as conn:
            value = conn.execute(stmt).scalar_one_or_none()
        return str(value) if value else None

    def get(self, task_name: str, key: str, tenant: str = "") -> RunView | None:
        """Return the run of (task, tenant, key), or None."""
        c = RUNS.c
        stmt = _runs_query(self.db).where(c.task_name == task_name, c.tenant == tenant, c.idempotency_key == key)
        with self.db.read() as conn:
            row = conn.execute(stmt).first()
        return None if row is None else run_view(row)

    def by_id(self, run_id: int) -> RunView | None:
        """Return the run with this id, or None."""
        stmt = _runs_query(self.db).where(RUNS.c.id == run_id)
        with self.db.read() as conn:
            row = conn.execute(stmt).first()
        return None if row is None else run_view(row)

    def find(self, key: str, task_name: str | None = None, tenant: str | None = None) -> list[RunView]:
        """Return every run with `key` (of one task, one tenant, if given), ordered by task and tenant."""
        c = RUNS.c
        stmt = _runs_query(self.db).where(c.idempotency_key == key).order_by(c.task_name, c.tenant)
        if task_name is not None:
            stmt = stmt.where(c.task_name == task_name)
        if tenant is not None:
            stmt = stmt.where(c.tenant == tenant)
        with self.db.read() as conn:
            return [run_view(row) for row in conn.execute(stmt)]

    def list(
        self,
        *,
        task_name: str | None = None,
        status: RunStatus | None = None,
        keys: Collection[str] | None = None,
        tenant: str | None = None,
        limit: int | None = 50,
    ) -> builtins.list[RunView]:
        """Return runs, most recently updated first, filtered by task, status, keys and tenant."""
        c = RUNS.c
        stmt = _runs_query(self.db).order_by(c.updated_at.desc(), c.id.desc())
        if tenant is not None:
            stmt = stmt.where(c.tenant == tenant)
        if task_name is not None:
            stmt = stmt.where(c.task_name == task_name)
        if status is not None:
            stmt = stmt.where(c.status == status)
        if keys is not None:
            stmt = stmt.where(c.idempotency_key.in_(list(keys)))
        if limit is not None:
            stmt = stmt.limit(limit)
        with self.db.read() as conn:
            return [run_view(row) for row in conn.execute(stmt)]

    def statuses(self, task_name: str, keys: Collection[str]) -> dict[RunStatus, int]:
        """Return how many of `keys`' runs are in each status (keys without a run are not counted)."""
        c = RUNS.c
        stmt = (
            select(c.status, func.count())
            .where(c.task_name == task_name, c.idempotency_key.in_(list(keys)))
            .group_by(c.status)
        )
        with self.db.read() as conn:
            return {status: int(n) for status, n in conn.execute(stmt)}

    def keys_in(self, task_name: str, status: RunStatus, keys: Collection[str]) -> set[str]:
        """Return the keys among `keys` whose run is in `status`."""
        c = RUNS.c
        stmt = select(c.idempotency_key).where(
            c.task_name == task_name, c.status == status, c.idempotency_key.in_(list(keys))
        )
        with self.db.read() as conn:
            return {key for (key,) in conn.execute(stmt)}

    def held(self, task_name: str, keys: Collection[str]) -> set[str]:
        """Return the keys among `keys` whose run is RUNNING under a live lease (a holder is on it)."""
        c = RUNS.c
        stmt = select(c.idempotency_key).where(
            c.task_name == task_name,
            c.idempotency_key.in_(list(keys)),
            c.status == RunStatus.RUNNING,
            lease_live(self.db.dialect.now()),
        )
        with self.db.read() as conn:
            return {key for (key,) in conn.execute(stmt)}

    def steps(self, run_id: int) -> builtins.list[StepView]:
        """Return the run's checkpointed steps in position order."""
        s = STEPS.c
        stmt = (
            select(s.position, s.step_name, s.token, s.created_at, s.seconds)
            .where(s.run_id == run_id)
            .order_by(s.position)
        )
        with self.db.read() as conn:
            return [StepView(int(p), n, int(t), at, sec) for p, n, t, at, sec in conn.execute(stmt)]

    def model_calls(self, run_id: int) -> builtins.list[CallView]:
        """Return the model calls recorded for the run, oldest first (failed ones included)."""
        m = CALLS.c
        stmt = (
            select(
                m.id,
                m.step,
                m.model,
                m.prompt,
                m.input_tokens,
                m.output_tokens,
                m.latency_ms,
                m.ok,
                m.error,
                m.cost_micros,
                m.fencing_token,
                m.created_at,
                m.call_id,
                m.reason,
                m.reattached,
            )
            .where(m.run_id == run_id)
            .order_by(m.id)
        )
        with self.db.read() as conn:
            return [
                CallView(
                    *(int(r[0]), r[1], r[2], r[3], int(r[4]), int(r[5]), float(r[6]), bool(r[7]), r[8]),
                    *(usd(r[9]), r[10], r[11], r[12], r[13], bool(r[14])),
                )
                for r in conn.execute(stmt)
            ]

    def resumed_steps(self, task_name: str, keys: Collection[str]) -> int:
        """Return how many steps of `keys`' runs were checkpointed by an earlier holder than the current one."""
        s, r = STEPS.c, RUNS.c
        stmt = (
            select(func.count())
            .select_from(STEPS.join(RUNS, s.run_id == r.id))
            .where(r.task_name == task_name, r.idempotency_key.in_(list(keys)), s.token < r.fencing_token)
        )
        with self.db.read() as conn:
            return int(conn.execute(stmt).scalar_one())

    def outcome_counts(self, task_name: str | None = None, tenant: str | None = None) -> dict[str, int]:
        """Return exact {outcome: count} over every delivery (of one task, one tenant, if given)."""
        return outcome_counts(self.db, task_name, tenant)
