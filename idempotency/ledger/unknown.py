"""The ledger rule: every create that may have happened has exactly one ledger row.

An intent `prepared` may have reached the provider (its create may have been sent before the holder died); one
`sent` surely did. So whenever such an intent reaches any end but `done` (whose row is written with the step's
checkpoint), this module ends it and, in the same transaction:

- writes its ledger row at the estimate the intent kept when it was prepared (its input's conservative token
  count, its output limit, that usage's price), labelled (`unknown_outcome`, or why its run ended:
  `run_revoked`, `run_superseded`), its error saying the usage is estimated;
- releases its budget reservation and charges the estimate instead (the call may have been billed), once;
- leaves its limiters' admission as it was (the tokens may have been used).

The paths that end an intent this way: a successor re-sending it (create window, sync unknown, a lost response),
a lost response dead-lettered, an at-most-once call whose outcome is unknown, and every transaction that ends a
run (dead, revoked, superseded, stale): `abandon_run_intents_txn`. `abandon_finished` is the relay's sweep for
what anything missed (a run completed by a body that caught its call's error, a run purged, a crash).

The row's call id is the intent's public id, so however many of these paths meet the same intent, and whatever
transaction retries, it is counted once.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, and_, or_, select, update

from oncelery.ledger.rows import add_call
from oncelery.ledger.settle import Reservation, charge_txn, release_txn
from oncelery.models import IntentState, RunStatus
from oncelery.models.batches import ItemState
from oncelery.store.database import Database, rowcount
from oncelery.store.dialects import Dialect
from oncelery.store.tables import BATCH_ITEMS, BUDGETS, INTENTS, RUNS

__all__ = [
    "ESTIMATED_LABELS",
    "OPEN_STATES",
    "REVOKED_LABEL",
    "SUPERSEDED_LABEL",
    "UNKNOWN_OUTCOME",
    "abandon_finished",
    "abandon_run_intents_txn",
    "abandon_runs_intents_txn",
    "end_unanswered_txn",
]

OPEN_STATES = (IntentState.PREPARED, IntentState.SENT)
UNKNOWN_OUTCOME = "unknown_outcome"  # the ledger label of a call whose bill cannot be known (estimated usage)
REVOKED_LABEL = "run_revoked"  # ... of a call open when its run was revoked (Celery's revoke)
SUPERSEDED_LABEL = "run_superseded"  # ... of a call open when a newer debounced edit superseded its run
#: The labels of rows written at the intent's estimate: the call's outcome, and its bill, are unknown.
ESTIMATED_LABELS = frozenset({UNKNOWN_OUTCOME, REVOKED_LABEL, SUPERSEDED_LABEL})
FINISHED = (RunStatus.COMPLETED, RunStatus.DEAD)  # a run nobody will hold again (without a person's replay)

_i, _r = INTENTS.c, RUNS.c
_FIELDS = (
    _i.public_id, _i.run_id, _i.step_name, _i.attempt, _i.mode, _i.model, _i.reference, _i.reserved,
    _i.estimated_input_tokens, _i.estimated_output_tokens, _i.estimated_cost_micros,
    _r.task_name, _r.tenant, _r.idempotency_key,
)  # fmt: skip


def end_unanswered_txn(
    conn: Connection, dialect: Dialect, public_id: str, state: IntentState, label: str, why: str
) -> dict[str, Any] | None:
    """End the open intent `public_id` as `state` with its ledger row at its estimate (labelled `label`) and its
    budgets charged, in the caller's transaction; return the row written (None: it was not open, or it never
    reached a provider and has no row)."""
    found = conn.execute(
        select(*_FIELDS)
        .select_from(INTENTS.outerjoin(RUNS, _r.id == _i.run_id))
        .where(_i.public_id == public_id, _i.state.in_(OPEN_STATES))
    ).first()
    if found is None:
        return None
    if found.mode == "batch" and _unqueued(conn, public_id):
        # A batch item never submitted reached no provider: it ends cancelled, its money released, with no row.
        state, label = IntentState.CANCELLED, ""
    ended = conn.execute(
        update(INTENTS)
        .where(_i.public_id == public_id, _i.state.in_(OPEN_STATES))
        .values(state=state, ended_at=dialect.now(), error=why[:1000])
    )
    if rowcount(ended) != 1:
        return None  # ended by another writer between the two statements: its row is that writer's
    reservation = Reservation.of(found.reserved)
    _lock_budgets(conn, reservation)
    release_txn(conn, dialect, public_id, reservation)
    if not label:
        return None
    cost = _estimated_cost(found, reservation)
    row = _row(found, label, why, cost)
    if not add_call(conn, dialect, row):
        return None
    charge_txn(conn, reservation, cost)
    return row


def abandon_run_intents_txn(conn: Connection, dialect: Dialect, run_id: int, label: str, why: str) -> int:
    """End every open intent of run `run_id` as `abandoned`, each with its estimated ledger row labelled `label`,
    in the caller's transaction (the one that ends the run); return how many."""
    return abandon_runs_intents_txn(conn, dialect, [run_id], label, why)


def abandon_runs_intents_txn(conn: Connection, dialect: Dialect, run_ids: list[int], label: str, why: str) -> int:
    """`abandon_run_intents_txn` for several ended runs at once (retention's batch), in the caller's transaction."""
    open_ones = conn.execute(
        select(_i.public_id).where(_i.run_id.in_(run_ids), _i.state.in_(OPEN_STATES)).order_by(_i.id)
    ).scalars()
    ended = (end_unanswered_txn(conn, dialect, pid, IntentState.ABANDONED, label, why) for pid in list(open_ones))
    return sum(1 for row in ended if row is not None)


def abandon_finished(db: Database, batch: int = 100) -> int:
    """End up to `batch` open intents whose run finished (completed, dead, or failed with no retry coming) or no
    longer exists, each with its estimated ledger row (`unknown_outcome`); return how many. The relay runs it
    every round."""
    failed_for_good = and_(_r.status == RunStatus.FAILED, _r.not_before.is_(None))
    over = or_(_r.id.is_(None), _r.status.in_(FINISHED), failed_for_good)
    orphan = select(_i.public_id).select_from(INTENTS.outerjoin(RUNS, _r.id == _i.run_id))
    orphan = orphan.where(_i.state.in_(OPEN_STATES), over).limit(batch)
    with db.read() as conn:
        found = list(conn.execute(orphan).scalars())
    ended = 0
    why = "its run finished while the call was open: outcome unknown"
    for public_id in found:  # one transaction each: a fault leaves the rest for the next round
        with db.begin() as conn:
            row = end_unanswered_txn(conn, db.dialect, public_id, IntentState.ABANDONED, UNKNOWN_OUTCOME, why)
            ended += row is not None
    return ended


def _lock_budgets(conn: Connection, reservation: Reservation | None) -> None:
    """Lock the call's budget rows first, in its reservation's order (the order reserve and release take them):
    a reservation already released by the sweeper would otherwise be charged only after the ledger's totals row
    was locked, the reverse of a settling call's order, and two such transactions can deadlock."""
    if reservation is None:
        return
    c = BUDGETS.c
    for name in reservation.budgets:
        conn.execute(update(BUDGETS).where(c.name == name).values(spent_micros=c.spent_micros))


def _unqueued(conn: Connection, custom_id: str) -> bool:
    """Take the intent's batch item out of its queue if it was never claimed into a batch; return whether."""
    b = BATCH_ITEMS.c
    taken = conn.execute(
        update(BATCH_ITEMS)
        .where(b.custom_id == custom_id, b.state == ItemState.QUEUED)
        .values(state=ItemState.CANCELLED, request=None)
    )
    return rowcount(taken) == 1


def _estimated_cost(found: Any, reservation: Reservation | None) -> int | None:
    """The estimate kept at prepare time; for an intent prepared before 0026, what it reserved (else no price)."""
    if found.estimated_cost_micros is not None:
        return int(found.estimated_cost_micros)
    if reservation is not None and reservation.budgets:
        return max(reservation.budgets.values())
    return None


def _row(found: Any, label: str, why: str, cost: int | None) -> dict[str, Any]:
    return {
        "call_id": found.public_id,
        "task_name": found.task_name,
        "tenant": found.tenant or "",
        "idempotency_key": found.idempotency_key,
        "step": found.step_name,
        "run_id": found.run_id,
        "fencing_token": None,  # written by whoever ended it: a successor, a run's end, the sweep
        "model": found.model,
        "prompt": None,
        "input_tokens": int(found.estimated_input_tokens or 0),
        "output_tokens": int(found.estimated_output_tokens or 0),
        "latency_ms": 0.0,
        "ok": False,
        "error": f"{why}; usage estimated (the provider's bill for it is unknown)"[:2000],
        "cost_micros": cost,
        "batch_saved_micros": None,
        "meta": {"attempt": found.attempt, "mode": found.mode, "estimated": True, "reference": found.reference},
        "reason": label,
        "reattached": False,
    }
