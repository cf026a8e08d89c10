"""The cost ledger: one `model_calls` row per real model call made in a task or step, with any SDK.

    with oncelery.model_call("gpt-4o-mini", prompt="summarize") as call:
        resp = client.chat.completions.create(model="gpt-4o-mini", messages=messages)
        call.usage(resp.usage)

Guarantees:
- one row per real call, committed in its OWN transaction as the block ends (never the run's effects
  transaction): it survives a rollback of the effects, and a worker killed right after the call leaves it;
- a row the database cannot take (down, restarting, SQLite locked) waits in a spool file and is written when it
  answers again (oncelery.ledger.spool); each row's `call_id` makes every write of it count once;
- a step replayed from its checkpoint never runs its body, so it makes no call and writes no row;
- the block's error is re-raised as it was; a ledger that cannot be written is logged, never raised;
- record-only: budgets and shared limits govern `self.llm()` calls, not these (a task they apply to warns once:
  oncelery.basetask.unbudgeted);
- the cost is computed when the row is written, at that day's price (`price_of`: `app.conf.oncelery_prices`, else
  the price file, LiteLLM's table shipped in the wheel), exactly (Decimal), and stored as integer micro-USD rounded
  up (oncelery.models.money).
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import operator
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from types import TracebackType
from typing import Any, ParamSpec, TypeVar, cast

from celery import current_app
from celery._state import get_current_task

from oncelery.basetask.idempotent import IdempotentTask
from oncelery.basetask.unbudgeted import warn_if_governed
from oncelery.delivery.steps import current_step
from oncelery.errors import ConfigurationError, StoreUnavailable
from oncelery.ledger.prices import Amount, Price, price_for
from oncelery.ledger.rows import write_call
from oncelery.ledger.spool import after_write, spool_row
from oncelery.models.money import micros_up, usd
from oncelery.runs.faults import fault_point
from oncelery.settings import CONF_PRICES, ENV_DATABASE_URL, configured_database_url
from oncelery.store.database import Database

__all__ = ["CONF_PRICES", "Meter", "MeteredCall", "Price", "model_call", "price_of"]

logger = logging.getLogger("oncelery.ledger")  # a stable name (users filter on it)

MAX_ERROR_CHARS = 2000  # of a failed call's error kept in its row
# Where SDKs put token counts: Anthropic and OpenAI Responses, OpenAI Chat Completions, Google Gemini.
_INPUT_FIELDS = ("input_tokens", "prompt_tokens", "prompt_token_count")
_OUTPUT_FIELDS = ("output_tokens", "completion_tokens", "candidates_token_count")

P = ParamSpec("P")
R = TypeVar("R")


def price_of(model: str, conf: Any = None) -> Price | None:
    """The price of `model` for `conf` (default: the current Celery app's): its `oncelery_prices[model]` if given
    (the user's overrides win), else the price file's (`oncelery_price_file`: default, LiteLLM's table shipped in
    the wheel), else None. A bad table or file raises ConfigurationError naming the fix."""
    return price_for(model, current_app.conf if conf is None else conf)


class MeteredCall:
    """One model call being measured: report its tokens in the block; its row is written when the block ends."""

    def __init__(self, model: str, prompt: str | None, meta: Mapping[str, Any] | None) -> None:
        self.model = model
        self.prompt = prompt
        #: The row's id (model_calls.call_id), chosen before the call: every write of the row counts once.
        self.call_id = uuid.uuid4().hex
        #: JSON details stored with the row (model version, seed, temperature...); add to it in the block.
        self.meta: dict[str, Any] = dict(meta or {})
        self.input_tokens = 0
        self.output_tokens = 0
        # Filled in when the block ends:
        self.latency_ms: float | None = None
        self.ok: bool | None = None
        self.error: str | None = None
        #: The call's cost as the ledger stores it: integer micro-USD, rounded up (None: the model had no price).
        self.cost_micros: int | None = None

    @property
    def cost(self) -> Decimal | None:
        """The call's cost in USD, exact (`cost_micros` as a Decimal with 6 places); None: no price known."""
        return usd(self.cost_micros)

    @cost.setter
    def cost(self, value: Amount | None) -> None:
        # USD as a number (a float by its shortest repr), kept as the ledger keeps it: micro-USD, rounded up.
        self.cost_micros = None if value is None else micros_up(value)

    def tokens(self, input_tokens: int, output_tokens: int = 0) -> None:
        """Set the call's token counts (as the model reported them)."""
        try:
            counts = tuple(operator.index(n) for n in (input_tokens, output_tokens) if not isinstance(n, bool))
        except TypeError:
            counts = ()
        if len(counts) != 2 or min(counts) < 0:
            raise ConfigurationError(f"token counts must be ints >= 0, got {(input_tokens, output_tokens)!r}")
        self.input_tokens, self.output_tokens = counts

    def usage(self, usage: Any) -> None:
        """Set the token counts from an SDK's usage object or dict, or an (input, output) pair.

        Reads input_tokens/output_tokens (Anthropic, OpenAI Responses), prompt_tokens/completion_tokens (OpenAI
        Chat Completions) or prompt_token_count/candidates_token_count (Gemini). None (a server that sent no
        usage) leaves the counts as they are.
        """
        if usage is None:
            logger.warning(
                "model call %s (%s): the reply carried no usage; tokens not recorded", self.model, self.prompt
            )
            return
        if isinstance(usage, tuple | list) and len(usage) == 2:
            self.tokens(*usage)
            return
        found = [_first_count(usage, names) for names in (_INPUT_FIELDS, _OUTPUT_FIELDS)]
        if found == [None, None]:
            raise ConfigurationError(
                f"model_call: cannot read token counts from a {type(usage).__name__}: give a usage with "
                f"{'/'.join(_INPUT_FIELDS)} and {'/'.join(_OUTPUT_FIELDS)}, or an (input, output) pair"
            )
        self.tokens(*(int(n or 0) for n in found))


def _first_count(usage: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        value = usage.get(name) if isinstance(usage, Mapping) else getattr(usage, name, None)
        if value is not None:
            return value
    return None


@dataclass(frozen=True)
class _Origin:
    """Where a call is made: the database its row goes to (None: not recorded), the app config, the run."""

    url: str | None
    conf: Any
    task_name: str | None = None
    tenant: str = ""
    key: str | None = None
    step: str | None = None
    run_id: int | None = None
    token: int | None = None


def _origin(model: str) -> _Origin:
    """The current run (task body and step), else the current task, else nothing: environment database only."""
    step = current_step()
    task = get_current_task()
    if isinstance(task, IdempotentTask):
        try:
            ctx = task.run_context()
        except ConfigurationError:  # not inside the body (e.g. a signal handler of the task)
            ctx = None
        if ctx is not None:
            if ctx.effects.connection is not None:
                raise ConfigurationError(
                    f"{task.name}: model_call({model!r}) after effects(): effects commit with the run's completion "
                    f"(and on SQLite hold the only write lock until then), so the call's ledger row could not be "
                    f"committed on its own; make model calls, like steps, before opening effects()"
                )
            claim = ctx.claim
            name = step.name if step is not None and step.run_id == claim.run_id else None
            url = ctx.steps.store.url  # the run's own database
            return _Origin(
                url, task.app.conf, claim.task_name, claim.tenant, claim.key, name, claim.run_id, claim.token
            )
    if step is not None:  # a step run outside a task body (a StepRunner of its own)
        return _Origin(
            step.database_url, current_app.conf, step.task_name, "", step.key, step.name, step.run_id, step.token
        )
    if task is not None:  # a plain Celery task: its app's database
        return _Origin(configured_database_url(task.app.conf), task.app.conf, task.name)
    return _Origin(configured_database_url(), current_app.conf)  # $ONCELERY_DATABASE_URL(_FILE)


class Meter:
    """Measures model calls: a context manager yielding a `MeteredCall`, and a decorator (see `model_call`)."""

    def __init__(
        self,
        model: str,
        prompt: str | None = None,
        meta: Mapping[str, Any] | None = None,
        usage: Callable[[Any], Any] | None = None,
    ) -> None:
        if not isinstance(model, str) or not model or len(model) > 255:
            raise ConfigurationError(f"model_call: model must be a non-empty name of at most 255 characters: {model!r}")
        if prompt is not None and (not isinstance(prompt, str) or len(prompt) > 255):
            raise ConfigurationError(f"model_call: prompt is a name of at most 255 characters: {prompt!r}")
        self.model = model
        self.prompt = prompt
        self.meta = dict(meta or {})
        self.usage_of = usage
        self._active: tuple[MeteredCall, _Origin, Price | None, float] | None = None

    def __enter__(self) -> MeteredCall:
        if self._active is not None:
            raise ConfigurationError("model_call(...) measures one call at a time: call model_call() for each `with`")
        origin = _origin(self.model)
        price = price_for(self.model, origin.conf)  # a bad price table fails here, before the call is paid for
        warn_if_governed(origin.conf, get_current_task(), origin.task_name, origin.tenant, self.model)
        call = MeteredCall(self.model, self.prompt, self.meta)
        self._active = (call, origin, price, time.perf_counter())
        return call

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._active is None:
            return
        (call, origin, price, started), self._active = self._active, None
        call.latency_ms = (time.perf_counter() - started) * 1000.0
        call.ok = exc is None
        call.error = None if exc is None else _error_text(exc)
        call.cost_micros = price.cost_micros(call.input_tokens, call.output_tokens) if price is not None else None
        try:
            _record(origin, call)
        except Exception:
            # The call's own outcome (its result or its error) is what the caller must see; the ledger's is logged.
            logger.exception("could not record model call %s (%s) in the cost ledger", call.model, call.prompt)
        # Returning None re-raises the block's error unchanged.

    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]:
        """Decorate `fn` (sync or async): each call is one measured model call, tokens read from its result."""
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def measured_async(*args: P.args, **kwargs: P.kwargs) -> Any:
                with self._fresh() as call:
                    result = await fn(*args, **kwargs)
                    self._read_usage(call, result)
                return result

            return cast(Callable[P, R], measured_async)

        @functools.wraps(fn)
        def measured(*args: P.args, **kwargs: P.kwargs) -> R:
            with self._fresh() as call:
                result = fn(*args, **kwargs)
                self._read_usage(call, result)
            return result

        return measured

    def _fresh(self) -> Meter:
        # One Meter per decorated call: concurrent calls of one decorated function never share a measurement.
        return Meter(self.model, self.prompt, self.meta, self.usage_of)

    def _read_usage(self, call: MeteredCall, result: Any) -> None:
        source = self.usage_of(result) if self.usage_of is not None else getattr(result, "usage", None)
        if source is not None:
            call.usage(source)


def model_call(
    model: str,
    *,
    prompt: str | None = None,
    meta: Mapping[str, Any] | None = None,
    usage: Callable[[Any], Any] | None = None,
) -> Meter:
    """Record one real model call in the cost ledger: `with model_call(...) as call:` or `@model_call(...)`.

    `model` is the name the price table knows; `prompt` the prompt or template's name (never its text); `meta`
    JSON details kept with the row. As a decorator, the tokens are read from the result's `.usage` (OpenAI,
    Anthropic), or from what `usage(result)` returns (a usage object or dict, or an (input, output) pair).
    Inside a task or step the row carries its task, tenant, key, step, run id and fencing token and goes to the
    run's database; outside any task, to $ONCELERY_DATABASE_URL if set, else nowhere. Record-only: no budget
    reserves and no shared limit admits the call (use `self.llm()` for that); where one applies to the task, its
    first call in the process warns `ModelCallNotBudgeted`.
    """
    return Meter(model, prompt, meta, usage)


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\x00", "\\x00")
    return text[:MAX_ERROR_CHARS]


@functools.lru_cache(maxsize=32)
def _database(url: str) -> Database:
    return Database(url)


def _record(origin: _Origin, call: MeteredCall) -> None:
    """Commit the call's row in its own durable transaction (never the caller's: it must survive a rollback),
    or, if the database cannot take it now, spool it to be written when it can."""
    if origin.url is None:
        logger.debug("model call %s not recorded: not in a task and no %s", call.model, ENV_DATABASE_URL)
        return
    row = {
        "call_id": call.call_id,
        "task_name": origin.task_name,
        "tenant": origin.tenant,
        "idempotency_key": origin.key,
        "step": origin.step,
        "run_id": origin.run_id,
        "fencing_token": origin.token,
        "model": call.model,
        "prompt": call.prompt,
        "input_tokens": call.input_tokens,
        "output_tokens": call.output_tokens,
        "latency_ms": call.latency_ms,
        "ok": call.ok,
        "error": call.error,
        "cost_micros": call.cost_micros,
        # JSON-safe whatever the block put in it: a value that is not JSON is kept as its text.
        "meta": json.loads(json.dumps(call.meta, default=str)) if call.meta else None,
    }
    db = _database(origin.url)
    db.require_file()  # never creates a SQLite file as a side effect of a call
    fault_point("ledger_write", task=origin.task_name, key=origin.key, model=call.model)
    try:
        write_call(db, row)  # the row, the running totals the exporter reads, and the run's (what replays save)
        fault_point("ledger_committed", task=origin.task_name, key=origin.key, model=call.model)
    except StoreUnavailable as exc:
        _spool(origin, call, row, exc)
        return
    after_write(origin.url, origin.conf)  # the database answers: rows spooled earlier go in now
    logger.debug(
        "ledger: %s %s[%s] step=%s ok=%s tokens=%d/%d",
        call.model,
        origin.task_name,
        origin.key,
        origin.step,
        call.ok,
        call.input_tokens,
        call.output_tokens,
    )


def _spool(origin: _Origin, call: MeteredCall, row: dict[str, Any], exc: StoreUnavailable) -> None:
    """Keep a row the database could not take (or whose commit went unanswered) in this process's spool."""
    url = cast(str, origin.url)
    try:
        path = spool_row(url, origin.conf, row)
    except OSError as spool_exc:
        # Neither the database nor the spool took it: the log line is the only record left, so it has the row.
        logger.error(
            "could not record model call %s (%s) in the cost ledger (%s) nor spool it (%s): %s",
            call.model,
            call.prompt,
            exc,
            spool_exc,
            json.dumps(row, default=str),
        )
        return
    logger.warning(
        "ledger: model call %s %s[%s] call_id=%s spooled to %s (%s); it is written once the database answers",
        call.model,
        origin.task_name or "-",
        origin.key or "-",
        call.call_id,
        path,
        exc,
    )
