"""The `oncelery` command line: schema upgrades, runs, and delivery outcomes of the claims database.

Runs standalone (`oncelery ...`) or as a Celery subcommand (`celery -A proj oncelery ...`, through the
`celery.commands` entry point); under Celery the database is the app's (`oncelery_database_url`).
This module holds the group, `db upgrade` and `outcomes`; the other commands live in `runs.py`, `ops.py`,
`dlq.py`, `costs.py`, `cache.py` and `metrics.py`; printing in `format.py`; how a command finds its database
in `context.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click
from sqlalchemy.exc import ArgumentError, DBAPIError

from oncelery.cli.batches import batches
from oncelery.cli.cache import cache
from oncelery.cli.context import (
    EXIT_CONFIGURATION,
    URL_META,
    ConfigurationProblem,
    check_services,
    refuse_unread_broker,
    resolve_database_url,
)
from oncelery.cli.costs import costs
from oncelery.cli.debounce import debounce
from oncelery.cli.dlq import dlq
from oncelery.cli.flower import flower
from oncelery.cli.fork import fork
from oncelery.cli.format import echo_json, format_table, json_option
from oncelery.cli.limits import budgets, limits
from oncelery.cli.metrics import metrics
from oncelery.cli.ops import purge_command, relay
from oncelery.cli.runs import runs
from oncelery.errors import ConfigurationError, OnceleryError
from oncelery.models import Outcome
from oncelery.models.migrate import BRANCHES, FRAMEWORK
from oncelery.runs.views import Runs
from oncelery.store.schema import upgrade_schema

# The public surface of `oncelery.cli`: the group, and what an application's own commands build on.
__all__ = [
    "DEMO",
    "EXIT_CONFIGURATION",
    "INSPECT",
    "OPERATE",
    "OnceleryGroup",
    "build_group",
    "check_services",
    "echo_json",
    "format_table",
    "oncelery",
    "refuse_unread_broker",
    "resolve_database_url",
]


# The sections of `oncelery --help`, in this order; a command added without one is listed under OTHER.
INSPECT = "Schema and runs"
OPERATE = "Operations (publish, dead letters, retention, metrics)"
DEMO = "The demo (embedded default: no servers)"
OTHER = "Other commands"
_SECTIONS = (INSPECT, OPERATE, DEMO)


class OnceleryGroup(click.Group):
    """A group that turns Oncelery's and the driver's errors into a one-line message (exit 2 or 1), and lists
    its commands in sections (operations apart from the demo's)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sections: dict[str, str] = {}

    def add_command(self, cmd: click.Command, name: str | None = None, *, section: str = OTHER) -> None:
        """Add `cmd`, listed by `--help` under `section` (INSPECT, OPERATE, DEMO, or a title of your own)."""
        super().add_command(cmd, name)
        self.sections[name or cmd.name or ""] = section

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Write the commands section by section: INSPECT, OPERATE, DEMO, then any other, each sorted by name."""
        listed: dict[str, list[tuple[str, click.Command]]] = {}
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                listed.setdefault(self.sections.get(name, OTHER), []).append((name, cmd))
        if not listed:
            return
        limit = formatter.width - 6 - max(len(name) for rows in listed.values() for name, _ in rows)
        others = sorted(set(listed) - set(_SECTIONS))
        for title in (*_SECTIONS, *others):
            if title in listed:
                with formatter.section(title):
                    formatter.write_dl([(name, cmd.get_short_help_str(limit)) for name, cmd in listed[title]])

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


def build_group() -> OnceleryGroup:
    """Return a fresh `oncelery` group with every command (an application may add its own commands)."""

    @click.group(cls=OnceleryGroup, name="oncelery")
    # The installed distribution's version (the first command of docs/adopting.md's walk): needs no database.
    @click.version_option(package_name="oncelery", message="oncelery %(version)s")
    @click.option(
        "--database-url",
        metavar="URL",
        default=None,
        help="Claims database (SQLAlchemy URL). Default: the Celery app's oncelery_database_url, "
        "else $ONCELERY_DATABASE_URL, else (reads only) the demo's ./oncelery.db if it exists.",
    )
    @click.pass_context
    def group(ctx: click.Context, database_url: str | None) -> None:
        """Oncelery: exactly-once effects for Celery tasks: inspect and operate the claims database, run the demo."""
        ctx.meta[URL_META] = database_url

    _add(group, INSPECT, (db, runs, outcomes, costs, limits, budgets, batches, debounce))
    _add(group, OPERATE, (relay, dlq, purge_command, cache, metrics, fork, flower))
    return group


def _add(group: OnceleryGroup, section: str, commands: Sequence[click.Command]) -> None:
    for cmd in commands:
        group.add_command(cmd, section=section)


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
@json_option()
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
