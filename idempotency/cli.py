"""The `oncelery` command line: schema upgrades, runs, and delivery outcomes of the claims database.

Runs standalone (`oncelery ...`) or as a Celery subcommand (`celery -A proj oncelery ...`, through the
`celery.commands` entry point); under Celery the database is the app's (`oncelery_database_url`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import click
from alembic.runtime.environment import EnvironmentContext
from alembic.script import ScriptDirectory
from oncelery.db import get_engine, translated
from oncelery.errors import OnceleryError
from oncelery.models import Outcome, RunStatus, StepResult, TaskRun
from oncelery.models.migrate import alembic_config, upgrade
from oncelery.settings import OnceleryConfig
from oncelery.store import RunStore
from sqlalchemy import Engine, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError

_URL_META = "oncelery.database_url"
_RUNS = TaskRun.__table__
_STEPS = StepResult.__table__
_KEY_WIDTH = 48  # `runs list` shortens longer keys; `runs show` prints them whole
_OWNER_WIDTH = 8


class _OnceleryGroup(click.Group):
    """A group that turns Oncelery's and the driver's errors into a one-line message and exit code 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
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
        "else $ONCELERY_DATABASE_URL, else ./oncelery.db.",
    )
    @click.pass_context
    def group(ctx: click.Context, database_url: str | None) -> None:
        """Oncelery: exactly-once effects for Celery tasks. Inspect and migrate the claims database."""
        ctx.meta[_URL_META] = database_url

    group.add_command(db)
    group.add_command(runs)
    group.add_command(outcomes)
    return group


def resolve_database_url(ctx: click.Context, fallback_app: Any = None) -> str:
    """Return the database to use: --database-url, else the Celery app's config, else env or default."""
    explicit: str | None = ctx.meta.get(_URL_META)
    if explicit:
        return explicit
    app = getattr(ctx.obj, "app", None) or fallback_app  # ctx.obj is Celery's CLIContext under `celery`
    return OnceleryConfig.from_app_conf(app.conf if app is not None else None).database_url


def safe_url(url: str) -> str:
    """Return `url` with its password masked, for messages."""
    return make_url(url).render_as_string(hide_password=True)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Return `rows` as a left-aligned plain-text table under `headers` (None shows as "-")."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    lines = [headers, ["-" * w for w in widths], *cells]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip() for line in lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, RunStatus | Outcome):
        return str(value.value)
    if isinstance(value, datetime):
        # Both dialects store UTC; PostgreSQL hands it back in the session's time zone.
        moment = value.astimezone(UTC) if value.tzinfo is not None else value
        return moment.strftime("%Y-%m-%d %H:%M:%S")
    return str(value)


def _shorten(text: str | None, width: int) -> str | None:
    if text is None or len(text) <= width:
        return text
    return text[: width - 3] + "..."


def _short_owner(owner: str | None) -> str | None:
    return owner[:_OWNER_WIDTH] if owner else owner


# -- db ------------------------------------------------------------------------------------------


@click.group()
def db() -> None:
    """Create or migrate Oncelery's schema."""


@db.command("upgrade")
@click.pass_context
def db_upgrade(ctx: click.Context) -> None:
    """Create or migrate the schema of the configured database to the newest revision."""
    url = resolve_database_url(ctx)
    click.echo(upgrade_database(url))


def upgrade_database(url: str) -> str:
    """Migrate `url` to head (idempotent) and return a line saying from which revision to which."""
    engine = get_engine(url)
    try:
        before = current_revision(engine)
        upgrade(engine)
        after = current_revision(engine)
    except DBAPIError as exc:
        # Not translated to SchemaMissing: "run `oncelery db upgrade`" is no advice to `db upgrade` itself.
        raise click.ClickException(f"Cannot upgrade {safe_url(url)}: {_driver_message(exc)}") from exc
    if before == after:
        return f"{safe_url(url)}: schema already at revision {after} (head)"
    return f"{safe_url(url)}: schema upgraded from revision {before or '<none>'} to {after} (head)"


def current_revision(engine: Engine) -> str | None:
    """Return the Alembic revision Oncelery's schema on `engine` is at (None before the first upgrade)."""
    cfg = alembic_config(engine)
    script = ScriptDirectory.from_config(cfg)
    heads: list[str] = []

    def collect(_rev: Any, context: Any) -> list[Any]:
        heads.extend(context.get_current_heads())
        return []  # no migration steps: only read the version table that env.py names

    with engine.connect() as conn, EnvironmentContext(cfg, script, fn=collect):
        cfg.attributes["connection"] = conn
        script.run_env()
    return ",".join(heads) or None


# -- runs ----------------------------------------------------------------------------------------


@click.group()
def runs() -> None:
    """List and show runs (one per task and idempotency key)."""


_LIST_COLUMNS = ("id", "task", "key", "status", "token", "attempts", "owner", "lease_expires_at", "updated_at")


@runs.command("list")
@click.option("--status", type=click.Choice([s.value for s in RunStatus], case_sensitive=False), default=None)
@click.option("--task", "task_name", metavar="NAME", default=None, help="Only runs of this task.")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@click.pass_context
def runs_list(ctx: click.Context, status: str | None, task_name: str | None, limit: int) -> None:
    """List the most recently updated runs (times in UTC)."""
    url = resolve_database_url(ctx)
    c = _RUNS.c
    stmt = (
        select(
            c.id,
            c.task_name,
            c.idempotency_key,
            c.status,
            c.fencing_token,
            c.attempts,
            c.owner,
            c.lease_expires_at,
            c.updated_at,
        )
        .order_by(c.updated_at.desc(), c.id.desc())
        .limit(limit)
    )
    if status is not None:
        stmt = stmt.where(c.status == RunStatus(status.upper()))
    if task_name is not None:
        stmt = stmt.where(c.task_name == task_name)
    with translated(url), get_engine(url).connect() as conn:
        rows = conn.execute(stmt).all()
    table = [
        (
            r.id,
            r.task_name,
            _shorten(r.idempotency_key, _KEY_WIDTH),
            r.status,
            r.fencing_token,
            r.attempts,
            _short_owner(r.owner),
            r.lease_expires_at,
            r.updated_at,
        )
        for r in rows
    ]
    click.echo(format_table(_LIST_COLUMNS, table))
    click.echo(f"({len(rows)} run{'s' if len(rows) != 1 else ''})")


@runs.command("show")
@click.argument("key")
@click.option("--task", "task_name", metavar="NAME", default=None, help="The task (if several share the key).")
@click.pass_context
def runs_show(ctx: click.Context, key: str, task_name: str | None) -> None:
    """Show every field of the run(s) with KEY, its result, error and checkpointed steps."""
    url = resolve_database_url(ctx)
    c = _RUNS.c
    stmt = select(_RUNS).where(c.idempotency_key == key).order_by(c.task_name)
    if task_name is not None:
        stmt = stmt.where(c.task_name == task_name)
    with translated(url), get_engine(url).connect() as conn:
        found = conn.execute(stmt).all()
        steps = {
            row.id: conn.execute(
                select(_STEPS.c.position, _STEPS.c.step_name, _STEPS.c.token, _STEPS.c.created_at)
                .where(_STEPS.c.run_id == row.id)
                .order_by(_STEPS.c.position)
            ).all()
            for row in found
        }
    if not found:
        where = f" for task {task_name}" if task_name else ""
        raise click.ClickException(f"No run with key {key!r}{where} in {safe_url(url)}")
    for i, row in enumerate(found):
        if i:
            click.echo()
        _echo_run(row._mapping, steps[row.id])


def _echo_run(row: Any, steps: Sequence[Any]) -> None:
    fields = [
        ("id", row["id"]),
        ("task", row["task_name"]),
        ("key", row["idempotency_key"]),
        ("status", row["status"]),
        ("fingerprint", row["fingerprint"]),
        ("fencing_token", row["fencing_token"]),
        ("owner", row["owner"]),
        ("attempts", row["attempts"]),
        ("lease_expires_at", row["lease_expires_at"]),
        ("concurrency_key", row["concurrency_key"]),
        ("celery_task_id", row["celery_task_id"]),
        ("created_at", row["created_at"]),
        ("updated_at", row["updated_at"]),
        ("finished_at", row["finished_at"]),
    ]
    width = max(len(name) for name, _ in fields)
    for name, value in fields:
        click.echo(f"{name.ljust(width)}  {_cell(value)}")
    click.echo("result:")
    click.echo(_indent(json.dumps(row["result"], indent=2, sort_keys=True, ensure_ascii=False)))
    click.echo("error:")
    click.echo(_indent(row["error"] or "-"))
    click.echo("message:")
    click.echo(_indent(json.dumps(row["message"], sort_keys=True, ensure_ascii=False)))
    click.echo(f"steps ({len(steps)}):")
    if steps:
        click.echo(_indent(format_table(("position", "step", "token", "created_at"), steps)))


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


# -- outcomes ------------------------------------------------------------------------------------


@click.command()
@click.option("--task", "task_name", metavar="NAME", default=None, help="Only this task's deliveries.")
@click.pass_context
def outcomes(ctx: click.Context, task_name: str | None) -> None:
    """Print exact delivery outcome counts (every delivery records one, across all workers)."""
    url = resolve_database_url(ctx)
    counts = RunStore(url).outcome_counts(task_name)
    rows = [(o.value, counts.get(o.value, 0)) for o in Outcome]
    rows.append(("total", sum(counts.values())))
    click.echo(format_table(("outcome", "count"), rows))


oncelery = build_group()
