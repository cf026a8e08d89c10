"""Oncelery: exactly-once effects for Celery tasks (claims, leases, fencing, step checkpoints).

This module is the public surface: everything a user (and Oncelery's own jobs in `oncelery.tasks`) imports,
grouped by concern below. `oncelery.errors`, `oncelery.settings`, `oncelery.outbox`, `oncelery.cli` and
`oncelery.testing` are public too; every subpackage (task, delivery, runs, store, ops) is an implementation detail.
"""

from oncelery import outbox
from oncelery.basetask.caller import outcome_of
from oncelery.basetask.debounce import DebouncedResult
from oncelery.basetask.idempotent import IdempotentTask
from oncelery.basetask.metering import MeteredCall, model_call, price_of
from oncelery.basetask.pipeline import pipeline
from oncelery.basetask.producer import ProducerReplay
from oncelery.delivery.steps import StepInfo, current_step, step_seed
from oncelery.embedded_broker import is_embedded_broker
from oncelery.errors import (
    ClaimError,
    ConfigurationError,
    ForkRefused,
    IdempotencyConflict,
    InProgress,
    InvalidKey,
    LeaseLost,
    ModelCallNotBudgeted,
    OnceleryError,
    PayloadError,
    PayloadNotJSON,
    PayloadTooLarge,
    ResultNotJSON,
    RunIsDead,
    SchemaMissing,
    StaleVersion,
    StepMismatch,
    StoreError,
    StoreUnavailable,
)
from oncelery.fake_provider import FakeProvider
from oncelery.ledger.prices import Price
from oncelery.llm.adapters.anthropic_messages import AnthropicMessages
from oncelery.llm.adapters.base import output_text
from oncelery.llm.adapters.batch import AnthropicBatches, GeminiBatches, OpenAIBatches
from oncelery.llm.adapters.gemini_generate import GeminiGenerateContent
from oncelery.llm.adapters.openai_chat import OpenAIChat
from oncelery.llm.adapters.openai_responses import OpenAIResponses
from oncelery.llm.batches import BatchPolicy
from oncelery.llm.errors import (
    BudgetExceeded,
    CallOutcomeUnknown,
    ProviderCallFailed,
    ProviderError,
    ProviderRateLimited,
    ProviderRejected,
    ProviderUnavailable,
    ResponseGone,
    ResponseLost,
)
from oncelery.models import Outcome, RunStatus
from oncelery.ops.costs import BatchSavings, CostLine, CostReport, Spend, batch_savings, cost_report
from oncelery.ops.dead_letters import DeadLetters, LetterView, ReplayReport
from oncelery.ops.fork import ForkHandle, fork_run, preview_fork
from oncelery.ops.fork_cohort import CohortPlan, fork_cohort
from oncelery.ops.fork_preview import ForkPreview, StepDiff, fork_diff
from oncelery.relay.loop import Relay, RelayRound, install_relay_task
from oncelery.relay.retention import PurgeReport, parse_age, purge
from oncelery.runs.debounce import Debounce
from oncelery.runs.kept import redact_arguments
from oncelery.runs.keys import Identity, differing_fields
from oncelery.runs.views import Runs, RunView, StepView
from oncelery.settings import (
    CELERY_DELIVERY_DEFAULTS,
    ENV_DATABASE_URL,
    WAIT_BACKOFF_CAP,
    configured_database_url,
    data_dir,
    embedded_database_url,
    require_database_url,
)
from oncelery.store.database import Database
from oncelery.store.schema import check_schema, schema_revision, upgrade_schema

__all__ = [
    # Tasks: the base class, its body API, pipelines
    "IdempotentTask",
    "ProducerReplay",
    "StepInfo",
    "current_step",
    "pipeline",
    "step_seed",
    # Keys and outcomes
    "Identity",
    "Outcome",
    "RunStatus",
    "differing_fields",
    "outcome_of",
    # Errors
    "ClaimError",
    "ConfigurationError",
    "ForkRefused",
    "IdempotencyConflict",
    "InProgress",
    "InvalidKey",
    "LeaseLost",
    "OnceleryError",
    "PayloadError",
    "PayloadNotJSON",
    "PayloadTooLarge",
    "ResultNotJSON",
    "RunIsDead",
    "SchemaMissing",
    "StaleVersion",
    "StepMismatch",
    "StoreError",
    "StoreUnavailable",
    # Configuration and the claims database
    "CELERY_DELIVERY_DEFAULTS",
    "ENV_DATABASE_URL",
    "WAIT_BACKOFF_CAP",
    "Database",
    "check_schema",
    "configured_database_url",
    "data_dir",
    "embedded_database_url",
    "is_embedded_broker",
    "require_database_url",
    "schema_revision",
    "upgrade_schema",
    # Reading runs
    "RunView",
    "Runs",
    "StepView",
    # The outbox and its relay
    "Relay",
    "RelayRound",
    "install_relay_task",
    "outbox",
    # Operations: dead letters, retention
    "DeadLetters",
    "LetterView",
    "PurgeReport",
    "ReplayReport",
    "parse_age",
    "purge",
    # Model calls and their costs
    "CostLine",
    "CostReport",
    "MeteredCall",
    "ModelCallNotBudgeted",
    "Price",
    "Spend",
    "batch_savings",
    "cost_report",
    "model_call",
    "price_of",
    # Model calls as durable steps (self.llm): provider adapters, the fake provider, their errors
    "AnthropicBatches",
    "AnthropicMessages",
    "BatchPolicy",
    "BatchSavings",
    "BudgetExceeded",
    "CallOutcomeUnknown",
    "FakeProvider",
    "GeminiBatches",
    "GeminiGenerateContent",
    "OpenAIBatches",
    "OpenAIChat",
    "OpenAIResponses",
    "ProviderCallFailed",
    "ProviderError",
    "ProviderRateLimited",
    "ProviderRejected",
    "ProviderUnavailable",
    "ResponseGone",
    "ResponseLost",
    "output_text",
    # Forks: a past run again from step N, with another model or prompt (docs/fork.md); kept arguments
    "CohortPlan",
    "ForkHandle",
    "ForkPreview",
    "StepDiff",
    "fork_cohort",
    "fork_diff",
    "fork_run",
    "preview_fork",
    "redact_arguments",
    # Debounce: a burst of edits of one key makes one run, on the latest (docs/debounce.md)
    "Debounce",
    "DebouncedResult",
]
