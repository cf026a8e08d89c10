"""`oncelery metrics`: serve the claims database's metrics to Prometheus over HTTP until SIGTERM/Ctrl-C."""

from __future__ import annotations

import signal
import threading
from typing import Any

import click
from prometheus_client import start_http_server

from oncelery.cli.context import resolve_database_url
from oncelery.ops.metrics import claims_registry
from oncelery.store.database import Database, safe_url

__all__ = [
    "DEFAULT_PORT",
    "metrics",
]

DEFAULT_PORT = 9808  # registered for no other exporter on the Prometheus default-port list


@click.command()
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True)
@click.option("--addr", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.pass_context
def metrics(ctx: click.Context, port: int, addr: str) -> None:
    """Serve /metrics for Prometheus: every value read from the claims database at scrape time."""
    url = resolve_database_url(ctx)
    Database(url).require_file()  # a mistyped SQLite path fails now, not on every scrape
    stop = threading.Event()

    def _stop(_signum: int, _frame: Any) -> None:
        stop.set()  # a scrape in flight finishes: the server shuts down between requests

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server, thread = start_http_server(port, addr, registry=claims_registry(url))
        try:
            bound = server.server_address[1]
            click.echo(f"metrics: serving http://{addr}:{bound}/metrics for {safe_url(url)} (Ctrl-C or SIGTERM stops)")
            stop.wait()
        finally:
            server.shutdown()
            server.server_close()
            thread.join(10)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    click.echo("metrics stopped")
