"""Intent rows: prepare (durably, before the create), mark sent (fenced), end, and find the latest of a step.

Every write by a holder is fenced the way a checkpoint is: the run's lease is renewed by the holder's token in
the same transaction (`RunStore.heartbeat_txn`), so a zombie that lost its lease writes nothing, and a takeover
waits for a fenced write in flight to commit instead of racing it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import Connection, select, update

from oncelery.ledger.recording import CallLedger
from oncelery.ledger.settle import Reservation, release_txn
from oncelery.ledger.unknown import UNKNOWN_OUTCOME
from oncelery.llm.budgets import BudgetPlan, reserve_txn
from oncelery.llm.limits import OUTPUT_RETURNED_ENDPOINTS, Admission, admit_txn, settle_txn, used_by
from oncelery.models.intents import IntentState, RepeatReason
from oncelery.runs.claims import RunStore
from oncelery.runs.decisions import Claim, lease_lost
from oncelery.store.database import rowcount
from oncelery.store.tables import INTENTS

__all__ = [
    "Intent",
    "end_intent",
    "end_intent_txn",
    "fenced_write",
    "latest_intent",
    "mark_sent",
    "prepare_intent",
]

_OPEN = (IntentState.PREPARED, IntentState.SENT)


@dataclass(frozen=True)
class Intent:
    """One intent row as the call protocol reads it."""

    id: int
    public_id: str
    attempt: int
    token: int
    mode: str
    request_digest: str
    state: IntentState
    reference: str | None
    cursor: int | None
    repeat_reason: RepeatReason | None
    admitted: dict[str, int] | None = None  # what the shared limiters admitted it for ({limiter: cost})
    reserved: dict[str, Any] | None = None  # what it reserved in the budgets (Reservation.as_json)
    endpoint: str = ""  # the provider's protocol ("responses", "messages"): how its limits count tokens

    @property
    def reservation(self) -> Reservation | None:
        """What the call reserved in the budgets (None: no budget applied)."""
        return Reservation.of(self.reserved)


_COLUMNS = [INTENTS.c[name] for name in Intent.__dataclass_fields__]


def latest_intent(store: RunStore, run_id: int, position: int) -> Intent | None:
    """Return the step's latest attempt (None: no call was ever prepared for it)."""
    c = INTENTS.c
    stmt = select(*_COLUMNS).where(c.run_id == run_id, c.position == position).order_by(c.attempt.desc()).limit(1)
    with store.db.read() as conn:
        row = conn.execute(stmt).first()
    return None if row is None else Intent(*row)


def fenced_write(store: RunStore, claim: Claim, what: str, body: Callable[[Connection], None]) -> None:
    """Run `body` in one durable transaction iff `claim` still holds the run (renewing its lease), else
    LeaseLost naming `what` (nothing written)."""
    with store.transaction() as conn:
        # Durable whatever the server's default: an intent forgotten by a crash after its create was sent would
        # be paid again with no label (claims may commit asynchronously; intents never do).
        store.db.dialect.commit_durably(conn)
        if not store.heartbeat_txn(conn, claim):
            raise lease_lost(claim, what)
        body(conn)


def prepare_intent(
    store: RunStore,
    claim: Claim,
    *,
    position: int,
    step_name: str,
    request: Mapping[str, Any],
    supersedes: Intent | None,
    reason: RepeatReason | None,
    ledger: CallLedger,
    admissions: Sequence[Admission] = (),
    budget: tuple[BudgetPlan, int] | None = None,
) -> Intent:
    """Commit a new `prepared` intent (durably, fenced) before any byte of the call leaves this process.

    `request` holds the fields the row keeps (provider, endpoint, model, mode, request_digest, retention_s).
    A `supersedes` intent still open is ended `lost` in the same transaction, with its ledger row at its estimate
    written through `ledger` (oncelery.ledger.unknown): its outcome is unknown.
    `admissions`: the shared limiters the call goes through, admitted in the same transaction, or Throttled
    is raised and nothing is written. `budget`: (the call's budgets, its estimated cost in micro-USD), reserved
    in the same transaction, or BudgetExceeded is raised and nothing is written.
    """
    attempt = 1 if supersedes is None else supersedes.attempt + 1
    public_id = uuid.uuid4().hex
    now = store.db.dialect.now()

    kept: list[dict[str, int] | None] = [None]
    reserved: list[dict[str, Any] | None] = [None]
    dialect = store.db.dialect

    def write(conn: Connection) -> None:
        admitted = kept[0] = admit_txn(conn, dialect, list(admissions)) if admissions else None
        if budget is not None and budget[0].active:
            plan, estimate = budget
            reserved[0] = reserve_txn(conn, dialect, plan, claim.tenant, claim.run_id, estimate).as_json()
        if supersedes is not None:
            why = f"outcome unknown: attempt {attempt} of step {step_name!r} replaced it"
            ledger.record_unanswered(conn, supersedes.public_id, IntentState.LOST, UNKNOWN_OUTCOME, why)
        conn.execute(
            INTENTS.insert().values(
                public_id=public_id,
                run_id=claim.run_id,
                position=position,
                step_name=step_name,
                attempt=attempt,
                token=claim.token,
                state=IntentState.PREPARED,
                repeat_reason=reason,
                prepared_at=now,
                admitted=admitted,
                reserved=reserved[0],
                **request,
            )
        )

    fenced_write(store, claim, f"the call of step {step_name!r} was not prepared", write)
    return Intent(
        0, public_id, attempt, claim.token, str(request["mode"]), str(request["request_digest"]),
        IntentState.PREPARED, None, None, reason, kept[0], reserved[0], str(request["endpoint"]),
    )  # fmt: skip


def mark_sent(store: RunStore, claim: Claim, intent: Intent, reference: str, cursor: int | None) -> Intent:
    """Record the provider's reference of a prepared intent, fenced by the claim; return the sent intent."""
    stmt = (
        update(INTENTS)
        .where(INTENTS.c.public_id == intent.public_id, INTENTS.c.state == IntentState.PREPARED)
        .values(state=IntentState.SENT, reference=reference, cursor=cursor, sent_at=store.db.dialect.now())
    )

    def write(conn: Connection) -> None:
        conn.execute(stmt)

    fenced_write(store, claim, "the call's reference was not saved", write)
    return replace(intent, state=IntentState.SENT, reference=reference, cursor=cursor)


def end_intent_txn(
    conn: Connection,
    store: RunStore,
    intent: Intent,
    state: IntentState,
    *,
    input_tokens: int | None = None,
    output_tokens: int | None = None,
    error: str | None = None,
) -> None:
    """End an open intent in the caller's transaction (with the step's checkpoint, for `done`); give its
    limiters back what it did not use (its tokens are known: `done`, or a failure that reported usage), and
    release its budget reservation (once; the ledger row written with it charges the actual cost)."""
    ended = conn.execute(
        update(INTENTS)
        .where(INTENTS.c.public_id == intent.public_id, INTENTS.c.state.in_(_OPEN))
        .values(
            state=state,
            ended_at=store.db.dialect.now(),
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            error=error[:1000] if error else None,
        )
    )
    known = input_tokens is not None or output_tokens is not None
    if intent.admitted and known and rowcount(ended) == 1:  # settled once: only by the write that ended it
        returned = intent.endpoint in OUTPUT_RETURNED_ENDPOINTS
        used = used_by(intent.admitted, int(input_tokens or 0), int(output_tokens or 0), returned)
        settle_txn(conn, store.db.dialect, intent.admitted, used)
    if state.terminal:
        release_txn(conn, store.db.dialect, intent.public_id, intent.reservation)


def end_intent(
    store: RunStore,
    claim: Claim,
    intent: Intent,
    state: IntentState,
    also: Callable[[Connection], None] | None = None,
    **figures: Any,
) -> None:
    """End an open intent (failed, lost, cancelled) in a fenced transaction of its own, with `also` in it."""

    def write(conn: Connection) -> None:
        end_intent_txn(conn, store, intent, state, **figures)
        if also is not None:
            also(conn)

    fenced_write(store, claim, f"the call's end ({state.value}) was not recorded", write)
