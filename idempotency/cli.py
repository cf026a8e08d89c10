"""The `oncelery` command line: schema upgrades, runs, and delivery outcomes of the claims database.

Runs standalone (`oncelery ...`) or as a Celery subcommand (`celery -A proj oncelery ...`, through the
`celery.commands` entry point); under Celery the database is the app's (`oncelery_database_url`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
from sqlalchemy.exc import ArgumentError, DBAPIError

from oncelery.errors import ConfigurationError, OnceleryError
from oncelery.models import Outcome, RunStatus
from oncelery.models.migrate import BRANCHES, FRAMEWORK
from oncelery.reach import check_app, check_database
from oncelery.runs import CallView, Runs, RunView, StepView
from oncelery.schema import upgrade_schema
from oncelery.settings import CONF_DATABASE_URL, ENV_DATABASE_URL, configured_database_url, embedded_database_url
from oncelery.store import safe_url

_URL_META = "oncelery.database_url"
_CHECKED_META = "oncelery.database_checked"
# Exit codes: 0 done; 1 the command failed (no such run, a driver error, a timeout); 2 the configuration or
# environment is wrong (a bad value, an unreachable service): nothing was done, fix the setting and re-run.
EXIT_CONFIGURATION = 2
_KEY_WIDTH = 48  # `runs list` shortens longer keys; `runs show` prints them whole
_OWNER_WIDTH = 8


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
        return _utc(value).strftime("%Y-%m-%d %H:%M:%S")
    return str(value)


def _utc(value: datetime) -> datetime:
    # Both dialects store UTC; PostgreSQL hands it back in the session's time zone, SQLite without one.
    return value.astimezone(UTC) if value.tzinfo is not None else value.replace(tzinfo=UTC)


def to_json(value: Any) -> Any:
    """Return `value` as JSON-ready data: datetimes as ISO 8601 UTC, statuses as their strings, recursively."""
    if isinstance(value, RunStatus | Outcome):
        return value.value
    if isinstance(value, datetime):
        return _utc(value).isoformat()
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    return value


def echo_json(document: dict[str, Any]) -> None:
    """Print `document` as the indented, key-sorted JSON every `--json` option prints."""
    click.echo(json.dumps(to_json(document), indent=2, sort_keys=True, ensure_ascii=False))


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


# -- runs ----------------------------------------------------------------------------------------


@click.group()
def runs() -> None:
    """List and show runs (one per task and idempotency key)."""


_LIST_COLUMNS = ("id", "task", "key", "status", "token", "attempts", "owner", "lease_expires_at", "updated_at")


@runs.command("list")
@click.option("--status", type=click.Choice([s.value for s in RunStatus], case_sensitive=False), default=None)
@click.option("--task", "task_name", metavar="NAME", default=None, help="Only runs of this task.")
@click.option("--tenant", metavar="TENANT", default=None, help="Only runs of this tenant ('' for none).")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON document (for scripts) instead of a table.")
@click.pass_context
def runs_list(
    ctx: click.Context, status: str | None, task_name: str | None, tenant: str | None, limit: int, as_json: bool
) -> None:
    """List the most recently updated runs (times in UTC)."""
    reader = Runs(resolve_database_url(ctx))
    found = reader.list(
        task_name=task_name, status=RunStatus(status.upper()) if status else None, tenant=tenant, limit=limit
    )
    seen = reader.pass_through_seen()
    if as_json:
        echo_json({"count": len(found), "pass_through_seen": seen, "runs": [_run_summary(r) for r in found]})
        return
    if seen:
        click.echo(f"WARNING: a worker ran with ONCELERY_PASS_THROUGH on (last: {seen}): its jobs ran unclaimed")
    table = [
        (
            r.run_id,
            r.task_name,
            _shorten(r.key, _KEY_WIDTH),
            r.status,
            r.token,
            r.attempts,
            _short_owner(r.owner),
            r.lease_expires_at,
            r.updated_at,
        )
        for r in found
    ]
    click.echo(format_table(_LIST_COLUMNS, table))
    click.echo(f"({len(found)} run{'s' if len(found) != 1 else ''})")


@runs.command("show")
@click.argument("key")
@click.option("--task", "task_name", metavar="NAME", default=None, help="The task (if several share the key).")
@click.option("--tenant", metavar="TENANT", default=None, help="The tenant (if several share the key).")
@click.option("--show-payload", is_flag=True, help="Print the stored message's arguments (redacted otherwise).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON document (for scripts) instead of text.")
@click.pass_context
def runs_show(
    ctx: click.Context, key: str, task_name: str | None, tenant: str | None, show_payload: bool, as_json: bool
) -> None:
    """Show every field of the run(s) with KEY: result, error, steps (timing, replayed or executed), model calls."""
    url = resolve_database_url(ctx)
    reader = Runs(url)
    found = reader.find(key, task_name, tenant)
    if not found:
        where = f" for task {task_name}" if task_name else ""
        raise click.ClickException(f"No run with key {key!r}{where} in {safe_url(url)}")
    details = [(run, reader.steps(run.run_id), reader.model_calls(run.run_id)) for run in found]
    if as_json:
        echo_json({"runs": [_run_detail(run, steps, calls, show_payload) for run, steps, calls in details]})
        return
    for i, (run, steps, calls) in enumerate(details):
        if i:
            click.echo()
        _echo_run(run, steps, calls, show_payload)


_PAYLOAD_KEPT = "<kept for recovery until the run completes; --show-payload prints it>"


def _run_summary(run: RunView) -> dict[str, Any]:
    """The fields `runs list` shows, and the counters, of one run."""
    return {
        "id": run.run_id,
        "task": run.task_name,
        "tenant": run.tenant,
        "key": run.key,
        "status": run.status,
        "token": run.token,
        "attempts": run.attempts,
        "owner": run.owner,
        "lease_expires_at": run.lease_expires_at,
        "lease_live": run.lease_live,
        "retries": run.retries,
        "lost": run.lost,
        "replays": run.replays,
        "created_at": run.created_at,
        "updated_at": run.updated_at,
        "finished_at": run.finished_at,
    }


def _run_detail(
    run: RunView, steps: Sequence[StepView], calls: Sequence[CallView], show_payload: bool
) -> dict[str, Any]:
    """Everything `runs show` prints of one run, as JSON-ready data."""
    payload_hidden = run.message is not None and not show_payload
    return {
        **_run_summary(run),
        "fingerprint": run.fingerprint,
        "not_before": run.not_before,
        "retry_wait": run.retry_wait,
        "concurrency_key": run.concurrency_key,
        "celery_task_id": run.celery_task_id,
        "result": run.result,
        "error": run.error,
        "message": _PAYLOAD_KEPT if payload_hidden else run.message,
        "steps": _step_timeline(run, steps),
        "model_calls": [_call(c) for c in calls],
    }


def _step_timeline(run: RunView, steps: Sequence[StepView]) -> list[dict[str, Any]]:
    """Each step with its checkpoint time, the seconds since the previous checkpoint, and how the last attempt
    got it: `replayed` from a checkpoint of an earlier fencing token, or `executed` by the current holder."""
    timeline = []
    previous = run.created_at  # the first step is timed from the run's claim
    for st in steps:
        seconds = None
        if st.created_at is not None and previous is not None:
            seconds = round((_utc(st.created_at) - _utc(previous)).total_seconds(), 6)
        previous = st.created_at
        timeline.append(
            {
                "position": st.position,
                "name": st.name,
                "token": st.token,
                "created_at": st.created_at,
                "seconds": seconds,
                "by_last_attempt": "replayed" if st.token < run.token else "executed",
            }
        )
    return timeline


def _call(call: CallView) -> dict[str, Any]:
    return {
        "id": call.call_id,
        "step": call.step,
        "model": call.model,
        "prompt": call.prompt,
        "input_tokens": call.input_tokens,
        "output_tokens": call.output_tokens,
        "latency_ms": call.latency_ms,
        "ok": call.ok,
        "error": call.error,
        "cost": None if call.cost is None else round(call.cost, 9),  # USD, no float noise (as `costs --json`)
        "token": call.token,
        "created_at": call.created_at,
    }


def _echo_run(
    run: RunView, steps: Sequence[StepView], calls: Sequence[CallView] = (), show_payload: bool = False
) -> None:
    fields = [
        ("id", run.run_id),
        ("task", run.task_name),
        ("tenant", run.tenant or None),
        ("key", run.key),
        ("status", run.status),
        ("fingerprint", run.fingerprint),
        ("fencing_token", run.token),
        ("owner", run.owner),
        ("attempts", run.attempts),
        ("retries", run.retries),
        ("lost", run.lost),
        ("replays", run.replays),
        ("not_before", run.not_before),
        ("lease_expires_at", run.lease_expires_at),
        ("lease_live", "yes" if run.lease_live else "no"),
        ("concurrency_key", run.concurrency_key),
        ("celery_task_id", run.celery_task_id),
        ("created_at", run.created_at),
        ("updated_at", run.updated_at),
        ("finished_at", run.finished_at),
    ]
    width = max(len(name) for name, _ in fields)
    for name, value in fields:
        click.echo(f"{name.ljust(width)}  {_cell(value)}")
    click.echo("result:")
    click.echo(_indent(json.dumps(run.result, indent=2, sort_keys=True, ensure_ascii=False)))
    click.echo("error:")
    click.echo(_indent(run.error or "-"))
    click.echo("message:")
    if run.message is not None and not show_payload:
        # Arguments may hold prompts, personal data or secrets: shown only when asked for.
        click.echo(_indent("<kept for recovery until the run completes; --show-payload prints it>"))
    else:
        click.echo(_indent(json.dumps(run.message, sort_keys=True, ensure_ascii=False)))
    click.echo(f"steps ({len(steps)}):")
    if steps:
        rows = [
            (s["position"], s["name"], s["token"], s["created_at"], _seconds(s["seconds"]), s["by_last_attempt"])
            for s in _step_timeline(run, steps)
        ]
        click.echo(_indent(format_table(("position", "step", "token", "created_at", "seconds", "last attempt"), rows)))
    click.echo(f"model calls ({len(calls)}):")
    if calls:
        call_headers = ("step", "model", "prompt", "tokens in", "tokens out", "latency ms", "ok", "cost USD", "token")
        call_rows = [
            (
                c.step,
                c.model,
                c.prompt,
                c.input_tokens,
                c.output_tokens,
                f"{c.latency_ms:.1f}",
                "yes" if c.ok else "no",
                None if c.cost is None else f"{c.cost:.6f}",
                c.token,
            )
            for c in calls
        ]
        click.echo(_indent(format_table(call_headers, call_rows)))


def _seconds(value: float | None) -> str | None:
    return None if value is None else f"{value:.3f}"


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


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
