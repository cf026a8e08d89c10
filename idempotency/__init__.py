"""Oncelery's framework: exactly-once effects for Celery tasks (claims, leases, fencing, results)."""

from idempotency.errors import (
    ClaimError,
    ConfigurationError,
    IdempotencyConflict,
    InProgress,
    InvalidKey,
    LeaseLost,
    OnceleryError,
    PayloadNotJSON,
    ResultNotJSON,
    SchemaMissing,
    StepMismatch,
    StoreError,
    StoreUnavailable,
)
from idempotency.pipeline import pipeline
from idempotency.steps import StepInfo, current_step, step_seed
from idempotency.task import IdempotentTask

__all__ = [
    "ClaimError",
    "ConfigurationError",
    "IdempotencyConflict",
    "IdempotentTask",
    "InProgress",
    "InvalidKey",
    "LeaseLost",
    "OnceleryError",
    "PayloadNotJSON",
    "ResultNotJSON",
    "SchemaMissing",
    "StepInfo",
    "StepMismatch",
    "StoreError",
    "StoreUnavailable",
    "current_step",
    "pipeline",
    "step_seed",
]
