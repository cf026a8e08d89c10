"""The rows debounce adds to a delivery's table (runs/debounce.py has the row protocol).

"A newer edit" is always one with another idempotency key: a newer edit with this message's key is the same job,
answered by the run of that key (it runs, or waits for it, or replays its result), never a reason to drop it.

| what was found                           | function      | what the delivery does                  | outcome    |
|------------------------------------------|---------------|-----------------------------------------|------------|
| (before claiming) a newer edit, no run   | `debounced`   | ack without a run (its outbox row done) | debounced  |
| (before claiming) a newer edit, the run  | `debounced`   | fence the parked run out, ack           | superseded |
|   parked WAITING (on_running=supersede)  |               |                                         |            |
| (before claiming) no newer edit, the run | `debounced`   | reopen it (FAILED, due), then claim it: | (the run's)|
|   of its key was superseded              |               | it runs, never replays an empty result  |            |
| CLAIMED, a renewal found a newer edit    | `superseded`  | roll back, ack (fenced out: counted by  | superseded |
|   (on_running="supersede")               |               | the transaction that fenced it)         |            |
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from oncelery.delivery.delivered import Call, RunContext
from oncelery.models import Outcome
from oncelery.runs.debounce import (
    SUPERSEDED_LABEL,
    check_edit,
    reopen_superseded,
    supersede_if_newer,
    supersede_parked,
)
from oncelery.runs.decisions import Claim
from oncelery.runs.faults import fault_point

__all__ = ["debounced", "superseded", "superseding_watch"]

logger = logging.getLogger("oncelery.delivery")


def debounced(delivery: Any, call: Call) -> bool:
    """Whether this message is settled by a newer edit of its key, before any claim: with no run yet, it is acked
    `debounced` (its outbox row closed; settled before counted, as a stale message); a run of it parked WAITING is
    superseded (on_running="supersede": nothing renews a parked run, so no renewal would ask). Else False: claim;
    a superseded run of this message's key is reopened first, so the claim runs it instead of replaying nothing."""
    mark = call.debounce
    if mark is None:
        return False
    task, ident, db = delivery.task, delivery.ident, delivery.store.db
    fault_point("debounce_check", task=task.name, key=ident.key)
    found = check_edit(db, task.name, ident.tenant, mark.key, mark.seq, ident.key)
    if not found.newer:
        if found.superseded:
            reopen_superseded(db, task.name, ident.tenant, ident.key, mark.key, mark.seq)
        return False
    if found.parked and mark.supersede:
        cancel = _canceller(delivery, mark.key)
        if supersede_parked(db, task.name, ident.tenant, ident.key, mark.key, mark.seq, cancel) is None:
            return False  # woken or finished meanwhile: the claim decides
        delivery.task.tell_caller(Outcome.SUPERSEDED, ident)
        return True
    if found.has_run:
        return False  # a redelivery or re-send of a run that exists: the claim decides it
    delivery.store.close_outbox_row(delivery.request.id, Outcome.DEBOUNCED)
    delivery._end_wait(Outcome.DEBOUNCED.value)
    delivery._count(Outcome.DEBOUNCED)
    logger.info("%s[%s]: edit %d of %s debounced: a newer edit replaced it", task.name, ident.key, mark.seq, mark.key)
    return True


def _canceller(delivery: Any, debounce_key: str) -> Callable[[int], None]:
    """Cancel a superseded run's calls in flight, best effort, off the calling thread (a renewal's, a delivery's):
    a provider's cancel must not delay the process's other renewals."""
    task, store = delivery.task, delivery.store
    why = f"cancelled: its run was superseded by a newer edit of {debounce_key}"

    def cancel(run_id: int) -> None:
        threading.Thread(
            target=_cancel, args=(store, run_id, task, why), name="oncelery-supersede", daemon=True
        ).start()

    return cancel


def superseding_watch(delivery: Any, claim: Claim) -> Callable[[], bool] | None:
    """The renewal's question for a run of on_running="supersede": fence it out if a newer edit exists."""
    mark = delivery.call.debounce
    if mark is None or not mark.supersede:
        return None
    task, store, tenant = delivery.task, delivery.store, delivery.ident.tenant
    cancel = _canceller(delivery, mark.key)

    def watch() -> bool:
        fault_point("supersede_check", task=task.name, key=claim.key)
        return supersede_if_newer(store.db, claim, mark.key, mark.seq, tenant, cancel)

    return watch


def _cancel(store: Any, run_id: int, task: Any, why: str) -> None:
    try:
        task.cancel_calls(run_id, why, SUPERSEDED_LABEL)
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
