"""Counts the database keeps itself, so the metrics exporter reads a small table instead of scanning a big one.

Triggers (migration 0009) add each row of `task_runs` in status FAILED or DEAD, and each `dead_letters` row,
to a counter row as it is inserted, changes status (or is replayed) and is deleted: every writer, a cascade
of a purge and an operator's own SQL included, keeps them exact without any code knowing. On PostgreSQL a bulk
delete (and every write of letters) is summed once per statement; a TRUNCATE of the counted table empties its
totals. SQLite has no TRUNCATE (its DELETE fires the row triggers).

Several counter rows per key (`shard` = the counted row's id % 16), summed on read: concurrent writers rarely
wait on one row. A later migration that rebuilds task_runs or dead_letters on SQLite (batch mode copies the
table and drops its triggers) must create the triggers again: tests/test_schema.py checks they exist at head.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from oncelery.models.base import Base
from oncelery.models.runs import RunStatus, _enum

#: The statuses whose runs are counted (the others: RUNNING is a small partial index, COMPLETED a counter).
COUNTED_STATUSES = (RunStatus.FAILED, RunStatus.DEAD)
#: The triggers migration 0009 creates, per dialect (tests check each exists at head).
TRIGGERS = {
    "postgresql": (
        "oncelery_run_status_totals_insert",
        "oncelery_run_status_totals_update",
        "oncelery_run_status_totals_delete",
        "oncelery_run_status_totals_truncate",
        "oncelery_letter_totals_insert",
        "oncelery_letter_totals_update",
        "oncelery_letter_totals_delete",
        "oncelery_letter_totals_truncate",
    ),
    "sqlite": (
        "oncelery_run_status_totals_insert",
        "oncelery_run_status_totals_update",
        "oncelery_run_status_totals_delete",
        "oncelery_letter_totals_insert",
        "oncelery_letter_totals_update",
        "oncelery_letter_totals_delete",
    ),
}


class RunStatusTotal(Base):
    """Runs now FAILED or DEAD per (task, status), kept by triggers on task_runs (summed over shards)."""

    __tablename__ = "run_status_totals"

    task_name: Mapped[str] = mapped_column(String(255), primary_key=True)
    status: Mapped[RunStatus] = mapped_column(_enum(RunStatus, "run_status"), primary_key=True)
    shard: Mapped[int] = mapped_column(Integer, primary_key=True)
    runs: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")


class LetterTotal(Base):
    """Dead letters now kept per (task, reason), and how many of them were replayed, kept by triggers."""

    __tablename__ = "letter_totals"

    task_name: Mapped[str] = mapped_column(String(255), primary_key=True)
    reason: Mapped[str] = mapped_column(String(32), primary_key=True)
    shard: Mapped[int] = mapped_column(Integer, primary_key=True)
    letters: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    replayed: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
