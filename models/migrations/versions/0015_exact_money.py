"""exact money: every cost column becomes integer micro-USD (BIGINT), renamed *_micros

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-05 09:00:00

Float USD drifts as it sums (0.1 + 0.2 != 0.3) and SQLite has no exact decimal type (NUMERIC is stored as a
REAL), so each money column becomes a BIGINT of micro-USD (oncelery.models.money), exact on both stores:

    model_calls.cost              FLOAT NULL      -> cost_micros        BIGINT NULL (NULL: no price)
    ledger_totals.cost            FLOAT NOT NULL  -> cost_micros        BIGINT NOT NULL DEFAULT 0
    task_runs.llm_cost            FLOAT NOT NULL  -> llm_cost_micros    BIGINT NOT NULL DEFAULT 0
    delivery_outcomes.saved_cost  FLOAT NOT NULL  -> saved_cost_micros  BIGINT NOT NULL DEFAULT 0

(`ledger_label_totals` of 0014 counts calls only: it holds no money.)

Why new names rather than the old names with a new type: a number that changes unit must change name. Any SQL
written against the old columns (a dashboard, an operator's query, a worker not yet upgraded writing `cost`)
then fails loudly instead of reading micro-USD as dollars, a factor of 10^6. And the rename spares SQLite a table
rebuild: the column is added (ALTER TABLE ADD COLUMN), filled, and the old one dropped (ALTER TABLE DROP COLUMN,
SQLite 3.35+, which Oncelery's RETURNING statements already need), so task_runs and model_calls keep their
triggers (0009's totals, 0012's histograms) untouched: no table is copied, no trigger is dropped or recreated
(tests/test_exact_money.py compares the trigger set, with its SQL, before and after). No trigger of 0007-0014
sums a cost: the ledger's totals are added by the code that writes each row (oncelery.task.ledger_rows).

Historic values (floats written before this revision) are converted one by one, half-up: value x 10^6 with its
float noise dropped below a thousandth of a micro-USD (0.30000000000000004 -> 300000), then rounded half away
from zero; the same expression on both stores. Every figure a report showed thus stays within half a micro-USD.
Rows and their totals are converted independently (retention may have deleted rows a total still counts): a
total can differ from the sum of its converted rows only where old rows held sub-micro fractions (a price of
0.15 USD/1M x 7 tokens = 1.05 micro-USD), by less than half a micro-USD per such row. Calls recorded from now on
are rounded UP to the micro-USD per call, so rows and totals agree exactly.

Downgrade: back to FLOAT USD (micros / 10^6), names as before; exact values become the nearest float.
Only non-zero values are rewritten: most runs made no priced call, and their rows are not touched.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

# (table, float USD column before, micro-USD column after, nullable)
_COLUMNS = (
    ("model_calls", "cost", "cost_micros", True),
    ("ledger_totals", "cost", "cost_micros", False),
    ("task_runs", "llm_cost", "llm_cost_micros", False),
    ("delivery_outcomes", "saved_cost", "saved_cost_micros", False),
)
# Float USD -> micro-USD, half-up after dropping float noise below 10^-3 micro-USD. PostgreSQL's round() of a
# double rounds half to even, of a NUMERIC half away from zero: the cast makes it the same rule as SQLite's.
_TO_MICROS = {
    "postgresql": "CAST(ROUND(ROUND(CAST({col} AS NUMERIC) * 1000000, 3)) AS BIGINT)",
    "sqlite": "CAST(ROUND(ROUND({col} * 1000000, 3)) AS INTEGER)",
}
_TO_USD = "CAST({col} AS FLOAT) / 1000000"


def _convert(table: str, source: str, target: str, nullable: bool, expression: str) -> None:
    """Fill `target` from `source` on the rows whose value is not zero (the default already says 0)."""
    where = f"{source} IS NOT NULL" if nullable else f"{source} <> 0"
    op.execute(f"UPDATE {table} SET {target} = {expression.format(col=source)} WHERE {where}")


def upgrade() -> None:
    """Apply this revision: add each *_micros column, fill it from the float, drop the float."""
    to_micros = _TO_MICROS[op.get_bind().dialect.name]
    for table, old, new, nullable in _COLUMNS:
        default = None if nullable else "0"
        op.add_column(table, sa.Column(new, sa.BigInteger(), server_default=default, nullable=nullable))
        _convert(table, old, new, nullable, to_micros)
        op.drop_column(table, old)


def downgrade() -> None:
    """Revert this revision: float USD columns again (micros / 10^6), under their old names."""
    for table, old, new, nullable in _COLUMNS:
        default = None if nullable else "0"
        op.add_column(table, sa.Column(old, sa.Float(), server_default=default, nullable=nullable))
        _convert(table, new, old, nullable, _TO_USD)
        op.drop_column(table, new)
