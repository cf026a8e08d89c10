"""The outbox's write side, and the one way a stored job goes back on the broker.

`enqueue` writes a job into the `outbox` table in the caller's transaction (the public `oncelery.outbox` is its
facade); `send_keyed` publishes a stored job with its key and tenant as headers, for the relay, the sweeper and a
dead-letter replay alike.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from celery import Celery, Signature
from sqlalchemy import Connection, insert
from sqlalchemy.orm import Session

from oncelery.basetask.idempotent import IdempotentTask
from oncelery.errors import ConfigurationError, ForkRefused
from oncelery.models import OutboxStatus
from oncelery.runs.faults import fault_point
from oncelery.runs.forks import stored_fork_headers
from oncelery.runs.keys import validate_key
from oncelery.runs.legacy import stored_names
from oncelery.settings import FORK_KEY_PREFIX, HEADER_FORK, HEADER_KEY, HEADER_TENANT, HEADER_WOKEN
from oncelery.store.tables import OUTBOX

# The outbox's logger: a job that could not be sent again is the outbox's story.
logger = logging.getLogger("oncelery.outbox")

# Message options that continue a pipeline after a link (kept with a run's message by the task).
CONTINUATION = ("chain", "link", "link_error")
# apply_async options an outbox row can carry (JSON values, meaningful at publish time).
ALLOWED_OPTIONS = (
    "queue",
    "routing_key",
    "exchange",
    "priority",
    "countdown",
    "expires",
    "headers",
    "link",
    "link_error",
    "chain",  # a chain link's continuation (what a dead-letter replay of a pipeline link carries)
)
KEY_PREFIX = "outbox:"

__all__ = ["ALLOWED_OPTIONS", "CONTINUATION", "KEY_PREFIX", "enqueue", "resend_kept", "send_keyed"]


def enqueue(session: Session | Connection, task: Any, *args: Any, **kwargs: Any) -> str:
    """Write a job into the outbox in `session`'s transaction; it is published iff that transaction commits.

    `task` is a task or a signature (`task.s(...).set(queue=..., idempotency_key=..., tenant=...)`); `args`
    and `kwargs` are the task's. Returns the Celery task id the job will have (follow it with AsyncResult).
    The key every publish carries: the call's `idempotency_key`, else the task's own key template, else the
    row's identity (`outbox:<task id>`).
    """
    sig = task.clone(args, kwargs) if isinstance(task, Signature) else task.s(*args, **kwargs)
    name = str(sig.task)
    options = dict(sig.options)
    key = options.pop("idempotency_key", None)
    tenant = options.pop("tenant", None)
    unknown = sorted(set(options) - set(ALLOWED_OPTIONS) - {"task_id"})
    if unknown:
        raise ConfigurationError(
            f"outbox.enqueue({name}): options {unknown} cannot be stored in the outbox; "
            f"use {', '.join(ALLOWED_OPTIONS)} (countdown instead of eta)"
        )
    task_id = str(options.pop("task_id", None) or uuid.uuid4())
    call_args, call_kwargs = list(sig.args), dict(sig.kwargs)
    _require_json(name, {"args": call_args, "kwargs": call_kwargs, "options": options})
    headers = options.get("headers")
    if isinstance(key, str) and key.startswith(FORK_KEY_PREFIX) and HEADER_FORK not in (headers or {}):
        # The fork command's namespace: only a fork's own re-send (a dead-letter replay) carries its header, and
        # the worker still checks that fork's tenant, task and key against the call's.
        raise ForkRefused.reserved(name, key)
    key, tenant = _key_of(session, sig, name, task_id, call_args, call_kwargs, key, tenant, headers)
    row = {
        "task_name": name,
        "args": call_args,
        "kwargs": call_kwargs,
        "options": options,
        "celery_task_id": task_id,
        "idempotency_key": key,
        "tenant": tenant or "",
        "status": OutboxStatus.PENDING,
    }
    session.execute(insert(OUTBOX).values(**row))
    return task_id


def _key_of(
    session: Session | Connection,
    sig: Signature,
    name: str,
    task_id: str,
    args: list[Any],
    kwargs: dict[str, Any],
    key: str | None,
    tenant: str | None,
    headers: Any,
) -> tuple[str | None, str | None]:
    """The key and tenant every publish carries (checked now: a bad one never reaches the table).

    The key the worker claims under, so the relay's join finds its run: the task's own derivation (no digest: a
    content-addressed task's rows carry `outbox:<task id>`), or the old form a run stored before the upgrade holds.
    """
    target = sig.type if name in sig.app.tasks else None
    if not isinstance(target, IdempotentTask):
        # A plain task has no claim to absorb a copy: it is never re-published for a lost run, but a relay killed
        # between publishing and marking its row sent publishes it again (at least once, never lost).
        return (validate_key(key) if key is not None else None), tenant
    if key is None and target.idempotency_key is None:
        key = KEY_PREFIX + task_id  # the row's identity
    # Resolved here, in the caller's context, once: the relay (no caller) sends the row's stored tenant.
    tenant = target.entry_tenant(args, kwargs, tenant, headers)
    call = target.key_of(args, kwargs, key, tenant)
    target.version_of(args, kwargs)
    return stored_names(session, name, call)


def _require_json(name: str, value: Any) -> None:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"outbox.enqueue({name}): the arguments and options must be JSON ({exc}); "
            f"convert objects (e.g. str(uuid), isoformat()) before enqueueing"
        ) from exc


def send_keyed(
    app: Celery,
    task_name: str,
    args: Any,
    kwargs: Any,
    task_id: str,
    key: str | None,
    tenant: str,
    options: dict[str, Any],
    retry: bool = True,
) -> Exception | None:
    """Send a stored job with its key and tenant as headers (a copy is absorbed by the claim).

    Returns None once sent, else the error (the caller keeps the job and tries again later). The one way
    the relay, the sweeper and a dead-letter replay put a job back on the broker.
    """
    options = dict(options)
    headers = dict(options.pop("headers", None) or {})
    if key is not None:
        headers[HEADER_KEY] = key
        if tenant:
            headers[HEADER_TENANT] = tenant
    try:
        fault_point("publish", task_name=task_name, key=key)  # a test's broker refusal is handled as a real one
        app.send_task(
            task_name,
            args=list(args or ()),
            kwargs=dict(kwargs or {}),
            task_id=task_id,
            headers=headers,
            retry=retry,
            **options,
        )
    except Exception as exc:  # any broker/transport error: the caller's job stays where it is
        logger.warning("could not send %s[%s]: %s", task_name, key, exc)
        return exc
    return None


def resend_kept(app: Celery, row: Any, woken: bool = False) -> int:
    """Send a run's kept message again under its key, with its queue, headers and continuation (and, when
    `woken`, the header that makes the delivery poll its call once); 1 if it was sent, 0 if the broker is down."""
    message = row.message if isinstance(row.message, dict) else {}
    # Where it ran, what follows it in a pipeline, and the headers it came with.
    options = {name: message[name] for name in ("queue", "headers", *CONTINUATION) if message.get(name)}
    headers = stored_fork_headers(row.idempotency_key, options.get("headers"))
    if woken:  # the woken delivery polls its call once (HEADER_WOKEN), then parks again if it is not done
        headers[HEADER_WOKEN] = 1
    if headers:
        options["headers"] = headers
    job = (row.task_name, message.get("args"), message.get("kwargs"), row.celery_task_id)
    # A broker that is down: the next sweep after the interval tries again.
    return int(send_keyed(app, *job, row.idempotency_key, row.tenant, options) is None)
