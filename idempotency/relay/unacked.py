"""A dead holder's job back from Redis's unacked hash, as soon as its lease has expired by the database clock.

kombu's Redis transport keeps each delivered, not yet acked message in a hash (`unacked`: delivery tag ->
[message, exchange, routing key]) and puts it back on its queue only once it is older than the visibility
timeout: a worker that is SIGKILLed mid-job leaves its job there for that long (the worker derives it from the
tasks' longest hold, `max_lease + lease`: minutes). The run's lease says sooner that its holder is gone. The
sweeper (inside `oncelery relay`) therefore puts the unacked message of a RUNNING run whose lease expired back
on its queue at once, with kombu's own `restore_by_tag` (a WATCHed transaction: an entry that a worker acks, or
that kombu's sweep restores, meanwhile is restored by nobody or by one of them, never twice).

Why this and not a copy of every message in the run's row: nothing of the payload is kept at rest for it (the
message stays where the broker keeps it anyway), and a restore is idempotent where a re-send is not (the original
comes back once, no second copy). A holder that was only slow (its lease lapsed while it ran) gets its message
redelivered while it still runs: the claim absorbs the copy or fences the old holder out, as with any redelivery.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

import redis

from oncelery.errors import ConfigurationError

__all__ = [
    "on_redis",
    "redis_channel",
    "restore_unacked",
]


def on_redis(app: Any) -> bool:
    """Whether the app's broker is kombu's Redis transport (redis://, rediss://, sentinel://)."""
    conn = app.connection_for_write()
    try:
        return str(getattr(conn.transport, "driver_type", "")) == "redis"
    finally:
        conn.release()


@contextmanager
def redis_channel(app: Any, options: dict[str, Any] | None = None) -> Iterator[Any]:
    """A kombu Redis channel of the app (its transport options, merged with `options`), or ConfigurationError;
    kombu's OperationalError at once when Redis cannot be reached."""
    url = str(app.conf.broker_url or "")
    conn = app.connection_for_write(transport_options=options or {})
    try:
        if str(getattr(conn.transport, "driver_type", "")) != "redis":
            raise ConfigurationError(f"this needs a Redis broker, not {url.split(':')[0]}://")
        conn.ensure_connection(max_retries=1)  # a Redis that is down fails this round at once; the next one retries
        yield conn.default_channel
    finally:
        conn.release()


def restore_unacked(app: Any, task_ids: Collection[str], options: dict[str, Any] | None = None) -> int:
    """Put every unacked message of the Celery tasks `task_ids` back on its queue now (kombu's restore_by_tag);
    return how many. Only for holders known to be gone: a live one's job is then delivered twice."""
    wanted = set(task_ids)
    if not wanted:
        return 0
    restored = 0
    with redis_channel(app, options) as channel:
        client = redis.Redis(connection_pool=channel.pool)
        # One pass over the hash: it holds the fleet's in-flight messages (prefetch x workers), not the queue.
        for tag, payload in client.hscan_iter(channel.global_keyprefix + channel.unacked_key, count=500):
            try:
                message = json.loads(payload)[0]
            except (ValueError, IndexError, TypeError):
                continue  # not kombu's shape: not ours to move
            if isinstance(message, dict) and (message.get("headers") or {}).get("id") in wanted:
                channel.qos.restore_by_tag(tag.decode() if isinstance(tag, bytes) else tag)
                restored += 1
    return restored
