"""Tables of the demo AI jobs (oncelery.tasks): article scores, on their own migration branch.

Their model calls go to the framework's cost ledger (`model_calls`, `oncelery.model_call`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import DateTime, Float, ForeignKey, Integer, String, Text, UniqueConstraint, func
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
