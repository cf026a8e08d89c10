"""Forks: a new run of a past run's task from step N, under its own key namespace, with overrides.

A fork records where it came from (the source run's id, task, tenant and key), the step it re-runs from, the
overrides `self.llm` applies from there on, where its effects go (`dry`, `shadow`, `live`), and the key of the
run it makes (`fork:<id>:<source key>`), so it never takes production's claim. A cohort groups forks that apply
one change to many past runs, and holds their shared cost cap.
"""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, CheckConstraint, DateTime, Integer, String, func
from sqlalchemy.orm import Mapped, mapped_column

from oncelery.models.base import Base, BigId, Json
from oncelery.models.runs import _enum  # VARCHAR + CHECK on every dialect, as every status


class ForkEffects(enum.Enum):
    """Where a fork's `effects()` writes go: rolled back, to a shadow database, or to production."""

    DRY = "dry"
    SHADOW = "shadow"
    LIVE = "live"


class Fork(Base):
    """One fork of a past run."""

    __tablename__ = "oncelery_forks"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    source_run_id: Mapped[int] = mapped_column(BigInteger, nullable=False, index=True)
    task_name: Mapped[str] = mapped_column(String(255), nullable=False)
    tenant: Mapped[str] = mapped_column(String(255), nullable=False, server_default="")
    source_key: Mapped[str] = mapped_column(String(512), nullable=False)
    from_step: Mapped[str] = mapped_column(String(255), nullable=False)
    from_position: Mapped[int] = mapped_column(Integer, nullable=False)
    # {step: {"model": ..., "prompt": ..., "temperature": ..., "seed": ...}}
    overrides: Mapped[Any] = mapped_column(Json, nullable=False)
    effects: Mapped[ForkEffects] = mapped_column(_enum(ForkEffects, "fork_effects"), nullable=False)
    shadow_url: Mapped[str | None] = mapped_column(String(1024))
    fork_key: Mapped[str] = mapped_column(String(255), nullable=False, unique=True)
    cohort_id: Mapped[int | None] = mapped_column(BigInteger, index=True)
    # The cohort's cost cap (micro-USD): every fork of the cohort reserves in one budget row, cohort:<id>.
    cohort_cap_micros: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()
    )

    __table_args__ = (CheckConstraint("from_position >= 0", name="from_position_non_negative"),)
