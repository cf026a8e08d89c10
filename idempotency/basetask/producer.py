"""Producer dedupe: `.delay()` of a duplicate is answered from the claims database, and nothing is published.

Where the producer has a claims database configured (app.conf.oncelery_database_url or $ONCELERY_DATABASE_URL; a
web producer without one publishes as ever, and needs no driver), `apply_async` asks it first, in one round trip
on PostgreSQL, with the identity (key, tenant, keyed fingerprint) a worker would derive:

- no run: the call publishes as without the check;
- COMPLETED with the same payload: a `ProducerReplay` holding the stored result is returned, counted `replayed`
  (at_producer), and nothing is published; a chain's next link is sent with the result, as a worker would;
- another payload (any status): IdempotencyConflict is raised at the caller (counted `conflict`, lettered);
- RUNNING with a live lease, or WAITING, and re-sent without this call (it keeps its message, or an outbox row
  will publish it again): the AsyncResult of the run's own task id is returned, and nothing is published;
- anything else (FAILED, DEAD, an expired lease, a run only this message would start again): it publishes.

It never drops a job that nothing else will run: it answers only what the database says is finished, or a run
that the sweeper, the waker or the relay re-sends without this message. Calls it does not judge publish as ever:
links and error links, chords and groups (their counters and callbacks live in the message), Celery's own
retries, tasks with `entity_version` (a stale check first), pass-through mode, and runs stored before keyed
digests. A bounded check: past `oncelery_producer_timeout` (0.25 s) or on any database error the call publishes,
and the producer skips checks for PRODUCER_COOLDOWN seconds, so a database that is down costs one timeout, not
one per call.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from celery import signature, states
from celery.backends.base import DisabledBackend
from celery.result import EagerResult
from sqlalchemy.exc import SQLAlchemyError

from oncelery.basetask.caller import store_answer
from oncelery.delivery.decision_table import conflict_error
from oncelery.errors import ConfigurationError, StoreError
from oncelery.models import Outcome, RunStatus
from oncelery.runs.decisions import ProducerFind
from oncelery.runs.keys import Identity
from oncelery.settings import (
    CONF_PRODUCER_DEDUPE,
    CONF_PRODUCER_TIMEOUT,
    DEFAULT_PRODUCER_TIMEOUT,
    HEADER_KEY,
    HEADER_TENANT,
    PRODUCER_COOLDOWN,
    configured_database_url,
    pass_through,
)
from oncelery.store.dialects import producer_mode

__all__ = [
    "ProducerReplay",
    "answer_at_producer",
    "cooling_down",
    "fail_open",
    "producer_dedupe_on",
    "producer_timeout",
]

logger = logging.getLogger("oncelery.producer")  # a stable name (users filter on it)

# Options that put a call in a canvas whose bookkeeping travels in the message (a group's result set, a chord's
# counter, callbacks), or mark Celery's own retry of a running job: such calls publish as ever.
_PUBLISHED_AS_EVER = ("link", "link_error", "chord", "group_id", "retries")

# Per claims database URL: the monotonic time until which this process publishes without asking (a failed check).
_cooldown: dict[str, float] = {}


class ProducerReplay(EagerResult):  # type: ignore[misc]
    """The result handle of a duplicate answered at the producer: it already holds the stored result.

    `.get()` returns at once; the result is also in the result backend under `id` (where the task keeps
    results), so `AsyncResult(id)` elsewhere sees it, and `outcome_of()` says `replayed`.
    """

    oncelery_outcome = Outcome.REPLAYED

    def __init__(self, task_id: str, result: Any, task_name: str, backend: Any) -> None:
        super().__init__(task_id, result, states.SUCCESS, name=task_name)
        self.backend = backend


def producer_dedupe_on(task: Any, call: bool | None) -> bool:
    """Whether this call is checked at the producer: the call's option, else the task's, else the app's (True)."""
    for value, where in (
        (call, f"{task.name}: apply_async(producer_dedupe=...)"),
        (task.producer_dedupe, f"{task.name}: producer_dedupe="),
        (task.settings().get(CONF_PRODUCER_DEDUPE), f"app.conf.{CONF_PRODUCER_DEDUPE}"),
    ):
        if value is None:
            continue
        if not isinstance(value, bool):
            raise ConfigurationError(f"{where}{value!r}: give True or False")
        return value
    return True


def answer_at_producer(
    task: Any, args: list[Any], kwargs: dict[str, Any], headers: dict[str, Any], options: dict[str, Any]
) -> Any:
    """A result handle for a call the claims database answers (nothing is published), else None: publish it.

    `args`, `kwargs`: the call's arguments as a worker will see them (after the serializer's round trip).
    Raises IdempotencyConflict for a key first used with another payload; never raises a store error.
    """
    conf = task.settings()
    url = configured_database_url(conf)
    if url is None or pass_through() or task.entity_version is not None:
        return None
    if any(options.get(name) is not None for name in _PUBLISHED_AS_EVER):
        return None
    if cooling_down(url):
        return None
    timeout = producer_timeout(conf)
    try:
        store = task.store
        if store.legacy.possible():
            return None  # runs stored before keyed digests: the worker's legacy lookup decides
        ident: Identity = task._keys.identity(
            tuple(args), kwargs, headers.get(HEADER_KEY), headers.get(HEADER_TENANT), None, store.identity_key()
        )
        found = store.producer_find(task.name, ident, producer_mode(timeout))
    except (StoreError, SQLAlchemyError, OSError) as exc:
        fail_open(url, task.name, exc)
        return None
    if found is None:
        return None
    if found.fingerprint != ident.fingerprint:
        if ident.same_payload(found.fingerprint):
            return None  # fingerprinted before digests were keyed: the worker's claim compares that form
        _conflict(task, args, kwargs, headers, ident)
    if found.counted:
        return _replayed(task, found, ident, options)
    return _in_progress(task, found, headers, options)


def _replayed(task: Any, found: ProducerFind, ident: Identity, options: dict[str, Any]) -> Any:
    """A COMPLETED run's answer, already counted: stored for the caller's task id, and a chain goes on."""
    task_id = options.get("task_id") or str(uuid.uuid4())
    backend = task.backend
    if not _ignores_result(task, options) and not isinstance(backend, DisabledBackend):
        try:
            # What a worker would have stored for this task id: a poller elsewhere (AsyncResult(id)) sees it too.
            store_answer(backend, task_id, found.result, Outcome.REPLAYED, ident.key, ident.tenant, found.token)
        except Exception as exc:  # the replay is counted and its result is in the handle: never publish now
            logger.warning("%s: could not store the replayed result of task %s: %s", task.name, task_id, exc)
    chain = options.get("chain")
    if chain:
        # What a worker does after a link: send the next one with this link's result (celery.app.trace).
        root_id = options.get("root_id") or task_id
        nxt = signature(chain[-1], app=task.app)
        nxt.apply_async(
            (found.result,), chain=chain[:-1], parent_id=task_id, root_id=root_id, priority=options.get("priority")
        )
    logger.debug("%s[%s]: answered at the producer from run %d", task.name, ident.key, found.run_id)
    return ProducerReplay(task_id, found.result, task.name, backend)


def _in_progress(task: Any, found: ProducerFind, headers: dict[str, Any], options: dict[str, Any]) -> Any:
    """The AsyncResult of a run in progress that is re-sent without this call's message, else None: publish."""
    live = (found.status is RunStatus.RUNNING and found.lease_live) or found.status is RunStatus.WAITING
    if not (live and found.recoverable and found.celery_task_id):
        return None  # FAILED, DEAD, an expired lease, or a run only this message would start again
    if options.get("chain"):
        return None  # the caller holds the last link's handle: the worker's wait sends the chain on
    if options.get("task_id") not in (None, found.celery_task_id):
        return None  # the caller holds a handle of its own task id, which only a delivery would resolve
    if task.policy_for(headers) != "retry":
        return None  # "skip" and "raise" are answers a delivery gives: it decides them
    return task.AsyncResult(found.celery_task_id)


def _conflict(task: Any, args: list[Any], kwargs: dict[str, Any], headers: dict[str, Any], ident: Identity) -> None:
    """Raise the IdempotencyConflict a worker would (naming the fields that differ), counted and lettered."""
    try:
        # With its field digests, to name the fields; then counted `conflict` with one redacted letter, as a worker.
        full = task.identity_of(args, kwargs, headers.get(HEADER_KEY), headers.get(HEADER_TENANT))
        stored = task.store.get(task.name, full.key, full.tenant)
        conflict = conflict_error(task.name, full, stored.field_digests if stored is not None else {})
        message = {"args": list(args), "kwargs": kwargs, "headers": {k: v for k, v in headers.items() if v}}
        task.store.letter_conflict(task.name, full, str(conflict), conflict.fields, message)
    except (StoreError, SQLAlchemyError, OSError) as exc:
        # The other payload is certain (the check read it); only the fields' names and the count are missing.
        logger.warning("%s: could not count a conflict answered at the producer: %s", task.name, exc)
        raise conflict_error(task.name, ident, {}) from exc
    raise conflict


def _ignores_result(task: Any, options: dict[str, Any]) -> bool:
    ignore = options.get("ignore_result")
    return bool(task.ignore_result if ignore is None else ignore)


def producer_timeout(conf: Any) -> float:
    """The bound in seconds of a producer's database work (`oncelery_producer_timeout`, validated)."""
    value = conf.get(CONF_PRODUCER_TIMEOUT)
    if value is None:
        return DEFAULT_PRODUCER_TIMEOUT
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 30:
        raise ConfigurationError(
            f"app.conf.{CONF_PRODUCER_TIMEOUT}={value!r}: give seconds in (0, 30] (e.g. {DEFAULT_PRODUCER_TIMEOUT})"
        )
    return float(value)


def cooling_down(url: str) -> bool:
    """Whether producer work on `url` is skipped for now (its database failed a check moments ago)."""
    return _cooldown.get(url, 0.0) > time.monotonic()


def fail_open(url: str, task_name: str, exc: BaseException) -> None:
    """Publish as without the check, and skip checks for a while: a database that is down costs one timeout."""
    if _cooldown.get(url, 0.0) <= time.monotonic():
        logger.warning(
            "%s: the claims database did not answer the producer's check (%s); publishing, and publishing without "
            "checks for %gs",
            task_name,
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            PRODUCER_COOLDOWN,
        )
    _cooldown[url] = time.monotonic() + PRODUCER_COOLDOWN
