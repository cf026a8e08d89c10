"""A duplicate's wait for a live holder: counted once per waiting message, its length a histogram.

A message that finds its key held (on_in_progress="retry") is sent back to the broker and checks again later,
as many times as the holder takes. Counting every re-check as an `in_progress` delivery made one waiting
duplicate look like many (one message, five re-checks: a duplicate ratio of 0.79). So:

    first find of a live holder   count `in_progress` once; the message carries `since` (database clock)
    each re-check still held      nothing counted (the header rides along)
    the delivery that ends it     one observation of `in_progress_wait` (now - since, database clock),
                                  labelled with how it ended: replayed, claimed, conflict, dead or stale

The histogram's `_count` per ending is what the duplicate ratio over first deliveries subtracts: a wait that
ended replayed is the same duplicate as its first `in_progress`, not a second one (ops/metrics.py).
"""

from __future__ import annotations

from bisect import bisect_left

from sqlalchemy import select

from oncelery.models.totals import HISTOGRAMS
from oncelery.runs.outcomes import counter_shard
from oncelery.store.database import Database
from oncelery.store.tables import HISTOGRAM_BUCKETS

__all__ = [
    "WAIT_FAMILY",
    "bucket_of",
    "record_wait",
    "wait_started",
]

WAIT_FAMILY = "in_progress_wait"


def bucket_of(family: str, seconds: float) -> int:
    """The bucket a value lands in: the first whose bound it does not exceed (le), else +Inf (len(bounds))."""
    return bisect_left(HISTOGRAMS[family], seconds)


def wait_started(db: Database) -> float:
    """The database clock now, in seconds since 1970: when a message began to wait (it carries this value)."""
    with db.read() as conn:
        return float(conn.execute(select(db.dialect.epoch())).scalar_one())


def record_wait(db: Database, task_name: str, tenant: str, since: float, ended: str) -> float:
    """Observe one ended wait (database clock now - `since`) in its bucket; return the seconds observed."""
    h = HISTOGRAM_BUCKETS.c
    with db.begin() as conn:
        seconds = max(0.0, float(conn.execute(select(db.dialect.epoch())).scalar_one()) - since)
        stmt = db.dialect.insert(HISTOGRAM_BUCKETS).values(
            family=WAIT_FAMILY,
            task_name=task_name,
            tenant=tenant,
            label=ended,
            bucket=bucket_of(WAIT_FAMILY, seconds),
            shard=counter_shard(),
            count=1,
            total=seconds,
        )
        conn.execute(
            stmt.on_conflict_do_update(
                index_elements=["family", "task_name", "tenant", "label", "bucket", "shard"],
                set_={"count": h.count + 1, "total": h.total + stmt.excluded.total},
            )
        )
    return seconds
