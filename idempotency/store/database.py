"""The handle on a claims database: this process's engines, its transactions, and the ONE place that
turns driver errors into Oncelery's typed errors (`SchemaMissing`, `StoreUnavailable`).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn, TypeVar, cast

from sqlalchemy import Connection, CursorResult
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DBAPIError, OperationalError, ProgrammingError

from oncelery.errors import SchemaMissing, StoreUnavailable
from oncelery.store.dialects import (
    MODE_AUTOCOMMIT,
    MODE_DEFAULT,
    MODE_FAST,
    MODE_READ,
    Dialect,
    dialect_of,
    producer_timeout_ms,
)
from oncelery.store.driver import DriverTransaction, driver_transaction, run_on_driver

__all__ = [
    "Database",
    "T",
    "dispose_engines",
    "first_and_count",
    "get_engine",
    "is_transient",
    "is_unreachable",
    "normalize_url",
    "on_sqlite3",
    "raise_translated",
    "rowcount",
    "safe_url",
    "translate_error",
    "translated",
]

T = TypeVar("T")

_engines: dict[tuple[str, int, str], Engine] = {}
_lock = threading.RLock()


def normalize_url(url: str) -> str:
    """Map `postgresql://` and `postgres://` to the psycopg 3 driver Oncelery ships with."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def safe_url(url: str) -> str:
    """Return `url` with its password masked, for messages and logs."""
    return make_url(url).render_as_string(hide_password=True)


def get_engine(url: str, mode: str = MODE_DEFAULT) -> Engine:
    """Return this process's engine for `url` in `mode` (a new one after fork: sockets are never shared)."""
    key = (url, os.getpid(), mode)
    engine = _engines.get(key)  # the hot path: no URL parsing
    if engine is None:
        with _lock:
            engine = _engines.get(key)
            if engine is None:
                engine = _engines[key] = _new_engine(url, mode)
    return engine


def _new_engine(url: str, mode: str) -> Engine:
    dia = dialect_of(normalize_url(url))
    if mode in dia.own_engine_modes or producer_timeout_ms(mode) is not None:
        return dia.create_engine(normalize_url(url), mode)
    base = get_engine(url)  # the lock is reentrant
    if dia.autocommit_statements and mode in (MODE_READ, MODE_AUTOCOMMIT):
        # Reads and durable single statements need no transaction: autocommit saves BEGIN/COMMIT trips.
        return base.execution_options(isolation_level="AUTOCOMMIT")
    return base


def dispose_engines() -> None:
    """Close every pooled connection of this process (tests, and after a database restart)."""
    with _lock:
        for (_, pid, _mode), engine in list(_engines.items()):
            if pid == os.getpid():
                engine.dispose()
        _engines.clear()


# -- the one translation of driver errors ------------------------------------------------------------

_MISSING_TABLE_RE = re.compile(r"no such table|relation \"[^\"]+\" does not exist")
_MISSING_DATABASE_RE = re.compile(r"database \"[^\"]+\" does not exist")
# Transient: the same statement can succeed later (reconnect, lock released, transaction retried).
_TRANSIENT_MARKERS = (
    "connection refused",
    "could not connect",
    "server closed the connection",
    "connection is closed",
    "connection is lost",
    "terminating connection",
    "unable to open database file",
    "connection failed",
    "the database system is",
    "database is locked",
    "database is busy",
    "database table is locked",
    "deadlock detected",
    "could not serialize access",
    "canceling statement due to lock timeout",
    "consuming input failed",
    "ssl syscall error",
    # The host name does not resolve (yet): compose's DNS knows a service only once its container runs.
    "failed to resolve host",
    "could not translate host name",
)
# Unreachable: no server answered, or it is not accepting connections yet. A subset of the transient errors: a
# server that answers "no such database", "no such role" or "bad password" is reachable and misconfigured.
_UNREACHABLE_MARKERS = (
    "connection refused",
    "could not connect",
    "failed to resolve host",
    "could not translate host name",
    "timeout expired",
    "no route to host",
    "network is unreachable",
    "the database system is starting up",
    "the database system is shutting down",
    "the database system is in recovery mode",
    "server closed the connection unexpectedly",
)
_CANNOT_CONNECT_NOW = "57P03"  # SQLSTATE of "the database system is starting up"
# SQLSTATE classes and codes that mean "try again": connection exceptions (08), operator intervention
# (57: admin shutdown, crash shutdown, cannot connect now), serialization failure and deadlock (40001,
# 40P01), lock not available (55P03).
_TRANSIENT_SQLSTATE_CLASSES = ("08", "57")
_TRANSIENT_SQLSTATES = ("40001", "40P01", "55P03")


def is_transient(exc: DBAPIError) -> bool:
    """Return whether a driver error is one a later attempt can get past (disconnect, lock, deadlock)."""
    if exc.connection_invalidated:
        return True
    sqlstate = str(getattr(exc.orig, "sqlstate", "") or "")
    if sqlstate[:2] in _TRANSIENT_SQLSTATE_CLASSES or sqlstate in _TRANSIENT_SQLSTATES:
        return True
    msg = _driver_text(exc).lower()
    return any(m in msg for m in _TRANSIENT_MARKERS)


def is_unreachable(exc: DBAPIError) -> bool:
    """Return whether a driver error says no database server answered (down, starting up, name not resolving)."""
    if str(getattr(exc.orig, "sqlstate", "") or "") == _CANNOT_CONNECT_NOW:
        return True
    msg = _driver_text(exc).lower()
    return any(m in msg for m in _UNREACHABLE_MARKERS)


def _driver_text(exc: DBAPIError) -> str:
    return str(exc.orig if exc.orig is not None else exc)


def translate_error(exc: BaseException, url: str) -> BaseException:
    """Map a driver error to SchemaMissing / StoreUnavailable with the fix in the message, else return it."""
    if not isinstance(exc, DBAPIError):
        return exc
    msg = _driver_text(exc).lower()
    where = safe_url(url)
    if _MISSING_DATABASE_RE.search(msg):
        return StoreUnavailable(
            f"The claims database in {where} does not exist: create it (e.g. `createdb`), "
            f"then run `oncelery db upgrade`",
            url=where,
        )
    if isinstance(exc, (OperationalError, ProgrammingError)) and _MISSING_TABLE_RE.search(msg):
        return SchemaMissing.for_url(where)
    if is_transient(exc):
        return StoreUnavailable(f"Cannot use the claims database {where} right now: {msg.strip()}", url=where)
    return exc


def raise_translated(exc: DBAPIError, url: str) -> NoReturn:
    """Raise driver error `exc` as Oncelery's typed store error (chained to it), or as it is if it has none."""
    mapped = translate_error(exc, url)
    if mapped is exc:
        raise exc
    raise mapped from exc


@contextmanager
def translated(url: str) -> Iterator[None]:
    """Re-raise driver errors inside the block as Oncelery's typed store errors (chained to the cause)."""
    try:
        yield
    except DBAPIError as exc:
        raise_translated(exc, url)


def on_sqlite3(engine: Engine) -> bool:
    """Whether `engine` talks to SQLite through the standard library's sqlite3 (the driver path's SQLite)."""
    return bool(engine.dialect.driver == "pysqlite")


def rowcount(result: Any) -> int:
    """Return the rows a DML statement matched (Session's stubs type its results as plain Result)."""
    return int(cast(CursorResult[Any], result).rowcount)


def first_and_count(result: Any) -> tuple[Any, int]:
    """Return (the first returned row or None, the rows matched) of a statement's result."""
    row = result.first() if result.returns_rows else None
    return row, rowcount(result)


class Database:
    """A claims database: engines per process, transactions, and typed errors on every call."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._dialect: Dialect | None = None
        self._file_seen = False  # once the file exists, reads stop checking (no stat per read)

    @property
    def dialect(self) -> Dialect:
        """The database's `Dialect` (PostgreSQL or SQLite)."""
        if self._dialect is None:
            self._dialect = dialect_of(normalize_url(self.url))
        return self._dialect

    @property
    def engine(self) -> Engine:
        """This process's engine for transactions."""
        return get_engine(self.url)

    @property
    def read_engine(self) -> Engine:
        """This process's engine for reads (autocommit on PostgreSQL; never SQLite's writer lock)."""
        return get_engine(self.url, MODE_READ)

    @property
    def fast_engine(self) -> Engine:
        """Engine for single-statement claim and lease writes (asynchronous commit on PostgreSQL)."""
        return get_engine(self.url, MODE_FAST)

    @contextmanager
    def begin(self) -> Iterator[Connection]:
        """A transaction; driver errors become typed store errors."""
        with translated(self.url), self.engine.begin() as conn:
            yield conn

    @contextmanager
    def begin_statements(self) -> Iterator[Connection | DriverTransaction]:
        """A durable write transaction for prebuilt statements only (`execute(stmt, params)`, `.first()`,
        `.rowcount`); driver errors become typed store errors.

        On SQLite (sqlite3) the statements go straight to the driver, so the file's write lock is held for
        the statements and not for SQLAlchemy's work around them; elsewhere it is `begin()`.
        """
        engine = self.engine
        if not on_sqlite3(engine):
            with self.begin() as conn:
                yield conn
            return
        with translated(self.url), driver_transaction(engine) as tx:
            yield tx

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A connection for reads; driver errors become typed store errors."""
        self.require_file()
        with translated(self.url), self.read_engine.connect() as conn:
            yield conn

    def one(self, stmt: Any, params: dict[str, Any], *, durable: bool = True) -> tuple[Any, int]:
        """Run one statement on its own; return (first returned row or None, rows matched).

        Autocommit where the dialect allows it (no BEGIN/COMMIT round trips), else a short transaction.
        `durable=False` commits without waiting for the disk (claims and lease renewals): PostgreSQL's
        synchronous_commit=off, SQLite's synchronous=NORMAL.
        """
        return self._once_more_if_invalidated(lambda: self._one(stmt, params, durable))

    def one_bounded(self, mode: str, stmt: Any, params: dict[str, Any]) -> tuple[Any, int]:
        """Run one statement on the engine of `mode` (a producer's, bounded by its timeout); as `one`, no retry.

        Asynchronous commit on PostgreSQL, and SQLite's synchronous=NORMAL, as a claim's.
        """
        try:
            return _run_one(get_engine(self.url, mode), stmt, params, self.dialect.autocommit_statements)
        except DBAPIError as exc:
            raise_translated(exc, self.url)

    def write(self, body: Callable[[Connection], None]) -> None:
        """Run `body` in one transaction, once more on a fresh connection if a killed pooled one failed it.

        For writes whose repeat is harmless, as in `one` (e.g. a ledger row: its call_id makes a repeat after a
        lost answer to COMMIT a no-op): never for effects.
        """

        def transaction() -> None:
            with self.engine.begin() as conn:
                body(conn)

        self._once_more_if_invalidated(transaction)

    def _once_more_if_invalidated(self, attempt: Callable[[], T]) -> T:
        # `translated`, without a generator context manager per call: this runs twice per job.
        try:
            try:
                return attempt()
            except DBAPIError as exc:
                if not exc.connection_invalidated:
                    raise
                # A pooled connection that a restart or failover killed: SQLAlchemy has invalidated the pool,
                # so one more try gets a fresh connection instead of costing the job a re-send. Repeating is
                # safe for claims, renewals, completions (ON CONFLICT and the token fence guard them) and ledger
                # rows (ON CONFLICT on their call_id); an outcome counter whose commit succeeded but whose answer
                # was lost would be written twice (rare).
                return attempt()
        except DBAPIError as exc:
            raise_translated(exc, self.url)

    def _one(self, stmt: Any, params: dict[str, Any], durable: bool) -> tuple[Any, int]:
        if self.dialect.autocommit_statements:
            return _run_one(get_engine(self.url, MODE_AUTOCOMMIT if durable else MODE_FAST), stmt, params, True)
        return _run_one(self.engine if durable else self.fast_engine, stmt, params, False)

    def require_file(self) -> None:
        """Raise StoreUnavailable if this is a SQLite file that does not exist (reads never create one)."""
        if self._file_seen or self.dialect.name != "sqlite":
            return
        database = make_url(self.url).database
        if database and database != ":memory:" and not database.startswith("file:") and not Path(database).exists():
            raise StoreUnavailable(
                f"No database at {safe_url(self.url)}: run `oncelery db upgrade` (or the job) first, or set "
                f"ONCELERY_DATABASE_URL to the database your workers use",
                url=safe_url(self.url),
            )
        self._file_seen = True


def _run_one(engine: Engine, stmt: Any, params: dict[str, Any], autocommit: bool) -> tuple[Any, int]:
    """One statement on `engine`: in autocommit (PostgreSQL's pools), or in its own write transaction; returns
    (the first returned row or None, the rows matched)."""
    if autocommit:
        if engine.dialect.driver == "psycopg":
            # The hot path (a claim, a completion, a renewal): SQLAlchemy compiles, psycopg runs it.
            return run_on_driver(engine, stmt, params)
        with engine.connect() as conn:
            return first_and_count(conn.execute(stmt, params))
    if on_sqlite3(engine):
        # A claim, a renewal, a count: SQLAlchemy compiles, sqlite3 runs it in its own write transaction.
        with driver_transaction(engine) as tx:
            return first_and_count(tx.execute(stmt, params))
    with engine.begin() as conn:
        return first_and_count(conn.execute(stmt, params))
