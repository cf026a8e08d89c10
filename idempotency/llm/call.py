"""The model-call protocol: a call is prepared before it is sent, found again after a crash, and paid once
wherever the provider allows it.

The step's checkpoint is missing (else the step replays and no call is made); what the step's latest intent says
decides what this holder does:

    | latest intent                    | what happens                                          | model calls |
    |----------------------------------|-------------------------------------------------------|-------------|
    | none                             | prepare attempt 1, create                             | 1           |
    | another request digest           | StepMismatch (the step's request changed)             | 0           |
    | sent                             | re-attach: poll the same reference                    | 0           |
    | prepared, background adapter     | create window: lost, re-send labelled create_window   | 1 (labelled)|
    | prepared, sync, at_most_once     | lost; CallOutcomeUnknown, dead-lettered for a person  | 0           |
    | prepared, sync                   | lost, re-send labelled sync_unknown                   | 1 (labelled)|
    | lost (provider forgot), recall   | re-send labelled lost                                 | 1 (labelled)|
    | lost, on_lost="dead_letter"      | ResponseLost, dead-lettered                           | 0           |
    | lost with no reference           | (its successor parked before sending) re-send labelled| 1 (labelled)|
    |                                  | create_window / sync_unknown, as it was               |             |
    | failed / cancelled / done        | a new attempt labelled failed / cancelled / superseded| 1           |
    | abandoned (its run had ended)    | a new attempt (a replayed dead letter) superseded     | 1 (labelled)|

Losing a lease never cancels a call the next holder can find again. The one exception: a holder fenced out
between the create's answer and saving its reference cancels that call (best effort), since nobody can re-attach.

The ledger rule (oncelery.ledger.unknown): a predecessor whose outcome cannot be known is ended `lost` with its
ledger row at the estimate kept on its intent, labelled `unknown_outcome`, its budgets charged, in one fenced
transaction committed BEFORE the new attempt is prepared: a new attempt refused by a budget or parked by a
limiter leaves the predecessor on the books. So do a lost response dead-lettered and an at-most-once call whose
outcome is unknown: provider creates never exceed ledger rows.

When the call ends `done`, the intent, the ledger row and the step's checkpoint commit in one transaction, fenced
by the run's token (`Answered.writes`, run by the step's checkpoint write): a zombie that polled the same
reference writes nothing. Losing a lease never cancels a call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection

from oncelery.errors import ConfigurationError, LeaseLost, RunParked
from oncelery.ledger.prices import batch_micros
from oncelery.ledger.recording import CallLedger
from oncelery.ledger.unknown import UNKNOWN_OUTCOME
from oncelery.llm.adapters.base import Adapter, Observed
from oncelery.llm.batches import (
    BatchItem,
    BatchPolicy,
    batch_url,
    clear_item_txn,
    fall_back,
    queue_item,
    read_item,
    seconds_since,
)
from oncelery.llm.budgets import count_refused
from oncelery.llm.call_step import (
    Answered,
    CallPolicy,
    CallStep,
    admissions_for,
    answer_ended,
    check_retry_budget,
    check_same_request,
    estimated_cost,
    heed_hint,
    intent_row,
    provider_limiters,
    record_call,
)
from oncelery.llm.errors import (
    BudgetExceeded,
    CallOutcomeUnknown,
    ProviderCallFailed,
    ProviderError,
    ProviderRateLimited,
    ProviderUnavailable,
    ResponseGone,
    ResponseLost,
)
from oncelery.llm.intents import (
    Intent,
    end_intent,
    end_intent_txn,
    fenced_write,
    latest_intent,
    mark_sent,
    prepare_intent,
)
from oncelery.llm.limits import Throttled, count_throttled, penalize
from oncelery.llm.observe import on_call
from oncelery.llm.request import request_digest
from oncelery.models.batches import ItemState
from oncelery.models.intents import IntentState, RepeatReason
from oncelery.runs.claims import RunStore
from oncelery.runs.decisions import Claim
from oncelery.runs.faults import fault_point

__all__ = ["call_batched", "call_model"]

logger = logging.getLogger("oncelery.llm")

POLL_FAILURES = 5  # consecutive failed polls (free) before the delivery gives up; the next one re-attaches
LIMIT_INLINE_S = 1.0  # a limiter wait up to this long (and within the inline wait) sleeps; a longer one parks
RATE_LIMITED_ATTEMPTS = 3  # a provider's 429s in a row one delivery takes before it leaves the call to a later one


def call_model(
    store: RunStore,
    claim: Claim,
    position: int,
    name: str,
    adapter: Adapter,
    request: Mapping[str, Any],
    policy: CallPolicy,
    ledger: CallLedger,
) -> Answered:
    """Make (or find again) the model call of step `name` at `position`; see the module's recovery table."""
    step = CallStep(
        store, claim, position, name, adapter, request, policy, ledger, admissions_for(claim, adapter, request, policy),
        estimated_cost(policy, request),
    )  # fmt: skip
    digest = request_digest(request)
    latest = latest_intent(store, claim.run_id, position)
    check_same_request(step, latest, digest)
    if latest is not None and latest.state is IntentState.SENT and latest.reference:
        on_call(latest.mode, reattached=True, repeated=latest.repeat_reason and latest.repeat_reason.value)
        return _wait(step, latest, reattached=True)
    reason = _repeat_reason(step, latest)
    if latest is not None and latest.state is IntentState.PREPARED:
        _record_unknown(step, latest)  # before the new attempt: a refusal or a park must not leave it off the books
    intent = _prepare(step, digest, latest, reason)
    try:
        return _send_admitted(step, intent)
    except ProviderError as exc:
        check_retry_budget(step, exc)
        raise


# A parked batch step is woken by the poller when its item is applied; this is only a safety net (a wake lost
# in the instant between its item being applied and its run being parked): short enough not to strand a run,
# long enough that a batch running for hours does not re-deliver its runs every minute.
BATCH_RECHECK_S = 600.0


def call_batched(
    store: RunStore,
    claim: Claim,
    position: int,
    name: str,
    adapter: Adapter,
    request: Mapping[str, Any],
    policy: CallPolicy,
    ledger: CallLedger,
    batch: BatchPolicy,
) -> Answered:
    """Make the call of step `name` as an item of a provider batch: queue it and park the run, or, once the
    poller applied its result, end it (oncelery.llm.batches has the table). `adapter` is the synchronous one:
    it names the provider and endpoint, reads the usage, and makes the call if the item falls back."""
    if policy.inline_wait_s is None:
        raise ConfigurationError(
            f"{claim.task_name}: step {name!r} is a batch step: its run parks until the batch returns, so send the "
            "task through the broker (.delay / apply_async), not as a direct or eager call"
        )
    digest = request_digest(request)
    latest = latest_intent(store, claim.run_id, position)
    if latest is not None and latest.mode != "batch":  # it fell back to a background call: that call's protocol
        return call_model(store, claim, position, name, adapter, request, policy, ledger)
    batch_url(adapter.endpoint)  # a batch endpoint exists for it, or ConfigurationError before anything is written
    estimate = estimated_cost(policy, request)
    step = CallStep(store, claim, position, name, adapter, request, policy, ledger, (), batch_micros(estimate))
    check_same_request(step, latest, digest)
    if latest is not None and latest.state is IntentState.SENT:
        item = read_item(store, latest.public_id)
        if item is not None and item.state is ItemState.DONE and item.response is not None:
            return _batch_done(step, latest, item.response)
        if item is not None and item.state is ItemState.FAILED:
            end_intent(store, claim, latest, IntentState.FAILED, error=item.error or "failed in its batch")
            raise ProviderCallFailed.of(adapter.provider, name, "failed", item.error or "failed in its batch")
        # Past its fallback time and never submitted (nothing runs at the provider for it): a background call.
        fallback = item is not None and item.state is ItemState.QUEUED and _past_fallback(store, item)
        if fallback and item is not None and fall_back(store, item.custom_id):
            end_intent(store, claim, latest, IntentState.CANCELLED, error="fell back to a background call")
            return call_model(store, claim, position, name, adapter, request, policy, ledger)
        if item is not None and item.state is not ItemState.CANCELLED:
            raise _park_batch(step, item.state.value, _wake_in(store, item))
        end_intent(store, claim, latest, IntentState.LOST, error="its batch item is gone")
    reason = (
        None if latest is None else _repeat_reason(step, latest) if latest.state.terminal else RepeatReason.SUPERSEDED
    )
    budget = None if policy.budgets is None else (policy.budgets, step.estimate_micros)
    queue_item(
        store, claim, position=position, step_name=name, row=intent_row(step, digest, "batch"),
        request=request, policy=batch, supersedes=latest, reason=reason,
        budget=budget,
    )  # fmt: skip
    first_look = min(batch.max_wait_s + BATCH_MARGIN_S, BATCH_RECHECK_S, batch.fallback_after_s or BATCH_RECHECK_S)
    raise _park_batch(step, ItemState.QUEUED.value, max(WAKE_FIRST_S, first_look))


BATCH_MARGIN_S = 5.0  # past the batch's max wait, a first look if the poller's wake has not come


def _past_fallback(store: RunStore, item: BatchItem) -> bool:
    return item.fallback_after_s is not None and seconds_since(store, item.queued_at) >= item.fallback_after_s


def _wake_in(store: RunStore, item: BatchItem) -> float:
    """When a parked batch step looks again if the poller has not woken it: at its fallback time, else later."""
    if item.state is ItemState.QUEUED and item.fallback_after_s is not None:
        left = item.fallback_after_s - seconds_since(store, item.queued_at)
        return max(WAKE_FIRST_S, min(BATCH_RECHECK_S, left))
    return BATCH_RECHECK_S


def _park_batch(step: CallStep, state: str, wake_in: float) -> RunParked:
    provider = step.adapter.provider
    # Flower's result column and `oncelery runs show` read this: "waiting on a batch" names why the run waits.
    return RunParked(wake_in, f"model call {step.name!r} waiting on a batch at {provider} (item {state})")


def _batch_done(step: CallStep, intent: Intent, response: Mapping[str, Any]) -> Answered:
    """The poller applied the item's result: end the intent with the step's checkpoint and the ledger row (at the
    batch price), and forget the item's request and response, in one transaction."""
    usage = step.adapter.usage(response)

    def writes(conn: Connection) -> None:
        end_intent_txn(
            conn,
            step.store,
            intent,
            IntentState.DONE,
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
        )
        reason = intent.repeat_reason.value if intent.repeat_reason else None
        record_call(step, conn, intent, usage, ok=True, reason=reason, reattached=False, error=None)
        clear_item_txn(conn, intent.public_id)

    return Answered(response, writes, False, intent.repeat_reason)


def _prepare(step: CallStep, digest: str, supersedes: Intent | None, reason: RepeatReason | None) -> Intent:
    """Prepare the call's intent once every shared limiter admits it (wait inline when short, else park) and
    every budget has room for its estimate (else BudgetExceeded, or a park until the window resets)."""
    waited = 0.0
    budget = None if step.policy.budgets is None else (step.policy.budgets, step.estimate_micros)
    while True:
        fault_point("llm_prepare", task=step.claim.task_name, key=step.claim.key, step=step.name)
        try:
            return prepare_intent(
                step.store, step.claim, position=step.position, step_name=step.name, request=intent_row(step, digest),
                supersedes=supersedes, reason=reason, ledger=step.ledger, admissions=step.admissions, budget=budget,
            )  # fmt: skip
        except BudgetExceeded as refused:
            with step.store.db.begin() as conn:  # its own statement: the refused transaction rolled back
                count_refused(conn, refused.budget)
            unknown = supersedes is not None and reason in _UNKNOWN_BEFORE
            over = refused.after_unknown(supersedes.attempt) if unknown and supersedes is not None else refused
            plan = step.policy.budgets
            if (
                plan is not None
                and plan.on_budget == "defer"
                and over.waits_s
                and step.policy.inline_wait_s is not None
            ):
                raise RunParked(over.waits_s, f"{over}; deferred until the window resets (on_budget='defer')") from None
            if over is refused:
                raise
            raise over from None
        except Throttled as throttled:
            if waited == 0.0:  # a call that waits is counted once, however many slots it misses
                with step.store.db.begin() as conn:  # its own statement: the refused transaction rolled back
                    count_throttled(conn, throttled.limiter)
            _wait_or_park(step, throttled.wait_s, waited, f"rate limit {throttled.limiter}")
            waited += throttled.wait_s


# A new attempt after one of these may follow a call that was made: a refusal says the earlier one is on the books.
_UNKNOWN_BEFORE = (RepeatReason.CREATE_WINDOW, RepeatReason.SYNC_UNKNOWN, RepeatReason.LOST)


def _wait_or_park(step: CallStep, wait_s: float, waited: float, why: str) -> None:
    """Sleep `wait_s` when short (or when the delivery may not park), else park the run WAITING that long."""
    inline = step.policy.inline_wait_s
    if inline is None or waited + wait_s <= min(inline, LIMIT_INLINE_S):
        time.sleep(wait_s)
        return
    raise RunParked(wait_s, f"{why}: the call waits {wait_s:.1f}s before it may be sent")


def _send_admitted(step: CallStep, intent: Intent) -> Answered:
    """Send the call; a 429 teaches the limiters and sends a new intent through them (never an immediate re-call).

    After RATE_LIMITED_ATTEMPTS 429s in one delivery the run parks until the provider's retry-after (a delivery
    that may not park raises the 429).
    """
    attempt = 1
    while True:
        try:
            return _send(step, intent)
        except ProviderRateLimited as exc:
            # `_send` ended the intent `failed` (nothing was made). The provider's limiters are halved and held
            # until its retry-after; the next attempt is a new intent admitted through them.
            names = provider_limiters(step)
            with step.store.db.begin() as conn:
                penalize(conn, step.store.db.dialect, names, exc.retry_after_s)
            wait = max(exc.retry_after_s or 0.0, WAKE_FIRST_S)
            if attempt >= RATE_LIMITED_ATTEMPTS:
                if step.policy.inline_wait_s is None:
                    raise
                raise RunParked(wait, f"{exc}; {attempt} in a row") from None
            if not names:  # no limiter of this provider to wait in: wait its retry-after itself
                _wait_or_park(step, wait, 0.0, str(exc))
            intent = _prepare(step, intent.request_digest, intent, RepeatReason.FAILED)
            attempt += 1


def _repeat_reason(step: CallStep, latest: Intent | None) -> RepeatReason | None:
    """Why this call is sent again (None: the first attempt), or raise when policy says not to."""
    if latest is None:
        return None
    unanswered = latest.state is IntentState.PREPARED or (latest.state is IntentState.LOST and not latest.reference)
    if unanswered and latest.mode == "background":
        return RepeatReason.CREATE_WINDOW
    if latest.state is IntentState.PREPARED and step.policy.at_most_once:
        _record_unknown(step, latest, "outcome unknown (at_most_once)")  # it may have been made: on the books
        raise CallOutcomeUnknown.of(step.claim.task_name, step.claim.key, step.name)
    if unanswered:
        return RepeatReason.SYNC_UNKNOWN
    if latest.state is IntentState.LOST:
        if step.policy.on_lost == "dead_letter":
            raise ResponseLost.of(step.claim.task_name, step.claim.key, step.name)
        return RepeatReason.LOST
    return {
        IntentState.FAILED: RepeatReason.FAILED,
        IntentState.CANCELLED: RepeatReason.CANCELLED,
    }.get(latest.state, RepeatReason.SUPERSEDED)


def _send(step: CallStep, intent: Intent) -> Answered:
    """Create the call (the intent is already durable), record where it went, then wait for its end."""
    where = {"task": step.claim.task_name, "key": step.claim.key, "step": step.name}
    fault_point("llm_create", **where)
    on_call(intent.mode, reattached=False, repeated=intent.repeat_reason and intent.repeat_reason.value)
    try:
        first = step.adapter.create(step.request, intent.public_id, background=intent.mode == "background")
    except ProviderUnavailable as exc:
        if exc.maybe_sent:
            raise  # left prepared: the provider may have it, so the next holder re-sends it labelled
        end_intent(step.store, step.claim, intent, IntentState.FAILED, error=str(exc))
        raise
    except ProviderError as exc:
        # Refused (429, 4xx): the provider made nothing. A later attempt is a new intent.
        end_intent(step.store, step.claim, intent, IntentState.FAILED, error=str(exc))
        raise
    fault_point("llm_created", **where)
    heed_hint(step)
    if first.terminal or not first.reference:
        return answer_ended(step, intent, first, reattached=False)
    try:
        sent = mark_sent(step.store, step.claim, intent, first.reference, first.cursor)
    except LeaseLost:
        _cancel_unfound(step, first.reference)
        raise
    return _wait(step, sent, first)


def _cancel_unfound(step: CallStep, reference: str) -> None:
    """Cancel, best effort, a call this holder created but could not record (fenced out: superseded, revoked or
    taken over): nobody can ever find it again to re-attach, so its tokens are only spend. It is on the books
    (its intent's row, at its estimate, is written by whoever ended it: the run's end or the next holder)."""
    cancel = getattr(step.adapter, "cancel", None)
    if cancel is None:
        return
    try:
        cancel(reference)
    except ProviderError as exc:
        logger.warning("call %s (fenced out before it was recorded) not cancelled: %s", reference, exc)


def _wait(step: CallStep, intent: Intent, first: Observed | None = None, *, reattached: bool = False) -> Answered:
    """Poll a sent call until it ends (the delivery's lease renewal keeps the run while it waits), or park the
    run past the inline wait: up to `inline_wait_s`, or once for the delivery that woke a parked run."""
    look, failures = first, 0
    inline = step.policy.inline_wait_s
    once = reattached and step.policy.woken
    deadline = None if inline is None else time.monotonic() + (0.0 if once else inline)
    while look is None or not look.terminal:
        if look is not None:
            pause = look.poll_after_s or step.policy.poll_s
            if deadline is not None and time.monotonic() + pause > deadline:
                raise _park(step, intent, look)
            time.sleep(pause)
        fault_point("llm_poll", task=step.claim.task_name, key=step.claim.key, step=step.name)
        try:
            look = step.adapter.poll(intent.reference or "")
            failures = 0
        except ResponseGone as exc:
            return _lost(step, intent, exc)
        except ProviderUnavailable:
            failures += 1  # a poll is free: try again, and leave the call to the next delivery past a bound
            if failures >= POLL_FAILURES:
                raise
            time.sleep(step.policy.poll_s * failures)
    return answer_ended(step, intent, look, reattached=reattached)


WAKE_FIRST_S = 1.0  # the first wake after a park, unless the provider's poll-after hint says later
WAKE_GROWTH = 1.25  # each later wake of the same call waits this much longer (a long call is polled less often)
WAKE_MAX_S = 15.0


def wake_after(wakes: int, hint_s: float | None) -> float:
    """Seconds before a parked call's next poll: the provider's hint, else a capped geometric backoff by wakes."""
    backoff = min(WAKE_MAX_S, WAKE_FIRST_S * WAKE_GROWTH ** max(0, wakes))
    return max(hint_s or 0.0, backoff)


def _park(step: CallStep, intent: Intent, look: Observed) -> RunParked:
    """The run's parking: the call is still running at the provider, and its intent stays `sent` to re-attach."""
    wakes = max(0, step.claim.token - intent.token)  # takeovers (wakes, re-attaches) since the call was sent
    reason = f"model call {step.name!r} ({step.adapter.provider} {intent.reference}) {look.state.value} at the provider"
    return RunParked(wake_after(wakes, look.poll_after_s), reason)


def _lost(step: CallStep, intent: Intent, exc: ResponseGone) -> Answered:
    """The provider forgot a sent call: by policy, dead-letter it or send it again (labelled `lost`)."""
    # It was made, and may have been billed: its answer is gone with it, so it goes on the books at its estimate
    # (before any new attempt is prepared, which a budget may refuse).
    _record_unknown(step, intent, f"response lost: {exc}")
    if step.policy.on_lost == "dead_letter" or intent.repeat_reason is RepeatReason.LOST:
        # Lost twice in a row: the provider keeps nothing long enough for this step; re-calling again would
        # pay for ever, so a person decides.
        raise ResponseLost.of(step.claim.task_name, step.claim.key, step.name) from exc
    again = _prepare(step, intent.request_digest, intent, RepeatReason.LOST)
    return _send_admitted(step, again)


def _record_unknown(step: CallStep, unanswered: Intent, why: str = "outcome unknown") -> None:
    """End a call whose outcome cannot be known `lost`, with its ledger row at its estimate and its budgets
    charged, in one fenced transaction (oncelery.ledger.unknown: provider creates <= ledger rows)."""
    written: list[Mapping[str, Any]] = []

    def write(conn: Connection) -> None:
        written.clear()  # a retried transaction writes it afresh
        row = step.ledger.record_unanswered(conn, unanswered.public_id, IntentState.LOST, UNKNOWN_OUTCOME, why)
        written.extend([row] if row is not None else [])

    fenced_write(step.store, step.claim, "the unknown outcome of the call was not recorded", write)
    for row in written:  # told once committed: a transaction that failed wrote no row
        step.ledger.tell(row)
