"""Celery's revoke cancels a parked run: its run goes DEAD (replayable) and its calls are cancelled at the provider.

A run parked WAITING holds no worker: its wake is a message the relay sends when the provider's answer is due.
`AsyncResult.revoke()` (or `celery control revoke`) makes every worker discard that message when it arrives;
the `task_revoked` signal then fires in the worker's main process, and this module cancels the run there:

- the run goes DEAD with a dead letter of reason `revoked` (so `oncelery dlq replay` can run it again), counted
  `dead`, guarded by its status and token (a run taken over meanwhile is left alone);
- in the same transaction, each call it had open ends `abandoned` with its ledger row at its estimate, labelled
  `run_revoked`, and its budgets charged (the ledger rule: oncelery.ledger.unknown);
- then each of those calls is cancelled at the provider where the task's adapter (`llm_adapter`) can cancel
  (OpenAI Responses), and its intent becomes `cancelled` (a cancel is best effort, so the call may still be
  billed: its row stays). A cancel that fails changes nothing: the call is on the books already.

A revoke with `terminate=True` cancels a RUNNING run the same way (its holder is being killed). Losing a lease
never cancels anything.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from celery import signals

from oncelery.errors import OnceleryError, StoreError
from oncelery.ledger.recording import CallLedger
from oncelery.ledger.unknown import REVOKED_LABEL
from oncelery.llm.cancel import adapter_of, cancel_sent_calls
from oncelery.runs.letters import cancel_revoked

__all__ = ["REVOKED_LABEL", "REVOKE_TRIES", "cancel_on_revoke", "cancel_run_calls", "watch_revokes"]

logger = logging.getLogger("oncelery.task")

REVOKE_TRIES = 4  # over ~3.5 s: a closed pooled connection fails once, a database restart takes a few seconds


def watch_revokes(task_class: type) -> None:
    """Cancel the run of every revoked message of a `task_class` task (called once with IdempotentTask)."""

    def revoked(
        sender: Any = None, request: Any = None, terminated: bool = False, expired: bool = False, **_: Any
    ) -> None:
        if not isinstance(sender, task_class) or request is None or expired:
            return  # an expired message never ran (Celery's `expires`): there is no parked run to cancel
        task_id = getattr(request, "id", None)
        if not task_id:
            return
        # Off the consumer's thread: a database round trip and a provider's cancel must not stall consumption.
        threading.Thread(
            target=cancel_on_revoke, args=(sender, str(task_id), bool(terminated)), name="oncelery-revoke", daemon=True
        ).start()

    signals.task_revoked.connect(revoked, weak=False, dispatch_uid="oncelery.revoke")


def cancel_on_revoke(task: Any, task_id: str, terminated: bool = False, tries: int = REVOKE_TRIES) -> bool:
    """Cancel the run of revoked message `task_id` of `task`, and its calls in flight; return whether it did.

    A store error is tried again (`tries` times in all, 0.5 s apart, doubling): a revoke is heard once, by the
    workers up at that moment, and remembered only in their memory, so a cancel given up here is lost if the
    worker restarts before the run's next wake (a pooled connection a database restart closed fails once)."""
    delay = 0.5
    for attempt in range(1, tries + 1):
        try:
            cancelled = cancel_revoked(task.store.db, task.name, task_id, terminated)
            break
        except StoreError as exc:
            if attempt == tries:  # the run stays parked; this worker revokes its next wake again, if it lives
                logger.warning(
                    "%s: could not cancel the run of revoked message %s after %d tries: %s", task.name, task_id,
                    tries, exc,
                )  # fmt: skip
                return False
            logger.info("%s: cancelling revoked message %s: %s; trying again in %.1fs", task.name, task_id, exc, delay)
            time.sleep(delay)
            delay *= 2
        except OnceleryError as exc:  # not a store fault: another try would fail the same way
            logger.warning("%s: could not cancel the run of revoked message %s: %s", task.name, task_id, exc)
            return False
    if cancelled is None:
        return False
    run_id, _token = cancelled
    logger.warning("%s: run %d cancelled: its message %s was revoked", task.name, run_id, task_id)
    # Only the calls made through the task adapter's provider (a call made with another adapter= stays `sent`).
    cancel_run_calls(task, run_id, "cancelled: its run was revoked", REVOKED_LABEL)
    return True


def cancel_run_calls(task: Any, run_id: int, why: str, label: str) -> int:
    """Ask the provider to stop the ended run's calls in flight, best effort (each is already on the books,
    labelled `label`: oncelery.ledger.unknown); return how many it cancelled."""
    ledger = CallLedger(task.store.db.dialect, task.app.conf)
    return cancel_sent_calls(task.store, run_id, adapter_of(task), why, label, ledger)
