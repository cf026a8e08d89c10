"""What the caller can see: which outcome a delivery had (executed, replayed, resumed, an in-progress wait...).

A Celery result says SUCCESS for an execution and for a replay alike. So the worker writes the delivery's
outcome next to the task's result, in the result backend under the task id (`celery-task-meta-<id>:oncelery`,
with the result's expiry), and `outcome_of(async_result)` reads it back. The last delivery of a task id wins:
an in-progress wait re-sends the same task id, so after `.get()` the outcome is the one that produced the
result. It needs a key-value result backend (Redis, the embedded filesystem backend, memcached...).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from celery import states
from celery.backends.base import BaseKeyValueStoreBackend
from celery.backends.redis import RedisBackend

from oncelery.errors import ConfigurationError
from oncelery.models import Outcome

__all__ = ["outcome_of", "store_answer", "tell_caller"]

logger = logging.getLogger("oncelery.caller")  # a stable name (users filter on it)

_SUFFIX = ":oncelery"


def tell_caller(backend: Any, task_id: str | None, outcome: Outcome, key: str, tenant: str, token: int | None) -> None:
    """Store this delivery's outcome for `outcome_of`; best effort (a backend error never fails the job)."""
    if not task_id or not isinstance(backend, BaseKeyValueStoreBackend):
        return
    value = json.dumps({"outcome": outcome.value, "key": key, "tenant": tenant, "token": token})
    try:
        backend.set(backend.get_key_for_task(task_id, _SUFFIX), value)
    except Exception as exc:  # the outcome is already counted in the database; this is only the caller's view
        logger.warning("could not store the outcome of task %s for its caller: %s", task_id, exc)


def store_answer(
    backend: Any, task_id: str, result: Any, outcome: Outcome, key: str, tenant: str, token: int | None
) -> None:
    """Store a result and its outcome under `task_id` as a worker's delivery would (raises the backend's errors).

    For a call answered where it was made (oncelery.basetask.producer): on Redis both in ONE round trip (a pipeline:
    the meta, its publish for a waiting `.get()`, and the outcome), elsewhere through the backend's own calls.
    """
    if not isinstance(backend, RedisBackend):
        backend.store_result(task_id, result, states.SUCCESS)
        tell_caller(backend, task_id, outcome, key, tenant, token)
        return
    now = backend.app.now().isoformat()
    meta = {"status": states.SUCCESS, "result": result, "traceback": None, "children": [], "date_done": now}
    encoded = backend.encode({**meta, "task_id": task_id})
    told = json.dumps({"outcome": outcome.value, "key": key, "tenant": tenant, "token": token})
    name = backend.get_key_for_task(task_id)
    expires = backend.expires
    with backend.client.pipeline(transaction=False) as pipe:  # no MULTI/EXEC: each entry stands alone
        for entry, value in ((name, encoded), (backend.get_key_for_task(task_id, _SUFFIX), told)):
            if expires:
                pipe.setex(entry, expires, value)
            else:
                pipe.set(entry, value)
        pipe.publish(name, encoded)  # a `.get()` already waiting on this id hears it at once
        pipe.execute()


def outcome_of(result: Any) -> Outcome | None:
    """The outcome of the delivery that produced `result` (an AsyncResult), or None if none was decided yet.

    Executed, resumed (some steps replayed from checkpoints), replayed (the stored result of an earlier run),
    in_progress (waiting for another holder, or skipped), and the refusals: conflict, stale, dead, lease_lost.
    """
    answered = getattr(result, "oncelery_outcome", None)
    if answered is not None:  # a duplicate answered at the producer (task.producer.ProducerReplay): never sent
        return Outcome(answered)
    backend = result.backend
    if not isinstance(backend, BaseKeyValueStoreBackend):
        raise ConfigurationError(
            f"outcome_of needs a key-value result backend (redis://, file://...); this app's is "
            f"{type(backend).__name__}: set result_backend to one, e.g. the Redis you use as the broker"
        )
    raw = backend.get(backend.get_key_for_task(result.id, _SUFFIX))
    if raw is None:
        return None
    return Outcome(json.loads(raw)["outcome"])
