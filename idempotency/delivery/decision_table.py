"""One delivery of one message, as a decision table: what the claim found decides what happens.

| what was found           | method             | what the delivery does                        | outcome           |
|--------------------------|--------------------|-----------------------------------------------|-------------------|
| (before claiming) newer  | `debounced`        | a newer edit replaced it (delivery/debounce)  | debounced         |
| (before claiming) stale  | `_stale`           | not newer than the applied version: ack       | stale             |
| (before claiming) cached | `_replay_cached`   | replay cache on: the stored answer from Redis | replayed          |
| CLAIMED                  | `_execute`         | run the body, complete fenced                 | executed, resumed |
|   the body parked        | `_parked`          | park WAITING (fenced), ack; a wake re-sends   | waiting           |
|   the body raised        | `_failed`          | record FAILED (or DEAD), raise                | failed, dead      |
|   the body asked a retry | `_retry_requested` | record the wait for the retry, raise          | (retry pending)   |
|   lease lost finishing   | `_lease_lost`      | roll back, re-send (the taker's result)       | lease_lost        |
|   superseded (renewal)   | `superseded`       | roll back, ack: a newer edit replaced it      | superseded        |
| COMPLETED                | `_replay`          | the stored result; the body is not called     | replayed          |
| CONFLICT                 | `_conflict`        | dead-letter, raise IdempotencyConflict        | conflict          |
| IN_PROGRESS, ENTITY_BUSY | `_busy`            | on_in_progress: re-send, skip or raise        | in_progress (1st) |
| DEAD                     | `_dead`            | raise RunIsDead (`oncelery dlq replay`)       | dead              |
| store unavailable        | `_store_failed`    | re-send (never acked as a failure)            | (not settled)     |

A message that waits for a live holder counts `in_progress` on its first find only; its re-checks count
nothing, and the delivery that stops waiting observes the wait's length (`_end_wait`, runs/waits.py).

The CLAIMED row and its sub-rows (`_execute` ... `_lease_lost`) are `ClaimedRow`'s methods (`claimed.py`), which
`Delivery` inherits; this module holds the table, the rows before and after a claim, and what the rows share.

The task (Celery glue) supplies how to re-send; this module decides when. It knows the task only through
`DeliveredTask`, the few things a delivery asks of it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from celery.exceptions import Ignore

from oncelery.delivery.claimed import ClaimedRow
from oncelery.delivery.debounce import debounced
from oncelery.delivery.delivered import Call, DeliveredTask
from oncelery.delivery.replay_cache import ReplayCache
from oncelery.delivery.resend import SendAgain, after_store_fault, can_resend, direct_backoff
from oncelery.errors import IdempotencyConflict, InProgress, RunIsDead, StaleVersion, StoreError
from oncelery.models import Outcome
from oncelery.runs.claims import RunStore
from oncelery.runs.decisions import ClaimResult, Decision, EntityVersionOf
from oncelery.runs.faults import fault_point
from oncelery.runs.keys import Identity, differing_fields, digest_key_rotated
from oncelery.runs.waits import record_wait, wait_started
from oncelery.settings import DIRECT_WAIT_TIMEOUT, HEADER_WAITING_SINCE

__all__ = ["Delivery", "conflict_error"]

logger = logging.getLogger("oncelery.delivery")  # a stable name (users filter on it)


class Delivery(ClaimedRow):
    """One delivery of `task` for a call: claims, then executes, replays, waits or refuses (one outcome)."""

    def __init__(self, task: DeliveredTask, call: Call, send_again: SendAgain) -> None:
        self.task = task
        self.call = call
        self.ident = call.ident
        self.version = call.version
        self.store: RunStore = task.store
        # The request of this delivery: Celery's `task.request` is a thread-local stack lookup per access.
        self.request = request = task.request
        # Eager (task_always_eager, .apply()): there is no broker to send the job again through, and
        # re-sending would run it again on this very stack (unbounded recursion).
        self.eager = bool(getattr(request, "is_eager", False))
        self.resend = can_resend(request, call.direct)
        self.send_again = send_again
        # This delivery's claimant name, sent along if a store fault makes it re-send the job (see claim()).
        self.owner = uuid.uuid4().hex
        self.cache: ReplayCache | None = None  # the app's replay cache, resolved when the delivery runs
        # When this message began to wait for a live holder (its header), until a delivery of it stops waiting.
        self.waiting_since = call.waiting_since

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Deliver once: loop only while a direct (no broker) caller waits for another holder."""
        deadline = time.monotonic() + DIRECT_WAIT_TIMEOUT
        waited = 0
        try:
            if self.call.debounce is not None and debounced(self, self.call):
                return None
            if self.version is not None and self._stale(self.version):
                return None
        except StoreError as exc:
            return self._store_failed(exc, "checking the version of")
        self.cache = self.task.replay_cache()  # resolved once per delivery: _remember writes to it
        # Not for a debounced edit: its key's run may have been superseded (and just reopened), and the empty
        # answer a redelivery of that run cached must not answer an edit that is to run it again.
        cached = None
        if self.cache is not None and self.call.debounce is None:
            cached = self.cache.lookup(self.task.name, self.ident)
        if self.cache is not None and cached is not None:
            self._end_wait(Outcome.REPLAYED.value)
            return self._replay_cached(self.cache, cached.run_id, cached.token, cached.result)
        while True:
            try:
                res = self._claim()
                if res.decision not in _WAITING:
                    self._end_wait(_WAIT_ENDED[res.decision])
                answer = self._decide(res, args, kwargs, deadline)
            except StoreError as exc:
                # Claiming, or counting the outcome, failed: nothing was decided, so the job is sent again.
                return self._store_failed(exc, "delivering")
            if answer is not _WAIT:
                return answer
            # A direct caller has no broker to re-deliver it: poll the database clock's verdict.
            time.sleep(direct_backoff(waited))
            waited += 1

    def _claim(self) -> ClaimResult:
        call = self.call
        fault_point("claim", task=self.task.name, key=self.ident.key)
        return self.store.claim(
            self.task.name,
            self.ident,
            call.lease,
            call.entity,
            self.request.id,
            call.message if call.keep_message else None,
            max_deliveries=self.task.max_deliveries,
            letter=call.message,
            owner=self.owner,
            abandoned=call.abandoned,
        )

    def _decide(self, res: ClaimResult, args: tuple[Any, ...], kwargs: dict[str, Any], deadline: float) -> Any:
        """The table: the row of the claim's decision (see the module's docstring)."""
        return _ROWS[res.decision](self, res, args, kwargs, deadline)

    # -- before claiming -------------------------------------------------------------------------

    def _stale(self, version: EntityVersionOf) -> bool:
        """Whether the entity already applied this version or a newer one: then count `stale` (acked)."""
        fault_point("version_check", task=self.task.name, key=self.ident.key)
        applied = self.store.applied_version(self.task.name, self.ident.tenant, version.entity)
        if applied is None or version.version > applied:
            return False
        # Settled before it is counted: a fault between them re-sends the job, which then counts it once.
        settled = self.store.settle_stale(self.task.name, self.ident)
        if settled is not None:  # a parked run's call may still run at the provider (it is on the books): stop it
            self.task.stop_calls_later(settled, "cancelled: its run was settled stale")
        self.store.close_outbox_row(self.request.id, Outcome.STALE)
        self._end_wait(Outcome.STALE.value)
        self._count(Outcome.STALE)
        stale = StaleVersion.of(version.entity, version.version, applied)
        logger.info("%s[%s]: %s", self.task.name, self.ident.key, stale)
        return True

    def _replay_cached(self, cache: ReplayCache, run_id: int, token: int, result: Any) -> Any:
        """A finished run's answer, no database round trip: counted in memory, written within a second."""
        cache.count(run_id, self.task.name, self.ident.tenant)
        self.task.tell_caller(Outcome.REPLAYED, self.ident, token)
        logger.info("replayed %s[%s] from the replay cache", self.task.name, self.ident.key)
        return result

    # -- the rows --------------------------------------------------------------------------------

    def _replay(self, res: ClaimResult, *_: Any) -> Any:
        """COMPLETED: the stored result answers; the body is not called."""
        run = res.run
        # The token of the run whose result answers this delivery (Flower shows which holder produced it).
        token = run.token if run is not None else None
        if res.counted:  # counted by the claim's own statement
            self.task.tell_caller(Outcome.REPLAYED, self.ident, token)
        else:
            self._count(Outcome.REPLAYED, run.run_id if run is not None else None, token)
        logger.info("replayed %s[%s] from its stored result", self.task.name, self.ident.key)
        if run is None:
            return None
        self._remember(run.run_id, run.token, run.result)  # e.g. an entry Redis lost: written back
        return run.result

    def _conflict(self, res: ClaimResult, *_: Any) -> Any:
        """CONFLICT: the key was first used with another payload; dead-letter this message, never retry it."""
        conflict = conflict_error(self.task.name, self.ident, res.run.field_digests if res.run is not None else {})
        fields = conflict.fields
        fault_point("dead_letter", task=self.task.name, key=self.ident.key)
        self.store.close_outbox_row(self.request.id, Outcome.CONFLICT)  # before the count: it is idempotent
        # The `conflict` count and one redacted letter per payload, in one transaction.
        self.store.letter_conflict(self.task.name, self.ident, str(conflict), fields, self.call.message)
        self.task.tell_caller(Outcome.CONFLICT, self.ident)
        raise conflict

    def _dead(self, res: ClaimResult, *_: Any) -> Any:
        """DEAD: the run is never run again until `oncelery dlq replay`."""
        self._count(Outcome.DEAD)
        how = "is DEAD"
        if res.killed:
            how = f"lost its worker on {self.task.max_deliveries} deliveries (a poison message) and is now DEAD"
            logger.error("%s[%s] %s", self.task.name, self.ident.key, how)
        raise RunIsDead(
            f"{self.task.name}[{self.ident.key}] {how}: it is not run again; see `oncelery dlq show "
            f"{self.ident.key}`, fix the cause, then `oncelery dlq replay {self.ident.key}`",
            task_name=self.task.name,
            key=self.ident.key,
        )

    def _busy(self, res: ClaimResult, _args: Any, _kwargs: Any, deadline: float) -> Any:
        """IN_PROGRESS / ENTITY_BUSY: someone else holds the key (or the entity); apply on_in_progress."""
        policy = self.call.policy
        held = res.run.token if res.run is not None else None  # the live holder's token, for Flower
        if res.parked_copy and self.resend:
            # A copy of a parked run's own message: counted, then acked without a result (the caller's result
            # is the run's, under this same task id); the waker sends the message again at the wake.
            self._count(Outcome.IN_PROGRESS, token=held)
            raise Ignore()
        since = None
        if self.waiting_since is not None:
            # A re-check of a message already waiting: its wait was counted once, on its first find.
            self.task.tell_caller(Outcome.IN_PROGRESS, self.ident, held)
        elif policy in ("skip", "raise") or self.resend or self.eager:
            if policy == "retry" and self.resend:
                since = wait_started(self.store.db)  # read before the count: a fault re-sends it uncounted
            self._count(Outcome.IN_PROGRESS, token=held)
        if policy == "skip":
            return None
        if policy == "raise":
            busy = f" (entity {self.call.entity} busy)" if res.decision is Decision.ENTITY_BUSY else ""
            raise self._in_progress(f"is being run by another worker{busy}")
        if self.resend:
            return self.send_again(None, waiting_since=since)
        if self.eager:
            raise self._in_progress(
                "is being run by another worker, and an eager call (task_always_eager or .apply()) cannot wait "
                "for it: use .delay(), or on_in_progress='skip'"
            )
        if time.monotonic() > deadline:
            raise InProgress(
                f"{self.task.name}[{self.ident.key}] still held after {DIRECT_WAIT_TIMEOUT}s", key=self.ident.key
            )
        return _WAIT

    def _in_progress(self, why: str) -> InProgress:
        return InProgress(f"{self.task.name}[{self.ident.key}] {why}", task_name=self.task.name, key=self.ident.key)

    # -- shared by the rows ----------------------------------------------------------------------

    def _end_wait(self, ended: str) -> None:
        """This delivery no longer waits: observe the message's wait (once), and drop its header."""
        since, self.waiting_since = self.waiting_since, None
        if since is None:
            return
        headers = self.request.headers
        if isinstance(headers, dict):  # a later retry() or re-send copies the request's headers: not this one
            headers.pop(HEADER_WAITING_SINCE, None)
        try:
            record_wait(self.store.db, self.task.name, self.ident.tenant, since, ended)
        except StoreError as exc:
            # An observation, not a count: losing it beats re-sending a delivery that was decided.
            logger.warning("%s[%s]: wait not observed: %s", self.task.name, self.ident.key, exc)

    def _remember(self, run_id: int, token: int, result: Any) -> None:
        if self.cache is not None:
            self.cache.remember(self.task.name, self.ident, run_id, token, result)

    def _store_failed(self, exc: StoreError, doing: str) -> Any:
        what = f"{doing} {self.task.name}[{self.ident.key}]"
        return after_store_fault(exc, what, self.resend, self.send_again, self.owner)

    def _count(self, outcome: Outcome, replayed_run: int | None = None, token: int | None = None) -> None:
        # A StoreError here propagates to `run`, which sends the job again: an uncounted delivery is not settled.
        fault_point("count_outcome", task=self.task.name, key=self.ident.key, outcome=outcome.value)
        self.store.record_outcome(self.task.name, outcome, self.ident.tenant, replayed_run)
        self.task.tell_caller(outcome, self.ident, token)


_WAIT = object()  # _busy's answer when a direct caller should poll again
_WAITING = (Decision.IN_PROGRESS, Decision.ENTITY_BUSY)


def conflict_error(task_name: str, ident: Identity, stored: dict[str, str]) -> IdempotencyConflict:
    """The IdempotencyConflict of a call whose key was first used with another payload, naming the fields that
    differ (`stored`: the run's field digests; `ident`'s own are compared with them) where the digests tell."""
    fields = differing_fields(stored, ident.field_digests)
    which = ", ".join(fields) or "unknown"
    if digest_key_rotated(stored, ident.field_digests):
        which = "unknown: the digest key (ONCELERY_DIGEST_KEY) changed since the first payload was stored"
    return IdempotencyConflict(
        f"{task_name}: idempotency key {ident.key!r} was first used with a different payload "
        f"(fields that differ: {which}); the first result stands. "
        f"Use a new key (e.g. bump the version in it) for a new payload.",
        task_name=task_name,
        key=ident.key,
        fields=fields,
    )


# How a wait ended, by the decision of the delivery that no longer waits (the label of in_progress_wait).
_WAIT_ENDED = {
    Decision.COMPLETED: Outcome.REPLAYED.value,
    Decision.CLAIMED: "claimed",
    Decision.CONFLICT: Outcome.CONFLICT.value,
    Decision.DEAD: Outcome.DEAD.value,
}

# The table's rows after the claim, one method each (built once: no per-delivery dispatch objects).
_ROWS: dict[Decision, Callable[[Delivery, ClaimResult, tuple[Any, ...], dict[str, Any], float], Any]] = {
    Decision.CLAIMED: Delivery._execute,
    Decision.COMPLETED: Delivery._replay,
    Decision.CONFLICT: Delivery._conflict,
    Decision.DEAD: Delivery._dead,
    Decision.IN_PROGRESS: Delivery._busy,
    Decision.ENTITY_BUSY: Delivery._busy,
}
