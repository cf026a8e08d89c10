"""Engines per process, the database clock, and translation of low-level failures into typed errors."""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

from oncelery.errors import ConfigurationError, SchemaMissing, StoreUnavailable
from oncelery.settings import SQLITE_BUSY_TIMEOUT_MS
from sqlalchemy import CursorResult, create_engine, event, func
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DBAPIError, OperationalError, ProgrammingError
from sqlalchemy.sql.elements import ColumnElement

_engines: dict[tuple[str, int, bool, bool], Engine] = {}
_lock = threading.Lock()


def normalize_url(url: str) -> str:
    """Map `postgresql://` and `postgres://` to the psycopg 3 driver Oncelery ships with."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def get_engine(url: str, *, read_only: bool = False, fast_claims: bool = False) -> Engine:
    """Return this process's engine for `url` (a new one after fork, so pooled sockets are never shared).

    `read_only=True` on SQLite gives an engine whose transactions begin DEFERRED, so reads never queue
    behind the single writer (WAL lets them run alongside it). `fast_claims=True` on PostgreSQL gives an
    autocommit engine with `synchronous_commit = off` for claim and lease statements. Otherwise (and on
    the other dialect) it is the default engine.
    """
    key = (url, os.getpid(), read_only, fast_claims)
    engine = _engines.get(key)  # the hot path: no URL parsing
    if engine is None:
        with _lock:
            engine = _engines.get(key)
            if engine is None:
                backend = make_url(normalize_url(url)).get_backend_name()
                mode = "read" if read_only and backend == "sqlite" else ""
                mode = "fast" if fast_claims and backend == "postgresql" else mode
                if mode:
                    engine = _create_engine(url, mode)
                else:
                    engine = _engines.get((url, os.getpid(), False, False)) or _create_engine(url)
                    _engines[(url, os.getpid(), False, False)] = engine
                    if read_only:
                        # PostgreSQL reads need no transaction: autocommit saves the BEGIN/ROLLBACK trips.
                        engine = engine.execution_options(isolation_level="AUTOCOMMIT")
                _engines[key] = engine
    return engine


def dispose_engines() -> None:
    """Close every pooled connection of this process (used by tests and after a database restart)."""
    with _lock:
        for (_, pid, _ro, _fast), engine in list(_engines.items()):
            if pid == os.getpid():
                engine.dispose()
        _engines.clear()


def _create_engine(url: str, mode: str = "") -> Engine:
    url = normalize_url(url)
    backend = make_url(url).get_backend_name()
    if backend == "sqlite":
        return _sqlite_engine(url, read_only=mode == "read")
    if backend == "postgresql":
        try:
            import psycopg  # noqa: F401
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ConfigurationError("PostgreSQL needs psycopg 3: pip install 'oncelery[postgres]'") from exc
        # No pre-ping: it costs a round trip per checkout. A connection found dead raises a disconnect
        # error (StoreUnavailable: the job is re-sent) and SQLAlchemy then invalidates the whole pool.
        if mode == "fast":
            # Claims and lease renewals need not survive a database crash (see RunStore); not waiting for
            # the WAL flush keeps a claim to one cheap round trip. Set at connection startup: no extra trip.
            # connect_args replace the URL's own `options` (e.g. a search_path): keep them.
            options = " ".join(
                filter(None, [str(make_url(url).query.get("options") or ""), "-c synchronous_commit=off"])
            )
            return create_engine(
                url, isolation_level="AUTOCOMMIT", pool_size=5, max_overflow=10, connect_args={"options": options}
            )
        return create_engine(url, pool_size=5, max_overflow=10)
    return create_engine(url, pool_pre_ping=True)


def _sqlite_engine(url: str, read_only: bool = False) -> Engine:
    engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Take over transaction control from pysqlite, whose implicit BEGIN is DEFERRED: a deferred
        # transaction that reads then writes fails at once with "database is locked" instead of waiting.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        # IMMEDIATE takes the write lock up front, so lock waits honour busy_timeout; readers need none.
        conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

    return engine


_SQLITE_TIME_FORMAT = "%Y-%m-%d %H:%M:%f"


def db_now(engine_or_dialect: Any) -> ColumnElement[Any]:
    """Return a SQL expression for the database clock's current time (leases never use the worker clock)."""
    name = _dialect_name(engine_or_dialect)
    if name == "sqlite":
        # Millisecond text in the layout SQLAlchemy stores DateTime in on SQLite, so comparisons hold.
        return func.strftime(_SQLITE_TIME_FORMAT, "now")
    if name == "postgresql":
        # clock_timestamp(), not now(): now() is frozen at the start of a (possibly long) transaction.
        return func.clock_timestamp()
    raise ConfigurationError(f"Unsupported database dialect {name!r}: use PostgreSQL or SQLite")


def _dialect_name(engine_or_dialect: Any) -> str:
    if isinstance(engine_or_dialect, str):
        return engine_or_dialect
    dialect = getattr(engine_or_dialect, "dialect", engine_or_dialect)
    return str(dialect.name)


_MISSING_TABLE_RE = re.compile(r"no such table|relation \"[^\"]+\" does not exist")
_MISSING_DATABASE_RE = re.compile(r"database \"[^\"]+\" does not exist")
_UNAVAILABLE_MARKERS = (
    "connection refused",
    "could not connect",
    "server closed the connection",
    "connection is closed",
    "terminating connection",
    "unable to open database file",
    "connection failed",
    "the database system is",
)


def translate_error(exc: BaseException, url: str) -> BaseException:
    """Map a driver error to SchemaMissing / StoreUnavailable with the fix in the message, else return it."""
    if not isinstance(exc, DBAPIError):
        return exc
    msg = str(exc.orig if exc.orig is not None else exc).lower()
    safe_url = make_url(url).render_as_string(hide_password=True)
    if _MISSING_DATABASE_RE.search(msg):
        return StoreUnavailable(
            f"The claims database in {safe_url} does not exist: create it (e.g. `createdb`), "
            f"then run `oncelery db upgrade`",
            url=safe_url,
        )
    if isinstance(exc, (OperationalError, ProgrammingError)) and _MISSING_TABLE_RE.search(msg):
        return SchemaMissing(
            f"Oncelery's tables are missing in {safe_url}: run `oncelery db upgrade` "
            f"(with ONCELERY_DATABASE_URL set to this database) to create them",
            url=safe_url,
        )
    if exc.connection_invalidated or any(m in msg for m in _UNAVAILABLE_MARKERS):
        return StoreUnavailable(f"Cannot reach the claims database {safe_url}: {msg.strip()}", url=safe_url)
    return exc


@contextmanager
def translated(url: str) -> Iterator[None]:
    """Re-raise driver errors inside the block as Oncelery's typed store errors (chained to the cause)."""
    try:
        yield
    except DBAPIError as exc:
        mapped = translate_error(exc, url)
        if mapped is exc:
            raise
        raise mapped from exc


def rowcount(result: Any) -> int:
    """Return the rows a DML statement matched (Session's stubs type its results as plain Result)."""
    return int(cast(CursorResult[Any], result).rowcount)
