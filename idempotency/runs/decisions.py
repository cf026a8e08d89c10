"""What a claim is and what it decides: the claim, the decision, the row seen, and the values they carry.

The data of the claim protocol (oncelery.runs.claims runs it): a `ClaimRequest` asked, a `Claim` held, a
`ClaimResult`, an entity version, a death sentence, and the helpers that shape what is written (a bounded error
text, a JSON-checked result, the completion's counter parameters, the one LeaseLost factory).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

from oncelery.errors import LeaseLost, ResultNotJSON
from oncelery.models import Outcome, RunStatus
from oncelery.runs.keys import Identity
from oncelery.runs.outcomes import counter_shard, outcome_params
from oncelery.runs.views import RunView

__all__ = [
    "LETTER_REASONS",
    "MAX_ERROR_CHARS",
    "REASON_BAD_MESSAGE",
    "REASON_BUDGET",
    "REASON_CONFLICT",
    "REASON_MAX_DELIVERIES",
    "REASON_NEVER_SUCCEEDS",
    "REASON_REPUBLISH_CAP",
    "REASON_RETRIES_EXHAUSTED",
    "Claim",
    "ClaimRequest",
    "ClaimResult",
    "Death",
    "Decision",
    "EntityVersionOf",
    "ProducerFind",
    "clean_error",
    "completion_counts",
    "encode_result",
    "lease_lost",
]

# Bounded error text in task_runs.error: enough for a traceback, never a megabyte of repr.
MAX_ERROR_CHARS = 10_000


def clean_error(text: str) -> str:
    """Return error text that every database can store: no NUL characters, at most MAX_ERROR_CHARS."""
    text = text.replace("\x00", "\\x00")
    if len(text) > MAX_ERROR_CHARS:
        text = text[: MAX_ERROR_CHARS - 20] + "\n...[truncated]"
    return text


class Decision(Enum):
    """What a claim attempt found."""

    CLAIMED = "claimed"  # this caller holds the run and must execute it
    COMPLETED = "completed"  # finished before: answer with the stored result
    IN_PROGRESS = "in_progress"  # a live holder runs this key
    ENTITY_BUSY = "entity_busy"  # another key of the same concurrency_key is RUNNING
    CONFLICT = "conflict"  # same key, different payload fingerprint
    DEAD = "dead"  # DEAD (dead-lettered): no delivery runs it until `oncelery dlq replay`


@dataclass(frozen=True)
class Claim:
    """A held claim: the run row, its fencing token and owner id, and the lease length."""

    run_id: int
    task_name: str
    key: str
    token: int
    owner: str
    lease: float
    attempts: int
    takeover: bool
    tenant: str = ""
    retries: int = 0  # Celery retries already spent on this run (by any message)

    @classmethod
    def inserted(cls, run_id: int, request: ClaimRequest) -> Claim:
        """The claim `request` holds on the run its INSERT created: token 1, first attempt, no takeover."""
        return cls(
            run_id=run_id,
            task_name=request.task_name,
            key=request.ident.key,
            token=1,
            owner=request.owner,
            lease=request.lease,
            attempts=1,
            takeover=False,
            tenant=request.ident.tenant,
        )

    @classmethod
    def from_row(cls, row: Any, request: ClaimRequest) -> Claim:
        """The claim `request` holds after its takeover returned `row` (id, fencing_token, attempts, retries)."""
        return cls(
            run_id=row.id,
            task_name=request.task_name,
            key=request.ident.key,
            token=row.fencing_token,
            owner=request.owner,
            lease=request.lease,
            attempts=row.attempts,
            takeover=True,
            tenant=request.ident.tenant,
            retries=row.retries,
        )


@dataclass(frozen=True)
class ClaimRequest:
    """One `RunStore.claim` call's arguments: who claims which run, and what decides a lost one's fate."""

    task_name: str
    ident: Identity
    lease: float
    owner: str  # this claimant (one per delivery)
    concurrency_key: str | None = None
    celery_task_id: str | None = None
    message: Any = None
    max_deliveries: int | None = None
    letter: Any = None
    abandoned: str | None = None  # the owner of this message's earlier delivery, given up on a database fault

    def params(self, lease: dict[str, Any]) -> dict[str, Any]:
        """The claim statements' parameters, with `lease` (p_lease) and a fresh counter shard per call."""
        ident = self.ident
        return {
            "p_task": self.task_name,
            "p_tenant": ident.tenant,
            "p_key": ident.key,
            "p_fingerprint": ident.fingerprint,
            "p_digests": ident.field_digests,
            "p_owner": self.owner,
            "p_entity": self.concurrency_key,
            "p_task_id": self.celery_task_id,
            "p_message": self.message,
            "p_abandoned": self.abandoned or "",
            "p_shard": counter_shard(),  # the replayed counter's row, if one is counted
            **lease,
        }


@dataclass(frozen=True)
class ClaimResult:
    """The outcome of `RunStore.claim`: a decision plus the claim (if CLAIMED) or the row seen."""

    decision: Decision
    claim: Claim | None = None
    # The row seen. From PostgreSQL's one-statement claim, the fields no decision reads are None
    # (one_trip.NOT_DECIDING): read the run (RunStore.get) for them.
    run: RunView | None = None
    killed: bool = False  # DEAD because this claim found its max_deliveries-th lost delivery
    counted: bool = False  # COMPLETED, and the replay was counted by the claim's own statement (PostgreSQL)
    # IN_PROGRESS of a run parked WAITING until its wake, found by a copy of its own message (a wake sent twice,
    # a redelivery): the waker sends the message again when it is due, so this copy has nothing left to do.
    parked_copy: bool = False


@dataclass(frozen=True)
class ProducerFind:
    """What a producer's check found of a call's run: enough to answer, point at the run, or publish."""

    run_id: int
    status: RunStatus
    fingerprint: str
    token: int
    result: Any
    celery_task_id: str | None
    lease_live: bool
    recoverable: bool  # the run keeps its message, or an outbox row will publish it again
    counted: bool  # a COMPLETED run of the same payload: its replay is already counted (at_producer)


@dataclass(frozen=True)
class EntityVersionOf:
    """The version an event carries for its entity (entity_version=): applied only forward."""

    entity: str
    version: int
    # The entity's name in the encoding before injective keys, where it differs (runs/legacy.py looks it up).
    before: str | None = None

    def params(self) -> dict[str, Any]:
        """The statement parameters of this entity and version."""
        return {"p_entity": self.entity, "p_version": self.version}


@dataclass(frozen=True)
class Death:
    """Why a run goes DEAD, and what `oncelery dlq replay` sends again (the message's args and key headers)."""

    reason: str
    traceback: str | None = None
    message: Any = None
    error: str | None = None  # the letter's one-line error (default: the run's error)


# Dead-letter reasons: the values stored in dead_letters.reason (stable; `oncelery dlq list` shows them).
REASON_RETRIES_EXHAUSTED = "retries_exhausted"
REASON_NEVER_SUCCEEDS = "never_succeeds"
REASON_MAX_DELIVERIES = "max_deliveries"
REASON_CONFLICT = "conflict"
REASON_BAD_MESSAGE = "bad_message"
REASON_REVOKED = "revoked"  # Celery revoked the message of a parked (or terminated) run: cancelled by a person
REASON_BUDGET = "budget_exceeded"  # a model call's estimate did not fit a budget: replay after raising the cap
REASON_REPUBLISH_CAP = "republish_cap"  # an outbox row published too often with no run finishing
#: Every reason a dead letter is written with: the one list the CLI's `--reason` choices (and any reader) take.
#: A new reason is a REASON_* above AND an entry here (tests/test_dead_letter_reasons.py checks both ways).
LETTER_REASONS: tuple[str, ...] = (
    REASON_RETRIES_EXHAUSTED,
    REASON_NEVER_SUCCEEDS,
    REASON_MAX_DELIVERIES,
    REASON_CONFLICT,
    REASON_BAD_MESSAGE,
    REASON_REVOKED,
    REASON_BUDGET,
    REASON_REPUBLISH_CAP,
)


def encode_result(value: Any, what: str) -> Any:
    """Return `value` round-tripped through strict JSON, raising ResultNotJSON with the fix if it can't."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ResultNotJSON(
            f"{what} is not JSON-serializable ({exc}); return JSON types (dict, list, str, int, float, "
            f"bool, None) — convert objects with .model_dump()/dataclasses.asdict() first",
            what=what,
        ) from exc


def completion_counts(claim: Claim, outcome: Outcome, steps: tuple[int, int]) -> dict[str, Any]:
    """The outcome counter's parameters for a completion: its steps (checkpointed, replayed) and takeovers."""
    executed, replayed = steps
    return outcome_params(
        claim.task_name,
        outcome,
        claim.tenant,
        steps_executed=executed,
        steps_replayed=replayed,
        takeovers=claim.token - 1,
    )


def lease_lost(claim: Claim, what: str = "this holder's writes were rolled back") -> LeaseLost:
    """The LeaseLost of `claim`'s holder (the one factory every fenced write uses)."""
    return LeaseLost.for_holder(claim.task_name, claim.key, claim.token, what)
