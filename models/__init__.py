"""SQLAlchemy models: the database is Oncelery's final deduplication barrier.

`oncelery.models` holds the framework's tables (`runs`, and the cost ledger's `ledger`); the demo jobs' tables
are in `oncelery.models.jobs`, on their own migration branch, so `oncelery db upgrade` never creates them in a
user's database.
"""

from oncelery.models.base import Base
from oncelery.models.ledger import LedgerTotal, ModelCall
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

__all__ = [
    "DIGEST_KEY_SECRET",
    "Base",
    "DeadLetter",
    "DeliveryOutcome",
    "EntityVersion",
    "LedgerTotal",
    "ModelCall",
    "OutboxMessage",
    "OutboxStatus",
    "Outcome",
    "RunStatus",
    "Secret",
    "StepResult",
    "TaskRun",
]
