"""`oncelery flower`: Flower itself, with a Runs section added to its own Tornado application (docs/flower.md).

    celery -A yourapp oncelery flower --port=5555        # any option of `celery flower`, FLOWER_* variables too

Flower 2.x has no plugin hook, and its `celery flower` command builds its Application and starts it in one
function. This command runs the same steps with Flower's own functions (options from FLOWER_* variables, the
command line and flowerconfig.py; its settings, logging, banner and SIGTERM handling), and between building the
Application and serving it adds the Runs pages with Tornado's `Application.add_handlers` (runs_pages.install):
one process, one port, Flower's own login, XSRF rule, read-only mode and url_prefix. Flower is optional
(`pip install 'oncelery[flower]'`): it is imported only when this command runs.
"""

from __future__ import annotations

import atexit
import contextlib
import signal
from typing import Any

import click

from oncelery.cli.context import APP_HELP, resolve_app, resolve_database_url
from oncelery.errors import ConfigurationError

__all__ = ["flower", "serve"]

_NO_FLOWER = "`oncelery flower` needs Flower: pip install 'oncelery[flower]'"


@click.command(
    "flower",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": True},
)
@click.option("--app", "app_path", metavar="MODULE[:APP]", default=None, help=APP_HELP)
@click.argument("flower_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def flower(ctx: click.Context, app_path: str | None, flower_args: tuple[str, ...]) -> None:
    """Run Flower with a Runs section: runs, steps, model calls, costs, letters (FLOWER_ARGS: `celery flower`'s)."""
    _require_flower()  # before anything is resolved: a missing extra is the one thing to say
    app = resolve_app(ctx, app_path)
    url = resolve_database_url(ctx, app)
    serve(app, url, list(flower_args))


def _require_flower() -> None:
    try:
        import flower.command  # noqa: F401  (optional: imported only by this command)
    except ImportError as exc:
        raise ConfigurationError(_NO_FLOWER) from exc


def serve(capp: Any, url: str, argv: list[str]) -> None:
    """Run Flower for `capp` with the Runs section on the claims database `url` until SIGTERM or Ctrl-C."""
    _require_flower()
    # Imported here: Flower is optional, and runs_pages builds on Flower's handler base class.
    from flower import command as flower_command
    from flower.app import Flower

    from oncelery.cli.runs_pages import install

    # The body of Flower's own `celery flower` command (flower/command.py), in its order.
    flower_command.apply_env_options()
    flower_command.apply_options("oncelery flower", argv)
    flower_command.extract_settings()
    flower_command.setup_logging()
    web = Flower(capp=capp, options=flower_command.options, **flower_command.settings)
    install(web, url)
    atexit.register(web.stop)
    signal.signal(signal.SIGTERM, flower_command.sigterm_handler)
    port = web.start_http_server()
    flower_command.print_banner(capp, "ssl_options" in flower_command.settings, port)
    with contextlib.suppress(KeyboardInterrupt, SystemExit):  # Ctrl-C, or SIGTERM's handler: a normal stop
        web.start()
