"""The `oncelery` command line: schema upgrades, runs, and delivery outcomes of the claims database.

Runs standalone (`oncelery ...`) or as a Celery subcommand (`celery -A proj oncelery ...`, through the
`celery.commands` entry point); under Celery the database is the app's (`oncelery_database_url`).
This module holds the group, how a command finds its database, `db upgrade` and `outcomes`; the other
commands live in `cli_runs.py`, `cli_ops.py`, `cli_costs.py`, `cli_metrics.py`; printing in `cli_format.py`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click
from sqlalchemy.exc import ArgumentError, DBAPIError

from oncelery.cli_format import echo_json as echo_json
from oncelery.cli_format import format_table as format_table
from oncelery.cli_format import to_json as to_json
from oncelery.cli_runs import runs as runs
from oncelery.cli_runs import runs_list as runs_list
from oncelery.cli_runs import runs_show as runs_show
from oncelery.errors import ConfigurationError, OnceleryError
from oncelery.models import Outcome
from oncelery.models.migrate import BRANCHES, FRAMEWORK
from oncelery.reach import check_app, check_database
from oncelery.runs import Runs
from oncelery.schema import upgrade_schema
from oncelery.settings import CONF_DATABASE_URL, ENV_DATABASE_URL, configured_database_url, embedded_database_url

_URL_META = "oncelery.database_url"
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


class _OnceleryGroup(click.Group):
    """A group that turns Oncelery's and the driver's errors into a one-line message (exit 2 or 1)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ConfigurationError as exc:  # a bad value or an unreachable service: nothing was done
            raise ConfigurationProblem(str(exc)) from exc
        except OnceleryError as exc:  # SchemaMissing / StoreUnavailable name the fix in their message
            raise click.ClickException(str(exc)) from exc
        except ArgumentError as exc:  # a malformed URL or an unknown dialect
            raise click.ClickException(f"Invalid database URL: {exc}") from exc
        except DBAPIError as exc:
            raise click.ClickException(_driver_message(exc)) from exc


def _driver_message(exc: DBAPIError) -> str:
    return str(exc.orig if exc.orig is not None else exc).strip()


def build_group() -> click.Group:
    """Return a fresh `oncelery` group with every command (an application may add its own commands)."""

    @click.group(cls=_OnceleryGroup, name="oncelery")
    @click.option(
        "--database-url",
        metavar="URL",
        default=None,
        help="Claims database (SQLAlchemy URL). Default: the Celery app's oncelery_database_url, "
        "else $ONCELERY_DATABASE_URL, else (reads only) the demo's ./oncelery.db if it exists.",
    )
    @click.pass_context
    def group(ctx: click.Context, database_url: str | None) -> None:
        """Oncelery: exactly-once effects for Celery tasks. Inspect and migrate the claims database."""
        ctx.meta[_URL_META] = database_url

    from oncelery.cli_costs import costs
    from oncelery.cli_metrics import metrics
    from oncelery.cli_ops import dlq, purge_command, relay  # they build on this module's helpers

    group.add_command(db)
    group.add_command(runs)
    group.add_command(outcomes)
    group.add_command(relay)
    group.add_command(dlq)
    group.add_command(purge_command)
    group.add_command(costs)
    group.add_command(metrics)
    return group


def resolve_database_url(ctx: click.Context, fallback_app: Any = None, *, embedded: bool = False) -> str:
    """Return the database to use: --database-url, else the Celery app's config, else the environment.

    With none of them: the embedded demo database if `embedded` (the demo commands) or if its file exists
    (reads after a demo run); otherwise a ConfigurationError saying what to set. Nothing is created here.
    """
    explicit: str | None = ctx.meta.get(_URL_META)
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


# -- db ------------------------------------------------------------------------------------------


@click.group()
def db() -> None:
    """Create or migrate Oncelery's schema."""


@db.command("upgrade")
@click.option(
    "--branch",
    type=click.Choice(sorted(BRANCHES)),
    default=FRAMEWORK.name,
    show_default=True,
    help="Which schema: Oncelery's own tables, or the demo jobs' (article_scores).",
)
@click.pass_context
def db_upgrade(ctx: click.Context, branch: str) -> None:
    """Create or migrate Oncelery's own tables in the configured database (never an application's)."""
    click.echo(upgrade_schema(resolve_database_url(ctx), BRANCHES[branch]))


# -- outcomes ------------------------------------------------------------------------------------


@click.command()
@click.option("--task", "task_name", metavar="NAME", default=None, help="Only this task's deliveries.")
@click.option("--tenant", metavar="TENANT", default=None, help="Only this tenant's deliveries ('' for none).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON document (for scripts) instead of a table.")
@click.pass_context
def outcomes(ctx: click.Context, task_name: str | None, tenant: str | None, as_json: bool) -> None:
    """Print exact delivery outcome counts (every delivery records one, across all workers)."""
    counts = Runs(resolve_database_url(ctx)).outcome_counts(task_name, tenant)
    if as_json:
        every = {o.value: counts.get(o.value, 0) for o in Outcome}  # every outcome, 0 included: stable keys
        echo_json({"task": task_name, "tenant": tenant, "outcomes": every, "total": sum(counts.values())})
        return
    rows = [(o.value, counts.get(o.value, 0)) for o in Outcome]
    rows.append(("total", sum(counts.values())))
    click.echo(format_table(("outcome", "count"), rows))


oncelery = build_group()
