"""A call's money in the budgets, settled once: its reservation released, its actual (or estimated) cost charged.

A budget's `reserved` holds what calls in flight may still cost; `spent` the sum of its calls' ledger rows.
`release_txn` moves a call's reservation out (once per intent, `llm_intents.released_at`); `charge_txn` adds a
ledger row's cost to `spent` (once per call id: it runs only when the row was new). Both run in the caller's
transaction, with the intent's end and the ledger row (oncelery.llm.budgets reserves; this room settles).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import BigInteger, Connection, case, literal, update

from oncelery.store.dialects import Dialect
from oncelery.store.tables import BUDGETS, INTENTS

__all__ = ["Reservation", "charge_txn", "release_txn"]


@dataclass(frozen=True)
class Reservation:
    """What one call reserved: {budget row: micro-USD}, and the price it was estimated at (settlement uses it)."""

    budgets: dict[str, int]
    price: tuple[str, str]

    def as_json(self) -> dict[str, Any]:
        """The JSON `llm_intents.reserved` keeps."""
        return {"budgets": dict(self.budgets), "price": list(self.price)}

    @classmethod
    def of(cls, value: Any) -> Reservation | None:
        """Read `llm_intents.reserved` back (None: the call reserved nothing)."""
        if not isinstance(value, Mapping) or not value.get("budgets"):
            return None
        price = value.get("price") or ["0", "0"]
        return cls({str(k): int(v) for k, v in value["budgets"].items()}, (str(price[0]), str(price[1])))


def release_txn(conn: Connection, dialect: Dialect, public_id: str, reservation: Reservation | None) -> bool:
    """Release the call's reservation in the caller's transaction, once (whoever comes first); return whether."""
    if reservation is None:
        return False
    i = INTENTS.c
    first = conn.execute(
        update(INTENTS)
        .where(i.public_id == public_id, i.released_at.is_(None), i.reserved.is_not(None))
        .values(released_at=dialect.now())
    )
    if first.rowcount != 1:
        return False
    c = BUDGETS.c
    for name, amount in reservation.budgets.items():
        back = literal(int(amount), BigInteger)
        conn.execute(
            update(BUDGETS)
            .where(c.name == name)
            .values(reserved_micros=case((c.reserved_micros > back, c.reserved_micros - back), else_=0))
        )
    return True


def charge_txn(conn: Connection, reservation: Reservation | None, cost_micros: int | None) -> None:
    """Add a call's actual cost to `spent` of the budgets it reserved in, with its ledger row (once per call).

    Never above the limit: a cost over what is left (an estimate's error) is counted in `overrun_micros`.
    """
    if reservation is None or not cost_micros:
        return
    c = BUDGETS.c
    cost = literal(int(cost_micros), BigInteger)
    fits = c.spent_micros + c.reserved_micros + cost <= c.limit_micros
    for name in reservation.budgets:
        conn.execute(
            update(BUDGETS)
            .where(c.name == name)
            .values(
                spent_micros=case((fits, c.spent_micros + cost), else_=c.limit_micros - c.reserved_micros),
                overrun_micros=case(
                    (fits, c.overrun_micros),
                    else_=c.overrun_micros + c.spent_micros + c.reserved_micros + cost - c.limit_micros,
                ),
            )
        )
