"""SQLAlchemy models: the database is Oncelery's final deduplication barrier."""

from models.ai import ArticleScore, LLMCall
from models.base import Base
from models.runs import DeliveryOutcome, Outcome, RunStatus, StepResult, TaskRun

__all__ = ["ArticleScore", "Base", "DeliveryOutcome", "LLMCall", "Outcome", "RunStatus", "StepResult", "TaskRun"]
