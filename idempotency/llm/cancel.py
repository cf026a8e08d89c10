"""Cancelling an ended run's calls still running at the provider, best effort (revoked, superseded, stale runs).

The transaction that ends a run already ended its open calls `abandoned`, each with its ledger row at its estimate
and its budgets charged (oncelery.ledger.unknown): whatever the provider does next, the call is on the books. This
module then asks the provider to stop each of them, to stop paying for tokens nobody will read:

- a cancel the provider accepts makes the intent `cancelled` (its row stays: a cancel is best effort, and OpenAI
  has been seen finishing a cancelled response; the usage the answer reports is kept on the intent);
- a cancel that fails (5xx, timeout, 404) changes nothing more: the call is already ended and on the books.

Only calls with a provider reference made through the adapter's provider are asked (a batch item's reference is
its own custom id, not a provider's). Losing a lease alone never cancels anything: only a decision that the run
will not go on does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from sqlalchemy import select, update

from oncelery.ledger.recording import CallLedger
from oncelery.llm.adapters.factory import task_adapter
from oncelery.llm.errors import ProviderError
from oncelery.models import IntentState
from oncelery.runs.claims import RunStore
from oncelery.store.tables import INTENTS

__all__ = ["adapter_of", "cancel_sent_calls"]

logger = logging.getLogger("oncelery.llm")

_ASKED = (IntentState.SENT, IntentState.ABANDONED)


def adapter_of(task: Any) -> Any:
    """The task's `llm_adapter` (made if it is a factory, once per task and process), or None."""
    return task_adapter(task)


def cancel_sent_calls(store: RunStore, run_id: int, adapter: Any, why: str, label: str, ledger: CallLedger) -> int:
    """Ask the provider to stop the ended run's calls it may still be running; return how many it cancelled.

    A call still `sent` (its run ended by a path that did not end it) ends `cancelled` with its ledger row
    labelled `label` (written through `ledger`), in one transaction, whether or not the cancel succeeds.
    """
    if adapter is None or not hasattr(adapter, "cancel"):
        return 0  # nothing to cancel with: the calls are on the books; the provider finishes them
    i = INTENTS.c
    asked = select(i.public_id, i.reference, i.state).where(
        i.run_id == run_id,
        i.provider == str(getattr(adapter, "provider", "")),
        i.state.in_(_ASKED),
        i.reference.is_not(None),
        i.mode != "batch",
    )
    with store.db.read() as conn:
        calls = conn.execute(asked).all()
    cancelled = 0
    for public_id, reference, state in calls:
        try:
            seen = adapter.cancel(reference)
        except ProviderError as exc:
            logger.warning("call %s of run %d not cancelled (it is on the books): %s", reference, run_id, exc)
            seen = None
        with store.db.begin() as conn:
            if state is IntentState.SENT:  # not ended by the run's end: on the books now, at its estimate
                ledger.record_unanswered(conn, public_id, IntentState.ABANDONED, label, why)
            if seen is None:
                continue
            usage = _reported(adapter, seen)
            conn.execute(
                update(INTENTS)
                .where(i.public_id == public_id, i.state == IntentState.ABANDONED)
                .values(
                    state=IntentState.CANCELLED,
                    input_tokens=None if usage is None else usage.input_tokens,
                    output_tokens=None if usage is None else usage.output_tokens,
                )
            )
        cancelled += 1
    return cancelled


def _reported(adapter: Any, seen: Any) -> Any:
    """The usage the cancel's answer reports (a response that finished anyway), or None when it reports none."""
    response = getattr(seen, "response", None)
    if not isinstance(response, Mapping) or not response.get("usage"):
        return None
    usage = adapter.usage(response)
    return usage if usage.input_tokens or usage.output_tokens else None
