"""A delivery's hot statements straight through the driver: compiled once, no SQLAlchemy per call.

A delivery's hot statements (the claim that also answers a duplicate, the completion, a lease renewal) run
once per job. For a statement that costs the server ~0.1 ms, SQLAlchemy's execution context, parameter
processing and result setup cost the worker more CPU than the statement itself (docs/benchmarks.md). So
SQLAlchemy still builds, compiles and pools, and raises its error classes; this module runs the compiled text
on the pooled driver connection and returns plain named tuples: one statement in autocommit on psycopg 3
(`run_on_driver`), or a few in one write transaction on sqlite3 (`driver_transaction`), where every moment
inside the transaction is a moment the other writers of the file wait.
"""

from __future__ import annotations

import sqlite3
from collections import namedtuple
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, StatementError

__all__ = [
    "STATEMENT_SETUP",
    "DriverResult",
    "DriverStatement",
    "DriverTransaction",
    "as_sqlalchemy_error",
    "driver_statement",
    "driver_transaction",
    "give_back",
    "prepared",
    "run_on_driver",
    "statement_listeners",
]


class DriverStatement:
    """A statement compiled once for an engine's dialect: its text, its parameter converters, its row type."""

    __slots__ = (
        "compiled",
        "converters",
        "defaults",
        "literals",
        "order",
        "renamed",
        "required",
        "row_type",
        "sql",
    )

    def __init__(self, stmt: Any, engine: Engine) -> None:
        dialect = engine.dialect
        self.compiled = stmt.compile(dialect=dialect)
        self.sql: str = self.compiled.string
        # The statement's literals (and None for the parameters a call gives), by the name in the SQL text.
        self.defaults: dict[str, Any] = dict(self.compiled.params)
        self.required = frozenset(bind.key for bind in self.compiled.bind_names if bind.required)
        # A call gives parameters by key; SQLAlchemy may render a key under another name (rare: truncation).
        # (Literals are `unique` binds with generated keys: their values are in `defaults`.)
        self.renamed = {
            bind.key: name for bind, name in self.compiled.bind_names.items() if not bind.unique and bind.key != name
        }
        # The same conversion SQLAlchemy applies to every bound value (JSON, enums, ...), None included:
        # a JSON column's None is JSON null, not SQL NULL.
        # A literal's is done once, here; a call's parameters at each call.
        self.converters: dict[str, Callable[[Any], Any]] = {}
        self.literals = frozenset(name for bind, name in self.compiled.bind_names.items() if bind.unique)
        for bind, name in self.compiled.bind_names.items():
            convert = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if convert is None:
                continue
            if bind.unique:
                self.defaults[name] = convert(self.defaults[name])
            else:
                self.converters[name] = convert
        self.row_type: Any = None
        # A positional driver (sqlite3's `?`): the parameters' names in the order the SQL text takes them.
        self.order: tuple[str, ...] | None = tuple(self.compiled.positiontup or ()) if dialect.positional else None

    def params(self, given: dict[str, Any]) -> dict[str, Any]:
        """The driver's parameters, as SQLAlchemy would send them: `given` by key, the literals, each converted."""
        if self.renamed or not self.required <= given.keys():
            values: dict[str, Any] = self.compiled.construct_params(given)  # it also says what is missing
            values.update((name, self.defaults[name]) for name in self.literals)  # converted already
        else:
            # The hot path: no per-call walk of the statement's binds (extra keys are ignored by psycopg).
            values = {**self.defaults, **given}
        for name, convert in self.converters.items():
            values[name] = convert(values[name])
        return values

    def args(self, values: dict[str, Any]) -> Any:
        """The parameters as the driver takes them: `values` itself, or a tuple in the SQL's order (positional)."""
        if self.order is None:
            return values
        return tuple(values[name] for name in self.order)

    def make_row(self, cursor: Any) -> Callable[[Any], Any]:
        """Row factory: named tuples with the statement's column names (the type built once)."""
        if self.row_type is None:
            if cursor.description is None:
                return tuple  # no rows to make (an UPDATE without RETURNING)
            # psycopg's columns have a name; sqlite3's are the DB-API's 7-tuples, name first.
            names = [getattr(column, "name", None) or column[0] for column in cursor.description]
            self.row_type = namedtuple("Row", names, rename=True)  # type: ignore[misc]
        return self.row_type._make  # type: ignore[no-any-return]


_compiled: dict[tuple[int, int], DriverStatement] = {}

#: Called with (SQL, parameters) before each statement this module sends: what SQLAlchemy's
#: before_cursor_execute event is for the other statements (tests and benchmarks count round trips).
statement_listeners: list[Callable[[str, dict[str, Any]], None]] = []

#: The key, in a pooled connection's `info`, of a statement `run_on_driver` sends before each statement on that
#: connection, in the same transaction: the session settings its connection cannot carry (store.pgbouncer).
STATEMENT_SETUP = "oncelery_statement_setup"


def driver_statement(stmt: Any, engine: Engine) -> DriverStatement:
    """The DriverStatement of `stmt` for `engine` (statements are built once per process and kept)."""
    key = (id(stmt), id(engine.dialect))
    found = _compiled.get(key)
    if found is None or found.compiled.statement is not stmt:
        found = _compiled[key] = DriverStatement(stmt, engine)
    return found


def prepared(stmt: Any, engine: Engine, params: dict[str, Any]) -> tuple[DriverStatement, dict[str, Any]]:
    """`stmt` compiled for `engine` and its driver parameters, told to the statement listeners (about to be sent)."""
    compiled = driver_statement(stmt, engine)
    values = compiled.params(params)
    for listener in statement_listeners:
        listener(compiled.sql, values)
    return compiled, values


def run_on_driver(engine: Engine, stmt: Any, params: dict[str, Any]) -> tuple[Any, int]:
    """Run `stmt` alone in autocommit on a pooled connection; return (first row or None, rows matched).

    Driver errors are raised as SQLAlchemy's (IntegrityError, OperationalError, ...), with
    `connection_invalidated` set, and the pool emptied, when the connection was lost: the caller's error
    handling is the same as for any other statement.
    """
    import psycopg  # an optional extra (oncelery[postgres]): imported only on PostgreSQL
    from psycopg.pq import ExecStatus  # the same optional extra

    compiled, values = prepared(stmt, engine, params)
    try:
        fairy = engine.raw_connection()
    except psycopg.Error as exc:
        # No connection at all (server down, refused): raised as SQLAlchemy raises a failed checkout.
        lost = engine.dialect.is_disconnect(cast(Any, exc), None, None)
        raise as_sqlalchemy_error(engine, compiled.sql, values, exc, psycopg.Error, lost) from exc
    conn: Any = fairy.driver_connection
    setup = fairy.info.get(STATEMENT_SETUP)
    broken = False
    try:
        # A connection of a transactional pool runs this one statement in autocommit (a client-side switch
        # while idle, no round trip), then goes back as it came.
        switched = not conn.autocommit
        if switched:
            conn.autocommit = True
        try:
            with conn.cursor(row_factory=compiled.make_row) as cur:
                if setup is None:
                    cur.execute(compiled.sql, values)
                else:
                    # Pipelined: both in one implicit transaction (it ends at the one Sync), one round trip.
                    with conn.pipeline():
                        conn.execute(setup)
                        cur.execute(compiled.sql, values)
                result = cur.pgresult
                row = cur.fetchone() if result is not None and result.status == ExecStatus.TUPLES_OK else None
                return row, cur.rowcount
        finally:
            if switched and not conn.closed:
                conn.autocommit = False
    except psycopg.Error as exc:
        broken = bool(conn.closed or conn.broken or engine.dialect.is_disconnect(cast(Any, exc), conn, None))
        raise as_sqlalchemy_error(engine, compiled.sql, values, exc, psycopg.Error, broken) from exc
    finally:
        give_back(engine, fairy, broken)


def as_sqlalchemy_error(
    engine: Engine, sql: str, values: Any, exc: Exception, base: type, lost: bool
) -> StatementError:
    """The driver error `exc` as SQLAlchemy raises it (IntegrityError, OperationalError...), `lost`: invalidated."""
    return DBAPIError.instance(sql, values, exc, base, connection_invalidated=lost, dialect=engine.dialect)


def give_back(engine: Engine, fairy: Any, broken: bool) -> None:
    """Return a pooled connection, or drop it and have the pool reconnect the others if it was `broken`."""
    if broken:
        # What SQLAlchemy itself does on a disconnect (Connection._handle_dbapi_exception): this connection
        # is dropped, and the pool's others (likely dead too after a server restart) are reconnected at
        # their next checkout, so the caller's one more try gets a live one.
        engine.pool._invalidate(fairy, None)
    else:
        fairy.close()


class DriverResult:
    """A statement's answer on the driver path: its rows (named tuples; None if it returns none), rows matched."""

    __slots__ = ("rowcount", "rows")

    def __init__(self, rows: list[Any] | None, rowcount: int) -> None:
        self.rows = rows
        self.rowcount = rowcount

    @property
    def returns_rows(self) -> bool:
        """Whether the statement returns rows (a SELECT, or DML with RETURNING), as SQLAlchemy's result says."""
        return self.rows is not None

    def first(self) -> Any:
        """The first row, or None."""
        return self.rows[0] if self.rows else None


class DriverTransaction:
    """Statements inside one write transaction of a pooled sqlite3 connection (see `driver_transaction`)."""

    def __init__(self, engine: Engine, conn: Any) -> None:
        self.engine = engine
        self.conn = conn
        self.begun = False
        self.last: tuple[str, Any] = ("BEGIN IMMEDIATE", ())  # what an error names

    def execute(self, stmt: Any, params: dict[str, Any]) -> DriverResult:
        """Run `stmt` in this transaction; driver errors leave `driver_transaction` as SQLAlchemy's."""
        compiled, values = prepared(stmt, self.engine, params)
        args = compiled.args(values)
        if not self.begun:
            # The file's write lock is taken at the first statement, its parameters ready: the caller's work
            # before it (building them, encoding JSON) is not time every other writer of the file waits for.
            # IMMEDIATE: the lock up front, before that statement reads (lock waits honour busy_timeout).
            self.conn.execute("BEGIN IMMEDIATE")
            self.begun = True
        self.last = (compiled.sql, values)
        cur = self.conn.execute(compiled.sql, args)
        try:
            if cur.description is None:
                return DriverResult(None, cur.rowcount)
            make = compiled.make_row(cur)
            rows = [make(row) for row in cur.fetchall()]  # all of them: RETURNING rows are counted as stepped
            return DriverResult(rows, cur.rowcount)
        finally:
            cur.close()


@contextmanager
def driver_transaction(engine: Engine) -> Iterator[DriverTransaction]:
    """One write transaction (BEGIN IMMEDIATE at its first statement) on a pooled sqlite3 connection of `engine`:
    committed at the end, rolled back if the block raises. Waits for the write lock as the connection's
    busy_timeout says. A block that runs no statement begins and commits nothing.

    Driver errors are raised as SQLAlchemy's (OperationalError, IntegrityError, ...), as `run_on_driver` does,
    so the caller's error handling is the one of any other statement.
    """
    fairy = engine.raw_connection()  # sqlite3 opens the file lazily: nothing to fail here that execute won't
    conn: Any = fairy.driver_connection
    tx = DriverTransaction(engine, conn)
    broken = False
    try:
        try:
            yield tx
            if tx.begun:
                tx.last = ("COMMIT", ())
                conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
    except sqlite3.Error as exc:
        sql, values = tx.last
        broken = bool(engine.dialect.is_disconnect(cast(Any, exc), conn, None))
        raise as_sqlalchemy_error(engine, sql, values, exc, sqlite3.Error, broken) from exc
    finally:
        give_back(engine, fairy, broken)
