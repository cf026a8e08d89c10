"""Debounce: a burst of edits of one key makes one run, on the latest edit (the row protocol, no Celery).

One row per (task, tenant, debounce key) (models/debounce.py). Its timeline, every time on the database clock:

    edit 1 (upsert: INSERT)       seq=1, task_id=T1, due = now + period, deadline = now + max_wait
    edit 2..n (upsert: UPDATE)    seq+1, latest arguments, due = min(now + period, deadline)   (same burst: T1)
    dispatch (guarded UPDATE)     WHERE due_at <= now AND seq > dispatched_seq: dispatched_seq = seq, arguments
                                  cleared (they go into the outbox row, published under T1 with seq in a header)
    edit n+1 (upsert)             seq = dispatched_seq + 1 -> a new burst: task_id=T2, a new due and deadline
    a delivery of seq s, key k    s < row.seq, the latest edit's key is not k, no run of k yet: acked, `debounced`
    a run in flight for seq s     on_running="supersede": its renewal finds s < row.seq and the latest edit's key
                                  not its own, and fences it out in one guarded UPDATE (token + 1, COMPLETED with
                                  no result), counted `superseded`
    a later edit of key k         the run of k was superseded: reopened (FAILED, due at once) and taken over by
                                  the edit's claim, never answered by its empty result

The idempotency key decides what an edit replaces: an edit with the key of a run in flight is that very job (same
key, same payload: G5), so that run answers it and is never superseded by it; and an edit whose key is a
superseded run's is a job not done, so it runs.

Every write is one atomic statement (INSERT ... ON CONFLICT DO UPDATE, UPDATE ... WHERE guard): two producers of
one key never both start a burst, and a dispatcher never sends a burst twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, and_, case, delete, exists, func, or_, select, update

from oncelery.errors import ConfigurationError
from oncelery.ledger.unknown import SUPERSEDED_LABEL, abandon_run_intents_txn
from oncelery.models import Outcome, RunStatus
from oncelery.runs.outcomes import record_outcome_txn
from oncelery.store.database import Database, rowcount
from oncelery.store.tables import CALLS, DEBOUNCE, LABEL_TOTALS, RUNS

__all__ = [
    "ON_RUNNING",
    "SUPERSEDED_ERROR",
    "SUPERSEDED_LABEL",
    "Debounce",
    "DebounceMark",
    "DueBurst",
    "Edit",
    "EditCheck",
    "any_due",
    "check_edit",
    "purge_dispatched",
    "reopen_superseded",
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
#: How a superseded run's error begins (a stored value): what tells it from a run that completed with no result.
SUPERSEDED_ERROR = "superseded: "


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
class EditCheck:
    """What a message of one edit finds before its claim: whether a newer edit of another key replaced it, and
    whether a run of its own key exists, is parked WAITING, or was superseded."""

    newer: bool
    has_run: bool
    parked: bool
    superseded: bool


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
    edit_key: str | None = None,
) -> Edit:
    """Record one edit in one atomic statement; return its sequence and its burst's task id.

    `call`: (args, kwargs, headers) of the edit. The first edit after a dispatch (seq == dispatched_seq) starts a
    new burst under `new_task_id`; any other keeps the burst's task id, and its due time is capped by the burst's
    deadline (first edit + max_wait). `bound_ms`: the statement's bound (a producer's; a blocked row or a slow
    server then raises a store error instead of holding `.delay()`); the commit stays durable. `edit_key`: the
    edit's idempotency key (None: unknown, so it replaces a run in flight whatever that run's key).
    """
    dia = db.dialect
    d = DEBOUNCE.c
    now = dia.now()
    args, kwargs, headers = call
    ins = dia.insert(DEBOUNCE).values(
        task_name=task_name, tenant=tenant, debounce_key=debounce_key, seq=1, dispatched_seq=0, task_id=new_task_id,
        edit_key=edit_key, args=args, kwargs=kwargs, headers=headers, burst_started_at=now,
        due_at=dia.lease_until("p_period"), deadline_at=dia.lease_until("p_max"), updated_at=now,
    )  # fmt: skip
    ex = ins.excluded
    new_burst = d.seq == d.dispatched_seq
    stmt = ins.on_conflict_do_update(
        index_elements=["task_name", "tenant", "debounce_key"],
        set_={
            # Every expression reads the row as it was before this statement (SQL's UPDATE rule, both dialects).
            "seq": d.seq + 1,
            "task_id": case((new_burst, ex.task_id), else_=d.task_id),
            "edit_key": ex.edit_key,
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


def check_edit(db: Database, task_name: str, tenant: str, debounce_key: str, seq: int, key: str) -> EditCheck:
    """What a message of edit `seq` (idempotency key `key`) finds before its claim, in one read transaction.

    `newer`: a newer edit with another key replaced it (a newer edit with the same key is this very job: the
    message runs, or is answered by the run of its key). The run of `key`: whether it exists, is parked, or was
    superseded (COMPLETED with no result, fenced out by a newer edit of another key).
    """
    d, r = DEBOUNCE.c, RUNS.c
    with db.read() as conn:
        latest = conn.execute(select(d.seq, d.edit_key).where(_row_of(task_name, tenant, debounce_key))).first()
        run = conn.execute(
            select(r.status, r.error).where(r.task_name == task_name, r.tenant == tenant, r.idempotency_key == key)
        ).first()
    newer = latest is not None and int(latest.seq) > seq and latest.edit_key != key
    status = None if run is None else RunStatus(run.status)
    superseded = run is not None and status is RunStatus.COMPLETED and str(run.error or "").startswith(SUPERSEDED_ERROR)
    return EditCheck(newer, has_run=status is not None, parked=status is RunStatus.WAITING, superseded=superseded)


def reopen_superseded(db: Database, task_name: str, tenant: str, key: str, debounce_key: str, seq: int) -> bool:
    """Reopen the superseded run of `key` for edit `seq`, which has that key again: FAILED and due at once, so the
    edit's claim takes it over (token + 1) and runs it, instead of replaying its empty result; return whether it did.

    One guarded UPDATE (only a run still COMPLETED as superseded): of two deliveries racing here, one reopens it, and
    their claims then decide as for any FAILED run (one takes it over, the other waits for it). Due now, as a retry
    is (`not_before`): an edit found stale next (entity_version) settles it again (runs/claims.settle_stale).
    """
    r = RUNS.c
    now = db.dialect.now()
    reopen = (
        update(RUNS)
        .where(
            r.task_name == task_name, r.tenant == tenant, r.idempotency_key == key, r.status == RunStatus.COMPLETED,
            r.error.like(SUPERSEDED_ERROR + "%"),
        )
        .values(
            status=RunStatus.FAILED, error=f"reopened: edit {seq} of {debounce_key} has this superseded run's key",
            not_before=now, finished_at=None, lease_expires_at=None, updated_at=now,
        )
    )  # fmt: skip
    with db.begin() as conn:
        done = rowcount(conn.execute(reopen)) == 1
    if done:
        logger.info("reopened %s[%s]: edit %d of %s has this superseded run's key", task_name, key, seq, debounce_key)
    return done


def supersede_if_newer(
    db: Database,
    claim: Any,
    debounce_key: str,
    seq: int,
    tenant: str,
    on_superseded: Callable[[int], None] | None = None,
) -> bool:
    """If a newer edit with another idempotency key exists, fence out the run `claim` holds (token + 1, COMPLETED
    with no result), count it `superseded` and label its ledger rows, in one transaction; return whether it did.

    A newer edit with the run's own key is that run's job again: it is answered by the run, never supersedes it.
    Guarded by the claim's token and RUNNING status: a run that completed first is left alone (its effects
    committed before the newer edit mattered), and its holder's every later write fails with LeaseLost.
    """
    d, r = DEBOUNCE.c, RUNS.c
    # Read first: asked at every renewal, and a write transaction that changes nothing still takes SQLite's lock.
    with db.read() as conn:
        latest = conn.execute(select(d.seq, d.edit_key).where(_row_of(claim.task_name, tenant, debounce_key))).first()
    if latest is None or int(latest.seq) <= seq or latest.edit_key == claim.key:
        return False
    held = and_(r.id == claim.run_id, r.fencing_token == claim.token, r.status == RunStatus.RUNNING)
    done = _supersede(db, claim.task_name, tenant, held, (debounce_key, seq, claim.key), on_superseded)
    if done is not None:
        logger.info(
            "superseded %s[%s] token=%d: a newer edit of %s", claim.task_name, claim.key, claim.token, debounce_key
        )
    return done is not None


def supersede_parked(
    db: Database, task_name: str, tenant: str, key: str, debounce_key: str, seq: int,
    on_superseded: Callable[[int], None] | None = None,
) -> int | None:  # fmt: skip
    """Fence out the run of `key` parked WAITING (nothing renews it, so no renewal would ask) if a newer edit of
    another key exists, as `supersede_if_newer` does; return its id, or None if it was not parked or no such edit
    exists."""
    r = RUNS.c
    parked = and_(r.task_name == task_name, r.tenant == tenant, r.idempotency_key == key, r.status == RunStatus.WAITING)
    done = _supersede(db, task_name, tenant, parked, (debounce_key, seq, key), on_superseded)
    if done is not None:
        logger.info("superseded %s[%s] while it waited: a newer edit of %s", task_name, key, debounce_key)
    return done


def _supersede(
    db: Database, task_name: str, tenant: str, which: Any, edit: tuple[str, int, str],
    on_superseded: Callable[[int], None] | None,
) -> int | None:  # fmt: skip
    """The one fencing statement, its count and labels; the run's id. Guarded by `which` and an edit newer than the
    run's `edit` (debounce key, sequence, idempotency key) whose key is another (NULL: written before keys were)."""
    d, r = DEBOUNCE.c, RUNS.c
    debounce_key, seq, key = edit
    now = db.dialect.now()
    other_key = or_(d.edit_key.is_(None), d.edit_key != key)
    newer = exists().where(_row_of(task_name, tenant, debounce_key), d.seq > seq, other_key)
    fence = (
        update(RUNS)
        .where(which, newer)
        .values(
            status=RunStatus.COMPLETED, fencing_token=r.fencing_token + 1, result=None, message=None,
            error=f"{SUPERSEDED_ERROR}a newer edit of {debounce_key} replaced edit {seq}",
            finished_at=now, updated_at=now, lease_expires_at=None, not_before=None,
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
