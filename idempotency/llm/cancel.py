"""Cancelling a run's calls in flight at the provider, best effort (a revoked run, a superseded run).

Only calls sent and not ended, made through the adapter's provider, are cancelled; each cancelled one's intent ends
`cancelled`. A call the provider refuses to cancel stays `sent` (a later holder may re-attach to it). Losing a lease
alone never cancels anything: only a decision that the run will not go on does (revoke, supersede).

A cancelled call was created, so it may be billed (a cancel is best effort: OpenAI has been seen finishing a
cancelled response): each one gets a ledger row in the transaction that ends its intent, so provider creates never
exceed ledger rows. Its usage is what the cancel's answer reports; where it reports none, the row carries 0 tokens,
the call's budget reservation as its estimated cost, and says so in its error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import Connection, select

from oncelery.llm.adapters.base import Usage
from oncelery.llm.budgets import charge_txn
from oncelery.llm.errors import ProviderError
from oncelery.llm.intents import Intent, end_unheld_intent, sent_calls
from oncelery.models import IntentState
from oncelery.runs.claims import RunStore
from oncelery.store.tables import INTENTS, RUNS

__all__ = ["CancelLedger", "adapter_of", "cancel_sent_calls"]

logger = logging.getLogger("oncelery.llm")


class CancelLedger:
    """How a cancelled call reaches the ledger (given by the task room, which owns prices and the ledger's rows).

    `write(conn, row)`: add one ledger row in the caller's transaction, return whether it was new (once per
    call id). `price(model, input_tokens, output_tokens)`: the cost in micro-USD, or None (no price).
    `label`: the row's reason (`run_superseded`, `run_revoked`).
    """

    def __init__(
        self,
        write: Callable[[Connection, Mapping[str, Any]], bool],
        price: Callable[[str, int, int], int | None],
        label: str,
    ) -> None:
        self.write = write
        self.price = price
        self.label = label


def adapter_of(task: Any) -> Any:
    """The task's `llm_adapter` (made if it is a factory, once per task and process), or None."""
    from oncelery.llm.adapters.factory import task_adapter

    return task_adapter(task)


def cancel_sent_calls(store: RunStore, run_id: int, adapter: Any, why: str, ledger: CancelLedger | None = None) -> int:
    """Cancel the run's calls in flight through `adapter` (if it can cancel); return how many were cancelled.

    With `ledger`, each cancelled call's ledger row is written with its intent's end, in one transaction.
    """
    if adapter is None or not hasattr(adapter, "cancel"):
        return 0  # nothing to cancel with: the calls stay `sent`, and a replay re-attaches to them
    cancelled = 0
    for intent in sent_calls(store, run_id, provider=str(getattr(adapter, "provider", ""))):
        try:
            seen = adapter.cancel(intent.reference or "")
        except ProviderError as exc:
            logger.warning("call %s of run %d not cancelled: %s", intent.reference, run_id, exc)
            continue
        also = None if ledger is None else _ledger_row(ledger, intent, _reported(adapter, seen), why)
        cancelled += end_unheld_intent(store, intent, IntentState.CANCELLED, why, also)
    return cancelled


def _reported(adapter: Any, seen: Any) -> Usage | None:
    """The usage the cancel's answer reports (a response that finished anyway), or None when it reports none."""
    response = getattr(seen, "response", None)
    if not isinstance(response, Mapping) or not response.get("usage"):
        return None
    usage: Usage = adapter.usage(response)
    return usage if usage.input_tokens or usage.output_tokens else None


def _ledger_row(ledger: CancelLedger, intent: Intent, usage: Usage | None, why: str) -> Callable[[Connection], None]:
    def write(conn: Connection) -> None:
        i, r = INTENTS.c, RUNS.c
        where = conn.execute(
            select(r.id, i.model, i.step_name, r.task_name, r.tenant, r.idempotency_key)
            .select_from(INTENTS.join(RUNS, RUNS.c.id == i.run_id))
            .where(i.public_id == intent.public_id)
        ).one()
        reservation = intent.reservation
        if usage is not None:
            cost = ledger.price(where.model, usage.input_tokens, usage.output_tokens)
            error = why
        else:
            # No usage reported: its reserved estimate is the best figure of what it may have cost.
            cost = max(reservation.budgets.values()) if reservation and reservation.budgets else None
            error = f"{why}; usage not reported by the provider (estimated)"
        row = {
            "call_id": intent.public_id,
            "task_name": where.task_name,
            "tenant": where.tenant or "",
            "idempotency_key": where.idempotency_key,
            "step": where.step_name,
            "run_id": where.id,
            "fencing_token": None,  # written by the canceller, not by a holder of the run
            "model": where.model,
            "prompt": None,
            "input_tokens": usage.input_tokens if usage else 0,
            "output_tokens": usage.output_tokens if usage else 0,
            "latency_ms": 0.0,
            "ok": False,
            "error": error[:2000],
            "cost_micros": cost,
            "batch_saved_micros": None,
            "meta": {"attempt": intent.attempt, "mode": intent.mode, "cancelled": True},
            "reason": ledger.label,
            "reattached": False,
        }
        if ledger.write(conn, row):
            charge_txn(conn, reservation, cost)

    return write
