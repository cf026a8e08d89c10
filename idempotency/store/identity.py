"""What names a claims database's contents: a value that changes when the database is restored or replaced.

A cache kept outside the database (the replay cache) must not outlive what it repeats. After a restore, or a
failover that lost the last commits, the database no longer has runs the cache still remembers. An epoch kept
in a table cannot tell: a backup or a promoted replica brings the same row back. So the identity is read from
the server (`Dialect.identity_queries`), never from a table:

- PostgreSQL: the cluster's system_identifier (a restore into a new cluster), its timeline (a promoted replica,
  a point-in-time recovery), the database's oid (a dump restored into the same cluster as a new database), and
  the server's start time (a file-level restore in place keeps the other three). A server restart therefore
  changes it too: the cache refills once from the database.
- PostgreSQL where the role may not execute pg_control_system() / pg_control_checkpoint() (the default grants
  them to PUBLIC; some managed services revoke them): the oid and the start time, which still change on a
  restore into a new cluster and on a failover (both start another server). Logged once, with the grant that
  restores the full identity.
- SQLite: "" for ever. After restoring a file, run `oncelery cache flush`.
- Not changed by anything here: a restore into the SAME database of the same running server (`pg_restore
  --clean`); run `oncelery cache flush` after one.

A process reads it at most every REFRESH seconds, and again after it opened any new database connection: a
reconnect is where a restored or promoted server shows itself first. Never per delivery. While it cannot be
read (the server is down, every query refused, another thread reading it now), `current()` is None, and a
cache must then let the database answer.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import event
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import Pool

from oncelery.errors import StoreError
from oncelery.store.database import Database, safe_url

__all__ = ["REFRESH", "ServerIdentity", "connections_opened"]

logger = logging.getLogger("oncelery.identity")  # a stable name (users filter on it)

# Seconds a process trusts the identity it read: the longest a swapped server can go unnoticed by a process that
# opens no connection meanwhile (a worker answering only cached duplicates).
REFRESH = 2.0
# SQLSTATEs of a query the server will never run for this role: insufficient_privilege, undefined_function.
_REFUSED = frozenset({"42501", "42883"})


class _Connections:
    """How many database connections this process has opened, through any engine's pool."""

    opened = 0


def _opened(*_args: Any) -> None:
    _Connections.opened += 1  # a lost increment under a race is harmless: any change means "read it again"


event.listen(Pool, "connect", _opened)  # every pool, present and future


def connections_opened() -> int:
    """How many database connections this process has opened so far (a change: maybe another server)."""
    return _Connections.opened


@dataclass(frozen=True)
class _Reading:
    value: str | None
    at: float  # time.monotonic() when read
    connections: int  # connections_opened() just before the read


class ServerIdentity:
    """One database's identity as this process last read it: re-read after REFRESH s and after a new connection."""

    def __init__(self, db: Database, refresh: float = REFRESH) -> None:
        self.db = db
        self.refresh = refresh
        self._queries = db.dialect.identity_queries
        self._using = 0  # the first query the server has not refused
        self._reading: _Reading | None = None
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def current(self) -> str | None:
        """The identity, read less than `refresh` s ago and since the last new connection; None while unknown."""
        if not self._queries:
            return ""
        seen = self._reading
        if seen is not None and seen.connections == _Connections.opened and time.monotonic() - seen.at < self.refresh:
            return seen.value
        return self._read()

    def _read(self) -> str | None:
        if self._pid != os.getpid():  # a forked child: a lock a parent's thread held is never released here
            self._lock, self._pid = threading.Lock(), os.getpid()
        if not self._lock.acquire(blocking=False):
            return None  # another thread is reading it: meanwhile the database answers
        try:
            connections = _Connections.opened  # before the read: a connection the read opens means one more read
            value = self._query()
            self._reading = _Reading(value, time.monotonic(), connections)
            return value
        finally:
            self._lock.release()

    def _query(self) -> str | None:
        while self._using < len(self._queries):
            try:
                with self.db.read() as conn:
                    return str(conn.exec_driver_sql(self._queries[self._using]).scalar_one())
            except (StoreError, DBAPIError) as exc:
                if not _refused(exc):
                    logger.debug("identity of %s unknown for now: %s", safe_url(self.db.url), exc)
                    return None
                self._using += 1
                self._warn_refused(exc)
        return None

    def _warn_refused(self, exc: BaseException) -> None:
        where = safe_url(self.db.url)
        if self._using < len(self._queries):
            logger.warning(
                "identity of %s: pg_control_system() or pg_control_checkpoint() refused (%s); using the database's "
                "oid and the server's start time, which a restore or a failover changes as well. For the cluster "
                "and timeline too: GRANT EXECUTE ON FUNCTION pg_control_system(), pg_control_checkpoint() TO the "
                "workers' role",
                where,
                _first_line(exc),
            )
            return
        logger.error(
            "identity of %s cannot be read (%s): the replay cache never answers (the database does); grant the "
            "workers' role SELECT on pg_database and EXECUTE on pg_postmaster_start_time()",
            where,
            _first_line(exc),
        )


def _refused(exc: BaseException) -> bool:
    """Whether the server refuses this query to this role for good (not a fault a later attempt gets past)."""
    driver_error = exc.orig if isinstance(exc, DBAPIError) else getattr(exc.__cause__, "orig", None)
    return str(getattr(driver_error, "sqlstate", "") or "") in _REFUSED


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
