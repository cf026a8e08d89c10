"""One run's history for its page (Flower's Runs section): its holders in order, and what each one did.

Oncelery keeps no row per delivery: a run counts its claims (`attempts`), lost holders, retries and the
duplicates it answered, and each holder (a fencing token) signs what it wrote. So the timeline is one attempt per
fencing token: the steps it checkpointed (how long each ran), the model calls it prepared (the intent's state,
provider reference, limiter admissions and budget reservations) and the ledger rows they wrote (tokens, cost,
label, re-attached). Every read goes through an index on the run's id; nothing here writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import and_, select

from oncelery.models.money import usd
from oncelery.runs.forks import fork_id_of, load_fork_txn
from oncelery.runs.views import CallView, Runs, RunView, StepView
from oncelery.store.tables import BUDGETS, FORKS, INTENTS, LETTERS, RUNS

__all__ = [
    "Attempt",
    "ForkLink",
    "IntentView",
    "RunTimeline",
    "ledger_label",
    "read_intents",
    "read_timeline",
]


@dataclass(frozen=True)
class IntentView:
    """A model call's write-ahead intent: its state, the provider's reference, what it admitted and reserved."""

    intent_id: int
    public_id: str
    position: int
    step: str
    attempt: int
    token: int
    provider: str
    model: str
    mode: str
    state: str  # prepared | sent | done | failed | lost | cancelled | abandoned
    reference: str | None
    repeat_reason: str | None  # why this attempt was sent again (create_window, lost, ...)
    prepared_at: datetime | None
    sent_at: datetime | None
    ended_at: datetime | None
    input_tokens: int | None
    output_tokens: int | None
    error: str | None
    admitted: dict[str, int]  # the shared limiters' admissions: {limiter: units}
    reserved: dict[str, int]  # the budgets' reservations: {budget window: micro-USD}
    released_at: datetime | None  # when the reservations were released (None: still held, or none)
    estimated_cost: Decimal | None


@dataclass(frozen=True)
class ForkLink:
    """A fork of this run, or the run this one forks: the fork's id, from-step, effects, and the run's id."""

    fork_id: int
    from_step: str
    effects: str
    key: str
    run_id: int | None  # None: its run has not started yet


@dataclass(frozen=True)
class Attempt:
    """What one holder (fencing token) of the run wrote: checkpoints, model call intents and ledger rows."""

    token: int
    steps: list[StepView] = field(default_factory=list)
    intents: list[IntentView] = field(default_factory=list)
    calls: list[CallView] = field(default_factory=list)


@dataclass(frozen=True)
class RunTimeline:
    """A run and everything recorded about it, by index on its id."""

    run: RunView
    steps: list[StepView]
    calls: list[CallView]
    intents: list[IntentView]
    letter_ids: list[int]  # its dead letter (at most one: dead_letters.run_id is unique)
    job_budget: dict[str, Any] | None  # the run's own budget window (`max_cost_usd`): limit, spent, reserved
    forks: list[ForkLink]  # forks made from this run
    forked_from: ForkLink | None  # the fork this run is, if it is one

    def attempts(self) -> list[Attempt]:
        """One Attempt per fencing token from 1 to the run's, each with what that holder wrote."""
        by_token = {token: Attempt(token) for token in range(1, self.run.token + 1)}
        for st in self.steps:
            by_token.setdefault(st.token, Attempt(st.token)).steps.append(st)
        for intent in self.intents:
            by_token.setdefault(intent.token, Attempt(intent.token)).intents.append(intent)
        for call in self.calls:
            if call.token is not None:
                by_token.setdefault(call.token, Attempt(call.token)).calls.append(call)
        return [by_token[t] for t in sorted(by_token)]

    def intent_of(self, call: CallView) -> IntentView | None:
        """The intent a ledger row was written for (a `self.llm` call's row carries its intent's public id)."""
        return next((i for i in self.intents if i.public_id == call.ledger_call_id), None)


def _intent(r: Any) -> IntentView:
    reserved = r.reserved or {}
    return IntentView(
        int(r.id), r.public_id, int(r.position), r.step_name, int(r.attempt), int(r.token), r.provider, r.model,
        r.mode, _value(r.state), r.reference, None if r.repeat_reason is None else _value(r.repeat_reason),
        r.prepared_at, r.sent_at, r.ended_at, r.input_tokens, r.output_tokens, r.error, dict(r.admitted or {}),
        {str(k): int(v) for k, v in dict(reserved.get("budgets") or {}).items()}, r.released_at,
        usd(r.estimated_cost_micros) if r.estimated_cost_micros is not None else None,
    )  # fmt: skip


def _value(member: Any) -> str:
    return str(getattr(member, "value", member))


def read_intents(reader: Runs, run_id: int) -> list[IntentView]:
    """Every model-call intent of the run as stored now, in step position then attempt order: calls still in
    flight (`prepared`, `sent`: no checkpoint, maybe no ledger row yet) included."""
    i = INTENTS.c
    with reader.db.read() as conn:
        rows = conn.execute(select(INTENTS).where(i.run_id == run_id).order_by(i.position, i.attempt))
        return [_intent(row) for row in rows]


def ledger_label(intent: IntentView, calls: list[CallView]) -> str | None:
    """The label of the ledger row written for `intent` (create_window, lost, unknown_outcome...); None if its row
    has none, or if it has no row yet (a call in flight)."""
    return next((c.reason for c in calls if c.ledger_call_id == intent.public_id), None)


def read_timeline(reader: Runs, run_id: int) -> RunTimeline | None:
    """The run `run_id` with its steps, model calls, intents, letter, budget and forks; None if there is none."""
    run = reader.by_id(run_id)
    if run is None:
        return None
    steps, calls, intents = reader.steps(run_id), reader.model_calls(run_id), read_intents(reader, run_id)
    f, r = FORKS.c, RUNS.c
    with reader.db.read() as conn:
        letter_ids = [int(x) for x in conn.execute(select(LETTERS.c.id).where(LETTERS.c.run_id == run_id)).scalars()]
        budget = conn.execute(select(BUDGETS).where(BUDGETS.c.name == f"run:{run_id}")).mappings().first()
        # A fork's run is found by its key under the source's task and tenant (the unique index).
        joined = FORKS.outerjoin(
            RUNS, and_(r.task_name == f.task_name, r.tenant == f.tenant, r.idempotency_key == f.fork_key)
        )
        forks = [
            ForkLink(int(x.id), x.from_step, _value(x.effects), x.fork_key, x.run_id)
            for x in conn.execute(
                select(f.id, f.from_step, f.effects, f.fork_key, r.id.label("run_id"))
                .select_from(joined)
                .where(f.source_run_id == run_id)
                .order_by(f.id)
            )
        ]
        fork_id = fork_id_of(run.key)
        spec = None if fork_id is None else load_fork_txn(conn, fork_id)
    forked_from = None
    if spec is not None and spec.task_name == run.task_name and spec.tenant == run.tenant:
        forked_from = ForkLink(spec.id, spec.from_step, spec.effects, spec.source_key, spec.source_run_id)
    return RunTimeline(
        run, steps, calls, intents, letter_ids, None if budget is None else dict(budget), forks, forked_from
    )
