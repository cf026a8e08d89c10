"""What a provider call can end in, besides an answer: typed, picklable, and each saying what to do.

Part of the one error tree (`oncelery.OnceleryError`); the call layer raises only these for provider trouble.
"""

from __future__ import annotations

from typing import Any

from oncelery.errors import OnceleryError


class ProviderError(OnceleryError):
    """Raised when a model provider did not give an answer (the subclass says whether a retry can help)."""


class ProviderRateLimited(ProviderError):
    """Raised on a 429: wait `retry_after_s` (from the provider's headers) before the next call; nothing was made."""

    retry_after_s: float

    @classmethod
    def of(cls, provider: str, model: str, retry_after_s: float, detail: str) -> ProviderRateLimited:
        """Build the error for `provider`'s 429 on `model`."""
        return cls(
            f"{provider} rate-limited {model}: retry after {retry_after_s:g}s ({detail})",
            provider=provider,
            model=model,
            retry_after_s=retry_after_s,
        )


class ProviderUnavailable(ProviderError):
    """Raised on a 5xx, an overload or a network failure; `maybe_sent` says if the provider may have the call."""

    maybe_sent: bool

    @classmethod
    def of(cls, provider: str, what: str, maybe_sent: bool) -> ProviderUnavailable:
        """Build the error; `maybe_sent` is False only when the request surely never left (connect refused)."""
        return cls(f"{provider} unavailable: {what}", provider=provider, maybe_sent=maybe_sent)


class ProviderRejected(ProviderError):
    """Raised on a 4xx other than 429 (bad request, auth, unknown model): fix the request or the credentials."""

    @classmethod
    def of(cls, provider: str, status: int, detail: Any) -> ProviderRejected:
        """Build the error from the provider's status and message."""
        return cls(f"{provider} refused the request ({status}): {detail}", provider=provider, status=status)


class ResponseGone(ProviderError):
    """Raised when the provider no longer has a response it accepted (404 on retrieve, or retention passed)."""

    @classmethod
    def of(cls, provider: str, reference: str) -> ResponseGone:
        """Build the error for the reference the provider forgot."""
        return cls(
            f"{provider} no longer has response {reference} (past its retention, or never stored)",
            provider=provider,
            reference=reference,
        )


class ProviderCallFailed(ProviderError):
    """Raised when the provider ended a call as failed or cancelled; a retry of the task makes a new attempt."""

    @classmethod
    def of(cls, provider: str, step: str, state: str, detail: str) -> ProviderCallFailed:
        """Build the error for the call of `step` that `provider` ended as `state`."""
        return cls(f"{provider} ended the call of step {step!r} as {state}: {detail}", step=step, state=state)


class CallOutcomeUnknown(ProviderError):
    """Raised for an `at_most_once` call whose holder died mid-call: whether the provider made it is unknown.

    Never retried: the run is dead-lettered for a person to decide (`oncelery dlq show`, then replay or purge).
    """

    @classmethod
    def of(cls, task_name: str, key: str, step: str) -> CallOutcomeUnknown:
        """Build the error for the step whose call may or may not have been made."""
        return cls(
            f"{task_name}[{key}]: the at_most_once call of step {step!r} was interrupted and may have been made; "
            f"it is not sent again: check the provider's usage, then `oncelery dlq replay` or purge it",
            step=step,
        )


class ResponseLost(ProviderError):
    """Raised when the provider forgot a call's response and the policy (`on_lost="dead_letter"`) forbids a re-call."""

    @classmethod
    def of(cls, task_name: str, key: str, step: str) -> ResponseLost:
        """Build the error for the step whose response is gone."""
        return cls(
            f"{task_name}[{key}]: the provider no longer has the response of step {step!r} (past its retention); "
            f"on_lost='dead_letter' keeps it from being paid again: `oncelery dlq replay` re-sends it",
            step=step,
        )


class BudgetExceeded(OnceleryError):
    """Raised before a call is sent when its estimated cost does not fit a budget: this call was not sent.

    An earlier attempt of the same step whose outcome is unknown (a create window, a lost response) is already
    in the ledger at its estimate and charged to the budgets, and the message says so (`after_unknown`).

    Never retried (the same call would not fit again): the run is dead-lettered with the budget's name. Raise the
    cap (`oncelery budgets set`) or wait for the window, then `oncelery dlq replay`. `on_budget="defer"` parks
    the run WAITING until the window resets instead.
    """

    budget: str
    waits_s: float | None

    @classmethod
    def of(
        cls, budget: str, estimate: int, spent: int, reserved: int, limit: int, waits_s: float | None = None
    ) -> BudgetExceeded:
        """Build the error for budget row `budget` (amounts in micro-USD)."""
        money = {k: f"${v / 1_000_000:.6f}" for k, v in (("e", estimate), ("s", spent), ("r", reserved), ("l", limit))}
        scope = budget.rsplit("/", 1)[0] if budget.count("/") == 2 else budget
        fix = (
            "raise max_cost_usd (the task's or the call's)"
            if budget.startswith(("run:", "call"))
            else f"raise the cap (oncelery budgets set {scope.split('/')[0]} --{scope.split('/')[-1]} USD) "
            "or wait for the window"
        )
        return cls(
            f"budget {budget}: this call's estimate {money['e']} does not fit (spent {money['s']} + reserved "
            f"{money['r']} of {money['l']}); this call was not sent: {fix}, then `oncelery dlq replay`",
            budget=budget,
            waits_s=waits_s,
        )

    def after_unknown(self, attempt: int) -> BudgetExceeded:
        """The same refusal of a step whose earlier `attempt` may have been made: its message says it is on the
        books (in the ledger at its estimate, charged), so nobody reads "nothing was sent" as "nothing was paid"."""
        note = (
            f" (attempt {attempt} of this step may have been made: its outcome is unknown, and it is in the ledger "
            "at its estimate, labelled unknown_outcome, and charged to the budgets)"
        )
        return BudgetExceeded(self.message + note, budget=self.budget, waits_s=self.waits_s)
