"""`self.llm(step, **request)`: a model call as a checkpointed step, through the write-ahead intent protocol.

The basetask room's part is what the call layer (`oncelery.llm`, which knows no Celery) leaves to it: which adapter,
which policy, and which ledger: the app's (`oncelery.ledger.recording.CallLedger`, pricing through `price_for`:
`oncelery_prices`, else the price file), through which the call layer writes its row in the transaction that ends
the intent (with the step's checkpoint when the call is done).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

from oncelery.delivery.delivered import RunContext
from oncelery.delivery.steps import WithWrites, current_step
from oncelery.errors import ConfigurationError
from oncelery.ledger.prices import price_for
from oncelery.ledger.recording import CallLedger
from oncelery.llm.adapters.base import Adapter, CallState
from oncelery.llm.adapters.factory import made_adapter, task_adapter
from oncelery.llm.batches import BatchPolicy
from oncelery.llm.budgets import BudgetPlan, BudgetRule, parse_budgets, parse_usd
from oncelery.llm.call import call_batched, call_model
from oncelery.llm.call_step import CallPolicy
from oncelery.llm.limits import LimitRule, parse_limits
from oncelery.llm.request import request_digest
from oncelery.runs.encoding import canonical_json
from oncelery.settings import CONF_BUDGETS, CONF_LIMITS, CONF_PRICES
from oncelery.tracing.calls import CallLog, traced_llm_step
from oncelery.tracing.otel import telemetry_of

__all__ = [
    "batch_policy",
    "call_unclaimed",
    "limits_of",
    "policy_of",
    "resolve_adapter",
    "run_llm_step",
]

MODES = ("call", "batch")


def batch_policy(task: Any, mode: str, batch: Any) -> BatchPolicy | None:
    """The call's batch policy (None: a synchronous or background call), or ConfigurationError."""
    if mode not in MODES:
        raise ConfigurationError(f"{task.name}: self.llm(mode={mode!r}): use 'call' or 'batch'")
    if mode == "call":
        if batch is not None:
            raise ConfigurationError(f"{task.name}: self.llm(batch=...) needs mode='batch'")
        return None
    chosen = batch if batch is not None else getattr(task, "llm_batch", None) or BatchPolicy()
    if not isinstance(chosen, BatchPolicy):
        raise ConfigurationError(f"{task.name}: self.llm(batch={chosen!r}): give oncelery.BatchPolicy(...)")
    return chosen.check(str(task.name))


ON_LOST = ("recall", "dead_letter")


def resolve_adapter(task: Any, adapter: Any) -> Adapter:
    """Return the call's adapter: `adapter=`, else the task's `llm_adapter` (an adapter or a factory of one)."""

    chosen = task_adapter(task) if adapter is None else made_adapter(task, adapter)
    if chosen is None or not all(hasattr(chosen, name) for name in ("create", "poll", "capabilities", "usage")):
        raise ConfigurationError(
            f"{task.name}: self.llm() needs a provider adapter: set llm_adapter on the task, or pass adapter=, "
            f"e.g. oncelery.llm.adapters.openai_responses.OpenAIResponses(base_url, api_key) (got {chosen!r})"
        )
    return chosen  # type: ignore[no-any-return]


def policy_of(
    task: Any,
    at_most_once: bool | None,
    on_lost: str | None,
    background: bool,
    inline_wait: Any = None,
    woken: bool = False,
    *,
    model: str = "",
    max_cost_usd: Any = None,
    shared: tuple[tuple[str, int], ...] = (),
) -> CallPolicy:
    """Return the call's policy: the per-call values, else the task's `llm_*` options."""
    lost = on_lost if on_lost is not None else task.llm_on_lost
    if lost not in ON_LOST:
        raise ConfigurationError(f"{task.name}: llm on_lost={lost!r}: use one of {', '.join(ON_LOST)}")
    once = at_most_once if at_most_once is not None else task.llm_at_most_once
    if inline_wait is not None and (
        isinstance(inline_wait, bool) or not isinstance(inline_wait, int | float) or inline_wait < 0
    ):
        raise ConfigurationError(
            f"{task.name}: llm inline_wait={inline_wait!r}: give seconds >= 0, or None to block until the call ends"
        )
    wait = None if inline_wait is None else float(inline_wait)
    limits = limits_of(task.app.conf)
    return CallPolicy(
        background=background, at_most_once=bool(once), on_lost=lost, inline_wait_s=wait, limits=limits, woken=woken,
        budgets=budget_plan(task, model, max_cost_usd, shared),
    )  # fmt: skip


def budget_plan(
    task: Any, model: str, max_cost_usd: Any = None, shared: tuple[tuple[str, int], ...] = ()
) -> BudgetPlan | None:
    """The budgets a call of `model` reserves in (None: none applies), or ConfigurationError (no price)."""
    conf = task.app.conf
    rules = budgets_of(conf)
    job = None if task.max_cost_usd is None else parse_usd(task.max_cost_usd, f"{task.name}: max_cost_usd")
    call = None if max_cost_usd is None else parse_usd(max_cost_usd, f"{task.name}: self.llm(max_cost_usd=)")
    if not rules and job is None and call is None and not shared:
        return None
    price = price_for(model, conf)
    if price is None:
        raise ConfigurationError(
            f"{task.name}: a budget applies to this call, and model {model!r} has no price (in the price file "
            f"neither): add it to app.conf.{CONF_PRICES} ({{'{model}': {{'input': usd_per_1M, 'output': usd_per_1M}}}})"
        )
    return BudgetPlan(rules, job, (price.input, price.output), task.on_budget, call, shared)


_Rules = TypeVar("_Rules")


def budgets_of(conf: Any) -> tuple[BudgetRule, ...]:
    """The app's `oncelery_budgets`, parsed once per value (a bad table raises ConfigurationError, naming it)."""
    return _parsed_once(conf, CONF_BUDGETS, parse_budgets)


def limits_of(conf: Any) -> tuple[LimitRule, ...]:
    """The app's `oncelery_limits`, parsed once per value (a bad table raises ConfigurationError, naming it)."""
    return _parsed_once(conf, CONF_LIMITS, parse_limits)


def _parsed_once(conf: Any, setting: str, parse: Callable[[Any, str], _Rules]) -> _Rules:
    """`parse(conf[setting], setting)`, kept per app and setting while the setting holds the same value: every
    model call asks, and the tables change only when a test or an operator sets them again."""
    table = conf.get(setting)
    cached = _PARSED.get((id(conf), setting))
    if cached is not None and cached[0] is table:
        return cast(_Rules, cached[1])
    rules = parse(table, setting)
    _PARSED[(id(conf), setting)] = (table, rules)
    return rules


_PARSED: dict[tuple[int, str], tuple[Any, Any]] = {}


def run_llm_step(
    task: Any,
    ctx: RunContext,
    name: str,
    adapter: Adapter,
    request: Mapping[str, Any],
    policy: CallPolicy,
    batch: BatchPolicy | None = None,
) -> Any:
    """Run the call as step `name` of the live run: replayed if checkpointed, else made or found again."""
    request = json.loads(canonical_json(dict(request)))  # JSON only, checked before anything is written
    meta = {"llm": {"provider": adapter.provider, "endpoint": adapter.endpoint, "model": request.get("model")}}
    if batch is not None:
        meta["llm"]["mode"] = "batch"
    if ctx.fork is not None and ctx.fork.overrides_for(name):  # which fork changed this step, and how
        # Only overridden steps (all at or after the from-step): a replayed step's meta stays the source's.
        meta["fork"] = {"id": ctx.fork.id, "overrides": ctx.fork.overrides_for(name)}

    tel = telemetry_of(task)
    log = None if tel is None else CallLog()

    def call() -> WithWrites:
        step = current_step()
        if step is None:  # StepRunner always runs `call` inside its step
            raise ConfigurationError(f"{task.name}: self.llm() ran outside its step")
        # The rows this delivery writes go to the step's tracing too (oncelery.tracing.calls).
        ledger = CallLedger(ctx.steps.store.db.dialect, task.app.conf, None if log is None else log.rows.append)
        ledger.price(str(request.get("model", "")))  # a bad price table fails here, before the call is made
        if log is not None:
            log.called = True
        where = (ctx.steps.store, ctx.claim, step.position, name, adapter, request, policy, ledger)
        answered = call_model(*where) if batch is None else call_batched(*where, batch)
        if log is not None:
            log.answered_at = len(log.rows)
        return WithWrites(dict(answered.response), answered.writes)

    def run() -> Any:
        return ctx.steps.run(name, call, (), {}, meta, False, request_digest(request))

    if tel is None or log is None:
        return run()
    return traced_llm_step(tel, task, ctx, name, adapter, request, run, log)


def call_unclaimed(adapter: Adapter, request: Mapping[str, Any], poll_s: float = 0.5) -> Any:
    """Make the call with no run (pass-through mode): create, then poll to its end; nothing is recorded."""
    look = adapter.create(request, "pass-through", background=False)
    while not look.terminal:
        time.sleep(look.poll_after_s or poll_s)
        look = adapter.poll(look.reference or "")
    if look.state is not CallState.DONE:
        raise ConfigurationError(f"the model call ended {look.state.value}: {look.response.get('error')}")
    return dict(look.response)
