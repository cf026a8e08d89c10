"""One delivery of one message, as a decision table: what the claim found decides what happens.

| claim decision          | what the delivery does                                     | outcome recorded       |
|-------------------------|------------------------------------------------------------|------------------------|
| CLAIMED                 | run the body, complete fenced (or record the failure)      | executed/resumed/failed|
| COMPLETED               | return the stored result; the body is not called           | replayed               |
| CONFLICT                | raise IdempotencyConflict (never retried)                  | conflict               |
| IN_PROGRESS/ENTITY_BUSY | on_in_progress: re-send with backoff, skip, or raise       | in_progress            |
| DEAD                    | raise RunIsDead (acked; `oncelery dlq replay` runs it)     | dead                   |
| (before claiming) stale | a version not newer than the entity's applied one: ack     | stale                  |
| (before claiming) cached| replay cache on: the COMPLETED run's answer from Redis     | replayed (batched)     |
| store unavailable       | re-send the message (never acked as a failure)             | (none: not settled)    |
| lease lost on finishing | roll back, re-send: the next delivery replays the taker's  | lease_lost             |

The task (Celery glue) supplies how to re-send; this module decides when.
"""

from __future__ import annotations

import logging
import time
import traceback
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery.exceptions import Retry

from oncelery.delivery.effects import EffectsScope
from oncelery.delivery.renewal import Heartbeat
from oncelery.delivery.replay_cache import ReplayCache
from oncelery.delivery.resend import SendAgain, after_store_fault, can_resend, direct_backoff, seconds_until
from oncelery.delivery.steps import StepRunner, load_checkpoints
from oncelery.errors import (
    ConfigurationError,
    IdempotencyConflict,
    InProgress,
    LeaseLost,
    ResultNotJSON,
    RunIsDead,
    StaleVersion,
    StepMismatch,
    StoreError,
)
from oncelery.models import Outcome
from oncelery.runs.claims import (
    CONFLICT,
    NEVER_SUCCEEDS,
    RETRIES_EXHAUSTED,
    Claim,
    ClaimResult,
    Death,
    Decision,
    EntityVersionOf,
    RunStore,
    encode_result,
)
from oncelery.runs.faults import fault_point
from oncelery.runs.keys import Identity, differing_fields
from oncelery.settings import DEFAULT_LEASE_SECONDS, DIRECT_WAIT_TIMEOUT

if TYPE_CHECKING:
    from oncelery.task.idempotent import IdempotentTask

logger = logging.getLogger("oncelery.delivery")  # a stable name (users filter on it)

# Errors that no retry of the same message can fix: the run goes DEAD at once (with a dead letter).
NEVER_SUCCEED: tuple[type[BaseException], ...] = (StepMismatch, ResultNotJSON, ConfigurationError)


@dataclass
class RunContext:
    """The live claim of the run executing on this thread: heartbeat, step runner, effects scope."""

    claim: Claim
    heartbeat: Heartbeat
    steps: StepRunner
    effects: EffectsScope


class Delivery:
    """One delivery of `task` for `ident`: claims, then executes, replays, waits or refuses (one outcome)."""

    def __init__(
        self,
        task: IdempotentTask,
        ident: Identity,
        entity: str | None,
        message: Any,
        direct: bool,
        send_again: SendAgain,
        letter: Any = None,
        version: EntityVersionOf | None = None,
        abandoned: str | None = None,
        lease: float = DEFAULT_LEASE_SECONDS,
        policy: str = "retry",
    ) -> None:
        self.task = task
        self.letter = letter  # what a dead letter keeps to replay: the arguments and key headers
        self.version = version
        self.store: RunStore = task.store
        self.ident = ident
        self.entity = entity
        self.message = message
        self.direct = direct
        # The request of this delivery: Celery's `task.request` is a thread-local stack lookup per access.
        self.request = request = task.request
        # Eager (task_always_eager, .apply()): there is no broker to send the job again through, and
        # re-sending would run it again on this very stack (unbounded recursion).
        self.eager = bool(getattr(request, "is_eager", False))
        self.resend = can_resend(request, direct)
        self.send_again = send_again
        # This delivery's claimant name, sent along if a store fault makes it re-send the job (see claim()).
        self.owner = uuid.uuid4().hex
        self.abandoned = abandoned
        self.lease = lease  # this call's: its own option, else the task's, else the app's
        self.policy = policy  # on_in_progress, resolved the same way
        self.cache: ReplayCache | None = None  # the app's replay cache, resolved when the delivery runs

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Deliver once: loop only while a direct (no broker) caller waits for another holder."""
        deadline = time.monotonic() + DIRECT_WAIT_TIMEOUT
        waited = 0
        try:
            if self.version is not None and self._stale(self.version):
                return None
        except StoreError as exc:
            return self._store_failed(exc, "checking the version of")
        self.cache = cache = self.task.replay_cache()  # resolved once per delivery: _remember writes to it
        if cache is not None and (cached := cache.lookup(self.task.name, self.ident)) is not None:
            # A finished run's answer, no database round trip: counted in memory, written within a second.
            cache.count(cached.run_id, self.task.name, self.ident.tenant)
            self.task.tell_caller(Outcome.REPLAYED, self.ident, cached.token)
            logger.info("replayed %s[%s] from the replay cache", self.task.name, self.ident.key)
            return cached.result
        while True:
            try:
                fault_point("claim", task=self.task.name, key=self.ident.key)
                res = self.store.claim(
                    self.task.name,
                    self.ident,
                    self.lease,
                    self.entity,
                    self.request.id,
                    self.message,
                    max_deliveries=self.task.max_deliveries,
                    letter=self.letter,
                    owner=self.owner,
                    abandoned=self.abandoned,
                )
                answer = self._decide(res, args, kwargs, deadline)
            except StoreError as exc:
                # Claiming, or counting the outcome, failed: nothing was decided, so the job is sent again.
                return self._store_failed(exc, "delivering")
            if answer is not _WAIT:
                return answer
            # A direct caller has no broker to re-deliver it: poll the database clock's verdict.
            time.sleep(direct_backoff(waited))
            waited += 1

    def _decide(self, res: ClaimResult, args: tuple[Any, ...], kwargs: dict[str, Any], deadline: float) -> Any:
        """The table: one branch per claim decision."""
        if res.decision is Decision.CLAIMED and res.claim is not None:
            return self._execute(res.claim, args, kwargs)
        if res.decision is Decision.COMPLETED and res.run is not None:
            return self._replay(res)
        if res.decision is Decision.CONFLICT:
            conflict = self._conflict(res)
            fault_point("dead_letter", task=self.task.name, key=self.ident.key)
            self.store.letter_without_run(
                self.task.name, self.ident.tenant, CONFLICT, str(conflict), self.letter, self.ident.key
            )  # the letter and the `conflict` count, in one transaction
            self.task.tell_caller(Outcome.CONFLICT, self.ident)
            raise conflict
        if res.decision is Decision.DEAD:
            return self._dead(res)
        return self._busy(res, deadline)

    # -- the decisions ---------------------------------------------------------------------------

    def _replay(self, res: ClaimResult) -> Any:
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

    def _remember(self, run_id: int, token: int, result: Any) -> None:
        if self.cache is not None:
            self.cache.remember(self.task.name, self.ident, run_id, token, result)

    def _stale(self, version: EntityVersionOf) -> bool:
        """Whether the entity already applied this version or a newer one: then count `stale` (acked)."""
        fault_point("version_check", task=self.task.name, key=self.ident.key)
        applied = self.store.applied_version(self.task.name, self.ident.tenant, version.entity)
        if applied is None or version.version > applied:
            return False
        self._count(Outcome.STALE)
        stale = StaleVersion.of(version.entity, version.version, applied)
        logger.info("%s[%s]: %s", self.task.name, self.ident.key, stale)
        return True

    def _dead(self, res: ClaimResult) -> Any:
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

    def _conflict(self, res: ClaimResult) -> IdempotencyConflict:
        stored = res.run.field_digests if res.run is not None else {}
        fields = differing_fields(stored, self.ident.field_digests)
        return IdempotencyConflict(
            f"{self.task.name}: idempotency key {self.ident.key!r} was first used with a different payload "
            f"(fields that differ: {', '.join(fields) or 'unknown'}); the first result stands. "
            f"Use a new key (e.g. bump the version in it) for a new payload.",
            task_name=self.task.name,
            key=self.ident.key,
            fields=fields,
        )

    def _busy(self, res: ClaimResult, deadline: float) -> Any:
        """Someone else holds the key (or the entity) right now: apply the on_in_progress policy."""
        policy = self.policy
        held = res.run.token if res.run is not None else None  # the live holder's token, for Flower
        if policy == "skip":
            self._count(Outcome.IN_PROGRESS, token=held)
            return None
        if policy == "raise":
            self._count(Outcome.IN_PROGRESS, token=held)
            busy = " (entity " + str(self.entity) + " busy)" if res.decision is Decision.ENTITY_BUSY else ""
            raise InProgress(
                f"{self.task.name}[{self.ident.key}] is being run by another worker{busy}",
                task_name=self.task.name,
                key=self.ident.key,
            )
        if self.resend:
            self._count(Outcome.IN_PROGRESS, token=held)
            return self.send_again(None)
        if self.eager:
            self._count(Outcome.IN_PROGRESS, token=held)
            raise InProgress(
                f"{self.task.name}[{self.ident.key}] is being run by another worker, and an eager call "
                f"(task_always_eager or .apply()) cannot wait for it: use .delay(), or on_in_progress='skip'",
                task_name=self.task.name,
                key=self.ident.key,
            )
        if time.monotonic() > deadline:
            raise InProgress(
                f"{self.task.name}[{self.ident.key}] still held after {DIRECT_WAIT_TIMEOUT}s", key=self.ident.key
            )
        return _WAIT

    def _execute(self, claim: Claim, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        task, store = self.task, self.store
        logger.info("claimed %s[%s] token=%d attempt=%d", task.name, claim.key, claim.token, claim.attempts)
        try:
            # Only a taken-over run can have checkpoints: a fresh insert has none (saves a query per job).
            if claim.takeover:
                fault_point("load_checkpoints", task=task.name, key=claim.key)
            checkpoints = load_checkpoints(store, claim.run_id) if claim.takeover else []
        except StoreError as exc:
            return self._store_failed(exc, "loading the checkpoints of")
        hb = Heartbeat(store, claim, task.max_lease_seconds()).start()
        ctx = RunContext(claim, hb, StepRunner(store, claim, checkpoints), EffectsScope(store))
        task.attach(ctx)
        # Celery's max_retries counts this run's retries, whichever message (a duplicate, a re-send)
        # carries the attempt: never a fresh allowance per copy.
        self.request.retries = max(int(self.request.retries or 0), claim.retries)
        try:
            try:
                result = task.run(*args, **kwargs)
                hb.check()
                encoded = encode_result(result, f"The result of {task.name}[{claim.key}]")
                outcome = Outcome.RESUMED if ctx.steps.replayed else Outcome.EXECUTED
                fault_point("complete", task=task.name, key=claim.key)
                try:
                    steps = ctx.steps.counts()
                    store.complete(claim, encoded, ctx.effects.connection, outcome, self.version, steps)
                    task.tell_caller(outcome, self.ident, claim.token)
                    self._remember(claim.run_id, claim.token, encoded)  # committed: COMPLETED is final
                except StaleVersion as stale:
                    # A newer version of the entity was applied while this one ran: its effects roll back,
                    # and the run completes with no result, counted `stale` (never applied out of order).
                    ctx.effects.discard()
                    logger.info("%s[%s]: %s", task.name, claim.key, stale)
                    encoded = None
                    store.complete(claim, None, None, Outcome.STALE, steps=steps)
                    task.tell_caller(Outcome.STALE, self.ident, claim.token)
            finally:
                # Stopped only after the commit: on SQLite a renewal may wait for the effects
                # transaction's write lock, which the commit releases (joining first would deadlock).
                hb.stop()
        except LeaseLost:
            ctx.effects.discard()
            self._count(Outcome.LEASE_LOST)
            logger.warning("lease lost for %s[%s] token=%d: writes rolled back", task.name, claim.key, claim.token)
            if not self.resend:
                raise
            # The next delivery replays the new holder's result, or runs the job if the claim itself was lost
            # (e.g. a database crash): never a silent drop.
            return self.send_again(None)
        except StoreError as exc:
            ctx.effects.discard()
            # Nothing committed; the run stays RUNNING until its lease expires, then a re-delivery takes it.
            return self._store_failed(exc, "finishing")
        except Retry as retry:
            ctx.effects.discard()
            # Celery has already sent the retry's message: if the failure cannot be recorded, the run stays
            # RUNNING until its lease expires and the retry takes it over then. Recorded, the run waits
            # out the countdown: a duplicate delivery must not run it again sooner.
            self._record_failure(
                claim, "retry requested: " + traceback.format_exc(limit=5), retry_in=seconds_until(retry.when)
            )
            raise
        except BaseException as exc:
            ctx.effects.discard()
            death = self._death(exc)
            failure = self._record_failure(
                claim, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=20)}", death=death
            )
            if failure is not None and self.resend:
                # An unrecorded failure would be acked as final while the run stays RUNNING: send the job
                # again instead; it is taken over (and run again) once this holder's lease expires.
                return self._store_failed(failure, "recording the failure of")
            task.tell_caller(Outcome.DEAD if death is not None else Outcome.FAILED, self.ident, claim.token)
            raise
        finally:
            ctx.effects.close()
            task.detach(ctx)
        return encoded

    def _store_failed(self, exc: StoreError, doing: str) -> Any:
        what = f"{doing} {self.task.name}[{self.ident.key}]"
        return after_store_fault(exc, what, self.resend, self.send_again, self.owner)

    def _death(self, exc: BaseException) -> Death | None:
        """A Death if this final failure can never succeed or spent the last retry, else None (FAILED)."""
        task = self.task
        if isinstance(exc, NEVER_SUCCEED + tuple(task.dead_on)):
            reason = NEVER_SUCCEEDS
        elif (limit := _max_retries(task)) is not None and int(task.request.retries or 0) >= limit:
            # Celery re-raises the error of the last allowed retry (or MaxRetriesExceededError): it is final.
            reason = RETRIES_EXHAUSTED
        else:
            return None
        tb = traceback.format_exc(limit=50)
        return Death(reason, tb, self.letter, f"{type(exc).__name__}: {exc}")

    def _record_failure(
        self, claim: Claim, error: str, retry_in: float | None = None, death: Death | None = None
    ) -> StoreError | None:
        """Record the run FAILED (or DEAD); return the store error that prevented it (re-send), else None."""
        try:
            fault_point("record_failure", task=self.task.name, key=claim.key)
            self.store.fail(claim, error, retry_in=retry_in, death=death)
        except StoreError as exc:
            logger.error("could not record failure of %s[%s]: %s", self.task.name, claim.key, exc)
            return exc
        return None

    def _count(self, outcome: Outcome, replayed_run: int | None = None, token: int | None = None) -> None:
        # A StoreError here propagates to `run`, which sends the job again: an uncounted delivery is not settled.
        fault_point("count_outcome", task=self.task.name, key=self.ident.key, outcome=outcome.value)
        self.store.record_outcome(self.task.name, outcome, self.ident.tenant, replayed_run)
        self.task.tell_caller(outcome, self.ident, token)


_WAIT = object()  # _busy's answer when a direct caller should poll again


def _max_retries(task: IdempotentTask) -> int | None:
    """The retry limit Celery enforces: autoretry's retry_kwargs["max_retries"] wins over the task's."""
    retry_kwargs = getattr(task, "retry_kwargs", None) or {}
    if "max_retries" in retry_kwargs:
        value = retry_kwargs["max_retries"]
        return None if value is None else int(value)
    return None if task.max_retries is None else int(task.max_retries)
