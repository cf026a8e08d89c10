"""Debounce: a burst of edits of one key makes one run, on the latest edit (the row protocol, no Celery).

One row per (task, tenant, debounce key) (models/debounce.py). Its timeline, every time on the database clock:

    edit 1 (upsert: INSERT)       seq=1, task_id=T1, due = now + period, deadline = now + max_wait
    edit 2..n (upsert: UPDATE)    seq+1, latest arguments, due = min(now + period, deadline)   (same burst: T1)
    dispatch (guarded UPDATE)     WHERE due_at <= now AND seq > dispatched_seq: dispatched_seq = seq, arguments
                                  cleared (they go into the outbox row, published under T1 with seq in a header)
    edit n+1 (upsert)             seq = dispatched_seq + 1 -> a new burst: task_id=T2, a new due and deadline
    a delivery of seq s           s < row.seq and no run of its key yet: acked, counted `debounced`
    a run in flight for seq s     on_running="supersede": its renewal finds s < row.seq and fences it out in one
                                  guarded UPDATE (token + 1, COMPLETED with no result), counted `superseded`

Every write is one atomic statement (INSERT ... ON CONFLICT DO UPDATE, UPDATE ... WHERE guard): two producers of
one key never both start a burst, and a dispatcher never sends a burst twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, and_, case, delete, exists, func, select, update

from oncelery.errors import ConfigurationError
from oncelery.ledger.unknown import SUPERSEDED_LABEL, abandon_run_intents_txn
from oncelery.models import Outcome, RunStatus
from oncelery.runs.outcomes import record_outcome_txn
from oncelery.store.database import Database, rowcount
from oncelery.store.tables import CALLS, DEBOUNCE, LABEL_TOTALS, RUNS

__all__ = [
    "ON_RUNNING",
    "SUPERSEDED_LABEL",
    "Debounce",
    "DebounceMark",
    "DueBurst",
    "Edit",
    "Newer",
    "any_due",
    "newer_edit",
    "purge_dispatched",
    "supersede_if_newer",
    "supersede_parked",
    "take_due",
    "upsert_edit",
]

logger = logging.getLogger("oncelery.debounce")  # a stable name (users filter on it)

#: What a newer edit does to a run already in flight for an older one.
ON_RUNNING = ("supersede", "finish")
# SUPERSEDED_LABEL (oncelery.ledger.unknown), "run_superseded": the ledger label of the model calls a superseded
# run made. Not "superseded": that label already means a call re-sent after its step's earlier attempt ended.


@dataclass(frozen=True)
class Debounce:
    """A task's debounce: the edits of one key within `period` s of each other make one run, on the latest edit;
    a burst waits at most `max_wait` s from its first edit. `key`: a template over the task's arguments
    ("doc:{doc_id}") or a callable taking them. `on_running`: "supersede" fences out a run in flight for an
    older edit at its next lease renewal (its effects never commit); "finish" lets it finish."""

    key: Any
    period: float = 30.0
    max_wait: float = 300.0
    on_running: str = "supersede"

    def check(self, where: str) -> Debounce:
        """Return self if every field is valid, else raise ConfigurationError naming the fix."""
        if not (isinstance(self.key, str) and self.key) and not callable(self.key):
            raise ConfigurationError(f"{where}: Debounce(key={self.key!r}); give a template such as 'doc:{{doc_id}}'")
        for name in ("period", "max_wait"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigurationError(f"{where}: Debounce({name}={value!r}); give seconds > 0")
        if self.max_wait < self.period:
            raise ConfigurationError(
                f"{where}: Debounce(max_wait={self.max_wait!r}) is shorter than period={self.period!r}; "
                "give max_wait >= period"
            )
        if self.on_running not in ON_RUNNING:
            raise ConfigurationError(
                f"{where}: Debounce(on_running={self.on_running!r}); use one of {', '.join(ON_RUNNING)}"
            )
        return self


@dataclass(frozen=True)
class DebounceMark:
    """What a debounced burst's message carries: its debounce key, its edit's sequence, and the task's on_running."""

    key: str
    seq: int
    supersede: bool


@dataclass(frozen=True)
class Newer:
    """A newer edit exists: whether a run of the message's own key exists, and whether it is parked WAITING."""

    has_run: bool
    parked: bool


@dataclass(frozen=True)
class Edit:
    """What a producer's upsert answered: the edit's sequence and its burst's Celery task id."""

    seq: int
    task_id: str


@dataclass(frozen=True)
class DueBurst:
    """A burst the dispatcher took: its latest edit's sequence, arguments and call headers, and its task id."""

    task_name: str
    tenant: str
    debounce_key: str
    seq: int
    task_id: str
    args: list[Any]
    kwargs: dict[str, Any]
    headers: dict[str, Any]


def upsert_edit(
    db: Database,
    task_name: str,
    tenant: str,
    debounce_key: str,
    call: tuple[list[Any], dict[str, Any], dict[str, Any]],
    spec: Debounce,
    new_task_id: str,
    bound_ms: int | None = None,
) -> Edit:
    """Record one edit in one atomic statement; return its sequence and its burst's task id.

    `call`: (args, kwargs, headers) of the edit. The first edit after a dispatch (seq == dispatched_seq) starts a
    new burst under `new_task_id`; any other keeps the burst's task id, and its due time is capped by the burst's
    deadline (first edit + max_wait). `bound_ms`: the statement's bound (a producer's; a blocked row or a slow
    server then raises a store error instead of holding `.delay()`); the commit stays durable.
    """
    dia = db.dialect
    d = DEBOUNCE.c
    now = dia.now()
    args, kwargs, headers = call
    ins = dia.insert(DEBOUNCE).values(
        task_name=task_name, tenant=tenant, debounce_key=debounce_key, seq=1, dispatched_seq=0, task_id=new_task_id,
        args=args, kwargs=kwargs, headers=headers, burst_started_at=now, due_at=dia.lease_until("p_period"),
        deadline_at=dia.lease_until("p_max"), updated_at=now,
    )  # fmt: skip
    ex = ins.excluded
    new_burst = d.seq == d.dispatched_seq
    stmt = ins.on_conflict_do_update(
        index_elements=["task_name", "tenant", "debounce_key"],
        set_={
            # Every expression reads the row as it was before this statement (SQL's UPDATE rule, both dialects).
            "seq": d.seq + 1,
            "task_id": case((new_burst, ex.task_id), else_=d.task_id),
            "args": ex.args,
            "kwargs": ex.kwargs,
            "headers": ex.headers,
            "burst_started_at": case((new_burst, ex.burst_started_at), else_=d.burst_started_at),
            "deadline_at": case((new_burst, ex.deadline_at), else_=d.deadline_at),
            "due_at": case((new_burst, ex.due_at), (ex.due_at < d.deadline_at, ex.due_at), else_=d.deadline_at),
            "updated_at": ex.updated_at,
        },
    ).returning(d.seq, d.task_id)
    params = {"p_period": dia.lease_param(spec.period), "p_max": dia.lease_param(spec.max_wait)}
    with db.begin() as conn:
        if bound_ms is not None:
            dia.bound_statements(conn, bound_ms)
        row = conn.execute(stmt, params).one()
    return Edit(int(row.seq), str(row.task_id))


def any_due(db: Database) -> bool:
    """Whether a burst is due, read without a lock: an idle relay round never takes SQLite's writer lock."""
    d = DEBOUNCE.c
    with db.read() as conn:
        query = select(d.seq).where(d.seq > d.dispatched_seq, d.due_at <= db.dialect.now()).limit(1)
        return conn.execute(query).first() is not None


def take_due(conn: Connection, db: Database, limit: int) -> list[DueBurst]:
    """Take up to `limit` due bursts in the caller's transaction: each marked dispatched, its arguments cleared.

    The caller writes each one's outbox row in the same transaction, so a burst is sent iff it was taken. Rows
    another dispatcher holds are skipped (PostgreSQL's SKIP LOCKED; SQLite has one writer), and each take is
    guarded by the sequence read: an edit that lands in between leaves the row for the next round.
    """
    dia = db.dialect
    d = DEBOUNCE.c
    query = (
        select(d.task_name, d.tenant, d.debounce_key, d.seq, d.task_id, d.args, d.kwargs, d.headers)
        .where(d.seq > d.dispatched_seq, d.due_at <= dia.now())
        .order_by(d.due_at)
        .limit(limit)
    )
    taken: list[DueBurst] = []
    for row in conn.execute(dia.locked_rows(query, of=DEBOUNCE)).all():
        done = conn.execute(
            update(DEBOUNCE)
            .where(_row_of(row.task_name, row.tenant, row.debounce_key), d.seq == row.seq, d.dispatched_seq < row.seq)
            .values(dispatched_seq=row.seq, args=None, kwargs=None, headers=None, dispatched_at=dia.now())
        )
        if rowcount(done) == 1:
            taken.append(
                DueBurst(
                    row.task_name, row.tenant, row.debounce_key, int(row.seq), str(row.task_id),
                    list(row.args or []), dict(row.kwargs or {}), dict(row.headers or {}),
                )
            )  # fmt: skip
    return taken


def newer_edit(db: Database, task_name: str, tenant: str, debounce_key: str, seq: int, key: str) -> Newer | None:
    """What a message of edit `seq` finds, if a newer edit of its debounce key exists (else None), in one read:
    whether a run of `key` exists, and whether it is parked WAITING."""
    d, r = DEBOUNCE.c, RUNS.c
    run = (
        select(r.status).where(r.task_name == task_name, r.tenant == tenant, r.idempotency_key == key).scalar_subquery()
    )
    query = select(d.seq, run.label("run_status")).where(_row_of(task_name, tenant, debounce_key))
    with db.read() as conn:
        row = conn.execute(query).first()
    if row is None or int(row.seq) <= seq:
        return None
    status = None if row.run_status is None else RunStatus(row.run_status)
    return Newer(has_run=status is not None, parked=status is RunStatus.WAITING)


def supersede_if_newer(
    db: Database,
    claim: Any,
    debounce_key: str,
    seq: int,
    tenant: str,
    on_superseded: Callable[[int], None] | None = None,
) -> bool:
    """If a newer edit exists, fence out the run `claim` holds (token + 1, COMPLETED with no result), count it
    `superseded` and label its ledger rows, in one transaction; return whether it did.

    Guarded by the claim's token and RUNNING status: a run that completed first is left alone (its effects
    committed before the newer edit mattered), and its holder's every later write fails with LeaseLost.
    """
    d, r = DEBOUNCE.c, RUNS.c
    # Read first: asked at every renewal, and a write transaction that changes nothing still takes SQLite's lock.
    with db.read() as conn:
        latest = conn.execute(select(d.seq).where(_row_of(claim.task_name, tenant, debounce_key))).scalar()
    if latest is None or int(latest) <= seq:
        return False
    held = and_(r.id == claim.run_id, r.fencing_token == claim.token, r.status == RunStatus.RUNNING)
    done = _supersede(db, claim.task_name, tenant, held, debounce_key, seq, on_superseded)
    if done is not None:
        logger.info(
            "superseded %s[%s] token=%d: a newer edit of %s", claim.task_name, claim.key, claim.token, debounce_key
        )
    return done is not None


def supersede_parked(
    db: Database, task_name: str, tenant: str, key: str, debounce_key: str, seq: int,
    on_superseded: Callable[[int], None] | None = None,
) -> int | None:  # fmt: skip
    """Fence out the run of `key` parked WAITING (nothing renews it, so no renewal would ask) if a newer edit
    exists, as `supersede_if_newer` does; return its id, or None if it was not parked or no newer edit exists."""
    r = RUNS.c
    parked = and_(r.task_name == task_name, r.tenant == tenant, r.idempotency_key == key, r.status == RunStatus.WAITING)
    done = _supersede(db, task_name, tenant, parked, debounce_key, seq, on_superseded)
    if done is not None:
        logger.info("superseded %s[%s] while it waited: a newer edit of %s", task_name, key, debounce_key)
    return done


def _supersede(
    db: Database, task_name: str, tenant: str, which: Any, debounce_key: str, seq: int,
    on_superseded: Callable[[int], None] | None,
) -> int | None:  # fmt: skip
    """The one fencing statement (guarded by `which` and a newer edit), its count and labels; the run's id."""
    d, r = DEBOUNCE.c, RUNS.c
    now = db.dialect.now()
    newer = exists().where(_row_of(task_name, tenant, debounce_key), d.seq > seq)
    fence = (
        update(RUNS)
        .where(which, newer)
        .values(
            status=RunStatus.COMPLETED, fencing_token=r.fencing_token + 1, result=None, message=None,
            error=f"superseded: a newer edit of {debounce_key} replaced edit {seq}", finished_at=now, updated_at=now,
            lease_expires_at=None, not_before=None,
        )
        .returning(r.id)
    )  # fmt: skip
    with db.begin() as conn:
        row = conn.execute(fence).first()
        if row is None:
            return None
        record_outcome_txn(conn, db.dialect.name, task_name, Outcome.SUPERSEDED, tenant)
        _label_calls(conn, db, int(row.id))
        # Its calls still open go on the books now, labelled; the canceller then stops them at the provider.
        why = f"cancelled: its run was superseded by a newer edit of {debounce_key}"
        abandon_run_intents_txn(conn, db.dialect, int(row.id), SUPERSEDED_LABEL, why)
    if on_superseded is not None:
        on_superseded(int(row.id))
    return int(row.id)


def _label_calls(conn: Connection, db: Database, run_id: int) -> None:
    """Label the run's unlabelled ledger rows as a superseded run's, with their running label counts."""
    c = CALLS.c
    unlabelled = and_(c.run_id == run_id, c.reason.is_(None))
    counts = conn.execute(
        select(c.task_name, c.tenant, c.model, func.count().label("n"))
        .where(unlabelled)
        .group_by(c.task_name, c.tenant, c.model)
    ).all()
    conn.execute(update(CALLS).where(unlabelled).values(reason=SUPERSEDED_LABEL))
    for row in counts:
        stmt = db.dialect.insert(LABEL_TOTALS).values(
            task_name=row.task_name or "", tenant=row.tenant or "", model=row.model, label=SUPERSEDED_LABEL, calls=row.n
        )
        added = {"calls": LABEL_TOTALS.c.calls + stmt.excluded.calls}
        conn.execute(stmt.on_conflict_do_update(index_elements=["task_name", "tenant", "model", "label"], set_=added))


def purge_dispatched(db: Database, older_than_s: float) -> int:
    """Delete rows dispatched over `older_than_s` ago with no edit since; never a pending burst. Return how many."""
    d = DEBOUNCE.c
    cutoff = db.dialect.lease_until("p_age")
    with db.begin() as conn:
        done = conn.execute(
            delete(DEBOUNCE).where(d.seq == d.dispatched_seq, d.updated_at < cutoff),
            {"p_age": db.dialect.lease_param(-older_than_s)},
        )
    return rowcount(done)


def _row_of(task_name: str, tenant: str, debounce_key: str) -> Any:
    d = DEBOUNCE.c
    return and_(d.task_name == task_name, d.tenant == tenant, d.debounce_key == debounce_key)
