"""run browsing indexes: task_runs pages, newest first, by status, task, tenant and a few outcomes

Revision ID: 0028
Revises: 0027
Create Date: 2026-12-05 09:00:00

Flower's Runs section (oncelery.runs.browse) pages through runs newest first (by id) with a keyset: each page is
one short range of an index, never an OFFSET and never a scan. These five indexes are the ranges: (status, id),
(task_name, status, id) and (tenant, status, id) for the filters, and two partial indexes on id for the runs taken
over (or that lost a holder, or retried) and those that answered duplicates, which stay small.

On a large PostgreSQL table, CREATE INDEX holds off writes to task_runs while it builds: create them beforehand
with CREATE INDEX CONCURRENTLY (the statements are in docs/flower.md); this revision then finds them and skips
them (IF NOT EXISTS).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0028"
down_revision = "0027"
branch_labels = None
depends_on = None

# The partial indexes' predicates as models/runs.py writes them (TAKEN_OVER, REPLAYED), frozen at this revision.
_TAKEN_OVER = "fencing_token > 1 OR lost > 0 OR retries > 0"
_REPLAYED = "replays > 0"
_INDEXES: tuple[tuple[str, list[str], str | None], ...] = (
    ("ix_task_runs_status_id", ["status", "id"], None),
    ("ix_task_runs_task_name_status_id", ["task_name", "status", "id"], None),
    ("ix_task_runs_tenant_status_id", ["tenant", "status", "id"], None),
    ("ix_task_runs_taken_over", ["id"], _TAKEN_OVER),
    ("ix_task_runs_replayed", ["id"], _REPLAYED),
)


def upgrade() -> None:
    """Apply this revision."""
    for name, columns, where in _INDEXES:
        partial = {} if where is None else {"postgresql_where": sa.text(where), "sqlite_where": sa.text(where)}
        op.create_index(name, "task_runs", columns, unique=False, if_not_exists=True, **partial)


def downgrade() -> None:
    """Revert this revision."""
    for name, _, _ in reversed(_INDEXES):
        op.drop_index(name, table_name="task_runs", if_exists=True)
