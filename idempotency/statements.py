"""The claim protocol's SQL, built once per dialect with bind parameters.

Building a statement per call costs more CPU than the database round trip on a fast local server
(SQLAlchemy coerces every clause and derives a cache key); a prebuilt statement memoises both.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from typing import Any, cast

from sqlalchemy import JSON, Integer, String, Table, and_, bindparam, case, func, literal, or_, select, update
from sqlalchemy.dialects import postgresql
from sqlalchemy.sql.elements import ColumnElement

from oncelery.dialects import dialect as get_dialect
from oncelery.leases import lease_expired, lease_live
from oncelery.models import (
    DeadLetter,
    DeliveryOutcome,
    EntityVersion,
    OutboxMessage,
    Outcome,
    RunStatus,
    Secret,
    StepResult,
    TaskRun,
)

RUNS = cast(Table, TaskRun.__table__)
OUTCOMES = cast(Table, DeliveryOutcome.__table__)
LETTERS = cast(Table, DeadLetter.__table__)
VERSIONS = cast(Table, EntityVersion.__table__)
OUTBOX = cast(Table, OutboxMessage.__table__)
STEPS = cast(Table, StepResult.__table__)
SECRETS = cast(Table, Secret.__table__)
OUTCOME_SHARDS = 16  # counter rows per (task, outcome): concurrent completions rarely wait on one row
_OUTCOME_KEY = ["task_name", "tenant", "outcome", "shard"]
# Running totals each counted delivery adds to its counter row (models.runs.DeliveryOutcome says which).
OUTCOME_TOTALS = (
    "steps_executed",
    "steps_replayed",
    "takeovers",
    "saved_calls",
    "saved_input_tokens",
    "saved_output_tokens",
    "saved_cost",
)
# The task_runs columns a RunView (oncelery.runs) is made of.
RUN_VIEW_COLUMNS = (
    "id",
    "task_name",
    "tenant",
    "idempotency_key",
    "fingerprint",
    "field_digests",
    "status",
    "fencing_token",
    "owner",
    "attempts",
    "result",
    "error",
    "lease_expires_at",
    "concurrency_key",
    "celery_task_id",
    "message",
    "created_at",
    "updated_at",
    "finished_at",
    "retries",
    "not_before",
    "lost",
    "replays",
)
# What a replay saved: the replayed run's ok model calls, tokens and USD.
_SAVED_FROM = {
    "saved_calls": "llm_calls",
    "saved_input_tokens": "llm_input_tokens",
    "saved_output_tokens": "llm_output_tokens",
    "saved_cost": "llm_cost",
}


def retry_due(now: ColumnElement[Any]) -> ColumnElement[bool]:
    """A FAILED run may be taken over: Celery's retry countdown (not_before, database clock) has passed."""
    c = RUNS.c
    return or_(c.not_before.is_(None), c.not_before <= now)


def _fenced() -> ColumnElement[bool]:
    # The fence every holder write carries: this run, this token, this claim's random owner, still RUNNING.
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
        dia = get_dialect(dialect)
        insert = dia.insert
        now = dia.now()
        until = dia.lease_until()
        self.insert_claim = self._insert_claim(insert, until)
        self.takeover = self._takeover(now, until)
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
                not_before=None,
                message=None,  # kept only until the run completes (G9): it was there for recovery
            )
        )
        first_failed = func.coalesce(RUNS.c.first_failed_at, now)
        self.fail = (
            update(RUNS)
            .where(_fenced())
            .values(
                status=RunStatus.FAILED,
                error=bindparam("p_error"),
                updated_at=now,
                lease_expires_at=None,
                first_failed_at=first_failed,
            )
        )
        # A failure that can never succeed, or the last retry's: DEAD until `oncelery dlq replay`.
        self.fail_dead = (
            update(RUNS)
            .where(_fenced())
            .values(
                status=RunStatus.DEAD,
                error=bindparam("p_error"),
                updated_at=now,
                finished_at=now,
                lease_expires_at=None,
                not_before=None,
                first_failed_at=first_failed,
            )
        )
        # A poison message: the run lost its holder max_deliveries times (the worker died on every delivery).
        # Guarded by the token the claimant saw and the expiry, so a live holder or a taker is never killed.
        self.kill_lost = (
            update(RUNS)
            .where(
                RUNS.c.id == bindparam("p_run_id"),
                RUNS.c.fencing_token == bindparam("p_token"),
                RUNS.c.status == RunStatus.RUNNING,
                lease_expired(now),
            )
            .values(
                status=RunStatus.DEAD,
                error=bindparam("p_error"),
                lost=RUNS.c.lost + 1,
                updated_at=now,
                finished_at=now,
                lease_expires_at=None,
                first_failed_at=first_failed,
            )
        )
        self.letter = self._letter(insert, now)
        self.advance_version = self._advance_version(insert, now)
        # A failure Celery will retry after a countdown: no duplicate may take the run over before then
        # (database clock), and the retry is counted on the run, whichever message carries it.
        self.fail_for_retry = (
            update(RUNS)
            .where(_fenced())
            .values(
                status=RunStatus.FAILED,
                error=bindparam("p_error"),
                updated_at=now,
                lease_expires_at=None,
                not_before=dia.lease_until("p_delay"),
                retries=RUNS.c.retries + 1,
                first_failed_at=first_failed,
            )
        )
        self.demote_expired_entity = self._demote_expired_entity(now)
        self.count_outcome = _count(insert, {name: bindparam(f"p_{name}") for name in OUTCOME_TOTALS})
        self.complete_and_count = self._complete_and_count() if dia.dml_in_cte else None
        # A duplicate answered from a COMPLETED run's stored result: one more replay on that run (fenced by its
        # id and status), counted with the `replayed` outcome in the same transaction, with what it saved.
        self.count_replay_on_run = (
            update(RUNS)
            .where(RUNS.c.id == bindparam("p_run_id"), RUNS.c.status == RunStatus.COMPLETED)
            .values(replays=RUNS.c.replays + 1)
            .returning(*(RUNS.c[column] for column in _SAVED_FROM.values()))
        )
        self.count_replay = self._count_replay(insert) if dia.dml_in_cte else None
        self.claim_or_replay = self._claim_or_replay(now) if dia.dml_in_cte else None

    @staticmethod
    def _demote_expired_entity(now: ColumnElement[Any]) -> Any:
        # An entity's RUNNING run whose holder stopped renewing blocks nobody: demote it to FAILED (its old
        # holder's fenced writes now fail, and its own redelivery can take it over later).
        return (
            update(RUNS)
            .where(
                RUNS.c.tenant == bindparam("p_tenant"),
                RUNS.c.concurrency_key == bindparam("p_entity"),
                RUNS.c.status == RunStatus.RUNNING,
                lease_expired(now),
            )
            .values(
                status=RunStatus.FAILED,
                error="lease expired while another run of its entity waited; demoted so the entity is not blocked",
                updated_at=now,
                lease_expires_at=None,
                lost=RUNS.c.lost + 1,  # its holder vanished: a lost delivery, as for a takeover
            )
        )

    @staticmethod
    def _insert_claim(insert: Any, until: ColumnElement[Any]) -> Any:
        # A new key: INSERT ... ON CONFLICT DO NOTHING RETURNING id (no row back: the key exists).
        c = RUNS.c
        return (
            insert(RUNS)
            .values(
                task_name=bindparam("p_task"),
                tenant=bindparam("p_tenant"),
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
            .on_conflict_do_nothing(index_elements=["task_name", "tenant", "idempotency_key"])
            .returning(c.id)
        )

    @staticmethod
    def _takeover(now: ColumnElement[Any], until: ColumnElement[Any]) -> Any:
        # A FAILED run, or a RUNNING one whose lease expired: one guarded UPDATE bumps the token.
        c = RUNS.c
        return (
            update(RUNS)
            .where(
                c.task_name == bindparam("p_task"),
                c.tenant == bindparam("p_tenant"),
                c.idempotency_key == bindparam("p_key"),
                # A different payload never takes a run over: that is a conflict, decided by the caller.
                c.fingerprint == bindparam("p_fingerprint"),
                or_(
                    # Celery's own retry (the same task id) is due when it arrives; duplicates wait it out.
                    and_(c.status == RunStatus.FAILED, or_(retry_due(now), c.celery_task_id == bindparam("p_task_id"))),
                    # A lapsed holder, or this message's own earlier delivery that gave up on a store fault.
                    and_(c.status == RunStatus.RUNNING, or_(lease_expired(now), c.owner == bindparam("p_abandoned"))),
                ),
            )
            .values(
                status=RunStatus.RUNNING,
                fencing_token=c.fencing_token + 1,
                owner=bindparam("p_owner"),
                lease_expires_at=until,
                attempts=c.attempts + 1,
                # Taking over a RUNNING run means its holder vanished (SIGKILL, OOM): a lost delivery, unless
                # this message is that holder's own re-send after a database fault (it did not vanish).
                lost=c.lost
                + case((and_(c.status == RunStatus.RUNNING, c.owner != bindparam("p_abandoned")), 1), else_=0),
                updated_at=now,
                error=None,
                not_before=None,
                concurrency_key=bindparam("p_entity"),
                celery_task_id=bindparam("p_task_id"),
                message=bindparam("p_message", type_=JSON),
            )
            .returning(c.id, c.fencing_token, c.attempts, c.retries)
        )

    @staticmethod
    def _letter(insert: Any, now: ColumnElement[Any]) -> Any:
        # The dead letter of a run, written in the transaction that makes it DEAD: one row per run, its
        # first failure kept and the rest refreshed if it dies again after a replay. INSERT ... SELECT takes
        # the task, key, attempts and first failure from the run itself (the WHERE also lets SQLite parse
        # the ON CONFLICT clause).
        c = RUNS.c
        rows = select(
            c.id,
            c.task_name,
            c.tenant,
            c.idempotency_key,
            bindparam("p_reason", type_=String),
            bindparam("p_error", type_=String),
            bindparam("p_traceback", type_=String),
            c.attempts,
            bindparam("p_letter", type_=JSON),
            func.coalesce(c.first_failed_at, now),
            now,
        ).where(c.id == bindparam("p_run_id"))
        cols = [
            "run_id",
            "task_name",
            "tenant",
            "idempotency_key",
            "reason",
            "error",
            "traceback",
            "attempts",
            "message",
            "first_failed_at",
            "last_failed_at",
        ]
        stmt = insert(LETTERS).from_select(cols, rows)
        x = stmt.excluded
        return stmt.on_conflict_do_update(
            index_elements=["run_id"],
            set_={
                "reason": x.reason,
                "error": x.error,
                "traceback": x.traceback,
                "attempts": x.attempts,
                "message": x.message,
                "last_failed_at": x.last_failed_at,
                "replayed_at": None,
            },
        )

    @staticmethod
    def _advance_version(insert: Any, now: ColumnElement[Any]) -> Any:
        # The entity's applied version moves forward only: a row comes back iff this version is newer than
        # the stored one (or the first). Run in the completion transaction, its row lock also orders two
        # completions of one entity.
        stmt = insert(VERSIONS).values(
            task_name=bindparam("p_task"),
            tenant=bindparam("p_tenant"),
            entity=bindparam("p_entity"),
            version=bindparam("p_version"),
            updated_at=now,
        )
        x = stmt.excluded
        return stmt.on_conflict_do_update(
            index_elements=["task_name", "tenant", "entity"],
            set_={"version": x.version, "updated_at": now},
            where=VERSIONS.c.version < x.version,
        ).returning(VERSIONS.c.version)

    def _count_replay(self, insert: Any) -> Any:
        # PostgreSQL: ONE statement (WITH bumped AS (UPDATE ... RETURNING llm_*) INSERT INTO delivery_outcomes
        # ...): a data-modifying WITH runs once whether or not the INSERT reads it, so the outcome is counted
        # (saving 0) even if the run was purged meanwhile.
        bumped = self.count_replay_on_run.cte("bumped")
        totals: dict[str, Any] = {name: bindparam(f"p_{name}") for name in OUTCOME_TOTALS}
        for name, column in _SAVED_FROM.items():
            totals[name] = func.coalesce(select(bumped.c[column]).scalar_subquery(), 0)
        return _count(insert, totals).add_cte(bumped)

    def _claim_or_replay(self, now: ColumnElement[Any]) -> Any:
        # PostgreSQL: a delivery's claim in ONE statement (one round trip), whatever it finds:
        #   ins     INSERT the run ... ON CONFLICT DO NOTHING RETURNING id      (a new key: claimed)
        #   cur     the existing run, as RunStore.get reads it                  (else: decided in Python)
        #   bumped  a COMPLETED run of the same payload: replays + 1 RETURNING what it saves
        #   counted the `replayed` outcome with those savings, only if bumped (a duplicate is answered here)
        # All CTEs share one snapshot: `cur` never sees `ins`'s row, and a key inserted by a transaction that
        # committed after the snapshot is neither inserted nor seen (no row: the caller reads it again).
        c = RUNS.c
        ins = self.insert_claim.cte("ins")
        retry_wait = and_(c.not_before.is_not(None), c.not_before > now)
        # Only what a RunView holds: psycopg caches its parsing of a query only below 4096 characters.
        viewed = [c[name] for name in RUN_VIEW_COLUMNS]
        cur = (
            select(*viewed, lease_live(now).label("lease_live"), retry_wait.label("retry_wait"))
            .where(
                c.task_name == bindparam("p_task"),
                c.tenant == bindparam("p_tenant"),
                c.idempotency_key == bindparam("p_key"),
            )
            .cte("cur")
        )
        finished = select(cur.c.id).where(
            cur.c.status == RunStatus.COMPLETED, cur.c.fingerprint == bindparam("p_fingerprint")
        )
        bumped = (
            update(RUNS)
            .where(c.id == finished.scalar_subquery(), c.status == RunStatus.COMPLETED)
            .values(replays=c.replays + 1)
            .returning(c.id, *(c[column] for column in _SAVED_FROM.values()))
            .cte("bumped")
        )
        o = OUTCOMES.c
        rows = select(
            bindparam("p_task", type_=String),
            bindparam("p_tenant", type_=String),
            literal(Outcome.REPLAYED.value, type_=o.outcome.type),
            bindparam("p_shard", type_=Integer),
            literal(1),
            *(bumped.c[column] for column in _SAVED_FROM.values()),
        ).select_from(bumped)
        count = postgresql.insert(OUTCOMES).from_select([*_OUTCOME_KEY, "count", *_SAVED_FROM], rows)
        upsert = count.on_conflict_do_update(index_elements=_OUTCOME_KEY, set_=_added(count, _SAVED_FROM))
        counted = upsert.cte("counted")
        one = select(literal(1).label("one")).subquery("one")
        return (
            select(
                select(ins.c.id).scalar_subquery().label("new_id"),
                select(func.count()).select_from(bumped).scalar_subquery().label("replayed"),
                *cur.c,
            )
            .select_from(one.outerjoin(cur, literal(True)))
            .add_cte(counted)
        )

    def _complete_and_count(self) -> Any:
        # PostgreSQL: the fenced completion and the outcome counter in ONE statement (one round trip):
        # WITH done AS (UPDATE task_runs ... RETURNING id) INSERT INTO delivery_outcomes SELECT ... FROM done.
        # No row returned means the fence refused the completion (LeaseLost) and nothing was written.
        done = self.complete.returning(RUNS.c.id).cte("done")
        o = OUTCOMES.c
        rows = select(
            bindparam("p_task", type_=String),
            bindparam("p_tenant", type_=String),
            bindparam("p_outcome", type_=o.outcome.type),
            bindparam("p_shard", type_=Integer),
            literal(1),
            *(bindparam(f"p_{name}", type_=o[name].type) for name in OUTCOME_TOTALS),
        ).select_from(done)
        stmt = postgresql.insert(OUTCOMES).from_select([*_OUTCOME_KEY, "count", *OUTCOME_TOTALS], rows)
        return (
            stmt.on_conflict_do_update(index_elements=_OUTCOME_KEY, set_=_added(stmt)).returning(o.count).add_cte(done)
        )


def _count(insert: Any, totals: dict[str, Any]) -> Any:
    """INSERT one counter row (a shard of task, tenant, outcome) or add this delivery's figures to it."""
    stmt = insert(OUTCOMES).values(
        task_name=bindparam("p_task"),
        tenant=bindparam("p_tenant"),
        outcome=bindparam("p_outcome"),
        shard=bindparam("p_shard"),
        count=1,
        **totals,
    )
    return stmt.on_conflict_do_update(index_elements=_OUTCOME_KEY, set_=_added(stmt))


def _added(stmt: Any, totals: Iterable[str] = OUTCOME_TOTALS) -> dict[str, Any]:
    o, new = OUTCOMES.c, stmt.excluded
    return {"count": o.count + 1, **{name: o[name] + new[name] for name in totals}}


@cache
def statements(dialect: str) -> Statements:
    """Return the prebuilt statements of `dialect` ("postgresql" or "sqlite")."""
    return Statements(dialect)
