"""Write-ahead call intents: one `llm_intents` row per model call, committed before any byte reaches the provider.

An intent is how a model call outlives the worker that made it. Its life:

    prepared --create answered--> sent --provider ended--> done | failed | cancelled
        |                           |
        |                           +--provider forgot it (404, retention)--> lost
        +--next holder finds it prepared (create window: never answered)--> lost, and a new attempt
    prepared | sent --its run ended (dead, revoked, superseded, stale)--> abandoned (--cancel answered--> cancelled)

Every end but `done` of an intent that may have been created (`prepared` or `sent`) writes its ledger row in the
same transaction, at the estimate kept here (`estimated_*`) unless the provider reported its usage, labelled, and
charges its budgets (oncelery.ledger.unknown): provider creates never exceed ledger rows.

`prepared` is committed durably (synchronous commit) before the create, `sent` records the provider's
reference fenced by the run's token, and `done` commits in the same transaction as the step's checkpoint and the
ledger row. No prompt and no answer are kept here: the request's digest only (the answer is the checkpoint).
"""

from __future__ import annotations

import enum
from datetime import datetime

from sqlalchemy import BigInteger, DateTime, Float, Index, Integer, String, Text, func
from sqlalchemy.orm import Mapped, mapped_column

from oncelery.models.base import Base, BigId, Json
from oncelery.models.runs import _enum


class IntentState(enum.Enum):
    """Where a model call is: prepared -> sent -> done | failed | lost | cancelled."""

    PREPARED = "prepared"  # committed, create maybe sent: the create window
    SENT = "sent"  # the provider answered the create: `reference` finds the call again
    DONE = "done"  # answered; the step's checkpoint and the ledger row committed with this state
    FAILED = "failed"  # the provider refused or failed it (a later attempt is a new intent)
    LOST = "lost"  # its outcome cannot be known (never answered, or forgotten by the provider)
    CANCELLED = "cancelled"
    # Its run ended (dead, revoked, superseded, stale) while the call was open: the outcome is unknown, and its
    # ledger row carries the estimate (migration 0026). A cancel that succeeds afterwards makes it `cancelled`.
    ABANDONED = "abandoned"

    @property
    def terminal(self) -> bool:
        """Return whether no more can happen to this call (a reservation on it can be released)."""
        return self not in (IntentState.PREPARED, IntentState.SENT)


class RepeatReason(enum.Enum):
    """Why a call had to be sent again (a new attempt of the same step), as the ledger labels it."""

    CREATE_WINDOW = "create_window"  # the last holder died between sending and saving the reference
    SYNC_UNKNOWN = "sync_unknown"  # a synchronous call whose holder died: the provider may have made it
    LOST = "lost"  # the provider no longer had the response (404 or past its retention)
    FAILED = "failed"  # the provider failed the earlier attempt
    CANCELLED = "cancelled"  # the earlier attempt was cancelled
    SUPERSEDED = "superseded"  # the earlier attempt ended but its step was re-run


class LlmIntent(Base):
    """One model call of one step attempt of one run (no foreign key: it outlives nothing its run does not)."""

    __tablename__ = "llm_intents"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    # What the provider sees in the request's metadata: opaque, never a key or a tenant.
    public_id: Mapped[str] = mapped_column(String(40), nullable=False, unique=True)
    run_id: Mapped[int] = mapped_column(BigId, nullable=False)
    position: Mapped[int] = mapped_column(Integer, nullable=False)
    step_name: Mapped[str] = mapped_column(String(255), nullable=False)
    attempt: Mapped[int] = mapped_column(Integer, nullable=False)
    token: Mapped[int] = mapped_column(Integer, nullable=False)  # the fencing token of the holder that prepared it
    provider: Mapped[str] = mapped_column(String(64), nullable=False)
    endpoint: Mapped[str] = mapped_column(String(64), nullable=False)
    model: Mapped[str] = mapped_column(String(255), nullable=False)
    mode: Mapped[str] = mapped_column(String(16), nullable=False)  # background | sync
    request_digest: Mapped[str] = mapped_column(String(64), nullable=False)
    state: Mapped[IntentState] = mapped_column(_enum(IntentState, "intent_state"), nullable=False)
    reference: Mapped[str | None] = mapped_column(String(255))
    cursor: Mapped[int | None] = mapped_column(Integer)
    repeat_reason: Mapped[RepeatReason | None] = mapped_column(_enum(RepeatReason, "repeat_reason"))
    # How long the provider keeps the response for polling (None: not retrievable); past it, "at risk".
    retention_s: Mapped[float | None] = mapped_column(Float)
    prepared_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()
    )
    sent_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    input_tokens: Mapped[int | None] = mapped_column(Integer)
    output_tokens: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    # What the shared limiters admitted for this call ({limiter name: cost}, 0017): settlement gives back the
    # unused part in the transaction that ends the intent, whichever holder ends it.
    admitted: Mapped[dict[str, int] | None] = mapped_column(Json)
    # What the call reserved in the budgets ({"budgets": {name: micros}, "price": [in, out]}, 0018), and when that
    # reservation was released (once: by the intent's end, or by the sweeper for one left prepared too long).
    reserved: Mapped[dict[str, object] | None] = mapped_column(Json)
    released_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # What the call may cost, kept when it is prepared (0026): its input's conservative token estimate, its output
    # limit, and that usage's price in micro-USD (None: no price). An unknown outcome's ledger row is written from
    # these wherever the intent ends (a dead run, a sweep), with no request and no price table at hand.
    estimated_input_tokens: Mapped[int | None] = mapped_column(Integer)
    estimated_output_tokens: Mapped[int | None] = mapped_column(Integer)
    estimated_cost_micros: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (
        # One row per attempt of a step: the next holder finds the latest by (run, position).
        Index("ix_llm_intents_run_id_position_attempt", "run_id", "position", "attempt", unique=True),
        # Calls still open (prepared or sent), for `oncelery llm` and the at-risk report.
        Index("ix_llm_intents_state", "state"),
    )


class LlmLimiter(Base):
    """One shared limiter (a provider:model, tenant or task, and a kind): its GCRA state on the database clock."""

    __tablename__ = "llm_limiters"

    name: Mapped[str] = mapped_column(String(320), primary_key=True)  # "<scope>/<kind>", e.g. openai:gpt-x/tpm
    # Theoretical arrival time, epoch seconds by the database clock: the moment the admitted work is paid off.
    tat: Mapped[float] = mapped_column(Float, nullable=False, server_default="0")
    seconds_per_unit: Mapped[float] = mapped_column(Float, nullable=False)  # 60 / the per-minute limit
    tau_s: Mapped[float] = mapped_column(Float, nullable=False, server_default="0")  # the burst tolerance
    factor: Mapped[float] = mapped_column(Float, nullable=False, server_default="1")  # AIMD capacity in (0.1, 1]
    admitted: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    throttled_local: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    throttled_provider: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    # An operator's cap (`oncelery limits set`, 0018): seconds per unit that win over the configuration's.
    capped_spu: Mapped[float | None] = mapped_column(Float)
