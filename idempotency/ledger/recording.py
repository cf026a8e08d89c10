"""The one way the rooms above price and record a model call: `CallLedger`, made for one app's prices and database.

The call layer (a step's answered or billed call, an unknown outcome), the batcher (a duplicate batch's calls) and
the cancel path (a call still open when its run ended) each build their row and hand it here; the basetask room and
the relay make the ledger (`CallLedger(dialect, app.conf)`), so the llm room needs no callback of its own:

    | method              | what it guarantees                                                                  |
    |---------------------|-------------------------------------------------------------------------------------|
    | `cost_micros`       | exact integer micro-USD at `price_for(model, conf)`, a batch item at BATCH_PRICE    |
    | `record`            | the row, its totals and its budgets' charge, once per call id (`rows`, `settle`)    |
    | `record_unanswered` | an open intent ended with its row at its estimate (`unknown`: the ledger rule)      |
    | `tell`              | the watcher (`seen`, tracing) learns of a row `record_unanswered` wrote, once       |
    |                     | its transaction committed (`record` tells it in the transaction that writes it)     |

Every write runs in the caller's transaction, so a row commits with what it records (the step's checkpoint, the
intent's end, the batch's resolution) or not at all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import Connection

from oncelery.ledger.prices import Price, batch_micros, price_for
from oncelery.ledger.rows import add_call
from oncelery.ledger.settle import Reservation, charge_txn
from oncelery.ledger.unknown import end_unanswered_txn
from oncelery.models import IntentState
from oncelery.store.dialects import Dialect

__all__ = ["CallLedger", "RowWatcher"]

#: Told of each row a ledger wrote (a copy), e.g. the tracing of the step that made the call.
RowWatcher = Callable[[dict[str, Any]], None]


class CallLedger:
    """Prices model calls at one app's prices and records each in the caller's transaction, once per call id."""

    def __init__(self, dialect: Dialect, conf: Any, seen: RowWatcher | None = None) -> None:
        self.dialect = dialect
        self.conf = conf  # an app's settings (any mapping with `.get`): oncelery_prices, oncelery_price_file
        self.seen = seen

    def price(self, model: str) -> Price | None:
        """`model`'s price for this app (`price_for`: its oncelery_prices, else the price file); None: no price."""
        return price_for(model, self.conf)

    def cost_micros(self, model: str, input_tokens: int, output_tokens: int, mode: str = "sync") -> int | None:
        """What the tokens cost in exact integer micro-USD (a `batch` item at the batch price); None: no price."""
        price = self.price(model)
        if price is None:
            return None
        cost = price.cost_micros(input_tokens, output_tokens)
        return batch_micros(cost) if mode == "batch" else cost

    def record(self, conn: Connection, row: Mapping[str, Any], reservation: Reservation | None = None) -> bool:
        """Add the call's row and its totals in the caller's transaction, and charge its cost to the budgets of
        `reservation`, only if the row is new; return whether it was."""
        if not add_call(conn, self.dialect, row):
            return False  # written before (a retry, a re-read): so was its charge
        charge_txn(conn, reservation, row.get("cost_micros"))
        self.tell(row)
        return True

    def record_unanswered(
        self, conn: Connection, public_id: str, state: IntentState, label: str, why: str
    ) -> dict[str, Any] | None:
        """End the open intent `public_id` as `state` with its row at its estimate, labelled `label`, its budgets
        charged, in the caller's transaction; return the row (None: not open, or it reached no provider)."""
        return end_unanswered_txn(conn, self.dialect, public_id, state, label, why)

    def tell(self, row: Mapping[str, Any]) -> None:
        """Tell the watcher, if any, of a row this ledger wrote."""
        if self.seen is not None:
            self.seen(dict(row))
