"""Prometheus metrics of the claims database, read at scrape time: exact across processes, hosts and restarts.

Nothing is counted in this process: every value is a query on the database, so any number of exporters (or
a restarted one) report the same figures. Every query reads a small table (delivery_outcomes, ledger_totals,
the totals triggers keep of FAILED/DEAD runs and of dead letters, histogram_buckets: models/totals.py, and
ops/histograms.py) or walks a bounded
index (the partial index of RUNNING runs, the outbox rows not yet sent); none scans task_runs, dead_letters,
step_results or model_calls. docs/metrics.md gives each metric's definition and cost.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from datetime import datetime
from importlib import metadata
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from sqlalchemy import ColumnElement, Connection, DateTime, case, func, select, text, type_coerce

from oncelery.errors import OnceleryError
from oncelery.models import Outcome, RunStatus
from oncelery.ops.histograms import TenantCap, age_seconds, histogram_families, tenant_cap
from oncelery.ops.ledger_metrics import (
    budget_families,
    ledger_families,
    lifetime_families,
    limiter_families,
    open_call_families,
)
from oncelery.runs.waits import WAIT_FAMILY
from oncelery.settings import DEFAULT_METRICS_MAX_TENANTS
from oncelery.store.database import Database
from oncelery.store.tables import (
    HISTOGRAM_BUCKETS,
    LETTER_TOTALS,
    OUTBOX,
    OUTCOME_TOTALS,
    OUTCOMES,
    RUN_STATUS_TOTALS,
    RUNS,
    STEPS,
)

__all__ = ["COMPLETING_OUTCOMES", "DUPLICATE_OUTCOMES", "ClaimsCollector", "claims_registry"]

logger = logging.getLogger("oncelery.metrics")  # a stable name (users filter on it)

PREFIX = "oncelery"
# Literal predicates, not bound parameters: a prepared statement's generic plan cannot prove `status = $1`
# implies a partial index's `status = 'RUNNING'`, and would fall back to a scan of every run.
_RUNNING = text("task_runs.status = 'RUNNING'")
_WAITING = text("task_runs.status = 'WAITING'")  # literal, as _RUNNING: it matches the partial index's predicate
_PENDING = text("outbox.status = 'PENDING'")
# The framework branch's Alembic version table (models/migrate.py), read for oncelery_build_info.
FRAMEWORK_VERSION_TABLE = "oncelery_alembic_version"
# Deliveries that found the work already done or under way: what an at-least-once broker duplicated. THE
# definition (docs/metrics.md, the alert): a conflict is a client's error, never a duplicate.
DUPLICATE_OUTCOMES = (Outcome.REPLAYED.value, Outcome.IN_PROGRESS.value)
# Deliveries that moved a run to COMPLETED (a COMPLETED run is final: each completes one run, once).
# A superseded run moves to COMPLETED too (with no result), fenced out by a newer edit (runs/debounce.py).
COMPLETING_OUTCOMES = (Outcome.EXECUTED.value, Outcome.RESUMED.value, Outcome.STALE.value, Outcome.SUPERSEDED.value)


class ClaimsCollector(Collector):
    """Yields every `oncelery_*` metric from one read of the claims database per scrape."""

    def __init__(self, url: str, tasks: Iterable[str] = (), max_tenants: int = DEFAULT_METRICS_MAX_TENANTS) -> None:
        self.db = Database(url)
        self.url = url
        self.tasks = tuple(tasks)  # known before any run: their outcome series are exported at 0
        self.max_tenants = max_tenants

    def describe(self) -> Iterable[Metric]:
        """Nothing: registering must not query the database (the registry then calls collect on scrape only)."""
        return []

    def collect(self) -> Iterator[Metric]:
        """Every metric, or only `oncelery_database_up 0` if the database cannot be read (logged)."""
        started = time.perf_counter()
        up = GaugeMetricFamily(f"{PREFIX}_database_up", "1 if the last scrape read the claims database, else 0.")
        try:
            families = list(self._families())
        except OnceleryError as exc:
            logger.warning("metrics: cannot read the claims database: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families
        took = GaugeMetricFamily(f"{PREFIX}_scrape_duration_seconds", "Seconds the last scrape spent in the database.")
        took.add_metric([], time.perf_counter() - started)
        yield took

    def _families(self) -> Iterator[Metric]:
        with self.db.read() as conn:
            clock = conn.execute(select(database_clock(self.db))).scalar_one()
            cap = tenant_cap(conn, self.max_tenants)
            yield build_info(conn)
            yield from outcome_families(conn, cap, self.tasks)
            yield from run_families(conn, self.db, clock)
            yield from step_families(conn)
            yield from queue_families(conn, clock)
            yield from ledger_families(conn, cap)
            yield from open_call_families(conn, clock)
            yield from limiter_families(conn, clock)
            yield from budget_families(conn, clock)
            yield from histogram_families(conn, cap)


def claims_registry(
    url: str, tasks: Iterable[str] = (), max_tenants: int = DEFAULT_METRICS_MAX_TENANTS
) -> CollectorRegistry:
    """A registry holding only the claims collector (no process metrics: they would differ per exporter)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ClaimsCollector(url, tasks, max_tenants))
    return registry


# -- deliveries (delivery_outcomes: a few rows per task, tenant and outcome) ---------------------------------


def outcome_families(conn: Connection, cap: TenantCap, tasks: Iterable[str] = ()) -> Iterator[Metric]:
    """Deliveries per outcome (every outcome present, 0 included, for each known task), lease_lost writes,
    completed runs, and the lifetime duplicate ratio over first deliveries per task."""
    c = OUTCOMES.c
    sums = [func.sum(c[name]) for name in OUTCOME_TOTALS]
    rows = conn.execute(
        select(c.task_name, c.tenant, c.outcome, func.sum(c.count), *sums).group_by(c.task_name, c.tenant, c.outcome)
    ).all()
    counts: dict[tuple[str, str, str], int] = {}  # (task, tenant label, outcome) -> deliveries
    lifetime: dict[tuple[str, str], list[int]] = {}  # (task, tenant) -> OUTCOME_TOTALS summed over outcomes
    for task, tenant, outcome, n, *added in rows:
        tenant = cap(tenant)
        into = lifetime.setdefault((task, tenant), [0] * len(OUTCOME_TOTALS))
        for i, figure in enumerate(added):
            into[i] += int(figure or 0)  # integers all (micro-USD for the cost): summed exactly
        key = (task, tenant, outcome.value)
        counts[key] = counts.get(key, 0) + int(n)  # a backfill row (migration 0007) adds 0: totals only
    # Zero series: every outcome of every known task exists before it first happens, so `rate()` and
    # `absent()` need no `or vector(0)`. A task seen with tenants gets them; a configured one tenant "".
    tenants: dict[str, set[str]] = {}
    for task, tenant, _ in counts:
        tenants.setdefault(task, set()).add(tenant)
    for task in tasks:
        tenants.setdefault(task, {""})
    for task, seen in tenants.items():
        for tenant in seen:
            lifetime.setdefault((task, tenant), [0] * len(OUTCOME_TOTALS))
    deliveries = CounterMetricFamily(
        f"{PREFIX}_deliveries",
        "Deliveries by the outcome each recorded (a waiting duplicate counts in_progress once, not per re-check).",
        labels=["name", "tenant", "outcome"],
    )
    refused = CounterMetricFamily(
        f"{PREFIX}_zombie_writes_refused",
        "Completions refused because the holder's lease was lost (the lease_lost outcome): zombie writes fenced.",
        labels=["name", "tenant"],
    )
    completed = CounterMetricFamily(
        f"{PREFIX}_runs_completed",
        "Runs moved to COMPLETED (outcomes executed + resumed + stale + superseded; purging old runs does not "
        "lower it).",
        labels=["name", "tenant"],
    )
    per_task: dict[str, list[int]] = {}  # task -> [duplicates, all]
    for task in sorted(tenants):
        for tenant in sorted(tenants[task]):
            of = {outcome.value: counts.get((task, tenant, outcome.value), 0) for outcome in Outcome}
            for value, n in of.items():
                deliveries.add_metric([task, tenant, value], n)
            refused.add_metric([task, tenant], of[Outcome.LEASE_LOST.value])
            completed.add_metric([task, tenant], sum(of[value] for value in COMPLETING_OUTCOMES))
            totals = per_task.setdefault(task, [0, 0])
            totals[0] += sum(of[value] for value in DUPLICATE_OUTCOMES)
            # A park's wake re-delivers the same message: `waiting` deliveries are not first deliveries.
            totals[1] += sum(of.values()) - of[Outcome.WAITING.value]
    ratio = GaugeMetricFamily(
        f"{PREFIX}_duplicate_ratio",
        "Duplicates among first deliveries of the task (a waiting message counts once), since the database began.",
        labels=["name"],
    )
    ended = wait_ends(conn)
    for task, (duplicates, total) in sorted(per_task.items()):
        # A wait's ending delivery repeats its message's first one (in_progress): it is not a first delivery,
        # and if it ended replayed, not a second duplicate either (runs/waits.py).
        waits = ended.get(task, {})
        first = total - sum(waits.values())
        duplicates -= waits.get(Outcome.REPLAYED.value, 0)
        ratio.add_metric([task], min(1.0, max(0.0, duplicates / first)) if first > 0 else 0.0)
    yield from (deliveries, refused, completed, ratio)
    yield from lifetime_families(lifetime)


def wait_ends(conn: Connection) -> dict[str, dict[str, int]]:
    """{task: {how a wait ended: waits}}: the deliveries that stopped waiting (in_progress_wait's counts)."""
    h = HISTOGRAM_BUCKETS.c
    rows = conn.execute(
        select(h.task_name, h.label, func.sum(h.count)).where(h.family == WAIT_FAMILY).group_by(h.task_name, h.label)
    ).all()
    ended: dict[str, dict[str, int]] = {}
    for task, label, n in rows:
        ended.setdefault(task, {})[label] = int(n)
    return ended


# -- runs (the partial index of RUNNING runs; run_status_totals for FAILED and DEAD) -------------------------


def database_clock(db: Database) -> ColumnElement[Any]:
    """The database's clock as a datetime column (every age is measured by it, never by this host's clock)."""
    return type_coerce(db.dialect.now(), DateTime(timezone=True))


def run_families(conn: Connection, db: Database, clock: datetime) -> Iterator[Metric]:
    """Runs RUNNING/FAILED/DEAD per task, lease ages by the database clock, and takeovers of RUNNING runs."""
    c = RUNS.c
    now = database_clock(db)
    expired = c.lease_expires_at < now  # the sweeper's test: a RUNNING run whose holder stopped renewing
    running = conn.execute(
        select(
            c.task_name,
            func.count(),
            # A live holder's lease started at its claim (updated_at; heartbeats move only lease_expires_at).
            func.min(case((expired, None), else_=c.updated_at)),
            func.min(case((expired, c.lease_expires_at), else_=None)),
            func.coalesce(func.sum(c.fencing_token - 1), 0),
            func.coalesce(func.sum(c.lost), 0),
        )
        .where(_RUNNING)
        .group_by(c.task_name)
    ).all()
    t = RUN_STATUS_TOTALS.c  # FAILED and DEAD, counted by triggers: a few shard rows per task and status
    finished = conn.execute(select(t.task_name, t.status, func.sum(t.runs)).group_by(t.task_name, t.status)).all()
    runs = GaugeMetricFamily(
        f"{PREFIX}_runs",
        "Runs now in a status (RUNNING, WAITING, FAILED, DEAD; COMPLETED is oncelery_runs_completed_total).",
        labels=["name", "status"],
    )
    live = GaugeMetricFamily(
        f"{PREFIX}_oldest_live_lease_age_seconds",
        "Seconds since the longest-held live lease of a RUNNING run was claimed (0: none).",
        labels=["name"],
    )
    lapsed = GaugeMetricFamily(
        f"{PREFIX}_oldest_expired_lease_age_seconds",
        "Seconds since the oldest expired lease of a RUNNING run expired: a lost holder not yet taken over (0: none).",
        labels=["name"],
    )
    takeovers = GaugeMetricFamily(
        f"{PREFIX}_running_takeovers",
        "Takeovers (fencing_token - 1, summed) of the runs now RUNNING: retries and lost holders.",
        labels=["name"],
    )
    lost = GaugeMetricFamily(
        f"{PREFIX}_running_lost_deliveries",
        "Deliveries whose holder vanished (lease expired while RUNNING), summed over the runs now RUNNING.",
        labels=["name"],
    )
    for task, n, oldest_live, oldest_expiry, bumps, vanished in running:
        runs.add_metric([task, "RUNNING"], int(n))
        live.add_metric([task], age_seconds(clock, oldest_live))
        lapsed.add_metric([task], age_seconds(clock, oldest_expiry))
        takeovers.add_metric([task], int(bumps))
        lost.add_metric([task], int(vanished))
    for task, status, n in finished:
        runs.add_metric([task, status.value], int(n))
    # Parked runs (few: the partial index of WAITING runs), and how late the oldest wake is: a wake the relay
    # should have sent already (no `oncelery relay` running, or one that cannot publish).
    waiting = conn.execute(
        select(c.task_name, func.count(), func.min(c.not_before)).where(_WAITING).group_by(c.task_name)
    ).all()
    overdue = GaugeMetricFamily(
        f"{PREFIX}_oldest_overdue_wake_seconds",
        "Seconds since the oldest WAITING run's wake time passed with no delivery taking it (0: none); "
        "above a minute, no relay is waking parked runs.",
        labels=["name"],
    )
    for task, n, oldest_wake in waiting:
        runs.add_metric([task, RunStatus.WAITING.value], int(n))
        overdue.add_metric([task], age_seconds(clock, oldest_wake))
    yield from (runs, live, lapsed, takeovers, lost, overdue)


# -- steps of RUNNING runs (index of RUNNING runs, then step_results by run_id) --------------------------------


def step_families(conn: Connection) -> Iterator[Metric]:
    """Checkpointed steps of the RUNNING runs: executed by the current holder, or replayed from an earlier one."""
    s, r = STEPS.c, RUNS.c
    # Correlated per RUNNING run, so each is an index lookup on step_results(run_id, position): a join lets
    # the planner hash the whole step_results table instead.
    mine = select(func.count()).where(s.run_id == r.id, s.token == r.fencing_token).scalar_subquery()
    earlier = select(func.count()).where(s.run_id == r.id, s.token < r.fencing_token).scalar_subquery()
    per_run = select(r.task_name, mine.label("mine"), earlier.label("earlier")).where(_RUNNING).subquery()
    p = per_run.c
    rows = conn.execute(
        select(p.task_name, func.coalesce(func.sum(p.mine), 0), func.coalesce(func.sum(p.earlier), 0)).group_by(
            p.task_name
        )
    ).all()
    executed = GaugeMetricFamily(
        f"{PREFIX}_running_steps_executed",
        "Steps the current holders of RUNNING runs executed and checkpointed.",
        labels=["name"],
    )
    replayed = GaugeMetricFamily(
        f"{PREFIX}_running_steps_replayed",
        "Steps of RUNNING runs checkpointed by an earlier holder: replayed after a takeover, not re-executed.",
        labels=["name"],
    )
    for task, mine, earlier in rows:
        executed.add_metric([task], int(mine))
        replayed.add_metric([task], int(earlier))
    yield from (executed, replayed)


# -- outbox backlog (index of status) and dead letters (letter_totals) -----------------------------------------


def queue_families(conn: Connection, clock: datetime) -> Iterator[Metric]:
    """Outbox rows waiting to be published (and the oldest one's age), and dead letters not yet replayed."""
    o, d = OUTBOX.c, LETTER_TOTALS.c  # letters counted by triggers: a few shard rows per task and reason
    pending, oldest = conn.execute(select(func.count(), func.min(o.created_at)).where(_PENDING)).one()
    letters = conn.execute(
        select(d.task_name, d.reason, func.sum(d.letters), func.sum(d.replayed), func.sum(d.created)).group_by(
            d.task_name, d.reason
        )
    ).all()
    backlog = GaugeMetricFamily(f"{PREFIX}_outbox_pending", "Outbox rows committed but not yet published.")
    backlog.add_metric([], int(pending))
    age = GaugeMetricFamily(
        f"{PREFIX}_outbox_oldest_pending_age_seconds", "Seconds the oldest unpublished outbox row has waited (0: none)."
    )
    age.add_metric([], age_seconds(clock, oldest))
    dead = GaugeMetricFamily(
        f"{PREFIX}_dead_letters",
        "Dead letters (runs or messages that will never succeed as they are), replayed ones included.",
        labels=["name", "reason"],
    )
    replayed = GaugeMetricFamily(
        f"{PREFIX}_dead_letters_replayed",
        "Dead letters sent again with `oncelery dlq replay`.",
        labels=["name", "reason"],
    )
    created = CounterMetricFamily(
        f"{PREFIX}_dead_letters_created",
        "Dead letters ever written: a purge or TRUNCATE never lowers it (alert on its increase, not the gauge's).",
        labels=["name", "reason"],
    )
    for task, reason, n, again, made in letters:
        dead.add_metric([task, reason], int(n))
        replayed.add_metric([task, reason], int(again))
        created.add_metric([task, reason], int(made))
    yield from (backlog, age, dead, replayed, created)


# -- build ----------------------------------------------------------------------------------------------------


def build_info(conn: Connection) -> Metric:
    """`oncelery_build_info{version, schema_revision} 1`: the exporter's version and the database's schema head."""
    revision = conn.execute(text(f"SELECT version_num FROM {FRAMEWORK_VERSION_TABLE}")).scalar()
    info = GaugeMetricFamily(
        f"{PREFIX}_build_info",
        "1, labelled with the exporter's Oncelery version and the claims database's schema revision.",
        labels=["version", "schema_revision"],
    )
    info.add_metric([_version(), str(revision or "")], 1)
    return info


def _version() -> str:
    try:
        return metadata.version("oncelery")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"
