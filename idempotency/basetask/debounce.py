"""The producer side of debounce: `.delay()` of a debounced task records the edit, and publishes nothing.

The task's `debounce=Debounce(key=..., period=..., max_wait=..., on_running=...)` (runs/debounce.py) names the
key edits are grouped by. Where the producer has a claims database configured, each call upserts that key's row
(one statement, the database's clock) and returns `AsyncResult(<the burst's task id>)`: every call of one burst
returns the same handle, the handle of the one run that will carry the burst's latest edit. The relay's
dispatcher (relay/debounce.py) sends that run through the outbox once the burst is due.

Fails open, as every producer check: with no claims database configured, on a store error or a canvas call
(link, chain, a chosen task id, a countdown), the call publishes as an undebounced call does (logged). The upsert
is bounded by `oncelery_producer_timeout` (PostgreSQL's statement_timeout, lock waits included; its commit stays
durable); past it, the producer publishes undebounced and skips its database work for a few seconds, as the
producer's dedupe check does (basetask/producer.py).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from celery.result import AsyncResult
from sqlalchemy.exc import SQLAlchemyError

from oncelery.basetask.producer import cooling_down, fail_open, producer_timeout
from oncelery.errors import ConfigurationError, StoreError
from oncelery.runs.debounce import Debounce, upsert_edit
from oncelery.runs.keys import KeyBuilder
from oncelery.settings import HEADER_KEY, HEADER_TENANT, configured_database_url, pass_through

__all__ = ["DebouncedResult", "debounce_keys", "send_debounced"]

logger = logging.getLogger("oncelery.debounce")  # a stable name (users filter on it)

# Calls whose bookkeeping lives in the message or that the caller schedules itself: published as ever.
_PUBLISHED_AS_EVER = ("link", "link_error", "chain", "chord", "group_id", "retries", "task_id", "countdown", "eta")


class DebouncedResult(AsyncResult):  # type: ignore[misc]
    """The handle of a debounced call: the run that will carry its burst's latest edit (`debounce_seq`: this
    call's edit). If a newer edit arrives after the burst was sent and before its run starts, that run is acked
    `debounced` (its `.get()` returns None): the newer call's handle carries the latest version."""

    debounce_seq: int = 0


def debounce_keys(task: Any) -> KeyBuilder:
    """The KeyBuilder of the task's debounce key, validated at decoration time (a bad template fails there)."""
    spec = task.debounce
    return KeyBuilder(task.run, task.name or "", spec.key, None, what="debounce key")


def check_debounce(task: Any) -> None:
    """Raise ConfigurationError (naming the fix) for a debounce option that is not a valid Debounce."""
    spec = task.debounce
    if not isinstance(spec, Debounce):
        raise ConfigurationError(
            f"{task.name}: debounce={spec!r}; give oncelery.Debounce(key='doc:{{doc_id}}', period=30, max_wait=300)"
        )
    spec.check(f"{task.name}: debounce")
    _ = task._debounce_keys


def send_debounced(
    task: Any, args: list[Any], kwargs: dict[str, Any], headers: dict[str, Any], options: dict[str, Any]
) -> DebouncedResult | None:
    """Record this call as the latest edit of its debounce key; return its burst's handle, or None: publish it.

    `args`, `kwargs`: the call's arguments as a worker will see them (after the serializer's round trip).
    """
    conf = task.settings()
    url = configured_database_url(conf)
    if url is None or pass_through():
        logger.warning("%s: no claims database configured at this producer: published without debounce", task.name)
        return None
    if any(options.get(name) is not None for name in _PUBLISHED_AS_EVER):
        return None
    if cooling_down(url):
        return None  # its database failed moments ago: publish at once rather than wait out the bound again
    bound_ms = max(1, round(producer_timeout(conf) * 1000))
    spec: Debounce = task.debounce
    key = task._debounce_keys.named(args, kwargs)[0]
    try:
        store = task.store
        # The edit's idempotency key (content-addressed ones need the database's identity key): a run in flight is
        # superseded only by an edit of another key, since an edit of its own key is the job it is doing.
        ident = task._keys.identity(
            tuple(args), kwargs, headers.get(HEADER_KEY), headers.get(HEADER_TENANT), None, store.identity_key()
        )
        call = (args, kwargs, headers)
        edit = upsert_edit(
            store.db, task.name, ident.tenant, key, call, spec, str(uuid.uuid4()), bound_ms, edit_key=ident.key
        )
    except (StoreError, SQLAlchemyError, OSError) as exc:
        logger.warning("%s[%s]: the debounce row was not written (%s): published without debounce", task.name, key, exc)
        fail_open(url, task.name, exc)
        return None
    logger.debug("%s[%s]: edit %d of burst %s", task.name, key, edit.seq, edit.task_id)
    handle = DebouncedResult(edit.task_id, backend=task.backend, task_name=task.name, app=task.app)
    handle.debounce_seq = edit.seq
    return handle
