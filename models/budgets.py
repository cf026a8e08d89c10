"""Spending caps that are never overspent: one row per budget window, and the caps an operator set.

A call reserves its estimated cost (input estimate + output limit, at the model's price) in every budget that
applies to it, in the transaction that commits its intent as `prepared`; the ledger row that records its actual
cost moves that cost to `spent`, and the intent's end (or a sweeper, for an intent left `prepared` past a
timeout with no provider reference) releases the reservation. The database itself refuses an overspend: the
CHECK `spent + reserved <= limit` holds at every commit on both SQLite and PostgreSQL. A call whose actual cost
came out above its estimate (an estimate is conservative, so only by a tokenizer's error) never breaks it: the
excess is counted in `overrun_micros`, in sight, and `spent` stops at the limit.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, CheckConstraint, DateTime, Float, String, func
from sqlalchemy.orm import Mapped, mapped_column

from oncelery.models.base import Base, BigId


class LlmBudget(Base):
    """One window of one budget (`tenant:acme/day/2026-12-02`, `global/month/2026-12`, `run:42`), in micro-USD."""

    __tablename__ = "llm_budgets"

    name: Mapped[str] = mapped_column(String(320), primary_key=True)
    scope: Mapped[str] = mapped_column(String(300), nullable=False)  # "<budget>/<period>": what a cap names
    # The limit in force at the last reservation (the operator's cap, else the configuration's).
    limit_micros: Mapped[int] = mapped_column(BigInteger, nullable=False)
    spent_micros: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    reserved_micros: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    # Actual cost above the limit: a call that cost more than its reservation (only an estimate's error).
    overrun_micros: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    refused: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    # When the window ends (epoch seconds by the database clock; None: a job's budget has no window).
    resets_at: Mapped[float | None] = mapped_column(Float)

    __table_args__ = (
        CheckConstraint("spent_micros + reserved_micros <= limit_micros", name="within_limit"),
        CheckConstraint("spent_micros >= 0 AND reserved_micros >= 0", name="not_negative"),
    )


class OperatorCap(Base):
    """A cap an operator set with the CLI (`budget:<scope>` in micro-USD, `limit:<limiter>` per window): it wins."""

    __tablename__ = "oncelery_caps"

    name: Mapped[str] = mapped_column(String(320), primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger, nullable=False)
    set_by: Mapped[str] = mapped_column(String(255), nullable=False)
    set_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()
    )


class CapChange(Base):
    """Every change of an operator's cap: who, when, from what to what (None: the configuration's value)."""

    __tablename__ = "oncelery_cap_changes"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(320), nullable=False)
    old_value: Mapped[int | None] = mapped_column(BigInteger)
    new_value: Mapped[int | None] = mapped_column(BigInteger)  # None: the cap was removed (configuration rules)
    set_by: Mapped[str] = mapped_column(String(255), nullable=False)
    set_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()
    )
