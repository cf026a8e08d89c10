"""Money is exact: every money column holds an integer number of micro-USD (1 USD = 1,000,000 micros).

Why integers: SQLite has no exact decimal (its NUMERIC affinity stores a REAL), PostgreSQL's double precision
drifts as it sums (0.1 + 0.2 != 0.3), and a BIGINT is exact on both, sums exactly in SQL and spans ~9.2e12 USD.
Python reads them back as `Decimal` USD (`usd`), never as a float.

The rounding rule, written once (`micros_up`): a call's exact cost (a `Decimal` from the price table) is rounded
UP to the next micro-USD. The ledger then never reports less than was spent, and a budget built on it is never
overspent; a sum of rows is a sum of integers, so totals equal their rows exactly.
"""

from __future__ import annotations

import decimal
import math
from decimal import ROUND_CEILING, ROUND_HALF_EVEN, Decimal

__all__ = ["MICROS_PER_USD", "as_decimal", "micros_up", "usd"]

MICROS_PER_USD = 1_000_000
_MICRO = Decimal(1).scaleb(-6)  # Decimal("0.000001"): what usd() quantizes to
_FLOAT_NOISE = Decimal("0.001")  # micro-USD: a float's digits below this are binary noise, not money
_EXACT = decimal.Context(prec=80)  # wide enough for any float's digits times any token count: no rounding


def as_decimal(value: Decimal | float | int | str) -> Decimal:
    """`value` as a Decimal, a float by its shortest repr (`0.15` -> `Decimal("0.15")`, never 0.1499999...)."""
    if isinstance(value, bool):
        raise TypeError(f"not an amount: {value!r}")
    if isinstance(value, Decimal):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"not a finite amount: {value!r}")
    return Decimal(str(value)) if isinstance(value, float) else Decimal(value)


def micros_up(amount_usd: Decimal | float | int | str) -> int:
    """The amount in micro-USD, rounded UP (ceiling) to a whole micro: the ledger never under-reports.

    A Decimal (what the price table computes) is taken exactly. A float (a user's `call.cost = 0.25`, a row
    spooled by a version before 0015) first loses its binary noise below a thousandth of a micro-USD, the rule
    migration 0015 converts stored floats by: 0.1 + 0.2 (0.30000000000000004) is 300000 micros, not 300001.
    """
    exact = _EXACT.multiply(as_decimal(amount_usd), MICROS_PER_USD)
    if isinstance(amount_usd, float):
        exact = exact.quantize(_FLOAT_NOISE, rounding=ROUND_HALF_EVEN, context=_EXACT)
    return int(exact.to_integral_value(rounding=ROUND_CEILING, context=_EXACT))


def usd(micros: int | None) -> Decimal | None:
    """Micro-USD (as stored) as exact `Decimal` USD with 6 places (`1_500` -> `Decimal("0.001500")`)."""
    if micros is None:
        return None
    return (Decimal(int(micros)) / MICROS_PER_USD).quantize(_MICRO, context=_EXACT)
