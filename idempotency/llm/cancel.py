"""Cancelling a run's calls in flight at the provider, best effort (a revoked run, a superseded run).

Only calls sent and not ended, made through the adapter's provider, are cancelled; each cancelled one's intent ends
`cancelled`. A call the provider refuses to cancel stays `sent` (a later holder may re-attach to it). Losing a lease
alone never cancels anything: only a decision that the run will not go on does (revoke, supersede).
"""

from __future__ import annotations

import logging
from typing import Any

from oncelery.llm.errors import ProviderError
from oncelery.llm.intents import end_unheld_intent, sent_calls
from oncelery.models import IntentState
from oncelery.runs.claims import RunStore

__all__ = ["adapter_of", "cancel_sent_calls"]

logger = logging.getLogger("oncelery.llm")


def adapter_of(task: Any) -> Any:
    """The task's `llm_adapter` (made if it is a factory), or None."""
    adapter = getattr(task, "llm_adapter", None)
    if adapter is not None and not hasattr(adapter, "create") and callable(adapter):
        adapter = adapter()
    return adapter


def cancel_sent_calls(store: RunStore, run_id: int, adapter: Any, why: str) -> int:
    """Cancel the run's calls in flight through `adapter` (if it can cancel); return how many were cancelled."""
    if adapter is None or not hasattr(adapter, "cancel"):
        return 0  # nothing to cancel with: the calls stay `sent`, and a replay re-attaches to them
    cancelled = 0
    for intent in sent_calls(store, run_id, provider=str(getattr(adapter, "provider", ""))):
        try:
            adapter.cancel(intent.reference or "")
        except ProviderError as exc:
            logger.warning("call %s of run %d not cancelled: %s", intent.reference, run_id, exc)
            continue
        cancelled += end_unheld_intent(store, intent, IntentState.CANCELLED, why)
    return cancelled
