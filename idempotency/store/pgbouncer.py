"""PostgreSQL behind PgBouncer in transaction pooling mode: what changes, in one place.

A claims-database URL with the query flag `oncelery_pgbouncer=1`
(`postgresql://app@pgbouncer:6432/claims?oncelery_pgbouncer=1`) says its connections go through PgBouncer with
`pool_mode = transaction`, which hands each transaction to whichever server connection is free. Two things a
direct connection relies on then break, and this dialect replaces them:

- **No startup parameter `options`.** The fast pool (claims, lease renewals) asks for
  `-c synchronous_commit=off` there; PgBouncer refuses the parameter ("unsupported startup parameter:
  options"), or, with `ignore_startup_parameters = options`, drops it, and claims then silently commit
  durably. Here the settings Oncelery's engines would send at startup are sent with each statement instead:
  `SELECT set_config(name, value, true)` (what `SET LOCAL` does) pipelined before it, in the same implicit
  transaction (one Sync, one network round trip; `store.driver.run_on_driver`). They end with that transaction,
  so no other client's transaction on that server connection ever sees them. A URL's own `options` are refused
  here, naming where to put them instead.
- **No prepared statements.** psycopg prepares a statement it ran 5 times on a connection (`_pg3_N`); behind
  PgBouncer the next transaction may run on a server connection that lacks it, or where another client prepared
  that name. PgBouncer before 1.21 cannot track them at all: every connection gets `prepare_threshold=None`.

Everything else is PostgreSQL's: the statements, the clock, `SET LOCAL synchronous_commit = on` inside durable
transactions. docs/scaling.md has the PgBouncer configuration.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import URL, Engine, make_url

from oncelery.errors import ConfigurationError
from oncelery.store.dialects import PostgreSQL
from oncelery.store.driver import STATEMENT_SETUP

__all__ = ["PGBOUNCER_FLAG", "PgBouncer", "behind_pgbouncer", "driver_url", "pgbouncer", "settings_statement"]

#: The query flag of a claims-database URL whose connections go through PgBouncer in transaction mode.
PGBOUNCER_FLAG = "oncelery_pgbouncer"
_ON = ("1", "true", "yes", "on")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_VALUE = re.compile(r"[A-Za-z0-9_.:+-]*")


def behind_pgbouncer(url: str | URL) -> bool:
    """Whether `url` carries `oncelery_pgbouncer=1`; raise ConfigurationError for any other value of the flag."""
    value = make_url(url).query.get(PGBOUNCER_FLAG)
    if value is None:
        return False
    if isinstance(value, str) and value.lower() in _ON:
        return True
    raise ConfigurationError(
        f"{PGBOUNCER_FLAG}={value!r} in the claims database URL: use {PGBOUNCER_FLAG}=1 when the URL points at "
        "PgBouncer in transaction pooling mode, or leave the flag out"
    )


def driver_url(url: str) -> str:
    """`url` without Oncelery's own query flag: what the driver is given (libpq refuses options it does not know)."""
    parsed = make_url(url)
    if PGBOUNCER_FLAG not in parsed.query:
        return url
    return parsed.difference_update_query([PGBOUNCER_FLAG]).render_as_string(hide_password=False)


def settings_statement(options: str) -> str | None:
    """The `set_config(..., true)` statement equivalent to startup `options` (`-c name=value ...`); None if empty.

    Only Oncelery's own options reach here (a URL's are refused), so anything but `-c name=value` is a bug.
    """
    pairs: list[tuple[str, str]] = []
    tokens = options.split()
    while tokens:
        token = tokens.pop(0)
        if token == "-c" and tokens:
            token = tokens.pop(0)
        elif token.startswith(("-c", "--")):
            token = token[2:]
        name, sep, value = token.partition("=")
        if not sep or not _NAME.fullmatch(name) or not _VALUE.fullmatch(value):
            raise ConfigurationError(f"Cannot send the startup option {token!r} per transaction behind PgBouncer")
        pairs.append((name, value))
    if not pairs:
        return None
    return "SELECT " + ", ".join(f"set_config('{name}', '{value}', true)" for name, value in pairs)


class PgBouncer(PostgreSQL):
    """PostgreSQL through PgBouncer in transaction pooling mode: no startup options, no prepared statements."""

    def create_engine(self, url: str, mode: str) -> Engine:
        given = make_url(url)
        if given.get_driver_name() != "psycopg":
            raise ConfigurationError(
                f"{PGBOUNCER_FLAG}=1 needs the psycopg 3 driver: use a postgresql:// (or postgresql+psycopg://) URL"
            )
        if given.query.get("options"):
            raise ConfigurationError(
                "PgBouncer refuses the startup parameter `options` of the claims database URL: set those settings "
                "on the role (ALTER ROLE ... SET) or the database (ALTER DATABASE ... SET) instead"
            )
        engine = super().create_engine(driver_url(url), mode)

        @event.listens_for(engine, "do_connect")
        def _through_pgbouncer(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> Any:
            # The engine's startup options become a statement sent with each statement on the connection (the
            # driver path reads it from the pool record); the shared `cparams` stay as they are.
            params = {**cparams, "prepare_threshold": None}
            setup = settings_statement(str(params.pop("options", "") or ""))
            if setup is not None and record is not None:
                record.info[STATEMENT_SETUP] = setup
            return dialect.connect(*cargs, **params)

        return engine


@cache
def pgbouncer() -> PgBouncer:
    """The `PgBouncer` dialect (one per process, as the others)."""
    return PgBouncer()
