"""The replay cache (optional): a duplicate of a COMPLETED run answered from Redis, with no database round trip.

Switched on by `app.conf.oncelery_replay_cache = "redis://host:6379/3"` (or $ONCELERY_REPLAY_CACHE).

Why it cannot break exactly-once: the database still decides every claim (G6). An entry is written only
after a run's completion has committed, and COMPLETED is final (only a purge deletes the run), so an entry can
only repeat what the database already says. A miss, a different payload, an unreadable entry or any Redis
error sends the delivery to the database's claim, exactly as without the cache.

What it gives up, and when:
- Exact counts, for a while. A replay answered here is counted in this process's memory and written to the
  database (the run's `replays`, the `replayed` outcome with what it saved) at most FLUSH_INTERVAL later, and
  when the process ends normally. A SIGKILL loses at most that last interval's replay counts. The answer itself
  loses nothing.
- Forgetting, for up to the TTL. `oncelery purge` deletes the entries of the runs it deletes when the app it
  loads has the cache; a purge that cannot reach the cache leaves them to expire, and until then a duplicate
  of a purged key is replayed (never run again).
- Nothing when Redis loses state (FLUSHALL, restart, failover): the next duplicates are answered by the
  database, which also writes their entries back.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis
from celery import signals

from oncelery.errors import ConfigurationError
from oncelery.runs.keys import Identity
from oncelery.runs.outcomes import FLUSH_CHUNK, flush_at_exit, pending_replays
from oncelery.settings import (
    CONF_REPLAY_CACHE,
    CONF_REPLAY_CACHE_TTL,
    ENV_REPLAY_CACHE,
)
from oncelery.store.database import Database, safe_url

__all__ = [
    "COOLDOWN",
    "DEFAULT_TTL",
    "MAX_ENTRY_BYTES",
    "SOCKET_TIMEOUT",
    "CachedRun",
    "ReplayCache",
    "configured_cache",
    "purge_forgetter",
    "replay_cache",
]

logger = logging.getLogger("oncelery.replay_cache")  # a stable name (users filter on it)

# Results larger than this are not cached (the database answers them): Redis is for the common small answer.
MAX_ENTRY_BYTES = 64 * 1024
# After a Redis error, the cache is bypassed this long: an unreachable Redis must not add a timeout per job.
COOLDOWN = 5.0
SOCKET_TIMEOUT = 0.25
DEFAULT_TTL = 600.0


@dataclass(frozen=True)
class CachedRun:
    """A COMPLETED run's answer as the cache holds it: its id, fencing token and stored result."""

    run_id: int
    token: int
    result: Any


class ReplayCache:
    """Answers duplicates of COMPLETED runs from Redis; it never decides a claim, and an entry lives `ttl` at most."""

    def __init__(self, url: str, ttl: float, database_url: str) -> None:
        self.url = url
        self.ttl = max(1, int(ttl))
        self.db = Database(database_url)
        # Entries of one claims database only: two databases sharing a Redis never answer each other's keys.
        self.namespace = hashlib.blake2b(safe_url(database_url).encode(), digest_size=8).hexdigest()
        self._client: tuple[int, redis.Redis] | None = None
        self._off_until = 0.0

    def entry_name(self, task_name: str, tenant: str, key: str) -> str:
        """The Redis key of (task, tenant, key)'s entry (a digest: keys may be long or contain anything)."""
        raw = f"{task_name}\0{tenant}\0{key}".encode()
        return f"oncelery:done:{self.namespace}:{hashlib.blake2b(raw, digest_size=16).hexdigest()}"

    def lookup(self, task_name: str, ident: Identity) -> CachedRun | None:
        """The cached answer for this delivery, or None: then the database's claim decides."""
        client = self._usable()
        if client is None or pending_replays(self.db).full():
            return None
        try:
            raw = client.get(self.entry_name(task_name, ident.tenant, ident.key))
        except redis.RedisError as exc:
            self._failed(exc)
            return None
        if raw is None:
            return None
        try:
            entry = json.loads(raw)
            if entry["f"] != ident.fingerprint:
                return None  # a different payload: the database raises the conflict, naming the fields
            return CachedRun(int(entry["i"]), int(entry["t"]), entry["r"])
        except (ValueError, KeyError, TypeError):
            return None  # not an entry this code wrote: the database answers

    def remember(self, task_name: str, ident: Identity, run_id: int, token: int, result: Any) -> None:
        """Cache a COMPLETED run's answer; call only after its completion committed. Best effort."""
        client = self._usable()
        if client is None:
            return
        entry = json.dumps({"f": ident.fingerprint, "i": run_id, "t": token, "r": result}, separators=(",", ":"))
        if len(entry) > MAX_ENTRY_BYTES:
            return
        try:
            client.set(self.entry_name(task_name, ident.tenant, ident.key), entry, ex=self.ttl)
        except redis.RedisError as exc:
            self._failed(exc)

    def forget(self, refs: Iterable[tuple[str, str, str]]) -> bool:
        """Delete the entries of (task, tenant, key) runs a purge deleted; False (logged) if Redis failed.

        Entries it could not delete expire within the TTL; until then they replay those keys (never run them).
        """
        names = [self.entry_name(*ref) for ref in refs]
        try:
            client = self._connect()
            for start in range(0, len(names), FLUSH_CHUNK):
                client.delete(*names[start : start + FLUSH_CHUNK])
        except redis.RedisError as exc:
            logger.warning("replay cache %s: purged runs' entries expire within %ss (%s)", self.url, self.ttl, exc)
            return False
        return True

    def count(self, run_id: int, task_name: str, tenant: str) -> None:
        """Count one replay answered from the cache; written to the database within FLUSH_INTERVAL."""
        pending_replays(self.db).add(run_id, task_name, tenant)

    def _usable(self) -> redis.Redis | None:
        if self._off_until and time.monotonic() < self._off_until:
            return None
        return self._connect()

    def _connect(self) -> redis.Redis:
        pid = os.getpid()
        if self._client is None or self._client[0] != pid:  # a forked child opens its own connections
            client = redis.Redis.from_url(
                self.url, socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=SOCKET_TIMEOUT
            )
            self._client = (pid, client)
        return self._client[1]

    def _failed(self, exc: Exception) -> None:
        if not self._off_until or time.monotonic() >= self._off_until:
            logger.warning("replay cache %s unreachable (%s): the database answers for %ss", self.url, exc, COOLDOWN)
        self._off_until = time.monotonic() + COOLDOWN


_caches: dict[tuple[str, float, str], ReplayCache] = {}


def configured_cache(conf: Any, database_url: str) -> ReplayCache | None:
    """The replay cache app.conf (or $ONCELERY_REPLAY_CACHE) asks for, or None; a bad setting: ConfigurationError."""
    url = str((conf.get(CONF_REPLAY_CACHE) if conf is not None else None) or os.environ.get(ENV_REPLAY_CACHE) or "")
    if not url:
        return None
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigurationError(
            f"{CONF_REPLAY_CACHE}={url!r}: give a Redis URL (redis://host:6379/3), or leave it unset"
        )
    ttl = conf.get(CONF_REPLAY_CACHE_TTL) if conf is not None else None
    ttl = DEFAULT_TTL if ttl is None else ttl
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl < 1:
        raise ConfigurationError(f"{CONF_REPLAY_CACHE_TTL}={ttl!r}: give seconds >= 1 (e.g. {DEFAULT_TTL:g})")
    return replay_cache(url, float(ttl), database_url)


def purge_forgetter(conf: Any, database_url: str) -> Callable[[list[tuple[str, str, str]]], object] | None:
    """What `oncelery purge` calls with the runs it deleted, to drop their cache entries (None: no cache)."""
    cache = configured_cache(conf, database_url)
    return None if cache is None else cache.forget


def replay_cache(url: str, ttl: float, database_url: str) -> ReplayCache:
    """The process's cache for (Redis url, ttl, claims database): one per process, shared by its tasks."""
    ident = (url, ttl, database_url)
    cache = _caches.get(ident)
    if cache is None:
        cache = _caches[ident] = ReplayCache(url, ttl, database_url)
    return cache


def _flush_on_shutdown(**_kwargs: Any) -> None:
    flush_at_exit()  # a prefork child ends without atexit handlers: Celery's signal is its last word


signals.worker_process_shutdown.connect(_flush_on_shutdown, weak=False)
