"""One model call's step, as `call.py`'s protocol sees it: what it is given (its policy, the app's ledger, its
request), what it is estimated to cost and which limiters and budgets admit it before it is sent, and how a
call the provider finished ends (`Answered`, or ProviderCallFailed, each with its ledger row: `record_call`).

The protocol itself (prepare, send, re-attach, recover: the recovery table) is `call.py`'s; these are the parts
of it that read a request or a response and write nothing but what they are asked to.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection

from oncelery.errors import ConfigurationError, StepMismatch
from oncelery.ledger.prices import batch_micros
from oncelery.ledger.recording import CallLedger
from oncelery.llm.adapters.base import Adapter, Observed, Usage
from oncelery.llm.adapters.base import CallState as Provider
from oncelery.llm.budgets import BudgetPlan, estimate_micros, remaining_micros
from oncelery.llm.errors import BudgetExceeded, ProviderCallFailed, ProviderError
from oncelery.llm.intents import Intent, end_intent, end_intent_txn
from oncelery.llm.limits import Admission, LimitRule, hold, limiters_for
from oncelery.llm.tokens import estimate_tokens, input_text, output_limit
from oncelery.models.intents import IntentState, RepeatReason
from oncelery.runs.claims import RunStore
from oncelery.runs.decisions import Claim

__all__ = [
    "Answered",
    "CallPolicy",
    "CallStep",
    "admissions_for",
    "answer_ended",
    "check_retry_budget",
    "check_same_request",
    "estimate_usage",
    "estimated_cost",
    "heed_hint",
    "intent_row",
    "provider_limiters",
    "record_call",
]

DEFAULT_POLL_S = 1.0


@dataclass(frozen=True)
class CallPolicy:
    """How one model call behaves (per task, overridable per call)."""

    background: bool = True  # where the adapter has a background mode
    at_most_once: bool = False  # a sync call whose outcome is unknown goes to a person, never re-sent
    on_lost: str = "recall"  # or "dead_letter": a response the provider forgot
    poll_s: float = DEFAULT_POLL_S  # between polls when the provider gives no hint
    # Seconds a delivery polls a background call before parking the run (RunParked); a delivery that woke the
    # parked run (`woken`) polls once. None: block until the call ends, holding the worker slot.
    inline_wait_s: float | None = None
    woken: bool = False
    limits: tuple[LimitRule, ...] = ()  # oncelery_limits: the shared limiters a call is admitted through
    budgets: BudgetPlan | None = None  # oncelery_budgets and max_cost_usd: what the call reserves before it is sent


@dataclass(frozen=True)
class Answered:
    """A finished call: the provider's response JSON, and the writes that commit with the step's checkpoint."""

    response: Mapping[str, Any]
    writes: Callable[[Connection], None]
    reattached: bool
    repeated: RepeatReason | None


@dataclass(frozen=True)
class CallStep:
    """What one model call of a step is given, fixed for the call's life (its admissions and estimate, once)."""

    store: RunStore
    claim: Claim
    position: int
    name: str
    adapter: Adapter
    request: Mapping[str, Any]
    policy: CallPolicy
    ledger: CallLedger  # the app's: prices the call and records its row (oncelery.ledger.recording)
    admissions: tuple[Admission, ...] = ()
    estimate_micros: int = 0  # the call's estimated cost, reserved in its budgets
    started: float = field(default_factory=time.perf_counter)  # the row's latency is measured from here

    @property
    def model(self) -> str:
        """The model the request names (the price table's name for it)."""
        return str(self.request.get("model", ""))


def check_same_request(step: CallStep, latest: Intent | None, digest: str) -> None:
    """Raise StepMismatch if the step's last attempt was prepared for another request."""
    claim, name, position = step.claim, step.name, step.position
    if latest is not None and latest.request_digest != digest:
        raise StepMismatch(
            f"{claim.task_name}[{claim.key}]: the model call of step {name!r} changed since attempt "
            f"{latest.attempt} was prepared (another model, prompt or parameter); use a new key to run the new request",
            position=position,
            expected=name,
            found=name,
            changed=["request"],
        )


def estimated_cost(policy: CallPolicy, request: Mapping[str, Any]) -> int:
    """The call's estimated cost in micro-USD (input estimate + output limit at the model's price; 0: no budget)."""
    if policy.budgets is None or not policy.budgets.active:
        return 0
    tokens = estimate_tokens(input_text(request), str(request.get("model", "")))
    return estimate_micros(policy.budgets.price, tokens, output_limit(request))


def check_retry_budget(step: CallStep, exc: ProviderError) -> None:
    """Before the task retries a failed call, check the job's budget still covers the next attempt's estimate:
    if not, the retry could only be refused, so the run is dead-lettered now (BudgetExceeded)."""
    plan = step.policy.budgets
    if plan is None or plan.job_limit_micros is None:
        return
    name = f"run:{step.claim.run_id}"
    with step.store.db.read() as conn:
        left = remaining_micros(conn, name)
    if left is not None and left < step.estimate_micros:
        spent = plan.job_limit_micros - left
        raise BudgetExceeded.of(name, step.estimate_micros, spent, 0, plan.job_limit_micros) from exc


def admissions_for(
    claim: Claim, adapter: Adapter, request: Mapping[str, Any], policy: CallPolicy
) -> tuple[Admission, ...]:
    """The shared limiters this call goes through, with its cost in each (none without `oncelery_limits`)."""
    if not policy.limits:
        return ()
    model = str(request.get("model", ""))
    tokens = (estimate_tokens(input_text(request), model), output_limit(request))
    chosen = limiters_for(policy.limits, adapter.provider, model, claim.tenant, claim.task_name, tokens)
    if tokens[1] == 0 and any(a.rule.kind in ("tpm", "otpm") for a in chosen):
        raise ConfigurationError(
            f"{claim.task_name}: a token limit applies to {adapter.provider}:{model}, so its calls need an output "
            "limit: pass max_output_tokens= (or max_tokens=, or Gemini's generationConfig={'maxOutputTokens': n}) to "
            "self.llm()"
        )
    return tuple(chosen)


def intent_row(step: CallStep, digest: str, mode: str | None = None) -> dict[str, Any]:
    """The intent's columns: where the call goes, how, and what it may cost (the ledger rule's estimate)."""
    capabilities = step.adapter.capabilities(step.request)
    background = capabilities.background and step.policy.background
    mode = mode or ("background" if background else "sync")
    estimate = estimate_usage(step.request)
    cost = step.ledger.cost_micros(step.model, estimate.input_tokens, estimate.output_tokens, mode)
    return {
        "provider": step.adapter.provider,
        "endpoint": step.adapter.endpoint,
        "model": step.model,
        "mode": mode,
        "request_digest": digest,
        "retention_s": capabilities.retention_s,
        "estimated_input_tokens": estimate.input_tokens,
        "estimated_output_tokens": estimate.output_tokens,
        "estimated_cost_micros": cost,
    }


HINT_MARGIN_S = 0.1


def heed_hint(step: CallStep) -> None:
    """Read the provider's rate-limit headers of the create: when they say the window is spent (no request
    left, or fewer tokens than a call like this one), hold this provider's limiters until the window resets,
    so the fleet waits before a 429 instead of after one."""
    ask = getattr(step.adapter, "rate_hint", None)
    hint = ask() if callable(ask) else None
    names = provider_limiters(step)
    if hint is None or not names or not hint.reset_s:
        return
    tokens = max((a.cost for a in step.admissions if a.rule.kind == "tpm"), default=1)
    spent = (hint.remaining_requests is not None and hint.remaining_requests < 1) or (
        hint.remaining_tokens is not None and hint.remaining_tokens < tokens
    )
    if spent:  # a little past the reset: the provider's clock and ours differ by a few milliseconds
        with step.store.db.begin() as conn:
            hold(conn, step.store.db.dialect, names, hint.reset_s + HINT_MARGIN_S)


def provider_limiters(step: CallStep) -> list[str]:
    """The limiters of this call's provider:model (not its tenant's or task's)."""
    return [a.name for a in step.admissions if not a.name.startswith(("tenant:", "task:"))]


def answer_ended(step: CallStep, intent: Intent, look: Observed, *, reattached: bool) -> Answered:
    """A call the provider ended: done, its answer and the writes that commit with the checkpoint; failed or
    cancelled, its intent ended so (a billed failure on the books) and ProviderCallFailed raised."""
    usage = step.adapter.usage(look.response)
    if look.state is Provider.DONE:

        def writes(conn: Connection) -> None:
            end_intent_txn(
                conn, step.store, intent, IntentState.DONE,
                input_tokens=usage.input_tokens, output_tokens=usage.output_tokens,
            )  # fmt: skip
            reason = intent.repeat_reason.value if intent.repeat_reason else None
            record_call(step, conn, intent, usage, ok=True, reason=reason, reattached=reattached, error=None)

        return Answered(look.response, writes, reattached, intent.repeat_reason)
    state = IntentState.CANCELLED if look.state is Provider.CANCELLED else IntentState.FAILED
    error = str(look.response.get("error") or look.state.value)

    def billed(conn: Connection) -> None:
        if usage.input_tokens or usage.output_tokens:  # a failed call can still be billed: never hide it
            reason = intent.repeat_reason.value if intent.repeat_reason else None
            record_call(step, conn, intent, usage, ok=False, reason=reason, reattached=reattached, error=error)

    end_intent(step.store, step.claim, intent, state, billed, error=error)
    raise ProviderCallFailed.of(step.adapter.provider, step.name, state.value, error)


def estimate_usage(request: Mapping[str, Any]) -> Usage:
    """A conservative usage of a call whose bill is unknown: its input's estimated tokens plus its output limit."""
    return Usage(estimate_tokens(input_text(request), str(request.get("model", ""))), output_limit(request))


def record_call(
    step: CallStep, conn: Connection, intent: Intent, usage: Usage, *, ok: bool, reason: str | None,
    reattached: bool, error: str | None,
) -> bool:  # fmt: skip
    """Write the call's ledger row (priced now) in the caller's transaction, and charge its budgets, once per
    intent (its id is the row's call id); return whether the row was new."""
    claim, model = step.claim, step.model
    full = step.ledger.cost_micros(model, usage.input_tokens, usage.output_tokens)  # one price lookup: both follow
    batch = full is not None and intent.mode == "batch"
    cost = batch_micros(full) if batch and full is not None else full
    saved = full - cost if batch and full is not None and cost is not None else None
    row = {
        "call_id": intent.public_id,
        "task_name": claim.task_name,
        "tenant": claim.tenant,
        "idempotency_key": claim.key,
        "step": step.name,
        "run_id": claim.run_id,
        "fencing_token": claim.token,
        "model": model,
        "prompt": None,
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "latency_ms": (time.perf_counter() - step.started) * 1000,
        "ok": ok,
        "error": error,
        "cost_micros": cost,
        "batch_saved_micros": saved,
        "meta": {"attempt": intent.attempt, "mode": intent.mode},
        "reason": reason,
        "reattached": reattached,
    }
    return step.ledger.record(conn, row, intent.reservation)
