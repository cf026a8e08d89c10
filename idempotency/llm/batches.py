"""A batch step: the model call is parked as an item of a provider batch (about half the price), and its run
waits WAITING without a worker slot until the batcher's poller applies its result and wakes it.

    self.llm("score", model=..., input=..., max_output_tokens=..., mode="batch",
             batch=BatchPolicy(max_items=1000, max_wait_s=60, fallback_after_s=3600))

What the step's latest intent (mode "batch", state `sent`, reference = its item's `custom_id`) and its item say:

    | item       | what the step does                                                             | calls |
    |------------|--------------------------------------------------------------------------------|-------|
    | none       | queue: the intent and the item (with the full request) in one fenced transaction | 0     |
    | queued     | park again; past `fallback_after_s`, never submitted: a background call instead  | 0 / 1 |
    | claimed /  | park again (in a batch: a fallback would be a labelled repeat, so it waits)     | 0     |
    | submitted  |                                                                                |       |
    | done       | the checkpoint, the intent's end and the ledger row (batch price) in one        | 0     |
    |            | transaction; the item's request and response are cleared                       |       |
    | failed     | the intent ends failed: the step fails through the normal retry path           | 0     |

Items are grouped by (provider, model, endpoint, policy): items with different policies never share a batch.
The batcher and the poller run in `oncelery relay` (oncelery.relay.batcher).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, select, update

from oncelery.errors import ConfigurationError
from oncelery.llm.budgets import BudgetPlan, reserve_txn
from oncelery.llm.intents import Intent, fenced_write
from oncelery.models.batches import ItemState
from oncelery.models.intents import IntentState, RepeatReason
from oncelery.runs.claims import RunStore
from oncelery.runs.decisions import Claim
from oncelery.store.tables import BATCH_ITEMS, INTENTS

__all__ = [
    "BatchItem",
    "BatchPolicy",
    "batch_url",
    "clear_item_txn",
    "fall_back",
    "group_key",
    "queue_item",
    "read_item",
    "seconds_since",
]

# Where a synchronous adapter's calls go in a batch: OpenAI's `url` of each line of its input file; Anthropic's and
# Gemini's requests go inline (Gemini's batch method is named after the model: `models/{model}:...`).
_BATCH_URLS = {
    "responses": "/v1/responses",
    "chat.completions": "/v1/chat/completions",
    "messages": "/v1/messages",
    "generateContent": "/v1beta/models/{model}:batchGenerateContent",
}


@dataclass(frozen=True)
class BatchPolicy:
    """How a batch step's items are pooled: up to `max_items` per batch, sent when the oldest waited `max_wait_s`;
    an item never submitted after `fallback_after_s` becomes a background call (None: it waits for a batch)."""

    max_items: int = 1000
    max_wait_s: float = 60.0
    fallback_after_s: float | None = None
    max_attempts: int = 3  # an item the provider failed is re-queued this many times, then its step fails

    def check(self, where: str) -> BatchPolicy:
        """Return this policy, or raise ConfigurationError naming the bad field."""
        if isinstance(self.max_items, bool) or not isinstance(self.max_items, int) or not 1 <= self.max_items <= 50_000:
            raise ConfigurationError(f"{where}: BatchPolicy(max_items={self.max_items!r}): give 1..50000")
        if not isinstance(self.max_wait_s, int | float) or self.max_wait_s < 0:
            raise ConfigurationError(f"{where}: BatchPolicy(max_wait_s={self.max_wait_s!r}): give seconds >= 0")
        if self.fallback_after_s is not None and (
            not isinstance(self.fallback_after_s, int | float) or self.fallback_after_s <= 0
        ):
            raise ConfigurationError(f"{where}: BatchPolicy(fallback_after_s={self.fallback_after_s!r}): seconds > 0")
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ConfigurationError(f"{where}: BatchPolicy(max_attempts={self.max_attempts!r}): give an int >= 1")
        return self


@dataclass(frozen=True)
class BatchItem:
    """One parked call as its step reads it back."""

    custom_id: str
    state: ItemState
    response: Mapping[str, Any] | None
    error: str | None
    queued_at: float
    fallback_after_s: float | None


def batch_url(endpoint: str) -> str:
    """The batch line `url` of a synchronous adapter's endpoint, or ConfigurationError (no batch for it)."""
    url = _BATCH_URLS.get(endpoint)
    if url is None:
        raise ConfigurationError(f"mode='batch' has no batch endpoint for {endpoint!r}: use {', '.join(_BATCH_URLS)}")
    return url


def group_key(provider: str, model: str, endpoint: str, policy: BatchPolicy) -> str:
    """The key items are pooled by: the same provider, model, endpoint and policy share batches, others never."""
    fallback = "-" if policy.fallback_after_s is None else f"{policy.fallback_after_s:g}"
    return f"{provider}|{model}|{endpoint}|{policy.max_items}|{policy.max_wait_s:g}|{fallback}|{policy.max_attempts}"


def queue_item(
    store: RunStore,
    claim: Claim,
    *,
    position: int,
    step_name: str,
    row: Mapping[str, Any],
    request: Mapping[str, Any],
    policy: BatchPolicy,
    supersedes: Intent | None,
    reason: RepeatReason | None,
    budget: tuple[BudgetPlan, int] | None,
) -> Intent:
    """Commit the step's intent (`sent`: its reference is the item) and its queued item, with the budgets'
    reservation at the batch price, in one fenced transaction; nothing reaches the provider here."""
    attempt = 1 if supersedes is None else supersedes.attempt + 1
    public_id = uuid.uuid4().hex
    dialect = store.db.dialect
    reserved: list[dict[str, Any] | None] = [None]
    key = group_key(str(row["provider"]), str(row["model"]), str(row["endpoint"]), policy)

    def write(conn: Connection) -> None:
        if budget is not None and budget[0].active:
            reserved[0] = reserve_txn(conn, dialect, budget[0], claim.tenant, claim.run_id, budget[1]).as_json()
        now = float(conn.execute(select(dialect.epoch())).scalar_one())
        conn.execute(
            INTENTS.insert().values(
                public_id=public_id, run_id=claim.run_id, position=position, step_name=step_name, attempt=attempt,
                token=claim.token, state=IntentState.SENT, repeat_reason=reason, prepared_at=dialect.now(),
                sent_at=dialect.now(), reference=public_id, reserved=reserved[0], **row,
            )
        )  # fmt: skip
        conn.execute(
            BATCH_ITEMS.insert().values(
                custom_id=public_id, run_id=claim.run_id, position=position, provider=row["provider"],
                model=row["model"], endpoint=row["endpoint"], group_key=key, max_items=policy.max_items,
                max_wait_s=float(policy.max_wait_s), fallback_after_s=policy.fallback_after_s,
                state=ItemState.QUEUED, request=dict(request), queued_at=now,
            )
        )  # fmt: skip

    fenced_write(store, claim, f"the batch item of step {step_name!r} was not queued", write)
    return Intent(
        0, public_id, attempt, claim.token, "batch", str(row["request_digest"]), IntentState.SENT, public_id, None,
        reason, None, reserved[0], str(row["endpoint"]),
    )  # fmt: skip


def read_item(store: RunStore, custom_id: str) -> BatchItem | None:
    """The step's item (None: it was consumed, or never queued)."""
    b = BATCH_ITEMS.c
    with store.db.read() as conn:
        row = conn.execute(
            select(b.custom_id, b.state, b.response, b.error, b.queued_at, b.fallback_after_s).where(
                b.custom_id == custom_id
            )
        ).first()
    return None if row is None else BatchItem(*row)


def clear_item_txn(conn: Connection, custom_id: str) -> None:
    """Forget the item's request and response (its step's checkpoint now holds the answer)."""
    b = BATCH_ITEMS.c
    conn.execute(update(BATCH_ITEMS).where(b.custom_id == custom_id).values(request=None, response=None))


def fall_back(store: RunStore, custom_id: str) -> bool:
    """Take a queued item out of batching (never submitted: nothing runs at the provider); return whether it was
    still queued. An item already claimed into a batch stays there: a cancel applies to a whole batch."""
    b = BATCH_ITEMS.c
    with store.db.begin() as conn:
        moved = conn.execute(
            update(BATCH_ITEMS)
            .where(b.custom_id == custom_id, b.state == ItemState.QUEUED)
            .values(state=ItemState.FALLBACK, request=None)
        )
    return moved.rowcount == 1


def seconds_since(store: RunStore, epoch: float) -> float:
    """Seconds since `epoch` on the database clock."""
    with store.db.read() as conn:
        return float(conn.execute(select(store.db.dialect.epoch())).scalar_one()) - epoch
