"""How a command finds what it works on: the claims database (checked reachable once per command line), the
Celery app that publishes, and the exit code of a configuration problem."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click
from celery import Celery
from celery.app.utils import find_app

from oncelery.embedded_broker import URL as EMBEDDED_BROKER_URL
from oncelery.embedded_broker import is_embedded_broker
from oncelery.errors import BrokerNotConfigured, ConfigurationError
from oncelery.ops.reach import check_app, check_database
from oncelery.settings import (
    CONF_DATABASE_URL,
    ENV_BROKER_URL,
    ENV_DATABASE_URL,
    configured_database_url,
    embedded_database_url,
    is_embedded_database,
)
from oncelery.store.database import safe_url

__all__ = [
    "APP_HELP",
    "EXIT_CONFIGURATION",
    "URL_META",
    "ConfigurationProblem",
    "celery_app_of",
    "check_services",
    "refuse_unread_broker",
    "resolve_app",
    "resolve_database_url",
    "resolve_publisher",
]

URL_META = "oncelery.database_url"
# The --app option of every command that publishes (relay, dlq replay).
APP_HELP = (
    "The Celery app to publish with (module or module:attribute). Default: the app of `celery -A`, "
    "else one built from oncelery.celeryconfig on ONCELERY_BROKER_URL (the embedded broker only for the "
    "demo's database ./oncelery.db)."
)
_CHECKED_META = "oncelery.database_checked"
# Exit codes: 0 done; 1 the command failed (no such run, a driver error, a timeout); 2 the configuration or
# environment is wrong (a bad value, an unreachable service): nothing was done, fix the setting and re-run.
EXIT_CONFIGURATION = 2


class ConfigurationProblem(click.ClickException):
    """A bad setting or an unreachable service: printed as one line `oncelery: <message>`, exit code 2."""

    exit_code = EXIT_CONFIGURATION

    def show(self, file: Any = None) -> None:
        """Print the message as one line on stderr (the message names the setting and what to give)."""
        click.echo(f"oncelery: {' '.join(self.format_message().split())}", err=True)


def resolve_database_url(ctx: click.Context, fallback_app: Any = None, *, embedded: bool = False) -> str:
    """Return the database to use: --database-url, else the Celery app's config, else the environment.

    With none of them: the embedded demo database if `embedded` (the demo commands) or if its file exists
    (reads after a demo run); otherwise a ConfigurationError saying what to set. Nothing is created here.
    """
    explicit: str | None = ctx.meta.get(URL_META)
    if explicit:
        return _reachable(ctx, explicit, "--database-url")
    app = getattr(ctx.obj, "app", None) or fallback_app  # ctx.obj is Celery's CLIContext under `celery`
    url = configured_database_url(app.conf if app is not None else None)
    if url is not None:
        return _reachable(ctx, url, ENV_DATABASE_URL if os.environ.get(ENV_DATABASE_URL) == url else CONF_DATABASE_URL)
    demo = embedded_database_url()
    if embedded or Path(demo.removeprefix("sqlite:///")).exists():
        return demo
    raise ConfigurationError(
        "No claims database configured: pass --database-url, set ONCELERY_DATABASE_URL, or set "
        "app.conf.oncelery_database_url in the app given with `celery -A`"
    )


def _reachable(ctx: click.Context, url: str, setting: str) -> str:
    # Checked once per command line, before the first statement: a server that is down is one line at once,
    # not the driver's traceback after its own connect timeout.
    root = ctx.find_root()
    if root.meta.get(_CHECKED_META) != url:
        check_database(url, setting)
        root.meta[_CHECKED_META] = url
    return url


def check_services(app: Any, *, backend: bool = True) -> None:
    """Raise ConfigurationError (one line: the setting, the masked URL) if the app's broker or backend is down."""
    check_app(app, backend=backend)


def celery_app_of(ctx: click.Context) -> Any:
    """The app `celery -A ...` loaded for this command line, or None (run as plain `oncelery`)."""
    return getattr(ctx.find_root().obj, "app", None) or getattr(ctx.obj, "app", None)


def resolve_app(ctx: click.Context, app_path: str | None) -> Celery:
    """The Celery app that publishes: --app, else `celery -A`'s, else one on Oncelery's celeryconfig."""
    if app_path:
        try:
            return find_app(app_path)
        except Exception as exc:
            raise ConfigurationError(f"--app {app_path!r}: cannot load it ({exc}); give module or module:app") from exc
    app = celery_app_of(ctx)
    if isinstance(app, Celery):
        return app
    app = Celery("oncelery")
    app.config_from_object("oncelery.celeryconfig")
    return app


def refuse_unread_broker(broker_url: str | None, database_url: str, command: str) -> None:
    """Raise BrokerNotConfigured if `command` would publish to the embedded broker for a database not the demo's.

    The embedded broker (./.oncelery/broker) is the demo's: only workers of the demo's database read it, so a
    message published there for any other claims database would wait for ever while the command says "done".
    """
    if is_embedded_broker(broker_url) and not is_embedded_database(database_url):
        raise BrokerNotConfigured.of(command, safe_url(database_url))


def resolve_publisher(ctx: click.Context, app_path: str | None, command: str) -> tuple[Celery, str]:
    """The Celery app that publishes and the claims database, for a command that publishes (relay, dlq replay).

    The app is --app, else `celery -A`'s, else one on oncelery.celeryconfig, whose broker is $ONCELERY_BROKER_URL
    or the embedded one. A publish to the embedded broker is refused unless the database is the demo's
    (BrokerNotConfigured, exit 2), before anything is read, written or created (not even ./.oncelery).
    """
    if not app_path and not isinstance(celery_app_of(ctx), Celery) and not os.environ.get(ENV_BROKER_URL, "").strip():
        # The fallback app would use the embedded broker: decided from the environment, before celeryconfig
        # is loaded (loading it creates the broker's folders).
        refuse_unread_broker(EMBEDDED_BROKER_URL, resolve_database_url(ctx), command)
    app = resolve_app(ctx, app_path)
    url = resolve_database_url(ctx, app)
    refuse_unread_broker(str(app.conf.broker_url or ""), url, command)
    return app, url
