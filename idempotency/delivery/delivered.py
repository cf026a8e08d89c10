"""What a delivery is given: the call (identity, message, options), the task it asks things of, the live run.

The task (Celery glue) builds a `Call` per delivery and implements `DeliveredTask`; the decision table uses
only these, so the delivery room never imports the basetask room.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from oncelery.delivery.effects import EffectsScope
from oncelery.delivery.renewal import Heartbeat
from oncelery.delivery.replay_cache import ReplayCache
from oncelery.delivery.steps import StepRunner
from oncelery.errors import ConfigurationError, ResultNotJSON, StepMismatch
from oncelery.llm.errors import BudgetExceeded, CallOutcomeUnknown, ProviderRejected, ResponseLost
from oncelery.models import Outcome
from oncelery.runs.claims import RunStore
from oncelery.runs.debounce import DebounceMark
from oncelery.runs.decisions import Claim, EntityVersionOf
from oncelery.runs.forks import ForkSpec
from oncelery.runs.keys import Identity
from oncelery.settings import DEFAULT_LEASE_SECONDS

__all__ = ["UNFIXABLE_ERRORS", "Call", "DeliveredTask", "RunContext", "max_retries"]

# Errors that no retry of the same message can fix: the run goes DEAD at once (with a dead letter).
# A model call whose outcome is unknown under at_most_once, a response the provider forgot under
# on_lost="dead_letter", a request the provider refuses (4xx) and a call over its budget wait for a person
# (or a raised cap), never for a retry.
UNFIXABLE_ERRORS: tuple[type[BaseException], ...] = (
    StepMismatch,
    ResultNotJSON,
    ConfigurationError,
    CallOutcomeUnknown,
    ResponseLost,
    ProviderRejected,
    BudgetExceeded,
)


@dataclass
class RunContext:
    """The live claim of the run executing on this thread: heartbeat, step runner, effects scope."""

    claim: Claim
    heartbeat: Heartbeat
    steps: StepRunner
    effects: EffectsScope
    # Whether the body may park the run WAITING (RunParked): only a delivery a broker can deliver again.
    parkable: bool = True
    # The fork this run is (its overrides and effects mode: runs/forks.py), else None: a production run.
    fork: ForkSpec | None = None


@dataclass(frozen=True)
class Call:
    """What one delivery carries: its identity, entity and version, its message, and this call's options.

    `message` is what a dead letter keeps to replay (the arguments and key headers); it reaches `task_runs`
    only where `keep_message` says so (the task's `store_message`, or the embedded broker).
    """

    ident: Identity
    message: dict[str, Any]
    keep_message: bool = False
    # The task's keep_arguments: completion keeps the message (a fork's arguments) until retention clears it.
    keep_arguments: bool = False
    entity: str | None = None
    version: EntityVersionOf | None = None
    direct: bool = False
    abandoned: str | None = None
    lease: float = DEFAULT_LEASE_SECONDS  # its own option, else the task's, else the app's
    policy: str = "retry"  # on_in_progress, resolved the same way
    # When this message first found its key held (database clock, epoch seconds; runs/waits.py), else None.
    waiting_since: float | None = None
    # A debounced burst's message (runs/debounce.py): acked `debounced` if a newer edit exists, else run.
    debounce: DebounceMark | None = None
    # The fork this message runs (sent by the fork command, checked against the call's task, tenant and key before
    # the claim: runs/forks.py), else None: a production run.
    fork: ForkSpec | None = None


class DeliveredTask(Protocol):
    """What a delivery asks of its task (the Celery glue implements it: `IdempotentTask`)."""

    name: str
    request: Any
    max_deliveries: int | None
    max_retries: int | None
    dead_on: tuple[type[BaseException], ...]

    @property
    def store(self) -> RunStore:
        """The claims database of this task."""

    def replay_cache(self) -> ReplayCache | None:
        """The app's replay cache, or None."""

    def tell_caller(self, outcome: Outcome, ident: Identity, token: int | None = None, note: str = "") -> None:
        """Tell the caller and Flower which outcome this delivery had."""

    def max_lease_seconds(self) -> float | None:
        """How long renewals may keep a hung body's lease."""

    def attach(self, ctx: RunContext) -> None:
        """Make `ctx` the live run of this thread (the body's step() and effects() use it)."""

    def detach(self, ctx: RunContext) -> None:
        """Undo `attach`."""

    def stop_calls_later(self, run_id: int, why: str) -> None:
        """Ask the provider to stop an ended run's calls, off the delivery's thread (best effort)."""

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """The task's body."""

    def cancel_calls(self, run_id: int, why: str, label: str) -> int:
        """Cancel a run's calls in flight at the provider, best effort, each with its ledger row (`label`)."""


def max_retries(task: DeliveredTask) -> int | None:
    """The retry limit Celery enforces: autoretry's retry_kwargs["max_retries"] wins over the task's."""
    retry_kwargs = getattr(task, "retry_kwargs", None) or {}
    if "max_retries" in retry_kwargs:
        value = retry_kwargs["max_retries"]
        return None if value is None else int(value)
    return None if task.max_retries is None else int(task.max_retries)
