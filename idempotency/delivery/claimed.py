"""The CLAIMED row of a delivery's decision table (`decision_table.py`): run the body, then complete, fail, wait
for a retry, park, or give the run up.

Its sub-rows (`_parked`, `_failed`, `_retry_requested`, `_lease_lost`) are drawn in the one table, in
`decision_table.py`'s docstring. `Delivery` inherits `ClaimedRow`: these methods are rows of that table, kept in
their own module so each module stays small.
"""

from __future__ import annotations

import logging
import traceback
from typing import TYPE_CHECKING, Any

from celery.exceptions import Ignore, Retry

from oncelery.delivery.debounce import superseded, superseding_watch
from oncelery.delivery.delivered import UNFIXABLE_ERRORS, Call, DeliveredTask, RunContext, max_retries
from oncelery.delivery.effects import EffectsScope
from oncelery.delivery.renewal import Heartbeat
from oncelery.delivery.resend import SendAgain, seconds_until
from oncelery.delivery.steps import StepRunner, load_checkpoints
from oncelery.errors import ConfigurationError, LeaseLost, RunParked, StaleVersion, StoreError
from oncelery.llm.errors import BudgetExceeded
from oncelery.models import Outcome
from oncelery.runs.claims import RunStore
from oncelery.runs.decisions import (
    REASON_BUDGET,
    REASON_NEVER_SUCCEEDS,
    REASON_RETRIES_EXHAUSTED,
    Claim,
    ClaimResult,
    Death,
    EntityVersionOf,
    encode_result,
)
from oncelery.runs.faults import fault_point
from oncelery.runs.forks import ForkSpec
from oncelery.runs.keys import Identity

__all__ = ["ClaimedRow"]

logger = logging.getLogger("oncelery.delivery")  # the delivery's own name (users filter on it)


class ClaimedRow:
    """The CLAIMED row of `Delivery`: the body runs under a renewed lease and the run ends in exactly one outcome."""

    # Set by `Delivery.__init__` (decision_table.py): what these rows read of the delivery.
    task: DeliveredTask
    call: Call
    ident: Identity
    version: EntityVersionOf | None
    store: RunStore
    request: Any
    resend: bool
    send_again: SendAgain

    if TYPE_CHECKING:  # shared by every row, defined by `Delivery` (decision_table.py)

        def _store_failed(self, exc: StoreError, doing: str) -> Any: ...

        def _remember(self, run_id: int, token: int, result: Any) -> None: ...

        def _count(self, outcome: Outcome, replayed_run: int | None = None, token: int | None = None) -> None: ...

    def _execute(self, res: ClaimResult, args: tuple[Any, ...], kwargs: dict[str, Any], _deadline: float) -> Any:
        """CLAIMED: run the body under a renewed lease; its effects commit with the fenced completion."""
        claim = res.claim
        if claim is None:  # a CLAIMED decision always carries its claim (a typed error, not an assert)
            raise StoreError(f"{self.task.name}[{self.ident.key}]: a claim was decided without a claim")
        logger.info("claimed %s[%s] token=%d attempt=%d", self.task.name, claim.key, claim.token, claim.attempts)
        try:
            fork = self.call.fork  # read and checked against this call before the claim (basetask/idempotent.py)
            checkpoints = self._checkpoints(claim, fork)
        except StoreError as exc:
            return self._store_failed(exc, "loading the checkpoints of")
        ctx = self._attach(claim, checkpoints, fork)
        try:
            return self._run_body(ctx, args, kwargs)
        except LeaseLost:
            return self._lease_lost(ctx)
        except StoreError as exc:
            ctx.effects.discard()
            # Nothing committed; the run stays RUNNING until its lease expires, then a re-delivery takes it.
            return self._store_failed(exc, "finishing")
        except Retry as retry:
            self._retry_requested(ctx, retry)
            raise
        except RunParked as parked:
            return self._parked(ctx, parked)
        except BaseException as exc:
            return self._failed(ctx, exc)
        finally:
            ctx.effects.close()
            self.task.detach(ctx)

    def _checkpoints(self, claim: Claim, fork: ForkSpec | None = None) -> list[Any]:
        # Only a taken-over run can have checkpoints: a fresh insert has none (saves a query per job).
        own: list[Any] = []
        if claim.takeover:
            fault_point("load_checkpoints", task=self.task.name, key=claim.key)
            own = load_checkpoints(self.store, claim.run_id)
        if fork is None:
            return own
        # A fork replays the steps before its from-step from the SOURCE run's checkpoints; from there it executes.
        mine = {c.position for c in own}
        source = load_checkpoints(self.store, fork.source_run_id)
        replayed = [c for c in source if c.position < fork.from_position and c.position not in mine]
        return sorted(own + replayed, key=lambda c: c.position)

    def _attach(self, claim: Claim, checkpoints: list[Any], fork: ForkSpec | None = None) -> RunContext:
        hb = Heartbeat(self.store, claim, self.task.max_lease_seconds(), superseding_watch(self, claim)).start()
        ctx = RunContext(
            claim, hb, StepRunner(self.store, claim, checkpoints), EffectsScope(self.store, fork), parkable=self.resend,
            fork=fork,
        )  # fmt: skip
        self.task.attach(ctx)
        # Celery's max_retries counts this run's retries, whichever message (a duplicate, a re-send)
        # carries the attempt: never a fresh allowance per copy.
        self.request.retries = max(int(self.request.retries or 0), claim.retries)
        return ctx

    def _run_body(self, ctx: RunContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        claim = ctx.claim
        try:
            result = self.task.run(*args, **kwargs)
            ctx.heartbeat.check()
            encoded = encode_result(result, f"The result of {self.task.name}[{claim.key}]")
            return self._complete(ctx, encoded)
        finally:
            # Stopped only after the commit: on SQLite a renewal may wait for the effects
            # transaction's write lock, which the commit releases (joining first would deadlock).
            ctx.heartbeat.stop()

    def _complete(self, ctx: RunContext, encoded: Any) -> Any:
        """Complete the run fenced by its token, with its effects; a newer entity version makes it stale."""
        claim = ctx.claim
        outcome = Outcome.RESUMED if ctx.steps.replayed else Outcome.EXECUTED
        fault_point("complete", task=self.task.name, key=claim.key)
        steps = ctx.steps.counts()
        try:
            keep = self.call.keep_arguments
            self.store.complete(claim, encoded, ctx.effects.connection, outcome, self.version, steps, keep)
        except StaleVersion as stale:
            # A newer version of the entity was applied while this one ran: its effects roll back,
            # and the run completes with no result, counted `stale` (never applied out of order).
            ctx.effects.discard()
            logger.info("%s[%s]: %s", self.task.name, claim.key, stale)
            self.store.complete(claim, None, None, Outcome.STALE, steps=steps)
            self.task.tell_caller(Outcome.STALE, self.ident, claim.token)
            return None
        self.task.tell_caller(outcome, self.ident, claim.token)
        self._remember(claim.run_id, claim.token, encoded)  # committed: COMPLETED is final
        return encoded

    def _lease_lost(self, ctx: RunContext) -> Any:
        """Lease lost while finishing: roll back; the next delivery replays the taker's result."""
        if ctx.heartbeat.was_superseded():  # fenced out by a newer edit (counted `superseded` where it was fenced)
            return superseded(self, ctx)
        claim = ctx.claim
        ctx.effects.discard()
        self._count(Outcome.LEASE_LOST)
        logger.warning("lease lost for %s[%s] token=%d: writes rolled back", self.task.name, claim.key, claim.token)
        if not self.resend:
            raise  # re-raises the LeaseLost being handled by _execute
        # The next delivery replays the new holder's result, or runs the job if the claim itself was lost
        # (e.g. a database crash): never a silent drop.
        return self.send_again(None)

    def _parked(self, ctx: RunContext, parked: RunParked) -> Any:
        """The body parked the run (a model call still running): WAITING, no slot held, woken by the relay."""
        claim = ctx.claim
        if ctx.heartbeat.superseded:  # fenced out by a newer edit: nothing to park
            return superseded(self, ctx)
        ctx.effects.discard()
        if not ctx.parkable:  # the body asked anyway (it may not know): there is no broker to wake it through
            raise ConfigurationError(
                f"{self.task.name}[{claim.key}]: a direct or eager call cannot park its run ({parked}): call it with "
                ".delay(), or let it block (inline_wait=None)"
            )
        try:
            fault_point("park", task=self.task.name, key=claim.key)
            ok = self.store.park(claim, parked.wake_in_s, f"waiting: {parked.reason}", self.call.message)
        except StoreError as exc:
            # Not parked: the run stays RUNNING, and this message's re-send takes it over as its own at once.
            return self._store_failed(exc, "parking")
        if not ok:  # counted lease_lost by park(): the holder that took it over finishes it
            logger.warning("lease lost for %s[%s] token=%d while parking", self.task.name, claim.key, claim.token)
            return self.send_again(None)
        self.task.tell_caller(Outcome.WAITING, self.ident, claim.token, note=parked.reason)
        logger.info("parked %s[%s] token=%d: %s", self.task.name, claim.key, claim.token, parked)
        # Acked without a result: the caller's AsyncResult stays pending until the woken delivery (the same task
        # id) completes the run.
        raise Ignore()

    def _retry_requested(self, ctx: RunContext, retry: Retry) -> None:
        """The body asked Celery to retry: record the wait, so a duplicate does not run it sooner."""
        ctx.effects.discard()
        # Celery has already sent the retry's message: if the failure cannot be recorded, the run stays
        # RUNNING until its lease expires and the retry takes it over then. Recorded, the run waits
        # out the countdown: a duplicate delivery must not run it again sooner.
        error = "retry requested: " + traceback.format_exc(limit=5)
        self._record_failure(ctx.claim, error, retry_in=seconds_until(retry.when))

    def _failed(self, ctx: RunContext, exc: BaseException) -> Any:
        """The body raised: record FAILED (or DEAD) and re-raise; re-send if the failure could not be recorded."""
        claim = ctx.claim
        ctx.effects.discard()
        death = self._death(exc)
        error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=20)}"
        failure = self._record_failure(claim, error, death=death)
        if failure is not None and self.resend:
            # An unrecorded failure would be acked as final while the run stays RUNNING: send the job
            # again instead; it is taken over (and run again) once this holder's lease expires.
            return self._store_failed(failure, "recording the failure of")
        self.task.tell_caller(Outcome.DEAD if death is not None else Outcome.FAILED, self.ident, claim.token)
        raise  # re-raises the body's error being handled by _execute, with its traceback

    def _death(self, exc: BaseException) -> Death | None:
        """A Death if this final failure can never succeed or spent the last retry, else None (FAILED)."""
        task = self.task
        if isinstance(exc, BudgetExceeded):
            reason = REASON_BUDGET
        elif isinstance(exc, UNFIXABLE_ERRORS + tuple(task.dead_on)):
            reason = REASON_NEVER_SUCCEEDS
        elif (limit := max_retries(task)) is not None and int(task.request.retries or 0) >= limit:
            # Celery re-raises the error of the last allowed retry (or MaxRetriesExceededError): it is final.
            reason = REASON_RETRIES_EXHAUSTED
        else:
            return None
        tb = traceback.format_exc(limit=50)
        return Death(reason, tb, self.call.message, f"{type(exc).__name__}: {exc}")

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
