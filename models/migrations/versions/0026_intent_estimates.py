"""intent estimates: what a model call may cost, kept on its intent, and the `abandoned` intent state

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-04 15:30:00

Every create that may have happened has exactly one ledger row: an intent that ends any way but `done` (its run
dead, revoked, superseded or stale; its response lost; a successor re-sending it) gets its row at an estimate,
in the transaction that ends it, wherever that is (a run's end in the run protocol, the relay's sweep), with no
request or price table at hand. So the estimate is kept on the intent when it is prepared: its input's
conservative token count, its output limit, and that usage's price in micro-USD (NULL: no price). Intents
prepared before this revision have none; their rows fall back to what they reserved in the budgets.

`abandoned` is a new value of llm_intents.state (VARCHAR + CHECK, native_enum=False): the run ended while the
call was open. The CHECK is widened in place (models/migrations/checks.py); no row is rewritten.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from oncelery.models.migrations.checks import set_in_check

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None

_STATES = ("prepared", "sent", "done", "failed", "lost", "cancelled")
_TABLE, _NAME, _COLUMN = "llm_intents", "ck_llm_intents_intent_state", "state"
_COLUMNS = (
    ("estimated_input_tokens", sa.Integer()),
    ("estimated_output_tokens", sa.Integer()),
    ("estimated_cost_micros", sa.BigInteger()),
)


def upgrade() -> None:
    """Apply this revision."""
    set_in_check(_TABLE, _NAME, _COLUMN, (*_STATES, "abandoned"))
    with op.batch_alter_table(_TABLE, recreate="never") as batch:
        for name, type_ in _COLUMNS:
            batch.add_column(sa.Column(name, type_, nullable=True))


def downgrade() -> None:
    """Revert this revision: abandoned intents read `lost` (their outcome is unknown either way)."""
    with op.batch_alter_table(_TABLE, recreate="never") as batch:
        for name, _type in _COLUMNS:
            batch.drop_column(name)
    op.execute("UPDATE llm_intents SET state = 'lost' WHERE state = 'abandoned'")
    set_in_check(_TABLE, _NAME, _COLUMN, _STATES)
