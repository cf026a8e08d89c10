"""Counts the database keeps itself, so the metrics exporter reads a small table instead of scanning a big one.

Triggers (migration 0009) add each row of `task_runs` in status FAILED or DEAD, and each `dead_letters` row,
to a counter row as it is inserted, changes status (or is replayed) and is deleted: every writer, a cascade
of a purge and an operator's own SQL included, keeps them exact without any code knowing. On PostgreSQL a bulk
delete (and every write of letters) is summed once per statement; a TRUNCATE of the counted table empties its
totals. SQLite has no TRUNCATE (its DELETE fires the row triggers).

Histograms (migration 0012): `histogram_buckets` holds one counter per bucket of each duration the exporter
publishes. Triggers observe a run's duration when it becomes COMPLETED (task_runs), a step's when its checkpoint
is written (step_results.seconds) and a model call's latency when its ledger row is inserted (model_calls); the
wait of a duplicate for a live holder has no row, so the delivery that ends the wait writes it
(oncelery.runs.waits). Bucket bounds are HISTOGRAMS below; the triggers compute the bucket with the same bounds
(frozen in migration 0012: changing them is a new migration, and tests compare the buckets with the rows).

Several counter rows per key (`shard` = the counted row's id % 16), summed on read: concurrent writers rarely
wait on one row. A later migration that rebuilds task_runs, step_results, model_calls or dead_letters on SQLite
(batch mode copies the table and drops its triggers) must create the triggers again: tests/test_schema.py
checks they exist at head.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Float, Integer, String
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
        "oncelery_histogram_run_duration",
        "oncelery_histogram_step_duration",
        "oncelery_histogram_llm_call_duration",
    ),
    "sqlite": (
        "oncelery_run_status_totals_insert",
        "oncelery_run_status_totals_update",
        "oncelery_run_status_totals_delete",
        "oncelery_letter_totals_insert",
        "oncelery_letter_totals_update",
        "oncelery_letter_totals_delete",
        "oncelery_histogram_run_duration",
        "oncelery_histogram_step_insert",
        "oncelery_histogram_step_update",
        "oncelery_histogram_llm_call_duration",
    ),
}

#: Histogram families and their bucket upper bounds in seconds (the +Inf bucket is index len(bounds)). A value
#: lands in the first bucket whose bound it does not exceed (Prometheus' `le`).
HISTOGRAMS: dict[str, tuple[float, ...]] = {
    # First claim (created_at) to COMPLETED (finished_at): retries, waits for a retry and takeovers included.
    "run_duration": (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
    # A duplicate's first find of a live holder to the delivery of it that no longer waits (database clock).
    "in_progress_wait": (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
    # A step function's own time (the executing worker's monotonic clock), for each checkpoint written.
    "step_duration": (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
    # A model call's latency as the ledger row records it (latency_ms / 1000).
    "llm_call_duration": (0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300),
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
    # Letters ever inserted (0012): never lowered by a delete, a purge or a TRUNCATE, unlike `letters`.
    created: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")


class HistogramBucket(Base):
    """Observations per (family, task, tenant, label) falling in one bucket, and their sum of seconds."""

    __tablename__ = "histogram_buckets"

    family: Mapped[str] = mapped_column(String(32), primary_key=True)
    task_name: Mapped[str] = mapped_column(String(255), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(255), primary_key=True)
    # The family's own label: the model (llm_call_duration), how the wait ended (in_progress_wait), else "".
    label: Mapped[str] = mapped_column(String(255), primary_key=True)
    bucket: Mapped[int] = mapped_column(Integer, primary_key=True)  # index into HISTOGRAMS[family]
    shard: Mapped[int] = mapped_column(Integer, primary_key=True)
    count: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    total: Mapped[float] = mapped_column(Float, nullable=False, server_default="0")
