"""`oncelery metrics`: serve the claims database's metrics to Prometheus over HTTP(S) until SIGTERM/Ctrl-C."""

from __future__ import annotations

import signal
import threading
from typing import Any

import click

from oncelery.basetask.idempotent import IdempotentTask
from oncelery.cli.context import celery_app_of, resolve_database_url
from oncelery.ops.exporter import DEFAULT_ADDR, Exporter, read_password_file, serve
from oncelery.ops.metrics import claims_registry
from oncelery.settings import DEFAULT_METRICS_MAX_TENANTS, ENV_METRICS_MAX_TENANTS
from oncelery.store.database import Database, safe_url

__all__ = [
    "DEFAULT_PORT",
    "metrics",
]

# Not on Prometheus' default-port list (its 9100-9999 block is fully allocated; 9808, our old default, is
# celery-exporter's, which Celery shops run beside us). docs/metrics.md, "The port", says why this one.
DEFAULT_PORT = 10734
_FILE = click.Path(exists=True, dir_okay=False, readable=True)


@click.command()
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True)
@click.option(
    "--addr",
    default=DEFAULT_ADDR,
    show_default=True,
    help="Address to listen on. The metrics name tasks and tenants: 0.0.0.0 only behind auth or a private network.",
)
@click.option("--tls-cert", type=_FILE, default=None, help="PEM certificate: serve HTTPS (needs --tls-key).")
@click.option("--tls-key", type=_FILE, default=None, help="PEM private key of --tls-cert.")
@click.option("--basic-auth-user", metavar="NAME", default=None, help="Require basic auth with this user name.")
@click.option(
    "--basic-auth-password-file",
    type=_FILE,
    default=None,
    help="File holding the basic-auth password (read once at start; surrounding whitespace ignored).",
)
@click.option(
    "--max-tenants",
    type=click.IntRange(1),
    envvar=ENV_METRICS_MAX_TENANTS,
    default=DEFAULT_METRICS_MAX_TENANTS,
    show_default=True,
    help="Tenants (most deliveries first) that keep their own tenant label; the rest are summed as 'other'.",
)
@click.option(
    "--task",
    "tasks",
    multiple=True,
    metavar="NAME",
    help="A task whose outcome series exist at 0 before its first delivery (repeatable; `celery -A` adds "
    "the app's idempotent tasks).",
)
@click.pass_context
def metrics(
    ctx: click.Context,
    port: int,
    addr: str,
    tls_cert: str | None,
    tls_key: str | None,
    basic_auth_user: str | None,
    basic_auth_password_file: str | None,
    max_tenants: int,
    tasks: tuple[str, ...],
) -> None:
    """Serve /metrics for Prometheus: every value read from the claims database at scrape time."""
    url = resolve_database_url(ctx)
    known = sorted({*tasks, *_idempotent_tasks(celery_app_of(ctx))})
    Database(url).require_file()  # a mistyped SQLite path fails now, not on every scrape
    password = read_password_file(basic_auth_password_file) if basic_auth_password_file else None
    exporter = Exporter(port, addr, tls_cert, tls_key, basic_auth_user, password)
    if exporter.user and exporter.scheme == "http":
        click.echo("metrics: warning: basic auth over plain HTTP sends the password in clear (add --tls-cert)")
    _serve_until_stopped(exporter, url, known, max_tenants)
    click.echo("metrics stopped")


def _idempotent_tasks(app: Any) -> list[str]:
    # The tasks of the app `celery -A` loaded (none when run as plain `oncelery`): known before their first run.
    if app is None:
        return []
    return [name for name, task in app.tasks.items() if isinstance(task, IdempotentTask)]


def _serve_until_stopped(exporter: Exporter, url: str, tasks: list[str], max_tenants: int) -> None:
    stop = threading.Event()

    def _stop(_signum: int, _frame: Any) -> None:
        stop.set()  # a scrape in flight finishes: the server shuts down between requests

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server, thread = serve(claims_registry(url, tasks, max_tenants), exporter)
        try:
            bound = server.server_address[1]
            auth = f", basic auth as {exporter.user}" if exporter.user else ""
            where = f"{exporter.scheme}://{exporter.addr}:{bound}/metrics"
            click.echo(f"metrics: serving {where} for {safe_url(url)}{auth} (Ctrl-C or SIGTERM stops)")
            stop.wait()
        finally:
            server.shutdown()
            server.server_close()
            thread.join(10)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
