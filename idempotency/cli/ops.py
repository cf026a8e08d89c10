"""Operations commands: `oncelery relay` (outbox + lost-job sweeper) and `oncelery purge` (`dlq ...`: dlq.py)."""

from __future__ import annotations

import json
import signal
import threading
from typing import Any

import click

from oncelery.cli.context import APP_HELP, celery_app_of, resolve_app, resolve_database_url, resolve_publisher
from oncelery.cli.format import echo_json, json_option
from oncelery.delivery.replay_cache import purge_forgetter
from oncelery.errors import ConfigurationError
from oncelery.ops.reach import check_app
from oncelery.relay.loop import DEFAULT_MAX_PUBLISHES, Relay
from oncelery.relay.retention import kept_arguments_age, parse_age, purge
from oncelery.store.database import Database


def _age(value: str | None, allow_off: bool = False) -> float | None:
    if value is None or (allow_off and value.strip().lower() in {"off", "never", "none"}):
        return None
    try:
        return parse_age(value)
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc)) from exc


# -- relay ---------------------------------------------------------------------------------------


@click.command()
@click.option("--app", "app_path", metavar="MODULE[:APP]", default=None, help=APP_HELP)
@click.option("--once", is_flag=True, help="Run one round and exit (cron, tests).")
@click.option(
    "--interval", type=click.FloatRange(min=0.05), default=0.5, show_default=True, help="Seconds between idle rounds."
)
@click.option("--batch", type=click.IntRange(min=1), default=100, show_default=True, help="Rows per round and kind.")
@click.option(
    "--republish-after",
    metavar="AGE",
    default="5m",
    show_default=True,
    help="Publish a SENT row again if its run has not finished this long after (the broker lost it).",
)
@click.option(
    "--sweep-interval",
    metavar="AGE",
    default="60s",
    show_default=True,
    help="Re-send a lost run's stored message at most this often ('off' disables the sweeper).",
)
@click.option(
    "--max-attempts",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="Failed publishes before a row is DEAD.",
)
@click.option(
    "--max-publishes",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_PUBLISHES,
    show_default=True,
    help="Publishes of a row whose run never finishes before it is DEAD, with a dead letter.",
)
@click.option(
    "--retention",
    metavar="AGE",
    default="7d",
    show_default=True,
    help="Purge runs finished longer ago than this, hourly ('off' keeps them for ever).",
)
@json_option("With --once: print the round as a JSON document (the default --once output is one JSON line).")
@click.pass_context
def relay(
    ctx: click.Context,
    app_path: str | None,
    once: bool,
    interval: float,
    batch: int,
    republish_after: str,
    sweep_interval: str,
    max_attempts: int,
    max_publishes: int,
    retention: str,
    as_json: bool,
) -> None:
    """Publish the outbox, re-publish what a broker lost, re-send lost runs; until SIGTERM/Ctrl-C."""
    app, url = resolve_publisher(ctx, app_path, "relay")
    check_app(app, backend=False)  # it publishes only: the broker must answer, the result backend need not
    worker = Relay(
        app,
        url,
        batch=batch,
        republish_after=_age(republish_after) or 0.0,
        max_attempts=max_attempts,
        sweep_interval=_age(sweep_interval, allow_off=True),
        max_publishes=max_publishes,
    )
    keep = _age(retention, allow_off=True)
    if once:
        done = worker.run_once()
        if keep is not None:
            kept = kept_arguments_age(app.conf)
            done.purged = purge(worker.db, keep, forget=purge_forgetter(app.conf, url), kept_older_than=kept).runs
        if as_json:
            echo_json(vars(done))
        else:
            click.echo(json.dumps(vars(done), sort_keys=True))
        return
    stop = threading.Event()

    def _stop(_signum: int, _frame: Any) -> None:
        stop.set()  # finish the round in hand (its rows are committed or rolled back whole), then exit

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    click.echo(f"relay: publishing the outbox of {Database(url).dialect.name} database (Ctrl-C or SIGTERM stops)")
    try:
        total = worker.serve(stop, interval, keep)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    click.echo("relay stopped: " + json.dumps(vars(total), sort_keys=True))


# -- purge ---------------------------------------------------------------------------------------


@click.command("purge")
@click.option("--older-than", "older_than", metavar="AGE", required=True, help="e.g. 7d, 24h, 90m (at least 0s).")
@click.option("--batch", type=click.IntRange(min=1), default=1000, show_default=True, help="Runs per transaction.")
@click.pass_context
def purge_command(ctx: click.Context, older_than: str, batch: int) -> None:
    """Delete runs finished before AGE ago, with their steps, dead letters and ledger rows (never RUNNING/DEAD)."""
    url = resolve_database_url(ctx)
    # The replay cache's entries go with the runs (when the app, or the environment, has the cache).
    conf = getattr(celery_app_of(ctx), "conf", None)
    forget = purge_forgetter(conf, url)
    report = purge(
        Database(url), _age(older_than) or 0.0, batch, forget=forget, kept_older_than=kept_arguments_age(conf)
    )
    click.echo(
        f"purged {report.runs} runs ({report.steps} steps, {report.dead_letters} dead letters, "
        f"{report.ledger} ledger rows) and {report.outbox} outbox rows in {report.batches} batches"
        + (f"; kept {report.kept_referenced} runs your tables still refer to" if report.kept_referenced else "")
        + (f"; cleared the kept arguments of {report.kept_arguments} runs" if report.kept_arguments else "")
    )


__all__ = ["purge_command", "relay", "resolve_app"]
