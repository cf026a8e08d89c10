"""SQLAlchemy models: the database is Oncelery's final deduplication barrier."""

from oncelery.models.ai import ArticleScore, LLMCall
from oncelery.models.base import Base
from oncelery.models.runs import DeliveryOutcome, Outcome, RunStatus, StepResult, TaskRun

__all__ = ["ArticleScore", "Base", "DeliveryOutcome", "LLMCall", "Outcome", "RunStatus", "StepResult", "TaskRun"]
