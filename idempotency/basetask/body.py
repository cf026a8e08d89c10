"""The API a task body calls on `self`: step(), llm(), effects(), run_id, seeds, and the progress each step reports.

Each works on the live run of this thread's delivery (its RunContext, attached by the delivery), or, under
$ONCELERY_PASS_THROUGH, as a plain call with no run.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy.orm import Session

from oncelery.basetask.announce import Announcing
from oncelery.basetask.llm_step import batch_policy, call_unclaimed, policy_of, resolve_adapter, run_llm_step
from oncelery.delivery.delivered import RunContext
from oncelery.delivery.steps import step_seed
from oncelery.errors import ConfigurationError
from oncelery.runs.forks import apply_overrides
from oncelery.settings import HEADER_WOKEN, require_database_url
from oncelery.store.database import Database
from oncelery.tracing.otel import telemetry_of

__all__ = [
    "RunBody",
]

_TASK_DEFAULT: Any = object()  # self.llm(inline_wait=...) not given: the task's llm_inline_wait

# The task's logger: this class is a part of IdempotentTask.
logger = logging.getLogger("oncelery.task")

# Request attributes: the live run of this delivery, and whether it runs under $ONCELERY_PASS_THROUGH.
_RUN_ATTR = "oncelery_run"
_PASS_ATTR = "oncelery_pass_through"


class RunBody(Announcing):
    """The in-body API of an IdempotentTask: checkpointed steps, fenced effects, the run's id and seeds."""

    # -- the run the body works on ---------------------------------------------------------------

    def attach(self, ctx: RunContext) -> None:
        """Make `ctx` the live run of this delivery (what step() and effects() use)."""
        setattr(self.request, _RUN_ATTR, ctx)
        tel = telemetry_of(self)
        if tel is not None:
            claim = ctx.claim
            tel.attached(claim.run_id, claim.attempts, claim.token, claim.takeover)

    def detach(self, ctx: RunContext) -> None:
        """Forget `ctx` once its delivery has ended."""
        if getattr(self.request, _RUN_ATTR, None) is ctx:
            setattr(self.request, _RUN_ATTR, None)

    def _pass_through(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """$ONCELERY_PASS_THROUGH: run the body as a plain function (no claim, no lease, nothing stored)."""
        logger.warning("%s: ONCELERY_PASS_THROUGH is on: the body runs unclaimed (unit tests only)", self.name)
        setattr(self.request, _PASS_ATTR, True)
        try:
            return self.run(*args, **kwargs)
        finally:
            setattr(self.request, _PASS_ATTR, False)

    def _passing(self) -> bool:
        return bool(getattr(self.request, _PASS_ATTR, False))

    # -- inside the body -------------------------------------------------------------------------

    def max_lease_seconds(self) -> float | None:
        """The bound on lease renewal: max_lease, else the task's (or app's) hard, then soft, time limit."""
        for value in (self.max_lease, self.time_limit, self.soft_time_limit):
            if value:
                return float(value)
        conf = self.app.conf
        # The app's limits are read once per configuration (two lookups per delivery otherwise): Celery's pool
        # reads them when the worker starts, so a later change would not apply to the pool either.
        seen = self.__dict__.get("_app_time_limit")
        if seen is None or seen[0] is not conf:
            limit = conf.get("task_time_limit") or conf.get("task_soft_time_limit")
            seen = (conf, float(limit) if limit else None)
            self.__dict__["_app_time_limit"] = seen
        return seen[1]  # type: ignore[no-any-return]

    def run_context(self, use: str = "effects()/step()") -> RunContext:
        """Return the live run of this thread's current delivery, or raise (naming `use`) outside the body."""
        ctx: RunContext | None = getattr(self.request, _RUN_ATTR, None)
        if ctx is None:
            raise ConfigurationError(
                f"{self.name}: {use} can only be used inside the task body; call it from the body a worker "
                f"runs, or from a direct call of the task"
            )
        return ctx

    def step(
        self,
        name: str,
        fn: Callable[..., Any],
        /,
        *args: Any,
        step_meta: dict[str, Any] | None = None,
        rerun_on_change: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Run `fn(*args, **kwargs)` once per run: checkpoint its JSON result, replay it on later attempts.

        If `fn` takes a `seed` argument it receives the step's deterministic seed (sha256 of task, key, step).
        `step_meta` (model, prompt hash...) is stored with the checkpoint; replaying under different meta
        raises StepMismatch, or re-executes the step when `rerun_on_change=True`.
        """
        if self._passing():  # no run: the step is a plain call (its seed still the step's own)
            if "seed" in inspect.signature(fn).parameters and "seed" not in kwargs:
                kwargs["seed"] = step_seed(self.name, "", name)
            return fn(*args, **kwargs)
        ctx = self.run_context()
        ctx.heartbeat.check()
        if ctx.effects.connection is not None:
            raise ConfigurationError(
                f"{self.name}: step {name!r} called after effects(); effects commit with the run's completion, "
                f"so run every step() first and open effects() last"
            )
        self._report_progress(ctx, name)
        tel = telemetry_of(self)
        if tel is None:
            return ctx.steps.run(name, fn, args, kwargs, step_meta, rerun_on_change)
        with tel.step(name, ctx.steps.position, ctx.claim.run_id, "step") as span:
            replayed = len(ctx.steps.replayed)
            value = ctx.steps.run(name, fn, args, kwargs, step_meta, rerun_on_change)
            span.set_attribute("oncelery.step.replayed", len(ctx.steps.replayed) > replayed)
            return value

    def llm(
        self,
        name: str,
        /,
        *,
        adapter: Any = None,
        background: bool = True,
        at_most_once: bool | None = None,
        on_lost: str | None = None,
        inline_wait: Any = _TASK_DEFAULT,
        max_cost_usd: Any = None,
        mode: str = "call",
        batch: Any = None,
        **request: Any,
    ) -> Any:
        """Make the model call `request` as step `name`: paid once where the provider allows it, replayed after.

        A write-ahead intent is committed before the call; a later holder re-attaches to a background call
        instead of paying again (docs/llm.md has the recovery table). Returns the provider's response JSON
        (`oncelery.llm.output_text(response)` gives its text) and records the call in the cost ledger. A background
        call still running after `inline_wait` seconds (the task's `llm_inline_wait`, 5 s) parks the run WAITING:
        the worker slot is freed, and `oncelery relay` wakes the run when the provider's answer is due.
        Under `oncelery_limits` and budgets (`oncelery_budgets`, the task's `max_cost_usd`, this call's
        `max_cost_usd`) the call is admitted and its estimated cost reserved before it is sent (docs/limits.md).
        `mode="batch"` (with `batch=BatchPolicy(...)`) makes the call an item of a provider batch at about half
        the price: the run waits WAITING until the batch returns (docs/batches.md).
        """
        chosen = resolve_adapter(self, adapter)
        waits = self.llm_inline_wait if inline_wait is _TASK_DEFAULT else inline_wait
        if self._passing():
            return call_unclaimed(chosen, request)
        ctx = self.run_context("self.llm()")
        shared: tuple[tuple[str, int], ...] = ()
        if ctx.fork is not None:  # a fork's --set STEP.model=... (docs/fork.md), and its cohort's shared cap
            changes = ctx.fork.overrides_for(name)
            request = apply_overrides(request, changes) if changes else request
            mode = str(changes.get("mode", mode))
            shared = ctx.fork.shared_budgets()
        # A direct or eager call has no broker to wake a parked run through: it blocks, as inline_wait=None does.
        woken = bool((self.request.headers or {}).get(HEADER_WOKEN))  # this delivery woke a parked run
        policy = policy_of(
            self, at_most_once, on_lost, background, waits if ctx.parkable else None, woken,
            model=str(request.get("model", "")), max_cost_usd=max_cost_usd, shared=shared,
        )  # fmt: skip
        ctx.heartbeat.check()
        if ctx.effects.connection is not None:
            raise ConfigurationError(
                f"{self.name}: self.llm({name!r}) called after effects(); run every model call before effects()"
            )
        self._report_progress(ctx, name)
        return run_llm_step(self, ctx, name, chosen, request, policy, batch_policy(self, mode, batch))

    @property
    def run_id(self) -> int | None:
        """The id of the task_runs row this delivery holds (e.g. for a `generated_by_run_id` column).

        None under $ONCELERY_PASS_THROUGH, where the body runs with no run; outside a body it raises.
        """
        if self._passing():
            return None
        return self.run_context("self.run_id").claim.run_id

    def step_seed(self, name: str) -> int:
        """Return the deterministic seed of step `name` for the current run (same in every process)."""
        ctx = self.run_context()
        return step_seed(self.name, ctx.claim.key, name)

    @property
    def seed(self) -> int:
        """The current run's deterministic seed: sha256 of task name and key (never Python's salted hash())."""
        return self.step_seed("")

    def _report_progress(self, ctx: RunContext, name: str) -> None:
        req = self.request
        if req.called_directly or not req.id or self.ignore_result:
            return
        meta = {
            "step": name,
            "position": ctx.steps.position,
            "total": self.total_steps,
            "replayed": list(ctx.steps.replayed),
            "key": ctx.claim.key,
            "token": ctx.claim.token,
        }
        try:
            self.update_state(state="PROGRESS", meta=meta)
        except Exception as exc:  # progress is informative; a backend hiccup must not fail the job
            logger.debug("progress update failed for %s: %s", ctx.claim.key, exc)
        # Flower: the custom event sets the state PROGRESS; the step itself rides in the kwargs column.
        position = ctx.steps.position + 1
        how = "replayed" if ctx.steps.checkpoints.get(ctx.steps.position) is not None else "executing"
        total = f"/{self.total_steps}" if self.total_steps else ""
        decided = f"step {position}{total} {name} {how} key={ctx.claim.key} token={ctx.claim.token}"
        self._announce("task-progress", decided, {**meta, "state_detail": how}, f"step {position}{total} {name}")

    @contextmanager
    def effects(self) -> Iterator[Session]:
        """Yield a session whose writes commit atomically with the run's completion, fenced by its token."""
        if self._passing():  # no run to fence: a plain transaction on the claims database
            db = Database(require_database_url(self.app.conf, f"Task {self.name}"))
            with db.begin() as conn, Session(bind=conn) as session:
                yield session
                session.flush()
            return
        ctx = self.run_context()
        ctx.heartbeat.check()
        with ctx.effects.block() as session:
            yield session
