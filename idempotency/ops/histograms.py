"""The exported histograms, read from their bucket counters (histogram_buckets), and the tenant label's cap.

Where the buckets come from: the exporter counts nothing, so each histogram is a table of counters written with
what it measures, in the same transaction (models/totals.py): triggers observe a run's duration when it becomes
COMPLETED, a step's when its checkpoint is written and a model call's latency when its ledger row is inserted;
the delivery that ends a duplicate's wait writes that wait (runs/waits.py). A scrape reads one small table
(a row per family, task, tenant, label, bucket and shard), never the runs, steps or calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime

from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from sqlalchemy import Connection, func, select

from oncelery.models.totals import HISTOGRAMS
from oncelery.store.tables import HISTOGRAM_BUCKETS, OUTCOMES

__all__ = [
    "FAMILIES",
    "OTHER_TENANT",
    "Family",
    "TenantCap",
    "age_seconds",
    "histogram_families",
    "tenant_cap",
]

PREFIX = "oncelery"
OTHER_TENANT = "other"  # the tenants past the cap, summed (a tenant really named "other" joins them)


@dataclass(frozen=True)
class Family:
    """One histogram: its metric name, help text, and the name of its own label (None: no third label)."""

    metric: str
    help: str
    label: str | None = None


FAMILIES = {
    "run_duration": Family(
        "run_duration_seconds", "Seconds from a run's first claim to COMPLETED (retries and takeovers included)."
    ),
    "in_progress_wait": Family(
        "in_progress_wait_seconds",
        "Seconds a duplicate waited for a live holder (database clock), by how the wait ended.",
        "ended",
    ),
    "step_duration": Family("step_duration_seconds", "Seconds a step's function took, per checkpoint written."),
    "llm_call_duration": Family(
        "llm_call_duration_seconds", "Model-call latency as the cost ledger records it.", "model"
    ),
}


class TenantCap:
    """Maps a tenant to its label: itself if among the `keep` most active tenants, else OTHER_TENANT.

    While fewer tenants than the cap have deliveries (`full` False), every tenant keeps its label: one seen only
    in the ledger or the histograms (no delivery counted yet) is not summed away for nothing.
    """

    def __init__(self, keep: Iterable[str], full: bool = True) -> None:
        self.keep = frozenset(keep)
        self.full = full

    def __call__(self, tenant: str) -> str:
        """The tenant label to publish for `tenant`."""
        return tenant if tenant in self.keep or not self.full else OTHER_TENANT


def tenant_cap(conn: Connection, max_tenants: int) -> TenantCap:
    """The `max_tenants` tenants with the most deliveries ever (ties by name) keep their label; others are "other"."""
    c = OUTCOMES.c
    total = func.sum(c.count)
    # One more than the cap: whether any tenant is left over decides if the cap is full.
    ranked = list(
        conn.execute(
            select(c.tenant).group_by(c.tenant).order_by(total.desc(), c.tenant).limit(max_tenants + 1)
        ).scalars()
    )
    return TenantCap(ranked[:max_tenants], full=len(ranked) > max_tenants)


def histogram_families(conn: Connection, cap: TenantCap) -> Iterator[Metric]:
    """Every histogram family, cumulative buckets per (task, tenant[, label]); a family with no data is empty."""
    h = HISTOGRAM_BUCKETS.c
    rows = conn.execute(
        select(h.family, h.task_name, h.tenant, h.label, h.bucket, func.sum(h.count), func.sum(h.total)).group_by(
            h.family, h.task_name, h.tenant, h.label, h.bucket
        )
    ).all()
    # family -> (task, tenant label, label) -> [count per bucket (the last: +Inf)], and the sum of seconds
    counts: dict[str, dict[tuple[str, str, str], list[int]]] = {name: {} for name in FAMILIES}
    sums: dict[tuple[str, str, str, str], float] = {}
    for family, task, tenant, label, bucket, n, total in rows:
        bounds = HISTOGRAMS.get(family)
        if bounds is None:  # written by a newer version: not ours to publish
            continue
        key = (task, cap(tenant), label)
        per_bucket = counts[family].setdefault(key, [0] * (len(bounds) + 1))
        per_bucket[min(int(bucket), len(bounds))] += int(n)
        sums[(family, *key)] = sums.get((family, *key), 0.0) + float(total or 0)
    for family, spec in FAMILIES.items():
        labels = ["name", "tenant", *([spec.label] if spec.label else [])]
        metric = HistogramMetricFamily(f"{PREFIX}_{spec.metric}", spec.help, labels=labels)
        bounds = HISTOGRAMS[family]
        for (task, tenant, label), per_bucket in sorted(counts[family].items()):
            cumulative, running = [], 0
            for bound, n in zip([*(_le(b) for b in bounds), "+Inf"], per_bucket, strict=True):
                running += n
                cumulative.append((bound, float(running)))
            values = [task, tenant, *([label] if spec.label else [])]
            metric.add_metric(values, cumulative, sums[(family, task, tenant, label)])
        yield metric


def _le(bound: float) -> str:
    # Prometheus client libraries print bounds as floats ("0.5", "1.0"): the same text joins their series.
    return repr(float(bound))


def age_seconds(clock: datetime, moment: datetime | None) -> float:
    """Seconds from `moment` to the database's `clock` (0 for none), whatever the datetimes' awareness."""
    if moment is None:
        return 0.0
    # PostgreSQL returns aware datetimes, SQLite naive UTC ones: compare like with like.
    if (clock.tzinfo is None) != (moment.tzinfo is None):
        clock, moment = clock.replace(tzinfo=None), moment.replace(tzinfo=None)
    return max(0.0, (clock - moment).total_seconds())
