"""Up-front reachability of the services a command needs: the broker, the result backend, the claims database.

Checked before a command does anything, with short timeouts: an unreachable service is then one line naming
its setting and its URL (password masked), not a traceback after kombu's and the driver's retries. A check
only proves the service answers; what it says afterwards (a bad password, a missing table) is reported by
the command as before.
"""

from __future__ import annotations

import os
import socket
from typing import Any
from urllib.parse import urlsplit

from kombu.utils.url import sanitize_url
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError
from sqlalchemy.pool import NullPool

from oncelery.embedded_broker import SCHEME
from oncelery.errors import ServiceUnreachable
from oncelery.settings import ENV_BROKER_URL, ENV_RESULT_BACKEND
from oncelery.store.database import normalize_url, safe_url
from oncelery.store.dialects import dialect_of
from oncelery.store.pgbouncer import driver_url

REACH_TIMEOUT = 2.0  # seconds per service: a live service on a LAN answers in milliseconds
# Ports of the schemes whose URL may leave the port out (kombu's and Celery's defaults).
_DEFAULT_PORTS = {
    "redis": 6379,
    "rediss": 6379,
    "sentinel": 26379,
    "amqp": 5672,
    "amqps": 5671,
    "pyamqp": 5672,
    "postgresql": 5432,
    "postgres": 5432,
    "mysql": 3306,
    "mongodb": 27017,
}
# URLs that name no network service (files, memory) or ride on the broker (rpc): nothing to reach.
_LOCAL_SCHEMES = ("filesystem", SCHEME, "memory", "sqlite", "file", "rpc", "cache", "disabled")


def masked(url: str) -> str:
    """Return `url` with its password masked (never the secret), whatever the scheme."""
    try:
        return safe_url(url)
    except (ArgumentError, ValueError):  # a kombu-only shape (failover lists, sentinel) SQLAlchemy cannot parse
        return str(sanitize_url(url, mask="***"))


def check_broker(url: str, setting: str = ENV_BROKER_URL, timeout: float = REACH_TIMEOUT) -> None:
    """Return if the broker at `url` accepts a TCP connection within `timeout`, else raise ServiceUnreachable."""
    _check_tcp("broker", url, setting, timeout)


def check_result_backend(url: str, setting: str = ENV_RESULT_BACKEND, timeout: float = REACH_TIMEOUT) -> None:
    """Return if the result backend at `url` accepts a TCP connection within `timeout`, else raise."""
    _check_tcp("result backend", url, setting, timeout)


def check_database(url: str, setting: str, timeout: float = REACH_TIMEOUT) -> None:
    """Return if the claims database answers `SELECT 1` within `timeout` (SQLite files: always), else raise."""
    if make_url(url).get_backend_name() != "postgresql":
        return  # a SQLite file needs no server; reads and upgrades report a missing file with the fix
    # Before create_engine, which imports the driver itself: a missing psycopg is one line naming the extra.
    dialect_of(url).require_driver()
    # Its own engine without a pool: the check must not leave a connection (or a 30 s pool) behind.
    engine = create_engine(
        driver_url(normalize_url(url)), poolclass=NullPool, connect_args={"connect_timeout": int(timeout)}
    )
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except DBAPIError as exc:
        reason = _first_line(str(exc.orig if exc.orig is not None else exc))
        if "does not exist" in reason or "authentication" in reason:
            return  # it answered: the command says what to create or fix, as before
        raise ServiceUnreachable.of("claims database", setting, masked(url), reason) from exc
    finally:
        engine.dispose()


def check_app(app: Any, *, backend: bool = True, timeout: float = REACH_TIMEOUT) -> None:
    """Check the Celery app's broker (and result backend if `backend`), naming the setting each came from."""
    conf = app.conf
    broker = str(conf.broker_url or "")
    check_broker(broker, _setting(ENV_BROKER_URL, "broker_url", broker), timeout)
    if backend and conf.result_backend:
        result = str(conf.result_backend)
        check_result_backend(result, _setting(ENV_RESULT_BACKEND, "result_backend", result), timeout)


def _setting(env: str, conf_name: str, value: str) -> str:
    # The variable a user set, when the value is that variable's; otherwise the app's own Celery setting.
    return env if os.environ.get(env, "").strip() == value else conf_name


def _check_tcp(what: str, url: str, setting: str, timeout: float) -> None:
    # A failover list ("a;b") is tried in order by kombu: the first one is the one a command starts with.
    first = url.split(";", 1)[0].strip()
    scheme = first.split("://", 1)[0].lower().removeprefix("db+")
    if not first or scheme.split("+", 1)[0] in _LOCAL_SCHEMES:
        return
    try:
        parts = urlsplit(first)
        host, port = parts.hostname, parts.port or _DEFAULT_PORTS.get(scheme.split("+", 1)[0])
    except ValueError as exc:  # a port that is not a number
        raise ServiceUnreachable.of(what, setting, masked(url), f"not a valid URL ({exc})") from exc
    if host is None or port is None:
        return  # a Unix socket or an unknown scheme: left to the command's own client
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        if isinstance(exc, TimeoutError | socket.timeout):
            reason = f"no answer within {timeout:g} s"
        raise ServiceUnreachable.of(what, setting, masked(url), reason) from exc


def _first_line(text_: str) -> str:
    return text_.strip().splitlines()[0].strip() if text_.strip() else "no answer"


__all__ = ["REACH_TIMEOUT", "check_app", "check_broker", "check_database", "check_result_backend", "masked"]
