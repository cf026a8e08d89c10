"""Serving the claims metrics over HTTP(S): the address, TLS through prometheus_client, and basic auth.

The metrics carry task and tenant names, so the exporter listens on 127.0.0.1 unless told otherwise
(`oncelery metrics --addr`). prometheus_client serves and terminates TLS itself (its certfile/keyfile
options); it has no authentication, so `BasicAuth` wraps its WSGI app, with the password read from a file
(never from the command line, where `ps` shows it to every user of the host).

`/healthz` answers 200 "ok" to anyone, without reading the database and without credentials: the container's
health check (deploy/bin/oncelery-healthcheck) says the server serves, and it discloses nothing.

The server starts on an empty registry and gets its real app before `serve` returns: a request that races
the start is answered with no metric at all, never with the metrics unauthenticated.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import make_wsgi_app, start_http_server
from prometheus_client.registry import CollectorRegistry

from oncelery.errors import ConfigurationError

__all__ = [
    "DEFAULT_ADDR",
    "HEALTH_PATH",
    "BasicAuth",
    "Exporter",
    "read_password_file",
    "serve",
    "with_health",
]

logger = logging.getLogger("oncelery.metrics")

DEFAULT_ADDR = "127.0.0.1"  # tenant names are not for the whole network: 0.0.0.0 only when asked (compose)
REALM = "oncelery metrics"
HEALTH_PATH = "/healthz"
_HEALTHY = b"ok\n"
_UNAUTHORIZED = b"401 Unauthorized: this exporter needs the user and password given to --basic-auth-user\n"

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


def _digest(credentials: bytes) -> bytes:
    # Compare digests, not the strings: equal lengths, so the comparison's time says nothing about the password.
    return hashlib.sha256(credentials).digest()


class BasicAuth:
    """A WSGI app that serves `app` only to requests carrying these credentials (RFC 7617), else answers 401."""

    def __init__(self, app: WsgiApp, user: str, password: str) -> None:
        self.app = app
        self._expected = _digest(f"{user}:{password}".encode())

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        """The wrapped app's answer for the right credentials; 401 with a Basic challenge for any other."""
        if self.accepts(environ.get("HTTP_AUTHORIZATION", "")):
            return self.app(environ, start_response)
        if environ.get("HTTP_AUTHORIZATION"):
            logger.warning("metrics: refused a scrape from %s: wrong credentials", environ.get("REMOTE_ADDR", "?"))
        challenge = f'Basic realm="{REALM}", charset="UTF-8"'
        headers = [("WWW-Authenticate", challenge), ("Content-Type", "text/plain; charset=utf-8")]
        start_response("401 Unauthorized", [*headers, ("Content-Length", str(len(_UNAUTHORIZED)))])
        return [_UNAUTHORIZED]

    def accepts(self, authorization: str) -> bool:
        """True only for `Basic base64(user:password)` with the expected pair, compared in constant time."""
        scheme, _, encoded = authorization.partition(" ")
        given = b""
        if scheme.lower() == "basic":
            try:
                given = base64.b64decode(encoded.strip(), validate=True)
            except (binascii.Error, ValueError):
                given = b""
        return hmac.compare_digest(_digest(given), self._expected)


def with_health(app: WsgiApp) -> WsgiApp:
    """`app`, except that HEALTH_PATH answers 200 "ok" (no database read, no credentials asked)."""

    def health(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != HEALTH_PATH:
            return app(environ, start_response)
        headers = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(_HEALTHY)))]
        start_response("200 OK", headers)
        return [_HEALTHY]

    return health


def read_password_file(path: str | Path) -> str:
    """The password in `path`, surrounding whitespace removed (as Prometheus' `password_file` does); never empty."""
    try:
        password = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"Cannot read the basic-auth password file {path}: {exc}", path=str(path)) from exc
    if not password:
        raise ConfigurationError(
            f"The basic-auth password file {path} is empty: write the password into it "
            "(e.g. `openssl rand -hex 24 > FILE`) and give Prometheus the same one (basic_auth.password_file)",
            path=str(path),
        )
    return password


@dataclass(frozen=True)
class Exporter:
    """How `serve` exposes a registry: where it listens, its TLS certificate and key, its basic-auth login."""

    port: int
    addr: str = DEFAULT_ADDR
    certfile: str | None = None
    keyfile: str | None = None
    user: str | None = None
    password: str | None = None

    def __post_init__(self) -> None:
        # Half a TLS pair would serve plain HTTP (prometheus_client needs both), half a login no auth at all.
        if (self.certfile is None) != (self.keyfile is None):
            raise ConfigurationError("TLS needs both --tls-cert and --tls-key (a PEM certificate and its key)")
        if (self.user is None) != (self.password is None):
            raise ConfigurationError("Basic auth needs both --basic-auth-user and --basic-auth-password-file")

    @property
    def scheme(self) -> str:
        """https when a certificate is given, else http."""
        return "https" if self.certfile else "http"

    def app(self, registry: CollectorRegistry) -> WsgiApp:
        """prometheus_client's WSGI app for `registry`, behind basic auth when a user is set; /healthz open."""
        app: WsgiApp = make_wsgi_app(registry)
        if self.user is not None and self.password is not None:
            app = BasicAuth(app, self.user, self.password)
        return with_health(app)


def serve(registry: CollectorRegistry, exporter: Exporter) -> tuple[WSGIServer, threading.Thread]:
    """Serve `registry` on a daemon thread as `exporter` says; the app is in place before this returns."""
    try:
        server, thread = start_http_server(
            exporter.port,
            exporter.addr,
            registry=CollectorRegistry(auto_describe=False),  # empty until the real app is set below
            certfile=exporter.certfile,
            keyfile=exporter.keyfile,
        )
    except OSError as exc:  # ssl.SSLError included
        raise ConfigurationError(
            f"Cannot serve metrics on {exporter.addr}:{exporter.port}: {exc}. Check --addr/--port (is the port "
            "free?) and that --tls-cert/--tls-key are a PEM certificate and its key",
            addr=exporter.addr,
            port=exporter.port,
        ) from exc
    server.set_app(exporter.app(registry))
    return server, thread
