"""What an idempotent task's options must be, checked at decoration time; misspelt option names refused.

`options.TaskOptions` runs `validate_options` when a task class with a body is made (a bad option fails there,
not at 3 a.m.); `check_option_names` also checks each call's apply_async options.
"""

from __future__ import annotations

import difflib
import inspect
import logging
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

from oncelery.basetask.debounce import check_debounce
from oncelery.errors import ConfigurationError, UnknownOption
from oncelery.llm.budgets import ON_BUDGET, parse_usd
from oncelery.settings import check_lease, check_policy

if TYPE_CHECKING:
    from oncelery.basetask.options import TaskOptions

__all__ = [
    "check_option_names",
    "validate_options",
]

# The task's logger: these checks are a part of IdempotentTask.
logger = logging.getLogger("oncelery.task")


def validate_options(task: TaskOptions, known: Sequence[str]) -> None:
    """Raise ConfigurationError (or UnknownOption, against `known`) for the first bad option `task` declares."""
    check_task_option_names(task, known)
    if task.on_in_progress is not None:
        check_policy(task.on_in_progress, str(task.name))
    if task.lease is not None:
        check_lease(task.lease, str(task.name))
    if task.max_lease is not None and (not isinstance(task.max_lease, int | float) or task.max_lease <= 0):
        raise ConfigurationError(f"{task.name}: max_lease={task.max_lease!r}; give seconds > 0, or None")
    if task.max_deliveries is not None and (
        not isinstance(task.max_deliveries, int) or isinstance(task.max_deliveries, bool) or task.max_deliveries < 1
    ):
        raise ConfigurationError(f"{task.name}: max_deliveries={task.max_deliveries!r}; give an int >= 1, or None")
    bad = [t for t in task.dead_on if not (isinstance(t, type) and issubclass(t, BaseException))]
    if bad:
        raise ConfigurationError(f"{task.name}: dead_on={task.dead_on!r}; give a tuple of exception classes")
    check_versioning(task)
    check_budget_options(task)
    if task.debounce is not None:
        check_debounce(task)
    if task.name and (task.name.startswith("tasks.") or "." not in task.name):
        logger.debug("task %s has no explicit name; give it name='oncelery.<job>'", task.name)
    _ = task._keys, task._concurrency_keys


def check_budget_options(task: TaskOptions) -> None:
    """Raise ConfigurationError for a max_cost_usd that is not an amount or an on_budget that is not known."""

    if task.max_cost_usd is not None:
        parse_usd(task.max_cost_usd, f"{task.name}: max_cost_usd")
    if task.on_budget not in ON_BUDGET:
        raise ConfigurationError(f"{task.name}: on_budget={task.on_budget!r}; use one of {', '.join(ON_BUDGET)}")


def check_task_option_names(task: TaskOptions, known: Sequence[str]) -> None:
    """Raise UnknownOption for an attribute `task`'s own class adds that looks like one of `known` misspelt."""
    # Celery keeps any unknown task option as a class attribute, where nothing reads a misspelt one of ours
    # (idempotency_kye= would silently key the task by all its arguments). What a base class defines
    # (Celery's options, ours, a user's base) is known; only what this class adds is checked.
    cls = type(task)
    inherited = {name for base in cls.__mro__[1:] for name in vars(base)}
    added = [name for name in vars(cls) if not name.startswith("_") and name not in inherited]
    check_option_names(added, known, f"{task.name}: task option")


def check_versioning(task: TaskOptions) -> None:
    """Raise ConfigurationError unless entity_version is a parameter of the task, with an entity to order."""
    if task.entity_version is None:
        if task.entity is not None:
            raise ConfigurationError(f"{task.name}: entity= orders events only with entity_version=; set both")
        return
    params = list(inspect.signature(task.run).parameters)
    if task.entity_version not in params:
        raise ConfigurationError(
            f"{task.name}: entity_version={task.entity_version!r} is not a parameter of the task {params}"
        )
    if task.entity is None and task.concurrency_key is None:
        raise ConfigurationError(
            f"{task.name}: entity_version needs an entity: set concurrency_key= or entity= "
            f"(a template such as 'article:{{article_id}}')"
        )
    _ = task._entity_keys


# Any option starting with one of these is Oncelery's, known or misspelt.
_OUR_PREFIXES = ("idempotency", "oncelery")
# How close (difflib's ratio) a name must be to one of ours to be taken for a misspelling of it.
_CLOSE = 0.8


def check_option_names(names: Iterable[str], ours: Sequence[str], where: str) -> None:
    """Raise UnknownOption for the first name that looks like one of `ours` misspelt; leave all others alone.

    A name looks like ours when it starts with "idempotency"/"oncelery" or is close to one of ours; one that
    extends one of ours with a suffix of its own (`tenant_id`, `entity_id`) is the user's own attribute.
    """
    known = tuple(ours)
    for name in names:
        misspelt, nearest = _misspelt(name, known)
        if misspelt:
            raise UnknownOption.of(where, name, nearest, known)


@lru_cache(maxsize=1024)
def _misspelt(name: str, ours: tuple[str, ...]) -> tuple[bool, str | None]:
    # Cached: apply_async asks this for every option of every call (headers, queue, task_id...), and the answer
    # for a name never changes; difflib per option per call would cost more than the call's own checks.
    if name in ours:
        return False, None
    close = difflib.get_close_matches(name, ours, n=1, cutoff=_CLOSE)
    nearest = close[0] if close else None
    extends = nearest is not None and name.startswith(f"{nearest}_") and len(name) > len(nearest) + 1
    return name.lower().startswith(_OUR_PREFIXES) or (nearest is not None and not extends), nearest
