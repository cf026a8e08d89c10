"""Telling the caller and Flower what Oncelery decided for a delivery: its outcome, its step in progress."""

from __future__ import annotations

import logging
from typing import Any

from celery.utils.saferepr import saferepr

from oncelery.basetask.caller import tell_caller
from oncelery.basetask.options import TaskOptions
from oncelery.errors import IdempotencyConflict
from oncelery.models import Outcome
from oncelery.runs.keys import Identity
from oncelery.settings import CONF_FLOWER_NAME_SUFFIX
from oncelery.tracing.otel import telemetry_of

__all__ = [
    "Announcing",
]

# The task's logger: this class is a part of IdempotentTask.
logger = logging.getLogger("oncelery.task")


class Announcing(TaskOptions):
    """Publishes each delivery's outcome as a task event (for Flower) and in the result backend (for the caller)."""

    # Errors Oncelery raises on purpose, already counted and dead-lettered: Celery logs them at INFO without a
    # traceback ("expected"), not as "raised unexpected". A task's own `throws=` replaces this tuple.
    throws: tuple[type[BaseException], ...] = (IdempotencyConflict,)

    def tell_caller(self, outcome: Outcome, ident: Identity, token: int | None = None, note: str = "") -> None:
        """Publish this delivery's outcome: a task event for Flower, and `outcome_of(result)` for the caller.

        The event `task-<outcome>` (e.g. task-replayed) carries outcome, key, tenant and token as fields.
        Flower shows only Celery's standard fields, so its `kwargs` field also starts with a line saying what
        Oncelery decided (before the task's own kwargs): Flower's kwargs column and task page show the outcome.
        """
        tel = telemetry_of(self)
        if tel is not None:  # the run attempt's span says what the delivery decided (traced deliveries only)
            tel.current().set_attribute("oncelery.delivery.outcome", outcome.value)
        req = self.request
        if getattr(req, "is_eager", False) or getattr(req, "called_directly", True):
            return
        decided = f"{outcome.value} key={ident.key}"
        if ident.tenant:
            decided += f" tenant={ident.tenant}"
        if token is not None:
            decided += f" token={token}"
        if note:
            decided += f" ({note})"
        fields: dict[str, Any] = {"outcome": outcome.value, "key": ident.key, "tenant": ident.tenant, "token": token}
        if outcome in (Outcome.IN_PROGRESS, Outcome.WAITING):
            # A wait is not a failure: no exception, no traceback; the result column says what happens next.
            fields.update(exception=None, traceback=None, result=f"oncelery: {decided}")
        self._announce(f"task-{outcome.value}", decided, fields, outcome.value)
        if not self.ignore_result:
            tell_caller(self.backend, req.id, outcome, ident.key, ident.tenant, token)

    def _announce(self, event: str, decided: str, fields: dict[str, Any], label: str) -> None:
        """Send task event `event` with `fields` and `decided` at the start of its kwargs; the name stays the task's.

        Why kwargs (docs/flower.md): of the fields Flower shows, it is the one a finished task keeps (its
        task-succeeded event overwrites state and result) that Flower's task list, task page and search all show,
        and it is Celery's display-only text of the kwargs (the body ran with the real ones). The name stays the
        task's own, so Flower's /metrics and celery-exporter label by task, not by task x outcome x step;
        `oncelery_flower_name_suffix = True` also writes `[label]` after the name.
        """
        req = self.request
        # Only where task events are on (worker_send_task_events, as for Flower): else no extra publish per job.
        if not req.id or not self.send_events or not self.app.conf.worker_send_task_events:
            return
        own = req.kwargsrepr if getattr(req, "kwargsrepr", None) else saferepr(req.kwargs or {})
        # The decision first: the kwargs column is one line, and a long prompt would push an ending out of view.
        fields = {**fields, "kwargs": f"oncelery: {decided} | {own}"}
        if self.settings().get(CONF_FLOWER_NAME_SUFFIX):
            fields["name"] = f"{self.name} [{label}]"
        try:
            self.send_event(event, **fields)
        except Exception as exc:  # monitoring must never fail the job
            logger.debug("could not send the %s event of %s: %s", event, req.id, exc)
