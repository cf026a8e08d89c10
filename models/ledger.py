"""The cost ledger's table: one `model_calls` row per real model call, with its tokens, latency and cost."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Boolean, DateTime, Float, Index, Integer, String, Text, false, func
from sqlalchemy.orm import Mapped, mapped_column

from oncelery.models.base import Base, BigId, Json


class ModelCall(Base):
    """One real model call (never a replay), committed on its own as soon as the call ends, ok or failed.

    No foreign key to `task_runs`: a row outlives a rollback of its run's effects and is written even when
    the run never completes; retention deletes it with its run (by `run_id`).
    """

    __tablename__ = "model_calls"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    # The call's own id, chosen before its first write attempt: a row replayed from the spool after an unknown
    # commit outcome meets this unique index and is not counted twice (NULL: rows written before 0011).
    call_id: Mapped[str | None] = mapped_column(String(64))
    # Where the call was made: the run's task, tenant, key, step, run and fencing token (NULL outside a run).
    task_name: Mapped[str | None] = mapped_column(String(255))
    tenant: Mapped[str] = mapped_column(String(255), nullable=False, default="", server_default="")
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    step: Mapped[str | None] = mapped_column(String(255))
    run_id: Mapped[int | None] = mapped_column(BigId)
    fencing_token: Mapped[int | None] = mapped_column(Integer)
    model: Mapped[str] = mapped_column(String(255), nullable=False)
    # The prompt or template's name ("summarize"), not its text: the ledger never keeps a payload.
    prompt: Mapped[str | None] = mapped_column(String(255))
    input_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    output_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    latency_ms: Mapped[float] = mapped_column(Float, nullable=False)
    ok: Mapped[bool] = mapped_column(Boolean, nullable=False)
    error: Mapped[str | None] = mapped_column(Text)
    # Estimated cost in micro-USD (models/money.py: integer, rounded up per call) at the price of the day the
    # row was written (app.conf.oncelery_prices, else the price file); NULL: no price.
    cost_micros: Mapped[int | None] = mapped_column(BigInteger)
    # A batch item's row: what the synchronous price would have cost more, exactly (NULL: not a batch call, or
    # no price). `oncelery costs` sums it as the amount batching saved.
    batch_saved_micros: Mapped[int | None] = mapped_column(BigInteger)
    # What else produced the answer (model version, seed, temperature, prompt hash...), as the caller gives it.
    meta: Mapped[Any] = mapped_column(Json, nullable=True)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()
    )
    # Why this call was made again for the same step (a RepeatReason of its intent: create_window,
    # sync_unknown, lost...), or `unknown_outcome` for a call whose bill can't be known (estimated usage).
    reason: Mapped[str | None] = mapped_column(String(32))
    # The call's answer was taken by a later holder, which re-attached to it instead of paying again.
    reattached: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False, server_default=false())

    __table_args__ = (
        Index("ix_model_calls_task_name_idempotency_key", "task_name", "idempotency_key"),
        # Per-run sums (`oncelery costs`: what each replay of a run saved) and retention's delete by run.
        Index("ix_model_calls_run_id", "run_id"),
        Index("uq_model_calls_call_id", "call_id", unique=True),
    )


class LedgerTotal(Base):
    """Running totals of `model_calls` per (task, tenant, model), added in each call's own transaction.

    The metrics exporter reads this small table instead of summing model_calls; retention never lowers it.
    """

    __tablename__ = "ledger_totals"

    task_name: Mapped[str] = mapped_column(String(255), primary_key=True)  # "" for calls outside any task
    tenant: Mapped[str] = mapped_column(String(255), primary_key=True)
    model: Mapped[str] = mapped_column(String(255), primary_key=True)
    calls: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0, server_default="0")
    failed_calls: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0, server_default="0")
    input_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0, server_default="0")
    output_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0, server_default="0")
    cost_micros: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0, server_default="0")  # micro-USD
    unpriced_calls: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0, server_default="0")


class LedgerLabelTotal(Base):
    """Running counts of labelled `model_calls` per (task, tenant, model, label), added with each labelled row.

    A label is why a call was made again for its step (a `RepeatReason` of its intent), `unknown_outcome` (the
    estimated row of a call whose holder died before it was answered) or `reattached` (a call a later holder
    took the answer of). The exporter and `oncelery costs` read these few rows; retention never lowers them.
    """

    __tablename__ = "ledger_label_totals"

    task_name: Mapped[str] = mapped_column(String(255), primary_key=True)  # "" for calls outside any task
    tenant: Mapped[str] = mapped_column(String(255), primary_key=True)
    model: Mapped[str] = mapped_column(String(255), primary_key=True)
    label: Mapped[str] = mapped_column(String(32), primary_key=True)
    calls: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0, server_default="0")
