"""running totals for the metrics exporter: ledger_totals, task_runs.llm_*, delivery_outcomes step/saved sums

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03 10:00:00

The backfill makes the totals agree with what the database already holds: ledger_totals and each run's
llm_* from model_calls; the saved figures (replays x the run's ok calls), checkpointed steps and takeovers of
COMPLETED runs go to one extra counter row per (task, tenant) with shard -1 and count 0 (workers never use a
negative shard), so no delivery count changes. Steps replayed before this revision are unknown: they start
at 0.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def _counter(name: str) -> sa.Column[int]:
    return sa.Column(name, sa.BigInteger(), server_default="0", nullable=False)


def _usd(name: str) -> sa.Column[float]:
    return sa.Column(name, sa.Float(), server_default="0", nullable=False)


_OUTCOME_TOTALS = ("steps_executed", "steps_replayed", "takeovers", "saved_calls", "saved_input_tokens")
_OUTCOME_TOTALS += ("saved_output_tokens",)


def upgrade() -> None:
    """Apply this revision, then backfill the totals from the rows already there."""
    with op.batch_alter_table("task_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("llm_calls", sa.Integer(), server_default="0", nullable=False))
        batch_op.add_column(_counter("llm_input_tokens"))
        batch_op.add_column(_counter("llm_output_tokens"))
        batch_op.add_column(_usd("llm_cost"))
    with op.batch_alter_table("delivery_outcomes", schema=None) as batch_op:
        for name in _OUTCOME_TOTALS:
            batch_op.add_column(_counter(name))
        batch_op.add_column(_usd("saved_cost"))
    op.create_table(
        "ledger_totals",
        sa.Column("task_name", sa.String(length=255), nullable=False),
        sa.Column("tenant", sa.String(length=255), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=False),
        _counter("calls"),
        _counter("failed_calls"),
        _counter("input_tokens"),
        _counter("output_tokens"),
        _usd("cost"),
        _counter("unpriced_calls"),
        sa.PrimaryKeyConstraint("task_name", "tenant", "model", name=op.f("pk_ledger_totals")),
    )
    _backfill()


def _backfill() -> None:
    # Plain SQL both dialects run: correlated subqueries, no UPDATE ... FROM (SQLite < 3.33 lacks it).
    op.execute(
        """
        INSERT INTO ledger_totals (task_name, tenant, model, calls, failed_calls, input_tokens, output_tokens,
                                   cost, unpriced_calls)
        SELECT COALESCE(task_name, ''), tenant, model, COUNT(*),
               SUM(CASE WHEN ok THEN 0 ELSE 1 END), SUM(input_tokens), SUM(output_tokens),
               COALESCE(SUM(cost), 0), SUM(CASE WHEN cost IS NULL THEN 1 ELSE 0 END)
        FROM model_calls GROUP BY COALESCE(task_name, ''), tenant, model
        """
    )
    for column, expr in (
        ("llm_calls", "COUNT(*)"),
        ("llm_input_tokens", "COALESCE(SUM(m.input_tokens), 0)"),
        ("llm_output_tokens", "COALESCE(SUM(m.output_tokens), 0)"),
        ("llm_cost", "COALESCE(SUM(m.cost), 0)"),
    ):
        op.execute(
            f"UPDATE task_runs SET {column} = (SELECT {expr} FROM model_calls m WHERE m.run_id = task_runs.id "
            f"AND m.ok) WHERE id IN (SELECT run_id FROM model_calls WHERE ok AND run_id IS NOT NULL)"
        )
    op.execute(
        """
        INSERT INTO delivery_outcomes (task_name, tenant, outcome, shard, count, steps_executed, steps_replayed,
                                       takeovers, saved_calls, saved_input_tokens, saved_output_tokens, saved_cost)
        SELECT r.task_name, r.tenant, 'replayed', -1, 0, 0, 0, 0, SUM(r.replays * r.llm_calls),
               SUM(r.replays * r.llm_input_tokens), SUM(r.replays * r.llm_output_tokens),
               SUM(r.replays * r.llm_cost)
        FROM task_runs r WHERE r.replays > 0 GROUP BY r.task_name, r.tenant
        """
    )
    op.execute(
        """
        INSERT INTO delivery_outcomes (task_name, tenant, outcome, shard, count, steps_executed, steps_replayed,
                                       takeovers, saved_calls, saved_input_tokens, saved_output_tokens, saved_cost)
        SELECT r.task_name, r.tenant, 'executed', -1, 0,
               SUM((SELECT COUNT(*) FROM step_results s WHERE s.run_id = r.id)), 0, SUM(r.fencing_token - 1),
               0, 0, 0, 0
        FROM task_runs r WHERE r.status = 'COMPLETED' GROUP BY r.task_name, r.tenant
        """
    )


def downgrade() -> None:
    """Revert this revision (the totals are dropped; the rows they summed stay)."""
    op.execute("DELETE FROM delivery_outcomes WHERE shard = -1")
    op.drop_table("ledger_totals")
    with op.batch_alter_table("delivery_outcomes", schema=None) as batch_op:
        for name in (*_OUTCOME_TOTALS, "saved_cost"):
            batch_op.drop_column(name)
    with op.batch_alter_table("task_runs", schema=None) as batch_op:
        for name in ("llm_cost", "llm_output_tokens", "llm_input_tokens", "llm_calls"):
            batch_op.drop_column(name)
