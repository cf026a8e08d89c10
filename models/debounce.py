"""Debounce rows: one row per (task, tenant, debounce key), the pending burst of edits a dispatcher sends once.

A producer's `.delay()` of a debounced task upserts its row (a new sequence number, the latest arguments, a due
time on the database clock capped by the burst's `max_wait`) instead of publishing. The relay's dispatcher sends
a due row's latest arguments through the outbox under the burst's Celery task id, with its sequence in a header;
a delivery whose sequence is older than the row's is acked as `debounced`.

Pending while `seq > dispatched_seq`. The arguments are payload at rest: kept only while the burst is pending
(cleared when it is dispatched into the outbox), and dispatched rows are deleted by retention.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, CheckConstraint, DateTime, Index, String, func, text
from sqlalchemy.orm import Mapped, mapped_column

from oncelery.models.base import Base, Json


class DebounceRow(Base):
    """The latest edit of one debounce key: its sequence, arguments (while pending) and wake time."""

    __tablename__ = "oncelery_debounce"

    task_name: Mapped[str] = mapped_column(String(255), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(255), primary_key=True, default="", server_default="")
    debounce_key: Mapped[str] = mapped_column(String(255), primary_key=True)
    # One more per edit (the producer's upsert); never goes back, so an older message is recognised as such.
    seq: Mapped[int] = mapped_column(BigInteger, nullable=False)
    # The sequence last sent through the outbox: the burst is pending while seq > dispatched_seq.
    dispatched_seq: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    # The Celery task id of the pending burst's run, chosen at the burst's first edit: every .delay() of the
    # burst returns AsyncResult(task_id), and the dispatcher publishes under it.
    task_id: Mapped[str] = mapped_column(String(255), nullable=False)
    # The idempotency key of the latest edit (migration 0026; NULL in rows written before it): a run in flight is
    # superseded only by a newer edit of another key, and a later edit of a superseded run's key runs it again.
    # Kept after dispatch, as a run keeps its key: it is what a run in flight is compared with.
    edit_key: Mapped[str | None] = mapped_column(String(255), nullable=True)
    # The latest edit's arguments and call headers (key, tenant, lease...): NULL once dispatched (the outbox row
    # then holds them), so a burst's payload is at rest only while it waits.
    args: Mapped[Any] = mapped_column(Json, nullable=True)
    kwargs: Mapped[Any] = mapped_column(Json, nullable=True)
    headers: Mapped[Any] = mapped_column(Json, nullable=True)
    # Database clock: the burst's first edit, its wake time (last edit + period, capped) and its cap
    # (first edit + max_wait).
    burst_started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    due_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    deadline_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    dispatched_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()
    )

    __table_args__ = (
        CheckConstraint("seq >= dispatched_seq", name="seq_not_behind"),
        # The dispatcher's scan: pending rows by wake time (tiny: only the bursts waiting right now).
        Index(
            "ix_oncelery_debounce_pending_due",
            "due_at",
            postgresql_where=text("seq > dispatched_seq"),
            sqlite_where=text("seq > dispatched_seq"),
        ),
    )
