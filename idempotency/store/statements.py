"""The claim protocol's SQL, built once per dialect with bind parameters.

Building a statement per call costs more CPU than the database round trip on a fast local server
(SQLAlchemy coerces every clause and derives a cache key); a prebuilt statement memoises both.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import JSON, Integer, String, and_, bindparam, case, func, literal, or_, update
from sqlalchemy.sql.elements import ColumnElement

from oncelery.models import OutboxStatus, RunStatus
from oncelery.store.clock import lease_expired
from oncelery.store.dialects import dialect as get_dialect
from oncelery.store.letter_statements import conflict_letter, letter
from oncelery.store.one_trip import (
    claim_or_replay,
    complete_and_count,
    count_replay,
    count_statement,
    producer_answer,
    producer_view,
)
from oncelery.store.tables import (
    OUTBOX,
    OUTCOME_TOTALS,
    RUNS,
    SAVED_FROM,
    VERSIONS,
)

__all__ = [
    "Statements",
    "retry_due",
    "statements",
]


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
        still_running(),
    )


def _fenced_failure(status: RunStatus, now: ColumnElement[Any], first_failed: ColumnElement[Any], **values: Any) -> Any:
    # The holder's fenced write of a failure: the run leaves RUNNING with its error and loses its lease.
    return (
        update(RUNS)
        .where(_fenced())
        .values(
            status=status,
            error=bindparam("p_error"),
            updated_at=now,
            lease_expires_at=None,
            first_failed_at=first_failed,
            **values,
        )
    )


def still_running() -> ColumnElement[bool]:
    """`status = 'RUNNING'` for a row found by its id, kept out of the index conditions.

    A plain `status = ...` let PostgreSQL's generic plans (prepared statements) pick the (status, updated_at)
    index over the primary key and read every RUNNING run per write: a completion cost 1 ms with 3,000 runs
    in flight, and grew with them (tests/test_store_contract.py checks the plans).
    """
    return func.coalesce(RUNS.c.status, literal("", String), type_=String) == literal(RunStatus.RUNNING.value, String)


class Statements:
    """Prebuilt statements of one dialect; execute them with the parameters named `p_*`."""

    def __init__(self, dialect: str) -> None:
        self.dialect = dialect
        dia = get_dialect(dialect)
        insert, now, until = dia.insert, dia.now(), dia.lease_until()
        one_trip = dia.dml_in_cte  # PostgreSQL: two statements as one, through data-modifying CTEs
        # The claim: a new key, a takeover, an expired entity holder demoted (and PostgreSQL's one trip).
        self.insert_claim = self._insert_claim(insert, now, until)
        self.takeover = self._takeover(now, until)
        self.demote_expired_entity = self._demote_expired_entity(now)
        self.claim_or_replay = claim_or_replay(self.insert_claim, now) if one_trip else None
        # The holder's fenced writes: the lease renewed, the run completed (with its count, in one trip).
        self.heartbeat = update(RUNS).where(_fenced()).values(lease_expires_at=until)
        self.complete = self._complete(now)
        self.complete_keeping = self._complete(now, keep_message=True)  # the task keeps its arguments (a fork's)
        self.complete_and_count = complete_and_count(self.complete) if one_trip else None
        self.settle_stale = self._settle_stale(now)
        # A published outbox row whose delivery was refused before any run (stale, conflict, debounced): closed
        # for good. PENDING too: the relay publishes inside the transaction that marks the row SENT, so a fast
        # worker can settle the message while the committed row still reads PENDING; on PostgreSQL an UPDATE
        # matching only SENT skips that row without waiting (its snapshot says PENDING) and the row stayed SENT,
        # to be published again. Matching PENDING, the UPDATE waits for the relay's lock and re-checks the row.
        self.close_outbox_row = (
            update(OUTBOX)
            .where(
                OUTBOX.c.celery_task_id == bindparam("p_task_id"),
                # Two comparisons, not IN: the hot path's driver statements take no expanding parameter.
                or_(OUTBOX.c.status == OutboxStatus.PENDING, OUTBOX.c.status == OutboxStatus.SENT),
            )
            .values(status=OutboxStatus.DONE, outcome=bindparam("p_outcome", type_=String))
        )
        # Failure: FAILED, FAILED until Celery's retry, DEAD (a holder's or a poison run's) and its dead letter.
        first_failed = func.coalesce(RUNS.c.first_failed_at, now)
        self.fail = self._fail(now, first_failed)
        self.fail_for_retry = self._fail_for_retry(now, first_failed, dia.lease_until("p_delay"))
        self.park = self._park(now, dia.lease_until("p_delay"))
        self.fail_dead = self._fail_dead(now, first_failed)
        self.kill_lost = self._kill_lost(now, first_failed)
        self.letter = letter(insert, now)
        self.conflict_letter = conflict_letter(insert, now)
        # Counting: one delivery's outcome, a batch of cached replays, a replay on its run.
        self.count_outcome = count_statement(insert, {name: bindparam(f"p_{name}") for name in OUTCOME_TOTALS})
        # `p_count` deliveries at once: the replays the replay cache answered, written by its flusher.
        self.count_outcomes = count_statement(
            insert, {name: bindparam(f"p_{name}") for name in OUTCOME_TOTALS}, count=bindparam("p_count", type_=Integer)
        )
        self.count_replay_on_run = self._count_replay_on_run()
        self.count_replay = count_replay(self.count_replay_on_run, insert) if one_trip else None
        # A producer's check (oncelery.basetask.producer): its view of a call's run, and on PostgreSQL a duplicate's
        # answer and `replayed` count (at_producer) in the same statement.
        self.producer_view = producer_view(now)
        self.producer_answer = producer_answer(now) if one_trip else None
        # Entity versions: applied only forward.
        self.advance_version = self._advance_version(insert, now)

    # -- claim -------------------------------------------------------------------------------------

    @staticmethod
    def _insert_claim(insert: Any, now: ColumnElement[Any], until: ColumnElement[Any]) -> Any:
        # A new key: INSERT ... ON CONFLICT DO NOTHING RETURNING id (no row back: the key exists). Its times are
        # the database clock's, to the millisecond (SQLite's column default, CURRENT_TIMESTAMP, has whole seconds:
        # a run's duration, finished_at - created_at, would read up to a second long).
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
                created_at=now,
                updated_at=now,
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
                    # A parked run whose wake time came, by its own message only (the wake: its task id), so the
                    # first caller's AsyncResult gets the result; duplicates wait (runs/claim_rounds.py, _decide_on).
                    and_(c.status == RunStatus.WAITING, retry_due(now), c.celery_task_id == bindparam("p_task_id")),
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
    def _demote_expired_entity(now: ColumnElement[Any]) -> Any:
        # An entity's RUNNING run whose holder stopped renewing blocks nobody: demote it to FAILED with a retry
        # due (its old holder's fenced writes now fail, and a re-send or its own redelivery takes it over later).
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
                # Due for a retry now, not failed for good: the relay re-publishes its outbox row and the sweeper
                # re-sends its kept message (its own message died with its holder).
                not_before=now,
            )
        )

    # -- completion ----------------------------------------------------------------------------------

    @staticmethod
    def _complete(now: ColumnElement[Any], keep_message: bool = False) -> Any:
        # The holder's fenced completion, with the result it returned.
        values: dict[str, Any] = {
            "status": RunStatus.COMPLETED,
            "result": bindparam("p_result", type_=JSON),
            "finished_at": now,
            "updated_at": now,
            "lease_expires_at": None,
            "not_before": None,
        }
        if not keep_message:  # kept arguments stay until retention clears them (runs/kept.py)
            values["message"] = None  # kept only until the run completes (G9): it was there for recovery
        return update(RUNS).where(_fenced()).values(**values)

    @staticmethod
    def _settle_stale(now: ColumnElement[Any]) -> Any:
        # A run waiting to be run again (a retry due, or a holder that vanished) whose delivery is now stale: it
        # completes with no result, as a stale completion does, instead of being re-sent for ever.
        c = RUNS.c
        return (
            update(RUNS)
            .where(
                c.task_name == bindparam("p_task"),
                c.tenant == bindparam("p_tenant"),
                c.idempotency_key == bindparam("p_key"),
                or_(
                    and_(c.status == RunStatus.FAILED, c.not_before.is_not(None)),
                    c.status == RunStatus.WAITING,  # parked: nothing but its wake would run it again
                    and_(c.status == RunStatus.RUNNING, lease_expired(now)),
                ),
            )
            .values(
                status=RunStatus.COMPLETED,
                result=None,
                finished_at=now,
                updated_at=now,
                lease_expires_at=None,
                not_before=None,
                message=None,
            )
        )

    # -- failure -------------------------------------------------------------------------------------

    @staticmethod
    def _fail(now: ColumnElement[Any], first_failed: ColumnElement[Any]) -> Any:
        # The holder's fenced failure: a duplicate may take the run over at once.
        return _fenced_failure(RunStatus.FAILED, now, first_failed)

    @staticmethod
    def _fail_for_retry(now: ColumnElement[Any], first_failed: ColumnElement[Any], delayed: ColumnElement[Any]) -> Any:
        # A failure Celery will retry after a countdown: no duplicate may take the run over before then
        # (database clock), and the retry is counted on the run, whichever message carries it.
        return _fenced_failure(RunStatus.FAILED, now, first_failed, not_before=delayed, retries=RUNS.c.retries + 1)

    @staticmethod
    def _park(now: ColumnElement[Any], wake: ColumnElement[Any]) -> Any:
        # The holder parks its run WAITING until `wake` (database clock): no lease, no worker slot, not a retry
        # (retries are untouched). The message is kept for the waker, and swept_at cleared so it wakes when due.
        return (
            update(RUNS)
            .where(_fenced())
            .values(
                status=RunStatus.WAITING,
                error=bindparam("p_error"),
                updated_at=now,
                lease_expires_at=None,
                not_before=wake,
                swept_at=None,
                message=bindparam("p_message", type_=JSON),
            )
        )

    @staticmethod
    def _fail_dead(now: ColumnElement[Any], first_failed: ColumnElement[Any]) -> Any:
        # A failure that can never succeed, or the last retry's: DEAD until `oncelery dlq replay`.
        return _fenced_failure(RunStatus.DEAD, now, first_failed, finished_at=now, not_before=None)

    @staticmethod
    def _kill_lost(now: ColumnElement[Any], first_failed: ColumnElement[Any]) -> Any:
        # A poison message: the run lost its holder max_deliveries times (the worker died on every delivery).
        # Guarded by the token the claimant saw and the expiry, so a live holder or a taker is never killed.
        return (
            update(RUNS)
            .where(
                RUNS.c.id == bindparam("p_run_id"),
                RUNS.c.fencing_token == bindparam("p_token"),
                still_running(),
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

    # -- counting ------------------------------------------------------------------------------------

    @staticmethod
    def _count_replay_on_run() -> Any:
        # A duplicate answered from a COMPLETED run's stored result: one more replay on that run (fenced by its
        # id and status), counted with the `replayed` outcome in the same transaction, with what it saved.
        return (
            update(RUNS)
            # By id alone: the run was read COMPLETED, which is final (see one_trip.claim_or_replay's `bumped`).
            .where(RUNS.c.id == bindparam("p_run_id"))
            .values(replays=RUNS.c.replays + 1)
            .returning(*(RUNS.c[column] for column in SAVED_FROM.values()))
        )

    # -- versions ------------------------------------------------------------------------------------

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


@cache
def statements(dialect: str) -> Statements:
    """Return the prebuilt statements of `dialect` ("postgresql" or "sqlite")."""
    return Statements(dialect)
