"""The test kit and the Redis broker: the short recovery timeouts of its workers, putting a dead holder's job
back at once, and emptying one app's queues (never the whole Redis database, which others may share).

The keys are kombu's Redis transport's (kombu/transport/redis.py), named by a channel opened with the app's own
transport options, so a global_keyprefix, priority_steps or a `sep` of the app's are honoured:

    <queue>, <queue><sep><priority>   the queue's lists, one per priority step (step 0 is the bare name)
    _kombu.binding.<exchange>         a set of "<routing key><sep><pattern><sep><queue>" members (the bindings)
    _kombu.binding_permanent.<exch>   the same members, for queues without x-expires
    unacked, unacked_index            a hash tag -> [message, exchange, routing key] and a sorted set of tags
    unacked_mutex                     by delivery time, both shared by every app with the default names, and
                                      the lock of the restore sweep
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import redis

from oncelery.relay.unacked import on_redis, redis_channel, restore_unacked

__all__ = [
    "TEST_RESTORE_INTERVAL",
    "TEST_VISIBILITY_TIMEOUT",
    "TEST_WORKER_POLL",
    "drop_queues",
    "flush_broker",
    "kit_transport_options",
    "on_redis",
    "restore_delivery",
]

#: The visibility timeout of the kit's worker subprocesses on Redis: a job whose worker was killed goes back
#: to its queue this many seconds after it was delivered (the app's own value, often 3600, is overridden).
TEST_VISIBILITY_TIMEOUT = 10.0
#: How often those workers look for unacked jobs past the visibility timeout (kombu's default: every 10 x 10 s).
TEST_RESTORE_INTERVAL = 1.0
#: How often a kit worker on Redis asks for the next message (kombu's default: every 1 s).
TEST_WORKER_POLL = 0.1

# kombu's bookkeeping options and the suffix of the kit's own names for them (<default queue>.<suffix>).
_UNACKED = (("unacked_key", "unacked"), ("unacked_index_key", "unacked_index"), ("unacked_mutex_key", "unacked_mutex"))


def kit_transport_options(app: Any, visibility_timeout: float | None) -> dict[str, Any]:
    """The broker transport options the kit's worker subprocesses merge into the app's (Redis only, else {}).

    A short visibility timeout and a restore sweep every second, so a killed worker's job comes back within
    seconds; a 0.1 s poll; and, where the app keeps kombu's shared `unacked` names, names of its own: a short
    timeout must never restore another app's jobs that are still running elsewhere on the same Redis.
    """
    if visibility_timeout is None or not on_redis(app):
        return {}
    own = dict(app.conf.broker_transport_options or {})
    options: dict[str, Any] = {
        "visibility_timeout": float(visibility_timeout),
        "unacked_restore_interval": TEST_RESTORE_INTERVAL,
        "unacked_restore_throttle": 1,
    }
    if "polling_interval" not in own:
        options["polling_interval"] = TEST_WORKER_POLL
    base = str(app.conf.task_default_queue or "celery")
    for option, suffix in _UNACKED:
        if option not in own:
            options[option] = f"{base}.{suffix}"
    return options


def restore_delivery(app: Any, task_id: str, options: dict[str, Any] | None = None) -> int:
    """Put the unacked message(s) of Celery task `task_id` back on their queue now, as kombu's visibility
    sweep would later (its own restore_by_tag); return how many. Only for a holder known to be dead."""
    return restore_unacked(app, [task_id], options)


def flush_broker(app: Any, queues: Iterable[str] = ()) -> dict[str, int]:
    """Delete this app's jobs from its Redis broker, as a failover or a lost Redis would, and nothing else.

    Gone: the lists of the app's queues (`app.amqp.queues`, plus `queues`) at every priority, their bindings,
    and their unacked entries (the app's or the kit's own bookkeeping keys outright; from kombu's shared ones
    only the entries routed to these queues). Other keys of the database, results included, are left alone.
    Returns how many keys or entries went, by kind.
    """
    names = set(app.amqp.queues) | set(queues)
    gone = {"queue_lists": 0, "bindings": 0, "unacked": 0}
    with redis_channel(app) as channel:
        prefix = channel.global_keyprefix
        client = redis.Redis(connection_pool=channel.pool)
        tables = _remove_bindings(client, channel, names, gone)
        gone["unacked"] = _remove_unacked(app, client, channel, names, tables)
        lists = [prefix + channel._q_for_pri(q, pri) for q in sorted(names) for pri in channel.priority_steps]
        gone["queue_lists"] = int(client.delete(*lists)) if lists else 0
    return gone


def drop_queues(app: Any, prefix: str) -> int:
    """Delete the Redis keys of the app's queues named under `prefix` (a test's namespace): their lists at every
    priority, their exchanges' bindings (those exchanges are named under `prefix` too: nobody else's), and the kit
    workers' unacked bookkeeping keys. Every key is named, no SCAN of a database others may fill. Returns how
    many keys went."""
    ours = [q for q in app.amqp.queues.values() if q.name.startswith(prefix)]
    bookkeeping = dict(_UNACKED)
    with redis_channel(app) as channel:
        head = channel.global_keyprefix
        keys = [head + channel._q_for_pri(q.name, pri) for q in ours for pri in channel.priority_steps]
        exchanges = {q.exchange.name for q in ours if q.exchange is not None and q.exchange.name.startswith(prefix)}
        for template in (channel.keyprefix_queue, channel.keyprefix_binding_permanent):
            keys += [head + template % (x,) for x in sorted(exchanges)]
        keys += [head + v for k, v in kit_transport_options(app, 0.0).items() if k in bookkeeping]
        client = redis.Redis(connection_pool=channel.pool)
        return int(client.delete(*keys)) if keys else 0


def _remove_bindings(
    client: redis.Redis, channel: Any, names: set[str], gone: dict[str, int]
) -> dict[str, list[tuple[str, ...]]]:
    """SREM the binding members naming the queues; return every exchange's table as it was (for routing)."""
    prefix = channel.global_keyprefix
    tables: dict[str, list[tuple[str, ...]]] = {}
    for template in (channel.keyprefix_queue, channel.keyprefix_binding_permanent):
        head = prefix + template % ("",)
        for raw in client.scan_iter(match=_glob_escape(head) + "*", count=500):
            key = _text(raw)
            members = [_text(m) for m in client.smembers(key)]
            ours = [m for m in members if m.split(channel.sep)[-1] in names]
            if template == channel.keyprefix_queue:
                tables[key[len(head) :]] = [tuple(m.split(channel.sep)) for m in members]
            if ours:
                gone["bindings"] += int(client.srem(key, *ours))
    return tables


def _remove_unacked(
    app: Any, client: redis.Redis, channel: Any, names: set[str], tables: dict[str, list[tuple[str, ...]]]
) -> int:
    """Delete the unacked entries of the queues: private bookkeeping keys outright, shared ones entry by entry."""
    prefix = channel.global_keyprefix
    kit = kit_transport_options(app, 0.0)  # the names the kit's own workers use for this app, if any
    own = channel.unacked_key != "unacked"  # the app named its bookkeeping keys itself: nobody else's
    hashes = {kit.get("unacked_key", "")} | ({channel.unacked_key} if own else set())
    keys = {kit.get(option, "") for option, _ in _UNACKED}
    if own:
        keys |= {channel.unacked_key, channel.unacked_index_key, channel.unacked_mutex_key}
    removed = sum(int(client.hlen(prefix + h)) for h in hashes if h)
    keys.discard("")
    if keys:
        client.delete(*(prefix + k for k in keys))
    if own:
        return removed
    types = {q.exchange.name: q.exchange.type for q in app.amqp.queues.values()}
    for tag, payload in client.hscan_iter(prefix + channel.unacked_key):
        _message, exchange, routing_key = json.loads(payload)
        if _routes_to(channel, tables, types, exchange, routing_key) & names:
            client.hdel(prefix + channel.unacked_key, tag)
            client.zrem(prefix + channel.unacked_index_key, tag)
            removed += 1
    return removed


def _routes_to(
    channel: Any, tables: dict[str, list[tuple[str, ...]]], types: dict[str, str], exchange: str, routing_key: str
) -> set[str]:
    """The queues kombu's restore would put a message of (exchange, routing key) on (its exchange types' lookup)."""
    if not exchange:
        return {routing_key}
    kind = channel.exchange_types.get(types.get(exchange, "direct")) or channel.exchange_types["direct"]
    return set(kind.lookup(tables.get(exchange, []), exchange, routing_key, None))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _glob_escape(text: str) -> str:
    """`text` as a literal inside a Redis SCAN MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
