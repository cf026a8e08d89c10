"""`IdempotentTask`: the Celery Task base that turns at-least-once delivery into exactly-once effects.

The task decides *what happens* on each claim decision; `RunStore` decides *how* a claim is written.
"""

from __future__ import annotations

import inspect
import logging
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cached_property
from typing import Any

from celery import Task
from celery._state import _task_stack
from celery.exceptions import Ignore, Retry
from celery.utils.saferepr import saferepr
from celery.utils.serialization import raise_with_context
from kombu.serialization import dumps, loads, prepare_accept_content
from sqlalchemy.orm import Session

from oncelery.caller import tell_caller
from oncelery.claims import BAD_MESSAGE, EntityVersionOf, RunStore
from oncelery.delivery import NEVER_SUCCEED, Delivery, RunContext, after_store_fault, can_resend
from oncelery.errors import ConfigurationError, OnceleryError, StoreError
from oncelery.faults import fault_point
from oncelery.keys import FingerprintSpec, Identity, KeyBuilder, KeySpec, validate_key
from oncelery.models import Outcome
from oncelery.settings import (
    CONF_LEASE,
    CONF_ON_IN_PROGRESS,
    CONF_STORE_MESSAGE,
    CONF_TENANT,
    DEFAULT_LEASE_SECONDS,
    DEFAULT_MAX_DELIVERIES,
    HEADER_ABANDONED,
    HEADER_KEY,
    HEADER_LEASE,
    HEADER_ON_IN_PROGRESS,
    HEADER_TENANT,
    HEADER_WAITS,
    WAIT_BACKOFF_BASE,
    WAIT_BACKOFF_CAP,
    check_lease,
    check_policy,
    check_settings,
    digest_secret,
    pass_through,
    require_database_url,
)
from oncelery.steps import step_seed
from oncelery.store import Database

logger = logging.getLogger(__name__)

_RUN_ATTR = "oncelery_run"
_PASS_ATTR = "oncelery_pass_through"
# Headers a call's options travel in, kept with a run's message so a replay or a sweep sends them again.
_CALL_HEADERS = (HEADER_KEY, HEADER_TENANT, HEADER_ON_IN_PROGRESS, HEADER_LEASE)


def wait_backoff(waits: int, base: float = WAIT_BACKOFF_BASE, cap: float = WAIT_BACKOFF_CAP) -> float:
    """Return the delay before the `waits`-th re-check of a busy key: exponential, capped, jittered."""
    delay = min(cap, base * (2 ** min(waits, 16)))
    # Full jitter over the top half, so many waiters on one key do not poll in lockstep.
    return float(delay / 2 + random.random() * delay / 2)


class IdempotentTask(Task):  # type: ignore[misc]
    """A Celery task whose body's committed effects and stored result happen once per idempotency key."""

    #: Template over the bound arguments ("article:{article_id}:v{version}"), a callable taking the
    #: task's arguments, or None for a content-addressed key (task arguments' sha256).
    idempotency_key: KeySpec = None
    #: Argument names whose values make the payload fingerprint; None means all arguments.
    fingerprint: FingerprintSpec = None
    #: Lease in seconds, renewed by a heartbeat every lease/3 while the body runs. None: app.conf.oncelery_lease,
    #: else 60. Per call: apply_async(..., lease=30).
    lease: float | None = None
    #: What a delivery does while another live holder runs the key: "retry" | "skip" | "raise". None:
    #: app.conf.oncelery_on_in_progress, else "retry". Per call: apply_async(..., on_in_progress="raise").
    on_in_progress: str | None = None
    #: Optional template/callable: at most one RUNNING run per entity (a partial unique index).
    concurrency_key: KeySpec = None
    #: Optional number of steps, reported as "total" in the PROGRESS state Flower shows.
    total_steps: int | None = None
    #: Seconds after which the heartbeat stops renewing a running body's lease, so a hung body cannot hold
    #: its key for ever. None: the task's time_limit (else soft_time_limit, else the app's task_time_limit);
    #: with none of them set, renewal is unbounded. Set it above the longest honest run.
    max_lease: float | None = None
    #: Template or callable over the arguments giving the key's namespace (a tenant); per call:
    #: apply_async(..., tenant="acme"); app-wide: app.conf.oncelery_tenant, a callable (task_name, args,
    #: kwargs) -> tenant, called where the job is sent. One tenant never replays, conflicts with or blocks
    #: another's key.
    tenant: KeySpec = None
    #: Keep the message's arguments in the run row until it completes, so a job whose message a broker lost
    #: can be sent again. None: app.conf.oncelery_store_message, else only on the embedded (filesystem://)
    #: broker, which loses in-flight messages.
    store_message: bool | None = None
    #: Deliveries whose worker vanished mid-body (SIGKILL, OOM, segfault) after which the run goes DEAD with
    #: a dead letter instead of running again: Celery re-queues such a poison message for ever under
    #: task_reject_on_worker_lost. None: no bound.
    max_deliveries: int | None = DEFAULT_MAX_DELIVERIES
    #: Exception types that can never succeed on the same input (e.g. a validation error): the run goes DEAD
    #: at once. StepMismatch, ResultNotJSON and ConfigurationError always do.
    dead_on: tuple[type[BaseException], ...] = ()
    #: Name of the argument carrying the event's version (an int). An event whose version is not newer than
    #: its entity's last applied one is acked without running (outcome `stale`); completion applies it.
    entity_version: str | None = None
    #: Template or callable naming the entity that entity_version orders; default: concurrency_key.
    entity: KeySpec = None

    def __init__(self) -> None:
        super().__init__()
        if type(self).run is not Task.run:
            self._validate_options()

    # -- configuration ---------------------------------------------------------------------------

    def _validate_options(self) -> None:
        if self.on_in_progress is not None:
            check_policy(self.on_in_progress, str(self.name))
        if self.lease is not None:
            check_lease(self.lease, str(self.name))
        if self.max_lease is not None and (not isinstance(self.max_lease, int | float) or self.max_lease <= 0):
            raise ConfigurationError(f"{self.name}: max_lease={self.max_lease!r}; give seconds > 0, or None")
        if self.max_deliveries is not None and (
            not isinstance(self.max_deliveries, int) or isinstance(self.max_deliveries, bool) or self.max_deliveries < 1
        ):
            raise ConfigurationError(f"{self.name}: max_deliveries={self.max_deliveries!r}; give an int >= 1, or None")
        bad = [t for t in self.dead_on if not (isinstance(t, type) and issubclass(t, BaseException))]
        if bad:
            raise ConfigurationError(f"{self.name}: dead_on={self.dead_on!r}; give a tuple of exception classes")
        self._check_versioning()
        if self.name and (self.name.startswith("tasks.") or "." not in self.name):
            logger.debug("task %s has no explicit name; give it name='oncelery.<job>'", self.name)
        _ = self._keys, self._concurrency_keys

    @cached_property
    def _keys(self) -> KeyBuilder:
        return KeyBuilder(
            self.run, self.name or "", self._option("idempotency_key"), self.fingerprint, self._option("tenant")
        )

    @cached_property
    def _concurrency_keys(self) -> KeyBuilder | None:
        if self.concurrency_key is None:
            return None
        return KeyBuilder(self.run, self.name or "", self._option("concurrency_key"), None, what="concurrency_key")

    def _check_versioning(self) -> None:
        if self.entity_version is None:
            if self.entity is not None:
                raise ConfigurationError(f"{self.name}: entity= orders events only with entity_version=; set both")
            return
        params = list(inspect.signature(self.run).parameters)
        if self.entity_version not in params:
            raise ConfigurationError(
                f"{self.name}: entity_version={self.entity_version!r} is not a parameter of the task {params}"
            )
        if self.entity is None and self.concurrency_key is None:
            raise ConfigurationError(
                f"{self.name}: entity_version needs an entity: set concurrency_key= or entity= "
                f"(a template such as 'article:{{article_id}}')"
            )
        _ = self._entity_keys

    @cached_property
    def _entity_keys(self) -> KeyBuilder:
        spec = "entity" if self.entity is not None else "concurrency_key"
        return KeyBuilder(self.run, self.name or "", self._option(spec), None, what=spec)

    def version_of(self, args: Any = (), kwargs: Any = None) -> EntityVersionOf | None:
        """The entity and version this call carries (entity_version=), or None if the task is not versioned."""
        if self.entity_version is None:
            return None
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        version = self._keys.bind(args, kwargs).get(self.entity_version)
        if not isinstance(version, int) or isinstance(version, bool):
            raise ConfigurationError(
                f"{self.name}: entity_version argument {self.entity_version!r} must be an int, got {version!r}"
            )
        return EntityVersionOf(self._entity_keys.identity(args, kwargs).key, version)

    def _option(self, name: str) -> Any:
        # Celery keeps task options as class attributes, so a function given as an option (a callable key)
        # comes back bound to the task; it is documented to take the task's arguments only: unbind it.
        value = getattr(self, name)
        if inspect.ismethod(value) and value.__self__ is self:
            return value.__func__
        return value

    def settings(self) -> Any:
        """The app's configuration, its oncelery_* names checked once (a typo raises, naming the setting)."""
        conf = self.app.conf
        if self.__dict__.get("_settings_of") is not conf:
            check_settings(conf)
            self.__dict__["_settings_of"] = conf
        return conf

    def lease_for(self, headers: dict[str, Any] | None = None) -> float:
        """The lease of a call: its own (lease=), else the task's, else app.conf.oncelery_lease, else 60 s."""
        call = (headers or {}).get(HEADER_LEASE)
        if call is not None:
            return check_lease(call, f"{self.name} (this call)")
        if self.lease is not None:
            return float(self.lease)
        app_wide = self.settings().get(CONF_LEASE)
        return DEFAULT_LEASE_SECONDS if app_wide is None else check_lease(app_wide, f"app.conf.{CONF_LEASE}")

    def policy_for(self, headers: dict[str, Any] | None = None) -> str:
        """The on_in_progress of a call: its own, else the task's, else the app's, else "retry"."""
        call = (headers or {}).get(HEADER_ON_IN_PROGRESS)
        if call is not None:
            return check_policy(call, f"{self.name} (this call)")
        if self.on_in_progress is not None:
            return self.on_in_progress
        app_wide = self.settings().get(CONF_ON_IN_PROGRESS)
        return "retry" if app_wide is None else check_policy(app_wide, f"app.conf.{CONF_ON_IN_PROGRESS}")

    @property
    def store(self) -> RunStore:
        """The claims store of this task's app (app.conf.oncelery_database_url, else $ONCELERY_DATABASE_URL)."""
        url = require_database_url(self.app.conf, f"Task {self.name}")
        cached: RunStore | None = self.__dict__.get("_store")
        if cached is None or cached.url != url:
            cached = RunStore(url)
            self.__dict__["_store"] = cached
        return cached

    def identity_of(
        self,
        args: Any = (),
        kwargs: Any = None,
        idempotency_key: str | None = None,
        tenant: str | None = None,
        *,
        digests: bool = True,
    ) -> Identity:
        """Return the key, tenant and payload fingerprint this task derives for the given call.

        Per-field digests are keyed with ONCELERY_DIGEST_KEY, else with the secret the claims database
        generated (`digests=False` skips them, and the database).
        """
        digest_key = (digest_secret(self.app.conf) or self.store.digest_key()) if digests else None
        return self._keys.identity(tuple(args or ()), dict(kwargs or {}), idempotency_key, tenant, digest_key)

    # -- producer side ---------------------------------------------------------------------------

    def apply_async(self, args: Any = None, kwargs: Any = None, *a: Any, **options: Any) -> Any:
        """Send the task; refuse at once what a worker would refuse (bad key, non-JSON payload).

        `idempotency_key=` and `tenant=` travel as headers (Celery drops unknown options).
        """
        key = options.pop("idempotency_key", None)
        tenant = options.pop("tenant", None)
        policy = options.pop("on_in_progress", None)
        lease = options.pop("lease", None)
        headers = dict(options.get("headers") or {})
        conf = self.settings()  # a misspelt oncelery_* setting is refused here, at the first call
        if tenant is None and self.tenant is None and not headers.get(HEADER_TENANT):
            resolver = conf.get(CONF_TENANT)
            if resolver is not None:
                if not callable(resolver):
                    raise ConfigurationError(
                        f"app.conf.{CONF_TENANT}={resolver!r}: give a callable (task_name, args, kwargs) -> tenant"
                    )
                tenant = resolver(self.name, tuple(args or ()), dict(kwargs or {})) or None
        if key is not None:
            headers[HEADER_KEY] = validate_key(key)
        if tenant is not None:
            headers[HEADER_TENANT] = validate_key(tenant, "tenant")
        if policy is not None:
            headers[HEADER_ON_IN_PROGRESS] = check_policy(policy, f"{self.name} (this call)")
        if lease is not None:
            headers[HEADER_LEASE] = check_lease(lease, f"{self.name} (this call)")
        if headers:
            options["headers"] = headers
        self._check_at_call_time(args, kwargs, key, tenant, options.get("serializer"))
        return super().apply_async(args, kwargs, *a, **options)

    def _check_at_call_time(
        self, args: Any, kwargs: Any, key: str | None, tenant: str | None, serializer: str | None
    ) -> None:
        # The worker sees the arguments after a round trip through the serializer (kombu's JSON turns a
        # UUID, datetime or Decimal back into that object): derive the identity from the same values here,
        # so what every delivery would refuse is refused in the caller, not acked in a worker at 3 a.m.
        content_type, encoding, body = dumps(
            (list(args or ()), dict(kwargs or {})), serializer=serializer or self.serializer
        )
        accept = prepare_accept_content(self.app.conf.accept_content)
        seen_args, seen_kwargs = loads(body, content_type, encoding, accept=accept)
        try:
            self._keys.bind(seen_args, seen_kwargs)
        except ConfigurationError:
            # A chain link gets its first argument from the previous link, in the worker: checked there.
            return
        self.identity_of(seen_args, seen_kwargs, key, tenant, digests=False)
        self.version_of(seen_args, seen_kwargs)

    # -- worker side -----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the body at most once per key: claim, execute or answer from the stored result."""
        top = self.request_stack.top
        if top is not None and not top.called_directly:
            return self._guarded(args, kwargs, direct=False)
        # Called directly (not by a worker): give it a request of its own, as Task.__call__ does.
        _task_stack.push(self)
        self.push_request(args=args, kwargs=kwargs)
        try:
            return self._guarded(args, kwargs, direct=True)
        finally:
            self.pop_request()
            _task_stack.pop()

    def _guarded(self, args: tuple[Any, ...], kwargs: dict[str, Any], direct: bool) -> Any:
        headers = self.request.headers or {}
        if pass_through():
            return self._pass_through(args, kwargs)
        explicit = {name: headers[name] for name in _CALL_HEADERS if headers.get(name) is not None}
        # What a replay from the dead-letter queue (or a sweeper) sends again: the arguments and key headers.
        message: dict[str, Any] = {"args": list(args), "kwargs": kwargs, "headers": explicit}
        req = self.request
        queue = (req.delivery_info or {}).get("routing_key")
        if queue:
            message["queue"] = queue
        # A chain link's continuation: a replayed or swept link goes on down its pipeline.
        for option, value in (("chain", req.chain), ("link", req.callbacks), ("link_error", req.errbacks)):
            if value:
                message[option] = value
        try:
            ident, entity, version = self._identify(args, kwargs, explicit, message)
        except StoreError as exc:  # e.g. the digest secret could not be read: a store fault, not a bad message
            return after_store_fault(exc, f"before claiming {self.name}", can_resend(self, direct), self._send_again)
        kept = message if self._keeps_messages() else None
        try:
            lease, policy = self.lease_for(explicit), self.policy_for(explicit)
        except ConfigurationError as exc:  # a bad setting: no delivery can run until it is fixed
            logger.error("%s: %s", self.name, exc)
            raise
        abandoned = headers.get(HEADER_ABANDONED)
        delivery = Delivery(
            self,
            ident,
            entity,
            kept,
            direct,
            self._send_again,
            letter=message,
            version=version,
            abandoned=abandoned,
            lease=lease,
            policy=policy,
        )
        return delivery.run(args, kwargs)

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

    def _identify(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], explicit: dict[str, str], message: Any
    ) -> tuple[Identity, str | None, EntityVersionOf | None]:
        """The delivery's identity, entity and version; a message without them is dead-lettered, with why."""
        try:
            ident = self.identity_of(args, kwargs, explicit.get(HEADER_KEY), explicit.get(HEADER_TENANT))
            entity = self._concurrency_keys.identity(args, kwargs).key if self._concurrency_keys else None
            version = self.version_of(args, kwargs)
        except StoreError:
            raise
        except OnceleryError as exc:
            # No run can hold a delivery without an identity; it can never succeed: dead-letter it, say why.
            logger.error("%s: refused a delivery whose identity cannot be derived: %s", self.name, exc)
            fault_point("dead_letter", task=self.name, key=None)
            self.store.letter_without_run(self.name, explicit.get(HEADER_TENANT, ""), BAD_MESSAGE, str(exc), message)
            raise
        return ident, entity, version

    def _keeps_messages(self) -> bool:
        if self.store_message is not None:
            return bool(self.store_message)
        app_wide = self.settings().get(CONF_STORE_MESSAGE)
        if app_wide is not None:
            return bool(app_wide)
        return str(self.app.conf.broker_url or "").startswith("filesystem://")

    def _send_again(self, exc: BaseException | None, abandoned: str | None = None) -> Any:
        """Re-send this message with backoff, without spending the task's max_retries, and ack this one.

        `abandoned`: the owner this delivery claimed as before a store fault; the re-send names it, so
        taking its run over is not counted as a lost delivery (a poison message).
        """
        req = self.request
        headers = dict(req.headers or {})
        waits = int(headers.get(HEADER_WAITS, 0))
        headers[HEADER_WAITS] = waits + 1
        if abandoned is not None:
            headers[HEADER_ABANDONED] = abandoned
        delay = wait_backoff(waits)
        # Same task id and the same `retries` count: waiting on a live holder is not a failure.
        sig = self.signature_from_request(req, countdown=delay, retries=req.retries, headers=headers)
        # Sent as it came, without apply_async's caller-side checks: they passed when it was first sent (so
        # each wait would only repeat them), and a message that fails them (no identity) must still go back.
        options = dict(self._get_exec_options(), **sig.options)
        self.app.send_task(self.name, sig.args, sig.kwargs, task_type=self, result_cls=self.AsyncResult, **options)
        if exc is None:
            # A wait (or a lost lease answered by the new holder) is not a failure: Ignore makes the worker ack
            # this delivery without a task-retried event (which Flower shows with a traceback); the caller's
            # result stays pending until the copy just sent decides it.
            raise Ignore()
        # A store fault: Retry makes the worker ack this delivery and mark the task RETRY, with the error.
        raise Retry(exc=exc, when=delay, sig=sig)

    def retry(self, args: Any = None, kwargs: Any = None, exc: BaseException | None = None, *a: Any, **kw: Any) -> Any:
        """Celery's retry, except that an error which can never succeed is raised at once (the run goes DEAD).

        Covers autoretry_for=(Exception,) too: a dead_on error (or StepMismatch, ResultNotJSON, a
        ConfigurationError) is not retried max_retries times for nothing.
        """
        if exc is not None and isinstance(exc, NEVER_SUCCEED + tuple(self.dead_on)):
            raise_with_context(exc)
        return super().retry(args, kwargs, exc, *a, **kw)

    def tell_caller(self, outcome: Outcome, ident: Identity, token: int | None = None, note: str = "") -> None:
        """Publish this delivery's outcome: a task event for Flower, and `outcome_of(result)` for the caller.

        The event `task-<outcome>` (e.g. task-replayed) carries outcome, key, tenant and token as fields.
        Flower shows only Celery's standard fields, so its `kwargs` field also gets a line saying what Oncelery
        decided (after the task's own kwargs): every Flower page that lists kwargs shows the outcome.
        """
        req = self.request
        if getattr(req, "is_eager", False) or getattr(req, "called_directly", True):
            return
        decided = f"{outcome.value} key={ident.key}"
        if ident.tenant:
            decided += f" tenant={ident.tenant}"
        if token is not None:
            decided += f" token={token}"
        if note:
            decided += f" ({note})"
        fields: dict[str, Any] = {"outcome": outcome.value, "key": ident.key, "tenant": ident.tenant, "token": token}
        if outcome is Outcome.IN_PROGRESS:
            # A wait is not a failure: no exception, no traceback; the result column says what happens next.
            fields.update(exception=None, traceback=None, result=f"oncelery: {decided}")
        self._announce(f"task-{outcome.value}", decided, fields, outcome.value)
        if not self.ignore_result:
            tell_caller(self.backend, req.id, outcome, ident.key, ident.tenant, token)

    def _announce(self, event: str, decided: str, fields: dict[str, Any], label: str) -> None:
        """Send task event `event` with `fields`, `decided` after the task's own kwargs, `label` after its name.

        Flower displays only Celery's standard fields, and its task list only name, state and times: so the
        name reads "shop.charge [replayed]" in the list, and the task page's kwargs row says the whole decision.
        """
        req = self.request
        # Only where task events are on (worker_send_task_events, as for Flower): else no extra publish per job.
        if not req.id or not self.send_events or not self.app.conf.worker_send_task_events:
            return
        own = req.kwargsrepr if getattr(req, "kwargsrepr", None) else saferepr(req.kwargs or {})
        try:
            self.send_event(event, **fields, kwargs=f"{own} | oncelery: {decided}", name=f"{self.name} [{label}]")
        except Exception as exc:  # monitoring must never fail the job
            logger.debug("could not send the %s event of %s: %s", event, req.id, exc)

    def attach(self, ctx: RunContext) -> None:
        """Make `ctx` the live run of this delivery (what step() and effects() use)."""
        setattr(self.request, _RUN_ATTR, ctx)

    def detach(self, ctx: RunContext) -> None:
        """Forget `ctx` once its delivery has ended."""
        if getattr(self.request, _RUN_ATTR, None) is ctx:
            setattr(self.request, _RUN_ATTR, None)

    # -- inside the body -------------------------------------------------------------------------

    def max_lease_seconds(self) -> float | None:
        """The bound on lease renewal: max_lease, else the task's (or app's) hard, then soft, time limit."""
        conf = self.app.conf
        for value in (
            self.max_lease,
            self.time_limit,
            self.soft_time_limit,
            conf.get("task_time_limit"),
            conf.get("task_soft_time_limit"),
        ):
            if value:
                return float(value)
        return None

    def run_context(self) -> RunContext:
        """Return the live run of this thread's current delivery, or raise if called outside the body."""
        ctx: RunContext | None = getattr(self.request, _RUN_ATTR, None)
        if ctx is None:
            raise ConfigurationError(f"{self.name}: effects()/step() can only be used inside the task body")
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
        return ctx.steps.run(name, fn, args, kwargs, step_meta, rerun_on_change)

    @property
    def run_id(self) -> int:
        """The id of the task_runs row this delivery holds (e.g. for a `generated_by_run_id` column)."""
        return self.run_context().claim.run_id

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

    def outcome_counts(self) -> dict[str, int]:
        """Return this task's exact delivery outcome counts across all processes."""
        return self.store.outcome_counts(self.name)
