"""Oncelery: exactly-once effects for Celery tasks (claims, leases, fencing, step checkpoints).

This module is the public surface: everything a user (and Oncelery's own jobs in `oncelery.tasks`) imports.
Every other module of the package is an implementation detail.
"""

from oncelery import outbox
from oncelery import startup as _startup  # noqa: F401  (registers the worker's startup check)
from oncelery.caller import outcome_of
from oncelery.costs import CostLine, CostReport, Spend, cost_report
from oncelery.deadletters import DeadLetters, LetterView, ReplayReport
from oncelery.embedded_broker import is_embedded_broker
from oncelery.errors import (
    ClaimError,
    ConfigurationError,
    IdempotencyConflict,
    InProgress,
    InvalidKey,
    LeaseLost,
    OnceleryError,
    PayloadNotJSON,
    ResultNotJSON,
    RunIsDead,
    SchemaMissing,
    StaleVersion,
    StepMismatch,
    StoreError,
    StoreUnavailable,
)
from oncelery.keys import Identity, differing_fields
from oncelery.ledger import MeteredCall, Price, model_call, price_of
from oncelery.models import Outcome, RunStatus
from oncelery.pipeline import pipeline
from oncelery.relay import Relay, RelayRound, install_relay_task
from oncelery.retention import PurgeReport, parse_age, purge
from oncelery.runs import Runs, RunView, StepView
from oncelery.schema import check_schema, schema_revision, upgrade_schema
from oncelery.settings import (
    CELERY_DELIVERY_DEFAULTS,
    ENV_DATABASE_URL,
    WAIT_BACKOFF_CAP,
    configured_database_url,
    data_dir,
    embedded_database_url,
    require_database_url,
)
from oncelery.steps import StepInfo, current_step, step_seed
from oncelery.store import Database
from oncelery.task import IdempotentTask

__all__ = [
    "CELERY_DELIVERY_DEFAULTS",
    "ENV_DATABASE_URL",
    "WAIT_BACKOFF_CAP",
    "ClaimError",
    "ConfigurationError",
    "CostLine",
    "CostReport",
    "Database",
    "DeadLetters",
    "IdempotencyConflict",
    "IdempotentTask",
    "Identity",
    "InProgress",
    "InvalidKey",
    "LeaseLost",
    "LetterView",
    "MeteredCall",
    "OnceleryError",
    "Outcome",
    "PayloadNotJSON",
    "Price",
    "PurgeReport",
    "Relay",
    "RelayRound",
    "ReplayReport",
    "ResultNotJSON",
    "RunIsDead",
    "RunStatus",
    "RunView",
    "Runs",
    "SchemaMissing",
    "Spend",
    "StaleVersion",
    "StepInfo",
    "StepMismatch",
    "StepView",
    "StoreError",
    "StoreUnavailable",
    "check_schema",
    "configured_database_url",
    "cost_report",
    "current_step",
    "data_dir",
    "differing_fields",
    "embedded_database_url",
    "install_relay_task",
    "is_embedded_broker",
    "model_call",
    "outbox",
    "outcome_of",
    "parse_age",
    "pipeline",
    "price_of",
    "purge",
    "require_database_url",
    "schema_revision",
    "step_seed",
    "upgrade_schema",
]
