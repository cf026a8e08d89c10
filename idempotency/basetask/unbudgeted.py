"""`model_call` is record-only: budgets and shared limits govern `self.llm()` calls, never the calls it records.

A budget (`oncelery_budgets`, a task's `max_cost_usd`) reserves a call's estimated cost before the call is sent,
and a shared limit (`oncelery_limits`) admits it; both happen in the transaction that commits a `self.llm()`
call's intent. A call a task makes with its own SDK inside `model_call` has no intent: its ledger row is written
after it, and no budget or limiter saw it first. So where one applies to the task, the task's first recorded call
in this process warns (`ModelCallNotBudgeted`, and the same line on the `oncelery.ledger` logger), naming
`self.llm()` as the way to keep the task's calls within them.
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Any

from oncelery.errors import ConfigurationError, ModelCallNotBudgeted
from oncelery.llm.budgets import parse_budgets
from oncelery.llm.limits import parse_limits
from oncelery.settings import CONF_BUDGETS, CONF_LIMITS

__all__ = ["governing", "warn_if_governed"]

logger = logging.getLogger("oncelery.ledger")  # the ledger's logger: users already filter on it

_warned: set[str] = set()  # task names warned in this process
_warning = threading.Lock()  # two worker threads' first calls of one task warn once, not twice


def governing(conf: Any, task: Any, task_name: str, tenant: str, model: str) -> list[str]:
    """The settings that govern this task's `self.llm()` calls of `model` (scoped as `self.llm()` scopes them)."""
    found = []
    if getattr(task, "max_cost_usd", None) is not None:
        found.append(f"{task_name}'s max_cost_usd")
    try:
        budgets = parse_budgets(conf.get(CONF_BUDGETS), CONF_BUDGETS)
    except ConfigurationError:  # a table the worker's start refuses anyway: a budget is meant, whatever its shape
        budgets = ()
        found.append(CONF_BUDGETS)
    if any(rule.scope == "global" or _tenant_rule(rule.scope, tenant) for rule in budgets):
        found.append(CONF_BUDGETS)
    try:
        limits = parse_limits(conf.get(CONF_LIMITS), CONF_LIMITS)
    except ConfigurationError:
        limits = ()
        found.append(CONF_LIMITS)
    if any(_limit_applies(rule.scope, task_name, tenant, model) for rule in limits):
        found.append(CONF_LIMITS)
    return found


def warn_if_governed(conf: Any, task: Any, task_name: str | None, tenant: str, model: str) -> None:
    """Warn once per task name and process if budgets or shared limits apply to the task `model_call` records for."""
    if task_name is None or task_name in _warned:
        return
    found = governing(conf, task, task_name, tenant, model)
    if not found:
        return
    with _warning:
        if task_name in _warned:
            return
        _warned.add(task_name)
    message = (
        f"{task_name}: model_call({model!r}) only records the call: {' and '.join(dict.fromkeys(found))} govern "
        f"self.llm() calls only, and this one was neither admitted by a shared limit nor reserved in a budget; "
        f"make the call with self.llm() to keep it within them (docs/ledger.md). Warned once per task and process."
    )
    logger.warning("%s", message)
    # Three frames up: the caller's `with model_call(...)` (or the decorated function's call), not this module.
    warnings.warn(message, ModelCallNotBudgeted, stacklevel=3)


def _tenant_rule(scope: str, tenant: str) -> bool:
    # As self.llm() reads them: a call without a tenant skips tenant rules.
    return bool(tenant) and scope in ("tenant:*", f"tenant:{tenant}")


def _limit_applies(scope: str, task_name: str, tenant: str, model: str) -> bool:
    kind, _, which = scope.partition(":")
    if kind == "tenant":
        return _tenant_rule(scope, tenant)
    if kind == "task":
        return which == task_name
    # provider:model: a recorded call names no provider, so any provider's rule for its model (or all) applies.
    return which in (model, "*")
