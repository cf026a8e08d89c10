"""SQLAlchemy models: the database is Oncelery's final deduplication barrier.

`oncelery.models` holds the framework's tables (`runs`, the cost ledger's `ledger`, the model calls'
write-ahead `intents`, and `totals`, the counts triggers keep for the metrics exporter); the demo jobs' tables
are in `oncelery.models.jobs`, on their own migration branch, so `oncelery db upgrade` never creates them in a
user's database.
"""

from oncelery.models.base import Base
from oncelery.models.batches import BatchState, ItemState, LlmBatch, LlmBatchItem, OnceleryLease
from oncelery.models.budgets import CapChange, LlmBudget, OperatorCap
from oncelery.models.debounce import DebounceRow
from oncelery.models.forks import Fork, ForkEffects
from oncelery.models.intents import IntentState, LlmIntent, LlmLimiter, RepeatReason
from oncelery.models.ledger import LedgerLabelTotal, LedgerTotal, ModelCall
from oncelery.models.runs import (
    DIGEST_KEY_SECRET,
    DeadLetter,
    DeliveryOutcome,
    EntityVersion,
    OutboxMessage,
    OutboxStatus,
    Outcome,
    RunStatus,
    Secret,
    StepResult,
    TaskRun,
)
from oncelery.models.totals import HistogramBucket, LetterTotal, RunStatusTotal

__all__ = [
    "DIGEST_KEY_SECRET",
    "Base",
    "BatchState",
    "CapChange",
    "DeadLetter",
    "DebounceRow",
    "DeliveryOutcome",
    "EntityVersion",
    "Fork",
    "ForkEffects",
    "HistogramBucket",
    "IntentState",
    "ItemState",
    "LedgerLabelTotal",
    "LedgerTotal",
    "LetterTotal",
    "LlmBatch",
    "LlmBatchItem",
    "LlmBudget",
    "LlmIntent",
    "LlmLimiter",
    "ModelCall",
    "OnceleryLease",
    "OperatorCap",
    "OutboxMessage",
    "OutboxStatus",
    "Outcome",
    "RepeatReason",
    "RunStatus",
    "RunStatusTotal",
    "Secret",
    "StepResult",
    "TaskRun",
]
