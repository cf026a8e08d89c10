"""What an idempotent task declares (its options) and how one call resolves them.

Checked at decoration time (a bad option fails there, not at 3 a.m.); per call, a call's own option wins over
the task's, which wins over the app's (`app.conf.oncelery_*`), which wins over the default.
"""

from __future__ import annotations

import inspect
from functools import cached_property
from typing import Any

from celery import Task

from oncelery.basetask.debounce import debounce_keys
from oncelery.basetask.option_checks import check_option_names, validate_options
from oncelery.delivery.replay_cache import ReplayCache, configured_cache
from oncelery.embedded_broker import is_embedded_broker
from oncelery.errors import ConfigurationError
from oncelery.llm.adapters.factory import unbind_factories
from oncelery.runs.claims import RunStore
from oncelery.runs.decisions import EntityVersionOf
from oncelery.runs.keys import CallKey, FingerprintSpec, Identity, KeyBuilder, KeySpec
from oncelery.settings import (
    CONF_KEEP_ARGUMENTS,
    CONF_LEASE,
    CONF_ON_IN_PROGRESS,
    CONF_STORE_MESSAGE,
    CONF_TENANT,
    DEFAULT_LEASE_SECONDS,
    DEFAULT_MAX_DELIVERIES,
    HEADER_LEASE,
    HEADER_ON_IN_PROGRESS,
    HEADER_TENANT,
    check_lease,
    check_policy,
    check_settings,
    digest_secret,
    require_database_url,
)

__all__ = [
    "CALL_OPTIONS",
    "TASK_OPTIONS",
    "TaskOptions",
    "check_option_names",  # re-exported from option_checks: its callers import it from here
]


class TaskOptions(Task):  # type: ignore[misc]
    """The options of an IdempotentTask, validated when the task is defined and resolved for each call."""

    #: Template over the bound arguments ("article:{article_id}:v{version}"), a callable taking the
    #: task's arguments, or None for a content-addressed key (HMAC-SHA256 of the task's arguments under the claims
    #: database's identity key).
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
    #: can be sent again. None: app.conf.oncelery_store_message, else only on an embedded broker
    #: (oncelery-fs://, filesystem://: is_embedded_broker), which loses in-flight messages.
    store_message: bool | None = None
    #: Keep the run's arguments after it completes, so `oncelery fork` can run it again (docs/fork.md). None:
    #: app.conf.oncelery_keep_arguments, else False. Kept until retention (oncelery_kept_arguments_retention, 7d).
    keep_arguments: bool | None = None
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
    #: The provider adapter `self.llm()` calls (oncelery.llm: OpenAIResponses, OpenAIChat, AnthropicMessages),
    #: or a factory making one once per worker process: a zero-argument callable (`lambda: OpenAIResponses()`,
    #: or the class), or one taking the task; per call: self.llm(..., adapter=...).
    llm_adapter: Any = None
    #: A synchronous model call whose holder died mid-call may have been made: False sends it again (labelled
    #: sync_unknown in the ledger); True dead-letters the run for a person (CallOutcomeUnknown). Per call too.
    llm_at_most_once: bool = False
    #: A response the provider no longer has (404, past its retention): "recall" sends it again (labelled
    #: lost), "dead_letter" dead-letters the run (ResponseLost). Per call too.
    llm_on_lost: str = "recall"
    #: Seconds a delivery polls a background model call before it parks the run WAITING and frees its worker
    #: slot (the relay wakes it; a woken delivery polls once, then parks again). None blocks until the call
    #: ends, holding the slot. Per call too: self.llm(..., inline_wait=...).
    llm_inline_wait: float | None = 5.0
    #: The most one job (one run, across its retries and redeliveries) may spend on model calls, in USD: each
    #: call reserves its estimate before it is sent, and a call that does not fit raises BudgetExceeded (the run
    #: is dead-lettered; docs/limits.md). None: no cap. Per call too: self.llm(..., max_cost_usd=...) caps one call.
    max_cost_usd: Any = None
    #: Over a day or month budget (oncelery_budgets): "dead_letter" (BudgetExceeded) or "defer" (the run waits
    #: WAITING until the window resets, holding no worker slot). A job's own cap always dead-letters.
    on_budget: str = "dead_letter"
    #: The models this task's self.llm() calls use (e.g. ("gpt-4.1-mini",)): under a budget, a worker refuses to
    #: start if one has no price (oncelery_prices, the price file), instead of dead-lettering its first call.
    llm_models: tuple[str, ...] = ()
    #: The default BatchPolicy of this task's self.llm(..., mode="batch") calls (None: BatchPolicy()).
    llm_batch: Any = None
    #: Answer a duplicate `.delay()` from the claims database instead of publishing it, where the producer has one
    #: configured (oncelery.basetask.producer). None: app.conf.oncelery_producer_dedupe, else True. Per call too:
    #: apply_async(..., producer_dedupe=False).
    producer_dedupe: bool | None = None
    #: The provider's batch API the relay's batcher submits this task's batch items to (an adapter, or a factory
    #: as for llm_adapter), e.g. oncelery.llm.adapters.batch.OpenAIBatches(base_url, api_key).
    llm_batch_adapter: Any = None
    #: oncelery.Debounce(key="doc:{doc_id}", period=30, max_wait=300, on_running="supersede"): the calls of one key
    #: within `period` s of each other make one run, on the latest call's arguments (docs/debounce.md). Needs the
    #: claims database at the producer (else its calls publish undebounced).
    debounce: Any = None

    def __init__(self) -> None:
        super().__init__()
        if type(self).run is not Task.run:
            validate_options(self, TASK_OPTIONS)
            # Celery hands a function given as an option back bound to the task: a factory must not get the task.
            unbind_factories(self)

    # -- configuration ---------------------------------------------------------------------------

    @cached_property
    def _keys(self) -> KeyBuilder:
        return KeyBuilder(
            self.run, self.name or "", self._option("idempotency_key"), self.fingerprint, self._option("tenant")
        )

    def names_its_key(self) -> bool:
        """Whether this task derives its key from its arguments by a template or callable of its own."""
        return self._keys.key_spec is not None

    @cached_property
    def _concurrency_keys(self) -> KeyBuilder | None:
        if self.concurrency_key is None:
            return None
        return KeyBuilder(self.run, self.name or "", self._option("concurrency_key"), None, what="concurrency_key")

    @cached_property
    def _debounce_keys(self) -> KeyBuilder:
        return debounce_keys(self)

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
        entity, before = self._entity_keys.named(args, kwargs)
        return EntityVersionOf(entity, version, before)

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

    def replay_cache(self) -> ReplayCache | None:
        """The app's replay cache (app.conf.oncelery_replay_cache, else $ONCELERY_REPLAY_CACHE), or None if off."""
        conf = self.settings()
        seen = self.__dict__.get("_replay_cache")
        if seen is None or seen[0] is not conf:  # read once per app configuration: this is on every delivery
            seen = (conf, configured_cache(conf, require_database_url(conf, f"Task {self.name}")))
            self.__dict__["_replay_cache"] = seen
        return seen[1]  # type: ignore[no-any-return]

    def entry_tenant(self, args: Any, kwargs: Any, tenant: str | None, headers: Any = None) -> str | None:
        """The tenant a job carries from the door it enters by, resolved once: the per-call option, else one the
        message already carries, else None where the task derives its own (its `tenant` option), else the app's
        resolver (`app.conf.oncelery_tenant`). Re-sends carry what was resolved here and never call this again.
        """
        if tenant is not None:
            return tenant
        carried = (headers or {}).get(HEADER_TENANT)
        if carried is not None:
            return str(carried)
        if self.tenant is not None:
            return None  # the task's own template or callable derives it from the arguments, in every delivery
        resolver = self.settings().get(CONF_TENANT)
        if resolver is None:
            return None
        if not callable(resolver):
            raise ConfigurationError(
                f"app.conf.{CONF_TENANT}={resolver!r}: give a callable (task_name, args, kwargs) -> tenant"
            )
        # "" (no tenant) is an answer too: carried as such, a re-send (a retry) never asks the resolver again.
        return resolver(self.name, tuple(args or ()), dict(kwargs or {})) or ""

    def key_of(
        self, args: Any = (), kwargs: Any = None, idempotency_key: str | None = None, tenant: str | None = None
    ) -> CallKey:
        """Return the key and tenant of a call, refusing what a worker would; needs no database (a producer's check).

        A content-addressed key is None here: it is keyed with the claims database's identity key, in the worker.
        """
        return self._keys.call_key(tuple(args or ()), dict(kwargs or {}), idempotency_key, tenant)

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

        The fingerprint and a content-addressed key are keyed with the claims database's identity key (read from
        the database, generated there once). Per-field digests are keyed with ONCELERY_DIGEST_KEY, else with the
        secret the claims database generated (`digests=False` skips them). Without a database, see key_of().
        """
        store = self.store
        digest_key = (digest_secret(self.app.conf) or store.digest_key()) if digests else None
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        return self._keys.identity(args, kwargs, idempotency_key, tenant, digest_key, store.identity_key())

    def _keeps_arguments(self) -> bool:
        if self.keep_arguments is not None:
            return bool(self.keep_arguments)
        return bool(self.settings().get(CONF_KEEP_ARGUMENTS, False))

    def _keeps_messages(self) -> bool:
        if self.store_message is not None:
            return bool(self.store_message)
        conf = self.settings()
        app_wide = conf.get(CONF_STORE_MESSAGE)
        if app_wide is not None:
            return bool(app_wide)
        # Celery's broker_url property is costly (environment, aliases) and is read once per app configuration.
        seen = self.__dict__.get("_filesystem_broker")
        if seen is None or seen[0] is not conf:
            seen = (conf, is_embedded_broker(conf.broker_url))
            self.__dict__["_filesystem_broker"] = seen
        return bool(seen[1])


#: The options a task declares (TaskOptions' annotated attributes), as @app.task(...) keywords.
TASK_OPTIONS: tuple[str, ...] = tuple(TaskOptions.__annotations__)
#: The options one call may give apply_async (each travels as a header, but producer_dedupe, which is used where the
#: call is made); Celery drops other unknown ones.
CALL_OPTIONS: tuple[str, ...] = ("idempotency_key", "tenant", "on_in_progress", "lease", "producer_dedupe")
