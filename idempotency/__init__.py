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
    "StepMismatch",
    "StoreError",
    "StoreUnavailable",
]
