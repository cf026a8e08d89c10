"""PostgreSQL's one-round-trip statements (data-modifying CTEs) and the outcome counter's upsert.

A delivery's hot path is one statement per database visit: the claim that also answers and counts a duplicate,
the completion that also counts its outcome, the replay count that also bumps its run. Each is built once per
process (statements.Statements) from the plain statements it wraps.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import Integer, String, and_, bindparam, func, literal, null, or_, select, update
from sqlalchemy.dialects import postgresql
from sqlalchemy.sql.elements import ColumnElement

from oncelery.models import OutboxStatus, Outcome, RunStatus
from oncelery.store.clock import lease_live, stored_message
from oncelery.store.tables import OUTBOX, OUTCOME_KEY, OUTCOME_TOTALS, OUTCOMES, RUN_VIEW_COLUMNS, RUNS, SAVED_FROM

__all__ = [
    "NOT_DECIDING",
    "added",
    "claim_or_replay",
    "complete_and_count",
    "count_replay",
    "count_statement",
    "producer_answer",
    "producer_view",
]

# RunView columns the claim statement leaves NULL: no decision of a claim reads them, and decoding them (JSON,
# timestamps) was most of a duplicate's client time. A ClaimResult's run holds what the decisions read (id,
# names, key, fingerprint, status, token, owner, result, task id, lost, lease_live, retry_wait): RunStore.get
# reads the rest.
NOT_DECIDING = frozenset(
    {
        "message",
        "field_digests",
        "error",
        "attempts",
        "retries",
        "replays",
        "concurrency_key",
        "lease_expires_at",
        "not_before",
        "created_at",
        "updated_at",
        "finished_at",
    }
)


def count_replay(count_replay_on_run: Any, insert: Any) -> Any:
    """PostgreSQL: a replay's `replays + 1` on its run and its `replayed` count (with what it saved), one statement."""
    # PostgreSQL: ONE statement (WITH bumped AS (UPDATE ... RETURNING llm_*) INSERT INTO delivery_outcomes
    # ...): a data-modifying WITH runs once whether or not the INSERT reads it, so the outcome is counted
    # (saving 0) even if the run was purged meanwhile.
    bumped = count_replay_on_run.cte("bumped")
    totals: dict[str, Any] = {name: bindparam(f"p_{name}") for name in OUTCOME_TOTALS}
    for name, column in SAVED_FROM.items():
        totals[name] = func.coalesce(select(bumped.c[column]).scalar_subquery(), 0)
    return count_statement(insert, totals).add_cte(bumped)


def claim_or_replay(insert_claim: Any, now: ColumnElement[Any]) -> Any:
    """PostgreSQL: a delivery's claim, and a duplicate's answer and count, in one statement (see below)."""
    # PostgreSQL: a delivery's claim in ONE statement (one round trip), whatever it finds:
    #   ins     INSERT the run ... ON CONFLICT DO NOTHING RETURNING id      (a new key: claimed)
    #   cur     the existing run, as RunStore.get reads it                  (else: decided in Python)
    #   bumped  a COMPLETED run of the same payload: replays + 1 RETURNING what it saves
    #   counted the `replayed` outcome with those savings, only if bumped (a duplicate is answered here)
    # All CTEs share one snapshot: `cur` never sees `ins`'s row, and a key inserted by a transaction that
    # committed after the snapshot is neither inserted nor seen (no row: the caller reads it again).
    c = RUNS.c
    ins = insert_claim.cte("ins")
    retry_wait = and_(c.not_before.is_not(None), c.not_before > now)
    # Only what a RunView holds (psycopg caches its parsing of a query only below 4096 characters), and of
    # that only what a decision reads (NOT_DECIDING): a conflict reads the run again for its field digests.
    viewed = [null().label(name) if name in NOT_DECIDING else c[name] for name in RUN_VIEW_COLUMNS]
    cur = (
        select(*viewed, lease_live(now).label("lease_live"), retry_wait.label("retry_wait"))
        .where(
            c.task_name == bindparam("p_task"),
            c.tenant == bindparam("p_tenant"),
            c.idempotency_key == bindparam("p_key"),
        )
        .cte("cur")
    )
    bumped, counted = _replay_counted(cur)
    one = select(literal(1).label("one")).subquery("one")
    return (
        select(
            select(ins.c.id).scalar_subquery().label("new_id"),
            select(func.count()).select_from(bumped).scalar_subquery().label("replayed"),
            *cur.c,
        )
        .select_from(one.outerjoin(cur, literal(True)))
        .add_cte(counted)
    )


def producer_view(now: ColumnElement[Any]) -> Any:
    """What a producer decides on for the run of (p_task, p_tenant, p_key): a SELECT of at most one row."""
    # Only what the producer reads: a run in progress is recoverable without the call's message if it keeps its
    # own (`kept`) or an outbox row will publish it again (`queued`).
    c, o = RUNS.c, OUTBOX.c
    queued = (
        select(o.id)
        # Two literals, not IN (...): the driver path sends compiled text, which an expanding IN has none of.
        .where(
            o.celery_task_id == c.celery_task_id,
            or_(o.status == OutboxStatus.PENDING, o.status == OutboxStatus.SENT),
        )
        .exists()
    )
    return select(
        c.id,
        c.status,
        c.fingerprint,
        c.fencing_token,
        c.result,
        c.celery_task_id,
        lease_live(now).label("lease_live"),
        stored_message(c.message).label("kept"),
        queued.label("queued"),
    ).where(
        c.task_name == bindparam("p_task"),
        c.tenant == bindparam("p_tenant"),
        c.idempotency_key == bindparam("p_key"),
    )


def producer_answer(now: ColumnElement[Any]) -> Any:
    """PostgreSQL: a producer's view of a call's run, and a duplicate's answer and count, in one statement."""
    # As claim_or_replay without the INSERT (a producer never claims): a COMPLETED run of the same payload is
    # answered and counted (`replayed`, at_producer = 1) in the same round trip as the read.
    cur = producer_view(now).cte("cur")
    bumped, counted = _replay_counted(cur, at_producer=True)
    one = select(literal(1).label("one")).subquery("one")
    return (
        select(select(func.count()).select_from(bumped).scalar_subquery().label("replayed"), *cur.c)
        .select_from(one.outerjoin(cur, literal(True)))
        .add_cte(counted)
    )


def _replay_counted(cur: Any, at_producer: bool = False) -> tuple[Any, Any]:
    """The CTEs that answer a duplicate of `cur`: its run's replays + 1, and the `replayed` count with its savings."""
    #   bumped  a COMPLETED run of the same payload: replays + 1 RETURNING what it saves
    #   counted the `replayed` outcome with those savings, only if bumped (a duplicate is answered here)
    c = RUNS.c
    finished = select(cur.c.id).where(
        cur.c.status == RunStatus.COMPLETED, cur.c.fingerprint == bindparam("p_fingerprint")
    )
    bumped = (
        update(RUNS)
        # By id alone: COMPLETED is final (only a purge deletes it), and a status predicate here let a
        # generic plan pick the (status, updated_at) index and read every COMPLETED run per claim.
        .where(c.id == finished.scalar_subquery())
        .values(replays=c.replays + 1)
        .returning(c.id, *(c[column] for column in SAVED_FROM.values()))
        .cte("bumped")
    )
    o = OUTCOMES.c
    totals = list(SAVED_FROM)
    values: list[Any] = [bumped.c[column] for column in SAVED_FROM.values()]
    if at_producer:
        totals.append("at_producer")
        values.append(literal(1))
    rows = select(
        bindparam("p_task", type_=String),
        bindparam("p_tenant", type_=String),
        literal(Outcome.REPLAYED.value, type_=o.outcome.type),
        bindparam("p_shard", type_=Integer),
        literal(1),
        *values,
    ).select_from(bumped)
    count = postgresql.insert(OUTCOMES).from_select([*OUTCOME_KEY, "count", *totals], rows)
    upsert = count.on_conflict_do_update(index_elements=OUTCOME_KEY, set_=added(count, totals))
    return bumped, upsert.cte("counted")


def complete_and_count(complete: Any) -> Any:
    """PostgreSQL: the fenced completion and its outcome count in one statement; no row back: LeaseLost."""
    # PostgreSQL: the fenced completion and the outcome counter in ONE statement (one round trip):
    # WITH done AS (UPDATE task_runs ... RETURNING id) INSERT INTO delivery_outcomes SELECT ... FROM done.
    # No row returned means the fence refused the completion (LeaseLost) and nothing was written.
    done = complete.returning(RUNS.c.id).cte("done")
    o = OUTCOMES.c
    rows = select(
        bindparam("p_task", type_=String),
        bindparam("p_tenant", type_=String),
        bindparam("p_outcome", type_=o.outcome.type),
        bindparam("p_shard", type_=Integer),
        literal(1),
        *(bindparam(f"p_{name}", type_=o[name].type) for name in OUTCOME_TOTALS),
    ).select_from(done)
    stmt = postgresql.insert(OUTCOMES).from_select([*OUTCOME_KEY, "count", *OUTCOME_TOTALS], rows)
    return stmt.on_conflict_do_update(index_elements=OUTCOME_KEY, set_=added(stmt)).returning(o.count).add_cte(done)


def count_statement(insert: Any, totals: dict[str, Any], count: Any = 1) -> Any:
    """INSERT one counter row (a shard of task, tenant, outcome) or add this delivery's figures to it.

    `count`: how many deliveries it adds (1, or a bind parameter for a batch of cached replays).
    """
    stmt = insert(OUTCOMES).values(
        task_name=bindparam("p_task"),
        tenant=bindparam("p_tenant"),
        outcome=bindparam("p_outcome"),
        shard=bindparam("p_shard"),
        count=count,
        **totals,
    )
    by = count if isinstance(count, int) else None
    return stmt.on_conflict_do_update(index_elements=OUTCOME_KEY, set_=added(stmt, by=by))


def added(stmt: Any, totals: Iterable[str] = OUTCOME_TOTALS, by: int | None = 1) -> dict[str, Any]:
    """The upsert's SET: the counter grows by `by` (None: by the inserted row's count), each total by its value."""
    o, new = OUTCOMES.c, stmt.excluded
    return {"count": o.count + (new.count if by is None else by), **{name: o[name] + new[name] for name in totals}}
