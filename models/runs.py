"""Tables of the claim engine: one row per (task, key), its step checkpoints, and delivery outcome counts."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from oncelery.models.base import Base, BigId, Json


class RunStatus(enum.Enum):
    """Lifecycle of a run: RUNNING (claimed, lease live or expired) -> COMPLETED | FAILED | DEAD | WAITING.

    DEAD is final until `oncelery dlq replay`: no delivery runs it again (retries exhausted, an error that can
    never succeed, or a worker lost on every delivery).
    """

    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    DEAD = "DEAD"
    # Parked with no worker slot until `not_before` (database clock): a background model call still running.
    # The relay's waker re-sends its stored message when due; the next delivery takes it over (WAITING -> RUNNING).
    WAITING = "WAITING"


class Outcome(enum.Enum):
    """What one delivery of a message ended as; every delivery records exactly one (G7)."""

    EXECUTED = "executed"
    REPLAYED = "replayed"
    RESUMED = "resumed"
    IN_PROGRESS = "in_progress"
    CONFLICT = "conflict"
    STALE = "stale"
    LEASE_LOST = "lease_lost"
    FAILED = "failed"
    DEAD = "dead"
    WAITING = "waiting"  # the delivery parked its run (WAITING) and was acked: a later wake delivers it again
    # Debounce (migration 0025): a message of an edit a newer one replaced, acked without a run; a run in flight
    # for an older edit, fenced out at its lease renewal (its effects never commit).
    DEBOUNCED = "debounced"
    SUPERSEDED = "superseded"


def _enum(cls: type[enum.Enum], name: str) -> Enum:
    # Stored as VARCHAR + CHECK on every dialect (native_enum=False): adding a value later is a
    # CHECK change, not an ALTER TYPE that PostgreSQL cannot run inside a transaction.
    return Enum(
        cls,
        name=name,
        native_enum=False,
        create_constraint=True,
        length=16,
        values_callable=lambda e: [m.value for m in e],
        validate_strings=True,
    )


#: The predicates of task_runs' partial browsing indexes (0028); a query uses one only if it says the same.
TAKEN_OVER = "fencing_token > 1 OR lost > 0 OR retries > 0"
REPLAYED = "replays > 0"


class TaskRun(Base):
    """One row per (task_name, tenant, idempotency_key): the claim, its lease and fencing token, the result."""

    __tablename__ = "task_runs"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    task_name: Mapped[str] = mapped_column(String(255), nullable=False)
    # The key's namespace ("" without tenants): one tenant never replays, conflicts with or blocks another's.
    tenant: Mapped[str] = mapped_column(String(255), nullable=False, default="", server_default="")
    idempotency_key: Mapped[str] = mapped_column(String(255), nullable=False)
    fingerprint: Mapped[str] = mapped_column(String(64), nullable=False)
    # sha256 per fingerprinted argument, so a conflict can name the fields that differ.
    field_digests: Mapped[dict[str, str]] = mapped_column(Json, nullable=False)
    status: Mapped[RunStatus] = mapped_column(_enum(RunStatus, "run_status"), nullable=False)
    fencing_token: Mapped[int] = mapped_column(Integer, nullable=False, default=1)
    # Random per claim: with the token it makes a claim unique even if a crash loses a claim row.
    owner: Mapped[str | None] = mapped_column(String(64))
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, default=1)
    # Celery retries of this run (its body called self.retry or autoretry fired), counted per run, not per
    # message, and the database-clock moment before which no delivery may take the FAILED run over.
    retries: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    not_before: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Deliveries whose holder vanished (lease expired while RUNNING: SIGKILL, OOM, segfault): a run that loses
    # max_deliveries of them is a poison message and goes DEAD instead of killing another worker.
    lost: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    # Duplicate deliveries answered from this run's stored result (what `oncelery costs` counts as saved).
    replays: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    # The run's ok model calls, their tokens and priced micro-USD (models/money.py), added by the ledger as each
    # call is recorded: what each replay of this run saved, added to the replayed outcome's totals without
    # reading model_calls.
    llm_calls: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    llm_input_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    llm_output_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    llm_cost_micros: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    first_failed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # When the relay's sweeper last re-sent this run's stored message (so it re-sends once per interval).
    swept_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    result: Mapped[Any] = mapped_column(Json, nullable=True)
    error: Mapped[str | None] = mapped_column(Text)
    concurrency_key: Mapped[str | None] = mapped_column(String(255))
    # What is needed to re-enqueue a job whose message an embedded broker lost.
    celery_task_id: Mapped[str | None] = mapped_column(String(255))
    message: Mapped[Any] = mapped_column(Json, nullable=True)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()
    )
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()
    )
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        UniqueConstraint("task_name", "tenant", "idempotency_key"),
        CheckConstraint("fencing_token >= 1", name="token_positive"),
        # One RUNNING run per entity (of a tenant): enforced by the database, not by a lock in Python.
        Index(
            "uq_task_runs_running_concurrency_key",
            "tenant",
            "concurrency_key",
            unique=True,
            postgresql_where=text("status = 'RUNNING'"),
            sqlite_where=text("status = 'RUNNING'"),
        ),
        Index("ix_task_runs_status_updated_at", "status", "updated_at"),
        # The sweeper's scan: expired RUNNING runs only (a partial index stays tiny on a table of millions).
        Index(
            "ix_task_runs_running_lease",
            "lease_expires_at",
            postgresql_where=text("status = 'RUNNING'"),
            sqlite_where=text("status = 'RUNNING'"),
        ),
        # The waker's scan: WAITING runs by wake time (tiny: only the runs parked right now).
        Index(
            "ix_task_runs_waiting_wake",
            "not_before",
            postgresql_where=text("status = 'WAITING'"),
            sqlite_where=text("status = 'WAITING'"),
        ),
        # Browsing (Flower's Runs section, migration 0028): newest first by id, one page per index range, for a
        # status, a task or a tenant (one range per status: oncelery.runs.browse), never a table's worth.
        Index("ix_task_runs_status_id", "status", "id"),
        Index("ix_task_runs_task_name_status_id", "task_name", "status", "id"),
        Index("ix_task_runs_tenant_status_id", "tenant", "status", "id"),
        # ... and the few runs that were taken over, lost a holder or retried, or answered duplicates.
        Index(
            "ix_task_runs_taken_over",
            "id",
            postgresql_where=text(TAKEN_OVER),
            sqlite_where=text(TAKEN_OVER),
        ),
        Index(
            "ix_task_runs_replayed",
            "id",
            postgresql_where=text(REPLAYED),
            sqlite_where=text(REPLAYED),
        ),
    )


class StepResult(Base):
    """A checkpointed step of a run: replayed instead of re-executed on a later attempt (G4)."""

    __tablename__ = "step_results"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(BigId, ForeignKey("task_runs.id", ondelete="CASCADE"), nullable=False)
    position: Mapped[int] = mapped_column(Integer, nullable=False)
    step_name: Mapped[str] = mapped_column(String(255), nullable=False)
    result: Mapped[Any] = mapped_column(Json, nullable=True)
    # What produced the result (model, version, seed, temperature, prompt hash): a replay with different
    # inputs is refused or re-run, never answered from another model's checkpoint.
    meta: Mapped[Any] = mapped_column(Json, nullable=True)
    # sha256 of the step's arguments: a replay with other arguments at this position is refused or re-run.
    args_digest: Mapped[str | None] = mapped_column(String(64))
    token: Mapped[int] = mapped_column(Integer, nullable=False)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()
    )
    # Seconds the step's function took in the holder that wrote this checkpoint (0012; NULL before it): a
    # trigger adds it to the step_duration histogram (models/totals.py).
    seconds: Mapped[float | None] = mapped_column(Float)

    __table_args__ = (UniqueConstraint("run_id", "position"),)


class DeliveryOutcome(Base):
    """Exact per-task count of delivery outcomes, incremented in the transaction that decides each one."""

    __tablename__ = "delivery_outcomes"

    task_name: Mapped[str] = mapped_column(String(255), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(255), primary_key=True, default="", server_default="")
    outcome: Mapped[Outcome] = mapped_column(_enum(Outcome, "outcome"), primary_key=True)
    # Several rows per (task, outcome), summed on read: concurrent workers rarely queue on one counter row.
    shard: Mapped[int] = mapped_column(Integer, primary_key=True, default=0)
    count: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    # Running totals added by the same increment, so the metrics exporter reads a small table, never scans:
    # a completing delivery (executed/resumed/stale) adds its run's checkpointed steps (executed by any holder),
    # the steps it replayed from checkpoints, and its takeovers (fencing_token - 1); a replayed duplicate adds
    # the run's ok model calls, tokens and micro-USD it did not spend again (the run's llm_* columns).
    steps_executed: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    steps_replayed: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    takeovers: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    saved_calls: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    saved_input_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    saved_output_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    saved_cost_micros: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")  # micro-USD
    # Of `count`, the calls answered at the producer (`.delay()` of a duplicate, migration 0022): never published,
    # no worker slot; counted with the same outcome as a delivery answered by a worker would be.
    at_producer: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")


class OutboxStatus(enum.Enum):
    """Lifecycle of an outbox row: PENDING -> SENT -> DONE (its run completed), or DEAD (never published)."""

    PENDING = "PENDING"
    SENT = "SENT"
    DONE = "DONE"
    DEAD = "DEAD"


class OutboxMessage(Base):
    """A job written in the caller's transaction: published by the relay iff that transaction committed."""

    __tablename__ = "outbox"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    task_name: Mapped[str] = mapped_column(String(255), nullable=False)
    args: Mapped[Any] = mapped_column(Json, nullable=False)
    kwargs: Mapped[Any] = mapped_column(Json, nullable=False)
    # apply_async options that survive JSON (queue, routing_key, priority, countdown, expires as seconds).
    options: Mapped[Any] = mapped_column(Json, nullable=False)
    # Chosen at enqueue time, so the caller can follow the job with AsyncResult before it is even published.
    celery_task_id: Mapped[str] = mapped_column(String(255), nullable=False, unique=True)
    # The key every publish carries (the row's identity unless the call or the task gives one): a re-publish
    # is absorbed by the claim. NULL for a task that is not an IdempotentTask (published, never re-published).
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    tenant: Mapped[str] = mapped_column(String(255), nullable=False, default="", server_default="")
    status: Mapped[OutboxStatus] = mapped_column(_enum(OutboxStatus, "outbox_status"), nullable=False)
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, default=0, server_default="0")
    publishes: Mapped[int] = mapped_column(Integer, nullable=False, default=0, server_default="0")
    next_attempt_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()
    )
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()
    )
    sent_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # The delivery outcome that closed the row when its worker refused it before any run (stale, conflict);
    # NULL when the relay closed it because its run finished.
    outcome: Mapped[str | None] = mapped_column(String(32))

    __table_args__ = (Index("ix_outbox_status_next_attempt_at", "status", "next_attempt_at"),)


class DeadLetter(Base):
    """A run (or a message without one) that will never succeed as it is: why, how often, and how to replay it."""

    __tablename__ = "dead_letters"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    # NULL for a message that never had a run (its identity could not be derived, or it conflicted).
    run_id: Mapped[int | None] = mapped_column(
        BigId, ForeignKey("task_runs.id", ondelete="CASCADE"), nullable=True, unique=True
    )
    task_name: Mapped[str] = mapped_column(String(255), nullable=False)
    tenant: Mapped[str] = mapped_column(String(255), nullable=False, default="", server_default="")
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    # one of oncelery.runs.decisions.LETTER_REASONS (retries_exhausted, revoked, budget_exceeded, ...)
    reason: Mapped[str] = mapped_column(String(32), nullable=False)
    error: Mapped[str | None] = mapped_column(Text)
    traceback: Mapped[str | None] = mapped_column(Text)
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    # The message (args, kwargs, key headers) a replay sends again.
    message: Mapped[Any] = mapped_column(Json, nullable=True)
    first_failed_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()
    )
    last_failed_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()
    )
    replayed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    replays: Mapped[int] = mapped_column(Integer, nullable=False, default=0, server_default="0")
    # A conflict's payload fingerprint: one letter per (task, tenant, key, fingerprint), counted in `attempts`.
    fingerprint: Mapped[str | None] = mapped_column(String(64))

    __table_args__ = (
        Index("ix_dead_letters_task_name_last_failed_at", "task_name", "last_failed_at"),
        Index(
            "uq_dead_letters_conflict",
            "task_name",
            "tenant",
            "idempotency_key",
            "fingerprint",
            unique=True,
            postgresql_where=text("reason = 'conflict'"),
            sqlite_where=text("reason = 'conflict'"),
        ),
    )


class EntityVersion(Base):
    """The last applied version per (task, tenant, entity): written in the completion transaction, only forward."""

    __tablename__ = "entity_versions"

    task_name: Mapped[str] = mapped_column(String(255), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(255), primary_key=True, default="", server_default="")
    entity: Mapped[str] = mapped_column(String(255), primary_key=True)
    version: Mapped[int] = mapped_column(BigInteger, nullable=False)
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()
    )


class Secret(Base):
    """Deployment secrets Oncelery generates for itself (e.g. the key of per-field payload digests)."""

    __tablename__ = "oncelery_secrets"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(255), nullable=False)


#: The name of the secret that keys per-field digests when ONCELERY_DIGEST_KEY is not set.
DIGEST_KEY_SECRET = "digest_key"
