"""SQLAlchemy models: the database is Oncelery's final deduplication barrier."""

from models.base import Base
from models.runs import DeliveryOutcome, Outcome, RunStatus, StepResult, TaskRun

__all__ = ["Base", "DeliveryOutcome", "Outcome", "RunStatus", "StepResult", "TaskRun"]
