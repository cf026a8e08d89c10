"""The claim protocol on a SQL database: each transition is one atomic, token-guarded statement.

Lease timeline (all times are the database clock's, never a worker's):

    claim: INSERT (token=1) or takeover UPDATE (token=t+1), owner=o, lease_expires_at = now + L
    |<------------- L ------------->|
    holder renews every L/3:  UPDATE ... SET lease_expires_at = now + L WHERE id AND token=t AND owner=o
    completion:               UPDATE ... SET status=COMPLETED WHERE id AND token=t AND owner=o AND RUNNING

    If the holder stops renewing (SIGKILL, SIGSTOP, GC pause, partition):
    |<------------- L ------------->| expired: the next delivery takes over in ONE statement:
        UPDATE ... SET token=t+1, owner=o2 WHERE key AND fingerprint AND
                  (status=FAILED OR (status=RUNNING AND lease_expires_at < now))
    The old holder (a zombie) wakes: every write it makes says `token=t AND owner=o` -> 0 rows ->
    LeaseLost, and its transaction (result, effects, step) rolls back.

`owner` is a random id per claim: with the token it stays unique even if a database crash loses a claim
row and a counter is handed out again.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any, cast

from sqlalchemy import Connection, Table, and_, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from idempotency.db import db_now, db_now_plus, get_engine, rowcount, translated
from idempotency.errors import LeaseLost, ResultNotJSON, StoreError
from idempotency.keys import Identity
from models import DeliveryOutcome, Outcome, RunStatus, TaskRun

# A claim loops at most this often when the row changes between its statements (e.g. FAILED under us).
_MAX_CLAIM_ROUNDS = 8
_RUNS = cast(Table, TaskRun.__table__)
_OUTCOMES = cast(Table, DeliveryOutcome.__table__)


class Decision(Enum):
    """What a claim attempt found."""

    CLAIMED = "claimed"  # this caller holds the run and must execute it
    COMPLETED = "completed"  # finished before: answer with the stored result
    IN_PROGRESS = "in_progress"  # a live holder runs this key
    ENTITY_BUSY = "entity_busy"  # another key of the same concurrency_key is RUNNING
    CONFLICT = "conflict"  # same key, different payload fingerprint


@dataclass(frozen=True)
class Claim:
    """A held claim: the run row, its fencing token and owner id, and the lease length."""

    run_id: int
    task_name: str
    key: str
    token: int
    owner: str
    lease: float
    attempts: int
    takeover: bool


@dataclass(frozen=True)
class RunView:
    """A read-only snapshot of a task_runs row."""

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


@dataclass(frozen=True)
class ClaimResult:
    """The outcome of `RunStore.claim`: a decision plus the claim (if CLAIMED) or the row seen."""

    decision: Decision
    claim: Claim | None = None
    run: RunView | None = None


def encode_result(value: Any, what: str) -> Any:
    """Return `value` round-tripped through strict JSON, raising ResultNotJSON with the fix if it can't."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ResultNotJSON(
            f"{what} is not JSON-serializable ({exc}); return JSON types (dict, list, str, int, float, "
            f"bool, None) — convert objects with .model_dump()/dataclasses.asdict() first",
            what=what,
        ) from exc


class RunStore:
    """Claims, leases, fencing and completion of runs in one SQL database (PostgreSQL or SQLite)."""

    def __init__(self, url: str) -> None:
        self.url = url

    @property
    def engine(self) -> Engine:
        """This process's engine for the store's database."""
        return get_engine(self.url)

    @property
    def read_engine(self) -> Engine:
        """This process's engine for reads (never takes SQLite's writer lock)."""
        return get_engine(self.url, read_only=True)

    @property
    def runs(self) -> Table:
        """The task_runs table."""
        return _RUNS

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """A transaction on the store's database; driver errors become typed store errors."""
        with self._txn() as conn:
            yield conn

    @contextmanager
    def _txn(self) -> Iterator[Connection]:
        with translated(self.url), self.engine.begin() as conn:
            yield conn

    def _insert(self) -> Any:
        # Dialect insert for ON CONFLICT; both dialects spell it the same way in SQLAlchemy.
        if self.engine.dialect.name == "postgresql":
            return postgresql.insert(_RUNS)
        return sqlite.insert(_RUNS)

    # -- claim -------------------------------------------------------------------------------------

    def claim(
        self,
        task_name: str,
        ident: Identity,
        lease: float,
        concurrency_key: str | None = None,
        celery_task_id: str | None = None,
        message: Any = None,
    ) -> ClaimResult:
        """Take the run for (task, key) if it is new, FAILED, or its lease expired; else say who has it."""
        for _ in range(_MAX_CLAIM_ROUNDS):
            owner = uuid.uuid4().hex
            try:
                claim = self._insert_claim(task_name, ident, lease, owner, concurrency_key, celery_task_id, message)
                if claim is None:
                    claim = self._takeover(task_name, ident, lease, owner, concurrency_key, celery_task_id, message)
            except IntegrityError:
                # The partial unique index refused a second RUNNING run for this entity.
                return ClaimResult(Decision.ENTITY_BUSY)
            if claim is not None:
                return ClaimResult(Decision.CLAIMED, claim=claim)
            run = self.get(task_name, ident.key)
            if run is None:
                continue  # purged between our statements: try the insert again
            if run.fingerprint != ident.fingerprint:
                return ClaimResult(Decision.CONFLICT, run=run)
            if run.status is RunStatus.COMPLETED:
                return ClaimResult(Decision.COMPLETED, run=run)
            if run.status is RunStatus.RUNNING and run.lease_live:
                return ClaimResult(Decision.IN_PROGRESS, run=run)
            # FAILED or expired after our takeover statement looked: take it on the next round.
        raise StoreError(f"Could not settle a claim for {task_name}[{ident.key}] in {_MAX_CLAIM_ROUNDS} rounds")

    def _insert_claim(
        self,
        task_name: str,
        ident: Identity,
        lease: float,
        owner: str,
        concurrency_key: str | None,
        celery_task_id: str | None,
        message: Any,
    ) -> Claim | None:
        stmt = (
            self._insert()
            .values(
                task_name=task_name,
                idempotency_key=ident.key,
                fingerprint=ident.fingerprint,
                field_digests=ident.field_digests,
                status=RunStatus.RUNNING,
                fencing_token=1,
                owner=owner,
                lease_expires_at=db_now_plus(self.engine, lease),
                attempts=1,
                concurrency_key=concurrency_key,
                celery_task_id=celery_task_id,
                message=message,
            )
            .on_conflict_do_nothing(index_elements=["task_name", "idempotency_key"])
            .returning(_RUNS.c.id)
        )
        with self._txn() as conn:
            row = conn.execute(stmt).first()
        if row is None:
            return None
        return Claim(row.id, task_name, ident.key, 1, owner, lease, 1, takeover=False)

    def _takeover(
        self,
        task_name: str,
        ident: Identity,
        lease: float,
        owner: str,
        concurrency_key: str | None,
        celery_task_id: str | None,
        message: Any,
    ) -> Claim | None:
        now = db_now(self.engine)
        c = _RUNS.c
        stmt = (
            update(_RUNS)
            .where(
                c.task_name == task_name,
                c.idempotency_key == ident.key,
                # A different payload never takes a run over: that is a conflict, decided by the caller.
                c.fingerprint == ident.fingerprint,
                or_(
                    c.status == RunStatus.FAILED,
                    and_(c.status == RunStatus.RUNNING, c.lease_expires_at < now),
                ),
            )
            .values(
                status=RunStatus.RUNNING,
                fencing_token=c.fencing_token + 1,
                owner=owner,
                lease_expires_at=db_now_plus(self.engine, lease),
                attempts=c.attempts + 1,
                updated_at=now,
                error=None,
                concurrency_key=concurrency_key,
                celery_task_id=celery_task_id,
                message=message,
            )
            .returning(c.id, c.fencing_token, c.attempts)
        )
        with self._txn() as conn:
            row = conn.execute(stmt).first()
        if row is None:
            return None
        return Claim(row.id, task_name, ident.key, row.fencing_token, owner, lease, row.attempts, takeover=True)

    # -- holder's writes (all fenced) ----------------------------------------------------------------

    def fenced(self, claim: Claim) -> Any:
        """The WHERE clause every write of a holder carries: its run, token and owner, still RUNNING."""
        c = _RUNS.c
        return and_(
            c.id == claim.run_id,
            c.fencing_token == claim.token,
            c.owner == claim.owner,
            c.status == RunStatus.RUNNING,
        )

    def heartbeat(self, claim: Claim) -> bool:
        """Extend the lease by `claim.lease` from now (database clock) iff the claim is still ours."""
        stmt = update(_RUNS).where(self.fenced(claim)).values(lease_expires_at=db_now_plus(self.engine, claim.lease))
        with self._txn() as conn:
            return rowcount(conn.execute(stmt)) == 1

    def check_txn(self, conn: Connection | Session, claim: Claim) -> None:
        """Raise LeaseLost unless `claim` still holds its run (inside the caller's transaction)."""
        row = conn.execute(select(_RUNS.c.id).where(self.fenced(claim))).first()
        if row is None:
            raise _lease_lost(claim)

    def complete_txn(
        self, conn: Connection | Session, claim: Claim, result: Any, outcome: Outcome = Outcome.EXECUTED
    ) -> None:
        """Mark the run COMPLETED with `result` in the caller's transaction, or raise LeaseLost (no write)."""
        now = db_now(self.engine)
        stmt = (
            update(_RUNS)
            .where(self.fenced(claim))
            .values(
                status=RunStatus.COMPLETED,
                result=result,
                finished_at=now,
                updated_at=now,
                lease_expires_at=None,
            )
        )
        if rowcount(conn.execute(stmt)) != 1:
            raise _lease_lost(claim)
        self.record_outcome_txn(conn, claim.task_name, outcome)

    def complete(
        self, claim: Claim, result: Any, session: Session | None = None, outcome: Outcome = Outcome.EXECUTED
    ) -> None:
        """Commit the run's completion (and `session`'s pending effects) atomically, fenced by the token."""
        if session is None:
            with self._txn() as conn:
                self.complete_txn(conn, claim, result, outcome)
            return
        with translated(self.url):
            try:
                self.complete_txn(session, claim, result, outcome)
                session.commit()
            except BaseException:
                session.rollback()
                raise

    def fail(self, claim: Claim, error: str, outcome: Outcome = Outcome.FAILED) -> bool:
        """Record the run FAILED with `error` iff the claim is still ours; return whether it was."""
        now = db_now(self.engine)
        stmt = (
            update(_RUNS)
            .where(self.fenced(claim))
            .values(status=RunStatus.FAILED, error=error[:10_000], updated_at=now, lease_expires_at=None)
        )
        with self._txn() as conn:
            ok = rowcount(conn.execute(stmt)) == 1
            self.record_outcome_txn(conn, claim.task_name, outcome if ok else Outcome.LEASE_LOST)
        return ok

    # -- reads and counters --------------------------------------------------------------------------

    def get(self, task_name: str, key: str) -> RunView | None:
        """Return the run for (task, key), with whether its lease is live by the database clock."""
        c = _RUNS.c
        live = and_(c.lease_expires_at.is_not(None), c.lease_expires_at >= db_now(self.engine))
        stmt = select(_RUNS, live.label("lease_live")).where(c.task_name == task_name, c.idempotency_key == key)
        with translated(self.url), self.read_engine.connect() as conn:
            row = conn.execute(stmt).first()
        if row is None:
            return None
        return RunView(
            run_id=row.id,
            task_name=row.task_name,
            key=row.idempotency_key,
            status=row.status,
            fingerprint=row.fingerprint,
            field_digests=row.field_digests,
            token=row.fencing_token,
            owner=row.owner,
            attempts=row.attempts,
            result=row.result,
            error=row.error,
            lease_live=bool(row.lease_live),
        )

    def record_outcome_txn(self, conn: Connection | Session, task_name: str, outcome: Outcome) -> None:
        """Count one delivery outcome inside the caller's transaction (exact across processes)."""
        ins = postgresql.insert(_OUTCOMES) if self.engine.dialect.name == "postgresql" else sqlite.insert(_OUTCOMES)
        stmt = ins.values(task_name=task_name, outcome=outcome, count=1).on_conflict_do_update(
            index_elements=["task_name", "outcome"], set_={"count": _OUTCOMES.c.count + 1}
        )
        conn.execute(stmt)

    def record_outcome(self, task_name: str, outcome: Outcome) -> None:
        """Count one delivery outcome in its own transaction."""
        with self._txn() as conn:
            self.record_outcome_txn(conn, task_name, outcome)

    def outcome_counts(self, task_name: str | None = None) -> dict[str, int]:
        """Return {outcome: count} summed over all tasks, or for one task."""
        c = _OUTCOMES.c
        stmt = select(c.outcome, func.sum(c.count)).group_by(c.outcome)
        if task_name is not None:
            stmt = stmt.where(c.task_name == task_name)
        with translated(self.url), self.read_engine.connect() as conn:
            return {o.value: int(n) for o, n in conn.execute(stmt)}


def _lease_lost(claim: Claim) -> LeaseLost:
    return LeaseLost(
        f"{claim.task_name}[{claim.key}]: fencing token {claim.token} is stale — another worker took the run "
        f"over after this holder's lease expired; this holder's writes were rolled back",
        task_name=claim.task_name,
        key=claim.key,
        token=claim.token,
    )
