"""Retention: delete finished runs (with their steps, dead letters and ledger rows) in bounded batches.

Only COMPLETED runs and FAILED ones with no retry pending are deleted, never RUNNING ones (a holder may be
on it) and never DEAD ones (they wait in the dead-letter queue for a person: `oncelery dlq purge`). Each
batch is its own short transaction, walking the primary key, so workers keep claiming meanwhile. A key whose
run was purged executes again if it is sent again. Entity versions are kept: purging them would let a stale
event apply. Letters without a run (a conflict, a bad message, a capped re-publish) and closed outbox rows go
by the same age.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, and_, delete, func, inspect, or_, select
from sqlalchemy.exc import IntegrityError

from oncelery.errors import ConfigurationError
from oncelery.ledger.unknown import UNKNOWN_OUTCOME, abandon_runs_intents_txn
from oncelery.models import OutboxStatus, RunStatus
from oncelery.runs.debounce import purge_dispatched
from oncelery.runs.faults import fault_point
from oncelery.runs.retention import clear_kept_arguments, delete_runs_txn
from oncelery.settings import CONF_KEPT_ARGUMENTS_RETENTION, DEFAULT_KEPT_ARGUMENTS_RETENTION
from oncelery.store.database import Database
from oncelery.store.tables import LETTERS, OUTBOX, RUNS

__all__ = [
    "DEFAULT_BATCH",
    "DEFAULT_RETENTION_SECONDS",
    "LEDGER_TABLES",
    "MAX_BATCH_SECONDS",
    "PurgeReport",
    "parse_age",
    "purge",
]

logger = logging.getLogger("oncelery.retention")  # a stable name (users filter on it)

#: Tables that hold rows per run (by a `run_id` column) without a foreign key: the model-call cost ledger.
LEDGER_TABLES = ("model_calls",)
DEFAULT_BATCH = 1000
#: The longest a purge batch should hold its transaction (SQLite's one writer lock, PostgreSQL's row locks):
#: a batch that took longer halves the next one, so workers' lease renewals never wait past their lease.
MAX_BATCH_SECONDS = 0.25
#: The relay's default retention (`oncelery relay --retention`): a week, above Stripe's 24 hours.
DEFAULT_RETENTION_SECONDS = 7 * 24 * 3600.0

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_age(text: str) -> float:
    """Seconds in an age such as `7d`, `24h`, `90m`, `30s`, `2w` (a bare number is seconds)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", str(text))
    if m is None:
        raise ConfigurationError(f"age {text!r}: give a number with a unit, e.g. 7d, 24h, 90m, 30s")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


@dataclass
class PurgeReport:
    """How many rows a purge deleted, per table, and how many runs it kept because a table refers to them."""

    runs: int = 0
    steps: int = 0
    dead_letters: int = 0
    ledger: int = 0
    intents: int = 0
    batch_items: int = 0
    outbox: int = 0
    kept_referenced: int = 0
    batches: int = 0
    kept_arguments: int = 0  # completed runs whose kept arguments were cleared (runs/kept.py)
    debounce_rows: int = 0  # dispatched debounce rows idle past the kept-arguments retention (runs/debounce.py)


def kept_arguments_age(conf: Any = None) -> float:
    """Seconds a completed run keeps its arguments: `oncelery_kept_arguments_retention` of `conf`, else 7d."""
    value = None if conf is None else conf.get(CONF_KEPT_ARGUMENTS_RETENTION)
    return parse_age(value if value is not None else DEFAULT_KEPT_ARGUMENTS_RETENTION)


def purge(
    db: Database,
    older_than: float,
    batch: int = DEFAULT_BATCH,
    on_batch: Callable[[PurgeReport], None] | None = None,
    forget: Callable[[list[tuple[str, str, str]]], object] | None = None,
    kept_older_than: float | None = None,
) -> PurgeReport:
    """Delete runs that finished more than `older_than` seconds ago (database clock), `batch` per transaction.

    `forget`: called with the (task, tenant, key) of each batch's deleted runs once it committed (the replay
    cache drops their entries, so a purged key is forgotten there too). `kept_older_than`: the age past which a
    completed run's kept arguments are cleared (default: oncelery_kept_arguments_retention's default, 7d).
    """
    if older_than < 0 or batch < 1:
        raise ConfigurationError("purge: older_than must be >= 0 seconds and batch >= 1")
    report = PurgeReport()
    r = RUNS.c
    dia = db.dialect
    cutoff = dia.lease_until("p_age")
    params = {"p_age": dia.lease_param(-older_than)}
    finished = or_(
        r.status == RunStatus.COMPLETED,
        and_(r.status == RunStatus.FAILED, r.not_before.is_(None)),
    )
    with db.read() as conn:
        ledgers = [name for name in LEDGER_TABLES if inspect(conn).has_table(name)]
    last_id, size = 0, batch
    while True:
        query = (
            select(r.id, r.task_name, r.tenant, r.idempotency_key)
            .where(r.id > last_id, finished, func.coalesce(r.finished_at, r.updated_at) < cutoff)
            .order_by(r.id)
            .limit(size)
        )
        started = time.monotonic()
        with db.begin() as conn:
            found = conn.execute(query, params).all()
            if not found:
                break
            ids = [row.id for row in found]
            last_id = ids[-1]
            # A call a finished run left open goes on the books before its intent is deleted (the ledger rule).
            abandon_runs_intents_txn(conn, dia, ids, UNKNOWN_OUTCOME, "its run was purged while the call was open")
            _delete_runs(conn, ids, ledgers, report)
            fault_point("purge_batch", runs=len(ids))
        size = next_batch_size(size, batch, time.monotonic() - started)
        if forget is not None:
            # All found runs, kept ones included: an entry dropped for a run that stays is only a cache miss.
            forget([(row.task_name, row.tenant, row.idempotency_key) for row in found])
        report.batches += 1
        if on_batch is not None:
            on_batch(report)
    _purge_runless(db, cutoff, params, report)
    kept_age = kept_arguments_age() if kept_older_than is None else kept_older_than
    report.kept_arguments = clear_kept_arguments(db, kept_age)
    # A pending burst is never deleted (it is a job not yet sent); a dispatched row holds no arguments, only the
    # sequence an older message is compared with, so it goes with the kept arguments' retention.
    report.debounce_rows = purge_dispatched(db, kept_age)
    return report


def next_batch_size(size: int, most: int, took: float) -> int:
    """The next purge batch's size: halved after a batch held its transaction over MAX_BATCH_SECONDS, grown
    back (doubled, up to `most`) after one that took under a quarter of it."""
    if took > MAX_BATCH_SECONDS:
        return max(1, size // 2)
    if took < MAX_BATCH_SECONDS / 4:
        return min(most, size * 2)
    return size


def _purge_runless(db: Database, cutoff: Any, params: dict[str, Any], report: PurgeReport) -> None:
    """Delete what has no run to go with: closed outbox rows, and letters without a run (a conflict, a bad
    message, a capped re-publish) last written before the cut-off."""
    o, d = OUTBOX.c, LETTERS.c
    with db.begin() as conn:
        done = o.status.in_([OutboxStatus.DONE, OutboxStatus.DEAD])
        report.outbox += conn.execute(delete(OUTBOX).where(done, o.created_at < cutoff), params).rowcount or 0
        runless = and_(d.run_id.is_(None), d.last_failed_at < cutoff)
        report.dead_letters += conn.execute(delete(LETTERS).where(runless), params).rowcount or 0


def _delete_runs(conn: Connection, ids: list[int], ledgers: list[str], report: PurgeReport) -> None:
    """Delete `ids` with their rows; a run an application's table still refers to is kept, not an error."""
    try:
        with conn.begin_nested():
            _delete(conn, ids, ledgers, report)
        return
    except IntegrityError:
        pass  # an application's foreign key (e.g. RESTRICT) refuses some: delete one by one, keep those
    for run_id in ids:
        try:
            with conn.begin_nested():
                _delete(conn, [run_id], ledgers, report)
        except IntegrityError:
            report.kept_referenced += 1


def _delete(conn: Connection, ids: list[int], ledgers: list[str], report: PurgeReport) -> None:
    for name, n in delete_runs_txn(conn, ids, ledgers).items():
        setattr(report, name, getattr(report, name) + n)
