"""Tables of the demo AI jobs (oncelery.tasks): article scores and the LLM cost ledger, on their own branch."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Boolean, DateTime, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint, func
from sqlalchemy.orm import Mapped, mapped_column

from oncelery.models.base import Base, BigId, Json


class ArticleScore(Base):
    """One scored article version, written through `effects()`; the run that generated it is UNIQUE."""

    __tablename__ = "article_scores"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    article_id: Mapped[str] = mapped_column(String(255), nullable=False)
    version: Mapped[int] = mapped_column(Integer, nullable=False)
    # The database barrier: a second write by the same run (or for the same version) is refused.
    generated_by_run_id: Mapped[int] = mapped_column(
        BigId, ForeignKey("task_runs.id", ondelete="RESTRICT"), nullable=False, unique=True
    )
    summary: Mapped[str] = mapped_column(Text, nullable=False)
    keywords: Mapped[Any] = mapped_column(Json, nullable=False)
    quality: Mapped[float] = mapped_column(Float, nullable=False)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()
    )

    __table_args__ = (UniqueConstraint("article_id", "version"),)


class LLMCall(Base):
    """One real model call (never a replay): the cost ledger, written even if the step never checkpoints."""

    __tablename__ = "llm_calls"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    task_name: Mapped[str | None] = mapped_column(String(255))
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    step: Mapped[str | None] = mapped_column(String(255))
    run_id: Mapped[int | None] = mapped_column(BigId)
    fencing_token: Mapped[int | None] = mapped_column(Integer)
    model: Mapped[str] = mapped_column(String(255), nullable=False)
    model_version: Mapped[str | None] = mapped_column(String(64))
    seed: Mapped[int | None] = mapped_column(BigId)
    temperature: Mapped[float] = mapped_column(Float, nullable=False)
    prompt_hash: Mapped[str] = mapped_column(String(64), nullable=False)
    input_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    output_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    latency_ms: Mapped[float] = mapped_column(Float, nullable=False)
    ok: Mapped[bool] = mapped_column(Boolean, nullable=False)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()
    )

    __table_args__ = (Index("ix_llm_calls_task_name_idempotency_key", "task_name", "idempotency_key"),)
