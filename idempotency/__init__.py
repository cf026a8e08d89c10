"""Oncelery's framework: exactly-once effects for Celery tasks (claims, leases, fencing, results)."""

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
    SchemaMissing,
    StepMismatch,
    StoreError,
    StoreUnavailable,
)
from oncelery.pipeline import pipeline
from oncelery.steps import StepInfo, current_step, step_seed
from oncelery.task import IdempotentTask

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
