"""The replay cache (optional): a duplicate of a COMPLETED run answered from Redis, with no database round trip.

Switched on by `app.conf.oncelery_replay_cache = "redis://host:6379/3"` (or $ONCELERY_REPLAY_CACHE).

Why it cannot break exactly-once: the database still decides every claim (G6). An entry is written only
after a run's completion has committed, and COMPLETED is final (only a purge deletes the run), so an entry can
only repeat what the database already says. A miss, a different payload, an unreadable entry or any Redis
error sends the delivery to the database's claim, exactly as without the cache.

Entries are named under the database's identity (oncelery.store.identity: on PostgreSQL the cluster's
system_identifier, its timeline, the database's oid and the server's start time), so a database restored or
replaced (a failover that lost the last commits) never meets the entries of the one before it: its duplicates
are answered by its own rows. Each process re-reads the identity every REFRESH seconds and after any new
database connection, never per delivery; while it cannot be read, the cache neither answers nor writes. An
entry is written only under the identity its delivery saw before claiming: a completion committed on a server
that was replaced meanwhile is never cached under the new server's name. Where nothing changes the identity
(SQLite, a `pg_restore --clean` into the same database), `oncelery cache flush` (`flush`) empties the
database's entries.

What it gives up, and when:
- Exact counts, for a while. A replay answered here is counted in this process's memory and written to the
  database (the run's `replays`, the `replayed` outcome with what it saved) at most FLUSH_INTERVAL later, and
  when the process ends normally. A SIGKILL loses at most that last interval's replay counts. The answer itself
  loses nothing.
- Forgetting, for up to the TTL. `oncelery purge` deletes the entries of the runs it deletes when the app it
  loads has the cache; a purge that cannot reach the cache leaves them to expire, and until then a duplicate
  of a purged key is replayed (never run again), unless `oncelery cache flush` empties them first.
- Nothing when Redis loses state (FLUSHALL, restart, failover): the next duplicates are answered by the
  database, which also writes their entries back.
- Answers while the database is down, after REFRESH seconds: its identity cannot be read, so the duplicates go
  to the database (and are sent again) like the others. After any database restart, a refill: the entries of
  the server before it are never read again, and expire within the TTL.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis
from celery import signals
from sqlalchemy.exc import ArgumentError

from oncelery.errors import ConfigurationError, ServiceUnreachable, StoreUnavailable
from oncelery.runs.keys import Identity
from oncelery.runs.outcomes import FLUSH_CHUNK, flush_at_exit, pending_replays
from oncelery.settings import (
    CONF_REPLAY_CACHE,
    CONF_REPLAY_CACHE_TTL,
    ENV_REPLAY_CACHE,
)
from oncelery.settings_files import env_value
from oncelery.store.database import Database, safe_url
from oncelery.store.identity import ServerIdentity

__all__ = [
    "COOLDOWN",
    "DEFAULT_TTL",
    "ENTRY_PREFIX",
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
ENTRY_PREFIX = "oncelery:done"  # <prefix>:<claims database>:<its identity>:<digest of task, tenant, key>


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
        # ... and of one incarnation of it: a restored or replaced database never reads its predecessor's.
        self.identity = ServerIdentity(self.db)
        self._named: tuple[str | None, str] = (None, "")  # (the last identity, its entries' prefix)
        self._seen = threading.local()  # the prefix this thread's delivery looked up under (for `remember`)
        self._client: tuple[int, redis.Redis] | None = None
        self._off_until = 0.0

    def entry_name(self, task_name: str, tenant: str, key: str) -> str:
        """The Redis key of (task, tenant, key)'s entry under the database's current identity.

        StoreUnavailable if the identity cannot be read now (then no delivery reads or writes an entry).
        """
        prefix = self._prefix()
        if prefix is None:
            raise StoreUnavailable(
                f"Cannot read the identity of the claims database {safe_url(self.db.url)}: start it, or check "
                f"the log of logger oncelery.identity",
                url=safe_url(self.db.url),
            )
        return _entry_name(prefix, task_name, tenant, key)

    def lookup(self, task_name: str, ident: Identity) -> CachedRun | None:
        """The cached answer for this delivery, or None: then the database's claim decides."""
        prefix = self._seen.prefix = self._prefix()  # `remember` writes only under what this delivery saw
        client = self._usable()
        if prefix is None or client is None or pending_replays(self.db).full():
            return None
        try:
            raw = client.get(_entry_name(prefix, task_name, ident.tenant, ident.key))
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
        """Cache a COMPLETED run's answer under the identity its lookup saw (never another); best effort.

        Call it only after the completion committed, in the thread of that delivery's `lookup`.
        """
        seen = getattr(self._seen, "prefix", None)
        self._seen.prefix = None  # one write per lookup
        client = self._usable()
        if client is None or seen is None or seen != self._prefix():
            return  # the server may have been replaced after this run committed: no entry under its successor
        entry = json.dumps({"f": ident.fingerprint, "i": run_id, "t": token, "r": result}, separators=(",", ":"))
        if len(entry) > MAX_ENTRY_BYTES:
            return
        try:
            client.set(_entry_name(seen, task_name, ident.tenant, ident.key), entry, ex=self.ttl)
        except redis.RedisError as exc:
            self._failed(exc)

    def forget(self, refs: Iterable[tuple[str, str, str]]) -> bool:
        """Delete the entries of (task, tenant, key) runs a purge deleted; False (logged) if Redis failed.

        Entries it could not delete expire within the TTL; until then they replay those keys (never run them).
        """
        try:
            names = [self.entry_name(*ref) for ref in refs]
            client = self._connect()
            for start in range(0, len(names), FLUSH_CHUNK):
                client.delete(*names[start : start + FLUSH_CHUNK])
        except (redis.RedisError, StoreUnavailable) as exc:
            logger.warning("replay cache %s: purged runs' entries expire within %ss (%s)", self.url, self.ttl, exc)
            return False
        return True

    def flush(self) -> int:
        """Delete every entry of this claims database under any identity; return how many (ServiceUnreachable).

        Safe at any time: the next duplicates are answered by the database, which writes their entries back.
        """
        deleted = 0
        try:
            client = self._connect()
            batch: list[bytes] = []
            for name in client.scan_iter(match=f"{ENTRY_PREFIX}:{self.namespace}:*", count=FLUSH_CHUNK):
                batch.append(name)
                if len(batch) >= FLUSH_CHUNK:
                    deleted += int(client.unlink(*batch))
                    batch = []
            if batch:
                deleted += int(client.unlink(*batch))
        except redis.RedisError as exc:
            raise ServiceUnreachable.of("replay cache", CONF_REPLAY_CACHE, _masked(self.url), str(exc)) from exc
        logger.info("replay cache %s: flushed %d entries of %s", _masked(self.url), deleted, safe_url(self.db.url))
        return deleted

    def count(self, run_id: int, task_name: str, tenant: str) -> None:
        """Count one replay answered from the cache; written to the database within FLUSH_INTERVAL."""
        pending_replays(self.db).add(run_id, task_name, tenant)

    def _prefix(self) -> str | None:
        """Where this database's entries live under its identity now; None while the identity is unknown."""
        identity = self.identity.current()
        if identity is None:
            return None
        named = self._named
        if named[0] != identity:  # a new server (or the first read): its entries are named afresh
            epoch = hashlib.blake2b(identity.encode(), digest_size=6).hexdigest()
            named = self._named = (identity, f"{ENTRY_PREFIX}:{self.namespace}:{epoch}:")
        return named[1]

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


def _entry_name(prefix: str, task_name: str, tenant: str, key: str) -> str:
    raw = f"{task_name}\0{tenant}\0{key}".encode()  # a digest: keys may be long or contain anything
    return prefix + hashlib.blake2b(raw, digest_size=16).hexdigest()


def _masked(url: str) -> str:
    """A Redis URL with its password masked, for messages and logs."""
    try:
        return safe_url(url)
    except (ArgumentError, ValueError):  # configured_cache accepts only URLs it parses; never print a secret
        return url.rsplit("@", 1)[-1]


_caches: dict[tuple[str, float, str], ReplayCache] = {}


def configured_cache(conf: Any, database_url: str) -> ReplayCache | None:
    """The replay cache app.conf (or $ONCELERY_REPLAY_CACHE) asks for, or None; a bad setting: ConfigurationError."""
    url = str((conf.get(CONF_REPLAY_CACHE) if conf is not None else None) or env_value(ENV_REPLAY_CACHE) or "")
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
