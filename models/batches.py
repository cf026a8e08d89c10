"""Batch steps: one row per provider batch, one per batch item (a parked model call), and the batcher's lease.

A step called with `mode="batch"` writes its intent (state `sent`, reference = the item's `custom_id`) and a
`queued` item holding its full request, then parks its run WAITING. The batcher (in `oncelery relay`, single
flight by the `batcher` lease on the database clock) claims queued items of one group into a batch row whose id
is derived from its items, uploads them, creates the provider batch tagged with that id, and saves the
provider's ids, each write fenced by its lease. The poller applies each result line once, by `custom_id`, and
wakes the item's run; the woken run's step finds its item done and writes the checkpoint, the intent's end and
the ledger row (at the batch price) in one transaction, clearing the item's request and response.

The item's request (and, until the run applies it, its response) is the one place a prompt is kept at rest
(docs/privacy.md); `oncelery batches` redacts it.
"""

from __future__ import annotations

import enum
from datetime import datetime

from sqlalchemy import DateTime, Float, Index, Integer, String, Text, func
from sqlalchemy.orm import Mapped, mapped_column

from oncelery.models.base import Base, BigId, Json
from oncelery.models.runs import _enum


class BatchState(enum.Enum):
    """Where a batch is: claimed -> uploaded -> submitted -> ended (or failed: never submitted, items re-queued)."""

    CLAIMED = "claimed"  # its items are claimed under it; nothing uploaded yet (as far as the row knows)
    UPLOADED = "uploaded"  # its input file is at the provider (file_id saved)
    SUBMITTED = "submitted"  # the provider's batch exists (provider_batch_id saved)
    ENDED = "ended"  # every result line applied (done, failed or re-queued)
    FAILED = "failed"  # the provider refused the batch (4xx): its items failed, their steps fail


class ItemState(enum.Enum):
    """Where one parked call is: queued -> claimed -> submitted -> done | failed (or fallback, or cancelled)."""

    QUEUED = "queued"
    CLAIMED = "claimed"
    SUBMITTED = "submitted"
    DONE = "done"  # its result line is applied (response kept until its run's step consumes it)
    FAILED = "failed"  # failed past the re-queue limit: its step fails through the normal retry path
    FALLBACK = "fallback"  # never submitted, past fallback_after_s: its step makes a background call instead
    CANCELLED = "cancelled"


class LlmBatch(Base):
    """One provider batch (its id is derived from its items: the tag that finds it again after a crash)."""

    __tablename__ = "llm_batches"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    provider: Mapped[str] = mapped_column(String(64), nullable=False)
    model: Mapped[str] = mapped_column(String(255), nullable=False)
    endpoint: Mapped[str] = mapped_column(String(64), nullable=False)
    group_key: Mapped[str] = mapped_column(String(400), nullable=False)
    state: Mapped[BatchState] = mapped_column(_enum(BatchState, "batch_state"), nullable=False)
    items: Mapped[int] = mapped_column(Integer, nullable=False)
    file_id: Mapped[str | None] = mapped_column(String(255))
    provider_batch_id: Mapped[str | None] = mapped_column(String(255))
    provider_status: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()
    )
    submitted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    next_poll_at: Mapped[float | None] = mapped_column(Float)  # epoch seconds, database clock
    polls: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    error: Mapped[str | None] = mapped_column(Text)
    # Anthropic only, after a create repeated past the untagged search bound (0021): the provider batches that
    # were running then and may run these requests too, until each has ended (oncelery.relay.batcher.Suspects:
    # `watched`, `items`, `applied`, `duplicates`, `others`). NULL: the create was never repeated.
    suspects: Mapped[dict[str, object] | None] = mapped_column(Json)

    __table_args__ = (Index("ix_llm_batches_state", "state"),)


class LlmBatchItem(Base):
    """One parked model call: its request until uploaded and applied, its result until its run consumes it."""

    __tablename__ = "llm_batch_items"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    custom_id: Mapped[str] = mapped_column(String(64), nullable=False, unique=True)  # its intent's public id
    run_id: Mapped[int] = mapped_column(BigId, nullable=False)
    position: Mapped[int] = mapped_column(Integer, nullable=False)
    provider: Mapped[str] = mapped_column(String(64), nullable=False)
    model: Mapped[str] = mapped_column(String(255), nullable=False)
    endpoint: Mapped[str] = mapped_column(String(64), nullable=False)
    # (provider, model, endpoint, policy): items with different policies never share a batch.
    group_key: Mapped[str] = mapped_column(String(400), nullable=False)
    max_items: Mapped[int] = mapped_column(Integer, nullable=False)
    max_wait_s: Mapped[float] = mapped_column(Float, nullable=False)
    fallback_after_s: Mapped[float | None] = mapped_column(Float)
    state: Mapped[ItemState] = mapped_column(_enum(ItemState, "batch_item_state"), nullable=False)
    batch_id: Mapped[str | None] = mapped_column(String(64))
    request: Mapped[dict[str, object] | None] = mapped_column(Json)
    response: Mapped[dict[str, object] | None] = mapped_column(Json)
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    error: Mapped[str | None] = mapped_column(Text)
    queued_at: Mapped[float] = mapped_column(Float, nullable=False)  # epoch seconds, database clock
    done_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        Index("ix_llm_batch_items_state_group_key", "state", "group_key"),
        Index("ix_llm_batch_items_batch_id", "batch_id"),
    )


class OnceleryLease(Base):
    """A named single-flight lease on the database clock (the batcher's): one holder at a time, fenced."""

    __tablename__ = "oncelery_leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(128), nullable=False)
    token: Mapped[int] = mapped_column(Integer, nullable=False)
    expires_at: Mapped[float] = mapped_column(Float, nullable=False)  # epoch seconds, database clock
