"""A task's adapter options (`llm_adapter`, `llm_batch_adapter`): an adapter, or a factory that makes one.

A factory is a zero-argument callable (`llm_adapter=lambda: OpenAIResponses()`, or the class itself), or a callable
taking the task as its one argument (`llm_adapter=lambda task: OpenAIResponses(api_key=keys[task.name])`). Celery
keeps task options as class attributes, so a function given as one reads back from the task as a method bound to
it: called as it is, the task would be passed to a function that takes nothing (TypeError). `as_factory` is the one
rule that unbinds it; every place that resolves a task's adapter goes through `task_adapter` or `made_adapter`.

A task's factory is called once per task and process, on first use (in a prefork child, after the fork): every
caller in the process then shares the adapter, as they share one given as such.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["ADAPTER_OPTIONS", "as_factory", "is_factory", "made_adapter", "task_adapter", "unbind_factories"]

ADAPTER_OPTIONS = ("llm_adapter", "llm_batch_adapter")
_MADE = "_oncelery_made_adapters"  # in a task's __dict__: {option: (the factory, the adapter it made)}
_MAKING = threading.Lock()  # two worker threads' first calls make one adapter, not two (one left unclosed)


def is_factory(value: Any) -> bool:
    """Whether an adapter option holds a factory (a function, method, class, or callable without `create`)."""
    if inspect.isclass(value) or inspect.isroutine(value) or isinstance(value, functools.partial):
        return True
    return callable(value) and not hasattr(value, "create")


def as_factory(owner: Any, factory: Callable[..., Any]) -> Callable[[], Any]:
    """`factory` callable with no argument: unbound from `owner` if bound to it, given `owner` if it takes one."""
    func = factory.__func__ if inspect.ismethod(factory) and factory.__self__ is owner else factory
    # A partial, never the class itself: code that tells an adapter by its attributes never takes it for one.
    return functools.partial(func) if _takes_no_argument(func) else functools.partial(func, owner)


def made_adapter(owner: Any, value: Any) -> Any:
    """The adapter `value` gives for `owner`: `value` itself, or what it makes if it is a factory (None stays None)."""
    if value is None or not is_factory(value):
        return value
    return as_factory(_unproxied(owner), value)()


def task_adapter(task: Any, option: str = "llm_adapter") -> Any:
    """The adapter the task's `option` gives (None: unset), a factory's made once per task and process."""
    task = _unproxied(task)
    value = getattr(task, option, None)
    if value is None or not is_factory(value):
        return value
    # A bound method is a new object at each attribute access: the function under it identifies the factory.
    factory = value.__func__ if inspect.ismethod(value) and value.__self__ is task else value
    with _MAKING:
        made: dict[str, tuple[Any, Any]] = vars(task).setdefault(_MADE, {})
        kept = made.get(option)
        if kept is not None and kept[0] is factory:
            return kept[1]
        adapter = made_adapter(task, value)
        made[option] = (factory, adapter)
    return adapter


def unbind_factories(task: Any) -> None:
    """Make each adapter option of `task` holding a factory read back as a callable of no argument."""
    for option in ADAPTER_OPTIONS:
        value = getattr(task, option, None)
        if value is not None and is_factory(value):
            # For code that reads the option as an attribute and calls it (the relay's batcher does).
            vars(task)[option] = as_factory(task, value)


def _unproxied(owner: Any) -> Any:
    # What `@app.task` returns before the app is finalized is Celery's proxy of the task: the task it stands for
    # is what a function given as an option is bound to.
    current = getattr(owner, "_get_current_object", None)
    return current() if callable(current) else owner


def _takes_no_argument(func: Callable[..., Any]) -> bool:
    try:
        inspect.signature(func).bind()
    except TypeError:
        return False
    except ValueError:  # no signature to read (some builtins): called as documented, with no argument
        return True
    return True
