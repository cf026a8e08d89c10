"""batch suspects: llm_batches.suspects, the provider batches that may run a batch's requests a second time

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-03 09:00:00

After a crash in Anthropic's create window (its batches carry no tag), a batch whose create may have been sent is
created again once the search bound passes with a batch still running. The batches running then (the suspects),
the digest of the batch's custom_ids and how each suspect was resolved are kept here, so the poller applies the
first of them to end and labels the other's calls `duplicate_batch` in the ledger (NULL: no create was repeated).
An addition: no table is rebuilt.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("llm_batches", schema=None, recreate="never") as batch_op:
        batch_op.add_column(sa.Column("suspects", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("llm_batches", schema=None, recreate="never") as batch_op:
        batch_op.drop_column("suspects")
