"""The framework's tables as SQLAlchemy Core handles, and the column groups the claim SQL is built from."""

from __future__ import annotations

from typing import cast

from sqlalchemy import Table

from oncelery.models import (
    CapChange,
    DeadLetter,
    DebounceRow,
    DeliveryOutcome,
    EntityVersion,
    Fork,
    HistogramBucket,
    LedgerLabelTotal,
    LedgerTotal,
    LetterTotal,
    LlmBatch,
    LlmBatchItem,
    LlmBudget,
    LlmIntent,
    LlmLimiter,
    ModelCall,
    OnceleryLease,
    OperatorCap,
    OutboxMessage,
    RunStatusTotal,
    Secret,
    StepResult,
    TaskRun,
)

__all__ = [
    "BATCHES",
    "BATCH_ITEMS",
    "BUDGETS",
    "CALLS",
    "CAPS",
    "CAP_CHANGES",
    "DEBOUNCE",
    "FORKS",
    "HISTOGRAM_BUCKETS",
    "INTENTS",
    "LABEL_TOTALS",
    "LEASES",
    "LETTERS",
    "LETTER_TOTALS",
    "LIMITERS",
    "OUTBOX",
    "OUTCOMES",
    "OUTCOME_KEY",
    "OUTCOME_SHARDS",
    "OUTCOME_TOTALS",
    "RUNS",
    "RUN_STATUS_TOTALS",
    "RUN_VIEW_COLUMNS",
    "SAVED_FROM",
    "SECRETS",
    "STEPS",
    "TOTALS",
    "VERSIONS",
]

RUNS = cast(Table, TaskRun.__table__)
OUTCOMES = cast(Table, DeliveryOutcome.__table__)
LETTERS = cast(Table, DeadLetter.__table__)
VERSIONS = cast(Table, EntityVersion.__table__)
OUTBOX = cast(Table, OutboxMessage.__table__)
STEPS = cast(Table, StepResult.__table__)
SECRETS = cast(Table, Secret.__table__)
# The cost ledger: one row per model call, and running totals per (task, tenant, model).
CALLS = cast(Table, ModelCall.__table__)
TOTALS = cast(Table, LedgerTotal.__table__)
# Labelled calls (repeated by reason, of unknown outcome, re-attached) per (task, tenant, model, label).
LABEL_TOTALS = cast(Table, LedgerLabelTotal.__table__)
# Write-ahead model-call intents (oncelery.llm): one row per call, before the call.
INTENTS = cast(Table, LlmIntent.__table__)
LIMITERS = cast(Table, LlmLimiter.__table__)
# Batch steps (models/batches.py): provider batches, their items (parked calls), the batcher's lease.
BATCHES = cast(Table, LlmBatch.__table__)
BATCH_ITEMS = cast(Table, LlmBatchItem.__table__)
LEASES = cast(Table, OnceleryLease.__table__)
# Budgets (spent + reserved <= limit, a CHECK), the caps an operator set, and every change of one.
BUDGETS = cast(Table, LlmBudget.__table__)
CAPS = cast(Table, OperatorCap.__table__)
CAP_CHANGES = cast(Table, CapChange.__table__)
# Debounce rows (models/debounce.py): the pending burst of edits per debounce key.
DEBOUNCE = cast(Table, DebounceRow.__table__)
# Forks of past runs (ops/fork.py): where each came from, its overrides and its effects mode.
FORKS = cast(Table, Fork.__table__)
# Kept by triggers (models/totals.py): runs FAILED/DEAD and dead letters, per task.
RUN_STATUS_TOTALS = cast(Table, RunStatusTotal.__table__)
LETTER_TOTALS = cast(Table, LetterTotal.__table__)
# Bucket counters of the exported histograms (models/totals.py: triggers, and the waits runs/waits.py writes).
HISTOGRAM_BUCKETS = cast(Table, HistogramBucket.__table__)
OUTCOME_SHARDS = 16  # counter rows per (task, outcome): concurrent completions rarely wait on one row
OUTCOME_KEY = ["task_name", "tenant", "outcome", "shard"]
# Running totals each counted delivery adds to its counter row (models.runs.DeliveryOutcome says which).
OUTCOME_TOTALS = (
    "steps_executed",
    "steps_replayed",
    "takeovers",
    "saved_calls",
    "saved_input_tokens",
    "saved_output_tokens",
    "saved_cost_micros",
    "at_producer",
)
# The task_runs columns a RunView (oncelery.runs) is made of.
RUN_VIEW_COLUMNS = (
    "id",
    "task_name",
    "tenant",
    "idempotency_key",
    "fingerprint",
    "field_digests",
    "status",
    "fencing_token",
    "owner",
    "attempts",
    "result",
    "error",
    "lease_expires_at",
    "concurrency_key",
    "celery_task_id",
    "message",
    "created_at",
    "updated_at",
    "finished_at",
    "retries",
    "not_before",
    "lost",
    "replays",
)
# What a replay saved: the replayed run's ok model calls, tokens and micro-USD.
SAVED_FROM = {
    "saved_calls": "llm_calls",
    "saved_input_tokens": "llm_input_tokens",
    "saved_output_tokens": "llm_output_tokens",
    "saved_cost_micros": "llm_cost_micros",
}
