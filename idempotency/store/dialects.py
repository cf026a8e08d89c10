"""PostgreSQL and SQLite differences, in one place: engines, the database clock, leases, upserts.

Everything else in Oncelery asks the `Dialect` of its database instead of branching on a name.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

from sqlalchemy import Float, String, bindparam, create_engine, event, func, type_coerce
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.sql.elements import ColumnElement

from oncelery.errors import ConfigurationError, DriverMissing
from oncelery.settings import sqlite_busy_timeout_ms

__all__ = [
    "MODE_AUTOCOMMIT",
    "MODE_DEFAULT",
    "MODE_FAST",
    "MODE_PRODUCER",
    "MODE_READ",
    "SQLITE_TIME_FORMAT",
    "Dialect",
    "PostgreSQL",
    "SQLite",
    "dialect",
    "dialect_of",
    "producer_mode",
    "producer_timeout_ms",
]

# Engine modes: the default (transactions), "read" (never takes SQLite's writer lock), and "fast"
# (autocommit claims and renewals that need not wait for a WAL flush on PostgreSQL).
MODE_DEFAULT = ""
MODE_READ = "read"
MODE_FAST = "fast"
MODE_AUTOCOMMIT = "autocommit"  # durable single statements
# A producer's check before it publishes (oncelery.basetask.producer): its own small pool, every statement bounded by
# a timeout (the mode's suffix, in ms), so a slow database delays a `.delay()` by that much at most.
MODE_PRODUCER = "producer"


def producer_mode(seconds: float) -> str:
    """The engine mode of producer checks bounded by `seconds` (one engine per distinct bound)."""
    return f"{MODE_PRODUCER}:{max(1, round(seconds * 1000))}"


def producer_timeout_ms(mode: str) -> int | None:
    """The bound in ms of a producer mode, or None for any other mode."""
    name, _, ms = mode.partition(":")
    return int(ms) if name == MODE_PRODUCER and ms else None


class Dialect:
    """What differs between the databases Oncelery runs on; one subclass per dialect."""

    name = ""
    #: Single statements run in autocommit mode (no BEGIN/COMMIT round trips).
    autocommit_statements = False
    #: A data-modifying CTE can do the completion and its outcome counter in one statement.
    dml_in_cte = False

    def create_engine(self, url: str, mode: str) -> Engine:
        """Return a new engine for `url` in `mode`."""
        raise NotImplementedError

    def require_driver(self) -> None:
        """Return if this dialect's DBAPI driver imports, else raise DriverMissing naming the extra to install.

        Called before SQLAlchemy's create_engine, which imports the driver itself and fails with a traceback.
        """

    def now(self) -> ColumnElement[Any]:
        """The database clock's current time (leases never use a worker's clock)."""
        raise NotImplementedError

    def lease_until(self, param: str = "p_lease") -> ColumnElement[Any]:
        """The database clock plus the seconds bound to `param` (its value made by `lease_param`)."""
        raise NotImplementedError

    def epoch(self) -> ColumnElement[Any]:
        """The database clock's current time in seconds since 1970 (a float a message header can carry)."""
        raise NotImplementedError

    def lease_param(self, seconds: float) -> Any:
        """The value of `p_lease` for a lease of `seconds`."""
        raise NotImplementedError

    def commit_durably(self, conn: Connection) -> None:
        """Make the caller's open transaction commit durably whatever the server's default (SQLite always does)."""

    def bound_statements(self, conn: Connection, ms: int) -> None:
        """Bound each later statement of the caller's open transaction (lock waits included) by `ms`.

        SQLite: nothing here; its connection's busy_timeout bounds a lock wait, and a local file has no network.
        """

    def past(self, seconds: float) -> str:
        """SQL text for the database clock `seconds` ago (tests and tools that expire a lease)."""
        raise NotImplementedError

    @property
    def insert(self) -> Callable[..., Any]:
        """The dialect's INSERT construct (with ON CONFLICT support)."""
        raise NotImplementedError

    #: How the driver names a violation of the partial unique index "one RUNNING run per entity"
    #: (models.runs.TaskRun), as it appears in the error's message.
    entity_index_name = ""
    #: SELECT ... FOR UPDATE SKIP LOCKED exists: two relays never take the same rows in one round.
    skips_locked_rows = False

    def is_entity_lock_violation(self, exc: BaseException) -> bool:
        """Whether a driver's integrity error is the entity lock refusing a second RUNNING run."""
        return bool(self.entity_index_name) and self.entity_index_name in str(getattr(exc, "orig", exc))

    def locked_rows(self, query: Any, **of: Any) -> Any:
        """`query` taking its rows FOR UPDATE SKIP LOCKED where the database can; `query` unchanged where not.

        SQLite has one writer at a time, so nothing else can take the rows a writer's transaction reads.
        """
        return query.with_for_update(skip_locked=True, **of) if self.skips_locked_rows else query

    #: Modes that get an engine (and pool) of their own; the others share the default engine.
    own_engine_modes: frozenset[str] = frozenset({MODE_DEFAULT})

    #: Queries of one text value naming this database's contents, which a restore or a replacement changes
    #: (store.identity), most precise first: a later one serves where the server refuses an earlier one.
    #: Empty (SQLite): the identity never changes; after a restore, `oncelery cache flush`.
    identity_queries: tuple[str, ...] = ()


class PostgreSQL(Dialect):
    """PostgreSQL through psycopg 3."""

    name = "postgresql"
    autocommit_statements = True
    dml_in_cte = True
    entity_index_name = "uq_task_runs_running_concurrency_key"  # named by the index
    skips_locked_rows = True

    def require_driver(self) -> None:
        try:
            import psycopg  # noqa: F401  (an optional extra: oncelery[postgres]; absent, one line names it)
        except ImportError as exc:
            raise DriverMissing.of("PostgreSQL", "psycopg 3", "postgres") from exc

    def create_engine(self, url: str, mode: str) -> Engine:
        self.require_driver()
        # No pre-ping: it costs a round trip per checkout. A connection found dead raises a disconnect
        # error (StoreUnavailable: the job is re-sent) and SQLAlchemy then invalidates the whole pool.
        if mode == MODE_AUTOCOMMIT:
            # Durable single statements (a completion, a count): a pool of autocommit connections, so the
            # driver path neither switches autocommit on and off around each statement nor resets the
            # connection when it goes back (there is never a transaction to roll back).
            return _autocommit_engine(url)
        if mode == MODE_FAST:
            # Claims and lease renewals need not survive a database crash (a lost claim only fails its
            # holder's fenced completion; the random owner keeps tokens unique). Not waiting for the WAL
            # flush keeps a claim to one cheap round trip.
            return _autocommit_engine(url, "synchronous_commit=off")
        bound = producer_timeout_ms(mode)
        if bound is not None:
            # A producer's check: statement_timeout bounds a slow or blocked statement; libpq's connect_timeout
            # (whole seconds, at least 2) bounds a server that does not answer at all. The caller then publishes
            # as it would without the check, and skips checks for a while (oncelery.basetask.producer).
            return _autocommit_engine(
                url, "synchronous_commit=off", f"statement_timeout={bound}", connect_timeout=max(2, -(-bound // 1000))
            )
        return create_engine(url, pool_size=5, max_overflow=10)

    def now(self) -> ColumnElement[Any]:
        # clock_timestamp(), not now(): now() is frozen at the start of a (possibly long) transaction.
        return func.clock_timestamp()

    def lease_until(self, param: str = "p_lease") -> ColumnElement[Any]:
        return func.clock_timestamp() + func.make_interval(0, 0, 0, 0, 0, 0, bindparam(param, type_=Float))

    def epoch(self) -> ColumnElement[Any]:
        return type_coerce(func.extract("epoch", func.clock_timestamp()), Float)

    def lease_param(self, seconds: float) -> Any:
        return float(seconds)

    def commit_durably(self, conn: Connection) -> None:
        # A server (or role) set to commit asynchronously would acknowledge before the WAL reaches the disk.
        conn.exec_driver_sql("SET LOCAL synchronous_commit = on")

    def bound_statements(self, conn: Connection, ms: int) -> None:
        # SET LOCAL: the bound ends with this transaction, so the pooled connection keeps its own setting.
        conn.exec_driver_sql(f"SET LOCAL statement_timeout = {max(1, int(ms))}")

    def past(self, seconds: float) -> str:
        return f"clock_timestamp() - interval '{float(seconds)} seconds'"

    @property
    def insert(self) -> Callable[..., Any]:
        return postgresql.insert

    own_engine_modes = frozenset({MODE_DEFAULT, MODE_FAST, MODE_AUTOCOMMIT})

    # The cluster (initdb: a restore into a new cluster), its timeline (a promoted replica, a point-in-time
    # recovery), this database (a dump restored into the same cluster as a new database) and the server's start
    # as epoch seconds, whatever the session's TimeZone (any start: a file-level restore in place keeps the
    # other three). pg_control_* may be refused to an application's role (revoked on some managed services);
    # then the second: without the cluster and timeline, every restore and failover still restarts a server.
    identity_queries = (
        "SELECT s.system_identifier::text || '/' || c.timeline_id::text || '/' || d.oid::text || '/' || "
        "extract(epoch FROM pg_postmaster_start_time())::text "
        "FROM pg_control_system() s, pg_control_checkpoint() c, pg_database d WHERE d.datname = current_database()",
        "SELECT 'no-control/' || d.oid::text || '/' || extract(epoch FROM pg_postmaster_start_time())::text "
        "FROM pg_database d WHERE d.datname = current_database()",
    )


def _autocommit_engine(url: str, *settings: str, **connect_args: Any) -> Engine:
    """A PostgreSQL pool of autocommit connections started with `settings` ("name=value"), for single statements.

    connect_args replace the URL's own `options` (e.g. a search_path): they are kept, before ours. A returned
    connection has no transaction to roll back, so none is reset.
    """
    given = str(make_url(url).query.get("options") or "")
    options = " ".join(filter(None, [given, *(f"-c {setting}" for setting in settings)]))
    if options:
        connect_args["options"] = options
    return create_engine(
        url,
        isolation_level="AUTOCOMMIT",
        pool_size=5,
        max_overflow=10,
        connect_args=connect_args,
        pool_reset_on_return=None,
    )


# Millisecond text in the layout SQLAlchemy stores DateTime in on SQLite, so comparisons hold.
SQLITE_TIME_FORMAT = "%Y-%m-%d %H:%M:%f"


class SQLite(Dialect):
    """SQLite in WAL mode: one writer at a time, readers alongside it."""

    name = "sqlite"
    entity_index_name = "task_runs.concurrency_key"  # named by the index's last column

    def create_engine(self, url: str, mode: str) -> Engine:
        read_only = mode == MODE_READ
        bound = producer_timeout_ms(mode)
        # A producer's check waits for the writer lock only as long as its bound, then publishes without it.
        busy_ms = sqlite_busy_timeout_ms() if bound is None else bound
        engine = create_engine(url, connect_args={"timeout": busy_ms / 1000})

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            # Take over transaction control from pysqlite, whose implicit BEGIN is DEFERRED: a deferred
            # transaction that reads then writes fails at once with "database is locked" instead of waiting.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
            cur.execute(f"PRAGMA busy_timeout={busy_ms}")
            cur.execute("PRAGMA foreign_keys=ON")
            if mode == MODE_FAST or bound is not None:
                # Claims and lease renewals, as on PostgreSQL (synchronous_commit=off): committed without an
                # fsync, so a power loss (never a process crash: WAL) may forget the last ones; the fence makes
                # a forgotten claim harmless, and the next durable commit (a completion) syncs them too.
                cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Any) -> None:
            # IMMEDIATE takes the write lock up front, so lock waits honour busy_timeout; readers need none.
            conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

        return engine

    def now(self) -> ColumnElement[Any]:
        return func.strftime(SQLITE_TIME_FORMAT, "now")

    def lease_until(self, param: str = "p_lease") -> ColumnElement[Any]:
        return func.strftime(SQLITE_TIME_FORMAT, "now", bindparam(param, type_=String))

    def epoch(self) -> ColumnElement[Any]:
        # julianday() keeps the milliseconds (strftime('%s') would not); 2440587.5 is 1970-01-01 as a Julian day.
        return type_coerce((func.julianday("now") - 2440587.5) * 86400.0, Float)

    def lease_param(self, seconds: float) -> Any:
        return f"{seconds:+.3f} seconds"

    def past(self, seconds: float) -> str:
        return f"strftime('{SQLITE_TIME_FORMAT}', 'now', '-{float(seconds)} seconds')"

    @property
    def insert(self) -> Callable[..., Any]:
        return sqlite.insert

    own_engine_modes = frozenset({MODE_DEFAULT, MODE_READ, MODE_FAST})


@cache
def dialect(name: str) -> Dialect:
    """Return the `Dialect` called `name` ("postgresql" or "sqlite"), or raise ConfigurationError."""
    for cls in (PostgreSQL, SQLite):
        if cls.name == name:
            return cls()
    raise ConfigurationError(f"Unsupported database dialect {name!r}: use PostgreSQL or SQLite")


def dialect_of(url: str) -> Dialect:
    """Return the `Dialect` of a database URL (PostgreSQL through PgBouncer when it says `oncelery_pgbouncer=1`)."""
    parsed = make_url(url)
    name = parsed.get_backend_name()
    if name == "postgresql" and parsed.query:
        from oncelery.store.pgbouncer import behind_pgbouncer, pgbouncer  # it builds on PostgreSQL, above

        if behind_pgbouncer(parsed):
            return pgbouncer()
    return dialect(name)
