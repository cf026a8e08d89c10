"""The two rows debounce adds to a delivery's table (runs/debounce.py has the row protocol).

| what was found                           | function      | what the delivery does                  | outcome    |
|------------------------------------------|---------------|-----------------------------------------|------------|
| (before claiming) a newer edit, no run   | `debounced`   | ack without a run (its outbox row done) | debounced  |
| CLAIMED, a renewal found a newer edit    | `superseded`  | roll back, ack (fenced out: counted by  | superseded |
|   (on_running="supersede")               |               | the transaction that fenced it)         |            |
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from oncelery.delivery.call import Call, RunContext
from oncelery.llm.cancel import adapter_of, cancel_sent_calls
from oncelery.models import Outcome
from oncelery.runs.debounce import newer_edit, supersede_if_newer
from oncelery.runs.decisions import Claim
from oncelery.runs.faults import fault_point

__all__ = ["debounced", "superseded", "superseding_watch"]

logger = logging.getLogger("oncelery.delivery")


def debounced(delivery: Any, call: Call) -> bool:
    """Whether this message carries an edit a newer one replaced (and no run of it exists): then it is acked,
    counted `debounced`, and its outbox row closed. Settled before counted, as a stale message."""
    mark = call.debounce
    if mark is None:
        return False
    task, ident = delivery.task, delivery.ident
    fault_point("debounce_check", task=task.name, key=ident.key)
    if not newer_edit(delivery.store.db, task.name, ident.tenant, mark.key, mark.seq, ident.key):
        return False
    delivery.store.close_outbox_row(delivery.request.id, Outcome.DEBOUNCED)
    delivery._end_wait(Outcome.DEBOUNCED.value)
    delivery._count(Outcome.DEBOUNCED)
    logger.info("%s[%s]: edit %d of %s debounced: a newer edit replaced it", task.name, ident.key, mark.seq, mark.key)
    return True


def superseding_watch(delivery: Any, claim: Claim) -> Callable[[], bool] | None:
    """The renewal's question for a run of on_running="supersede": fence it out if a newer edit exists."""
    mark = delivery.call.debounce
    if mark is None or not mark.supersede:
        return None
    task, store, tenant = delivery.task, delivery.store, delivery.ident.tenant

    def cancel_calls() -> None:
        # Off the renewal thread: a provider's cancel must not delay the process's other renewals.
        why = f"cancelled: its run was superseded by a newer edit of {mark.key}"
        threading.Thread(
            target=_cancel, args=(store, claim.run_id, task, why), name="oncelery-supersede", daemon=True
        ).start()

    def watch() -> bool:
        fault_point("supersede_check", task=task.name, key=claim.key)
        return supersede_if_newer(store.db, claim, mark.key, mark.seq, tenant, cancel_calls)

    return watch


def _cancel(store: Any, run_id: int, task: Any, why: str) -> None:
    try:
        cancel_sent_calls(store, run_id, adapter_of(task), why)
    except Exception as exc:  # best effort: the run is fenced out whatever its calls do
        logger.warning("%s: calls of superseded run %d not cancelled: %s", task.name, run_id, exc)


def superseded(delivery: Any, ctx: RunContext) -> Any:
    """The run was fenced out by a newer edit: its effects roll back, and this delivery is acked with no result
    (None, as a stale run's; no re-send: the newer edit's run carries the latest version)."""
    claim = ctx.claim
    ctx.effects.discard()
    delivery.task.tell_caller(Outcome.SUPERSEDED, delivery.ident, claim.token)
    logger.info("%s[%s] token=%d superseded: writes rolled back", delivery.task.name, claim.key, claim.token)
    return None
