"""Pages of runs, newest first, for a browser (Flower's Runs section): keyset paging on an index, never a scan.

A page is the runs with id < `before` that pass the filter, newest first; the next page starts below its last id
(no OFFSET). Each filter names the index that holds its runs in id order (models/runs.py, migration 0028):

    filter                              index read, newest first
    ----------------------------------  ------------------------------------------------------------------
    none                                the primary key
    status                              (status, id)
    task [+ status]                     (task_name, status, id): one range per status, merged
    tenant [+ status]                   (tenant, status, id): one range per status, merged
    outcome resumed | lost | retried    (id) WHERE taken over, lost a holder or retried (partial: few rows)
    outcome replayed                    (id) WHERE replays > 0 (partial)
    outcome executed                    as status COMPLETED

A page of those reads at most `limit + 1` entries of each range. A condition its index does not hold (a tenant
beside a task, an outcome beside any other filter, `executed`'s first holder) is applied to a WINDOW of the next
runs of that index: the page holds the matches among them and `next_before` goes on after the window, so a page
never reads more than WINDOW entries of a range, however rare the matches.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import ColumnElement, Connection, Select, and_, case, func, select, text, union_all

from oncelery.errors import ConfigurationError
from oncelery.models import RunStatus
from oncelery.models.money import usd
from oncelery.models.runs import REPLAYED, TAKEN_OVER
from oncelery.store.database import Database
from oncelery.store.tables import OUTCOMES as OUTCOME_COUNTS
from oncelery.store.tables import RUNS

__all__ = [
    "OUTCOMES",
    "PAGE",
    "WINDOW",
    "RunFilter",
    "RunPage",
    "RunRow",
    "browse_runs",
    "known_names",
]

PAGE = 50
#: The most index entries a page reads per range when a condition is applied beside its index (see above).
WINDOW = 2000
_ERROR_CHARS = 160  # a list shows the start of an error; the run page shows it whole

_c = RUNS.c
#: What a run's deliveries came to, by name: each a condition on the run's own counters (the outcome filter).
OUTCOMES: dict[str, ColumnElement[bool]] = {
    # COMPLETED by its first holder: no takeover, no lost worker, no retry, no wait.
    "executed": and_(_c.status == RunStatus.COMPLETED, _c.fencing_token == 1),
    # COMPLETED by a later holder: after a wait, a retry, a lost worker or a store fault (steps replayed).
    "resumed": and_(_c.status == RunStatus.COMPLETED, _c.fencing_token > 1),
    "replayed": _c.replays > 0,  # answered duplicates from its stored result
    "lost": _c.lost > 0,  # a holder vanished (SIGKILL, OOM) on at least one delivery
    "retried": _c.retries > 0,  # Celery retries (self.retry, autoretry)
}
# The outcomes a partial index holds (its predicate, written as models/runs.py writes it, so the planner uses it).
_PARTIAL = {"resumed": TAKEN_OVER, "lost": TAKEN_OVER, "retried": TAKEN_OVER, "replayed": REPLAYED}
_LABEL = case((OUTCOMES["executed"], "executed"), (OUTCOMES["resumed"], "resumed"), else_=func.lower(_c.status)).label(
    "outcome"
)
_COLUMNS = (
    _c.id, _c.task_name, _c.tenant, _c.idempotency_key, _c.status, _LABEL, _c.fencing_token, _c.attempts,
    _c.lost, _c.retries, _c.replays, _c.llm_calls, _c.llm_cost_micros, _c.celery_task_id,
    _c.created_at, _c.updated_at, _c.finished_at, _c.not_before,
    func.substr(_c.error, 1, _ERROR_CHARS).label("error"),
)  # fmt: skip


@dataclass(frozen=True)
class RunFilter:
    """Which runs a page lists: any of task, status, tenant and outcome (a name of OUTCOMES); None: any."""

    task_name: str | None = None
    status: RunStatus | None = None
    tenant: str | None = None
    outcome: str | None = None

    def __post_init__(self) -> None:
        if self.outcome is not None and self.outcome not in OUTCOMES:
            raise ConfigurationError(f"outcome {self.outcome!r}: give one of {', '.join(OUTCOMES)}")


@dataclass(frozen=True)
class RunRow:
    """One run as a list shows it: no result, no message, the start of its error."""

    run_id: int
    task_name: str
    tenant: str
    key: str
    status: RunStatus
    outcome: str  # executed | resumed for a COMPLETED run, else its status in lower case
    token: int
    attempts: int
    lost: int
    retries: int
    replays: int
    llm_calls: int
    cost: Decimal | None  # USD of its priced model calls
    celery_task_id: str | None
    created_at: datetime | None
    updated_at: datetime | None
    finished_at: datetime | None
    not_before: datetime | None
    error: str | None


@dataclass(frozen=True)
class RunPage:
    """A page of runs, newest first; `next_before` starts the next page (None: no older run matches)."""

    runs: list[RunRow]
    next_before: int | None
    # Set when a condition was applied to a window and the page is not full: how many runs of the index it read.
    searched: int | None = None


def _plan(flt: RunFilter) -> tuple[list[Any], list[RunStatus | None], list[ColumnElement[bool]]] | None:
    """The index range (its conditions and the statuses it is read per) and the conditions applied to a window;
    None when nothing can match."""
    given = _equal(flt.task_name, flt.tenant, flt.status)
    if flt.outcome in _PARTIAL:
        # In parentheses: the predicate is an OR, and the range's `id < before` is ANDed to it.
        return [text(f"({_PARTIAL[flt.outcome]})")], [None], [OUTCOMES[flt.outcome], *given]
    status, window = flt.status, []
    if flt.outcome == "executed":
        if status not in (None, RunStatus.COMPLETED):
            return None
        status = RunStatus.COMPLETED
        window.append(OUTCOMES["executed"])
    ranged: list[Any] = []
    if flt.task_name is not None:
        ranged.append(_c.task_name == flt.task_name)
        if flt.tenant is not None:  # no index holds both in id order: the task's, windowed
            window.append(_c.tenant == flt.tenant)
    elif flt.tenant is not None:
        ranged.append(_c.tenant == flt.tenant)
    if status is not None:
        return ranged, [status], window
    # (task or tenant, status, id) is in id order within one status: read each status's range and merge.
    return ranged, list(RunStatus) if ranged else [None], window


def _equal(task_name: str | None, tenant: str | None, status: RunStatus | None) -> list[ColumnElement[bool]]:
    found = []
    if task_name is not None:
        found.append(_c.task_name == task_name)
    if tenant is not None:
        found.append(_c.tenant == tenant)
    if status is not None:
        found.append(_c.status == status)
    return found


def _ids(ranged: list[Any], statuses: list[RunStatus | None], before: int | None, n: int) -> Select[Any]:
    """The ids of the `n` newest runs below `before` in the index range, one range per status, merged."""
    parts = []
    for status in statuses:
        stmt = select(_c.id).where(*ranged)
        if status is not None:
            stmt = stmt.where(_c.status == status)
        if before is not None:
            stmt = stmt.where(_c.id < before)
        parts.append(stmt.order_by(_c.id.desc()).limit(n))
    if len(parts) == 1:
        return parts[0]
    # Each range as a subquery: SQLite allows no ORDER BY/LIMIT on a compound select's own members.
    merged = union_all(*(select(sub.c.id) for sub in (part.subquery() for part in parts))).subquery()
    return select(merged.c.id).order_by(merged.c.id.desc()).limit(n)


def _rows(conn: Connection, ids: Select[Any], window: list[ColumnElement[bool]], limit: int) -> list[RunRow]:
    found = ids.subquery()
    stmt = (
        select(*_COLUMNS)
        .select_from(found.join(RUNS, _c.id == found.c.id))
        .where(*window)
        .order_by(_c.id.desc())
        .limit(limit + 1)
    )
    return [_row(r) for r in conn.execute(stmt)]


def _row(r: Any) -> RunRow:
    return RunRow(
        int(r.id), r.task_name, r.tenant, r.idempotency_key, RunStatus(r.status), str(r.outcome),
        int(r.fencing_token), int(r.attempts), int(r.lost), int(r.retries), int(r.replays), int(r.llm_calls),
        usd(r.llm_cost_micros) if r.llm_calls else None, r.celery_task_id, r.created_at, r.updated_at,
        r.finished_at, r.not_before, r.error,
    )  # fmt: skip


def browse_runs(db: Database, flt: RunFilter, before: int | None = None, limit: int = PAGE) -> RunPage:
    """One page of the runs `flt` selects with id < `before`, newest first, read from one index range (module doc)."""
    plan = _plan(flt)
    if plan is None:
        return RunPage([], None)
    ranged, statuses, window = plan
    with db.read() as conn:
        if not window:
            rows = _rows(conn, _ids(ranged, statuses, before, limit + 1), [], limit)
            return RunPage(rows[:limit], rows[limit - 1].run_id if len(rows) > limit else None)
        ids = _ids(ranged, statuses, before, WINDOW)
        rows = _rows(conn, ids, window, limit)
        if len(rows) > limit:
            return RunPage(rows[:limit], rows[limit - 1].run_id)
        # Fewer matches than a page: the window was read to its end. Go on below it if it was full.
        seen = ids.subquery()
        searched, oldest = conn.execute(select(func.count(), func.min(seen.c.id)).select_from(seen)).one()
    return RunPage(rows, int(oldest) if searched == WINDOW else None, int(searched))


def known_names(db: Database) -> tuple[list[str], list[str]]:
    """The task names and tenants that have had a delivery (from the outcome counters: a small table, no scan)."""
    o = OUTCOME_COUNTS.c
    with db.read() as conn:
        tasks = conn.execute(select(o.task_name).distinct().order_by(o.task_name)).scalars().all()
        tenants = conn.execute(select(o.tenant).distinct().order_by(o.tenant)).scalars().all()
    return [str(t) for t in tasks], [str(t) for t in tenants]
