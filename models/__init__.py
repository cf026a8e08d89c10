"""SQLAlchemy models: the database is Oncelery's final deduplication barrier.

`oncelery.models` holds the framework's tables (`runs`); the demo jobs' tables are in `oncelery.models.jobs`,
on their own migration branch, so `oncelery db upgrade` never creates them in a user's database.
"""

from oncelery.models.base import Base
from oncelery.models.runs import DeliveryOutcome, Outcome, RunStatus, StepResult, TaskRun

__all__ = ["Base", "DeliveryOutcome", "Outcome", "RunStatus", "StepResult", "TaskRun"]
