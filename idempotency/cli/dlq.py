"""`oncelery dlq list|show|replay|purge`: the dead-letter queue, and where each replayed letter's message is."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click

from oncelery.cli.context import APP_HELP, refuse_unread_broker, resolve_database_url, resolve_publisher
from oncelery.cli.format import echo_json, format_table, json_option
from oncelery.ops.dead_letters import DeadLetters, LetterView, ReplayReport, ReplayState
from oncelery.ops.reach import check_app
from oncelery.runs.decisions import LETTER_REASONS

__all__ = ["LETTER_PAYLOAD_KEPT", "dlq", "letter_detail", "replay_letters"]

# How `dlq list`/`dlq show` say where a replayed letter's message is.
_REPLAY_TEXT = {
    ReplayState.QUEUED: "queued, not yet published",
    ReplayState.PUBLISHED: "published",
    ReplayState.UNPUBLISHED: "not published (its outbox row is DEAD)",
}


# -- dlq -----------------------------------------------------------------------------------------


@click.group()
def dlq() -> None:
    """The dead-letter queue: runs that will never succeed as they are (list, show, replay, purge)."""


def _filters(func: Any) -> Any:
    for option in (
        click.option("--task", "task_name", metavar="NAME", default=None, help="Only this task's letters."),
        click.option("--tenant", default=None, help="Only this tenant's letters."),
        click.option("--reason", type=click.Choice(LETTER_REASONS), default=None, help="Only letters of this reason."),
    ):
        func = option(func)
    return func


def _select(
    letters: DeadLetters,
    refs: Sequence[str],
    task_name: str | None,
    tenant: str | None,
    reason: str | None,
    every: bool,
) -> list[LetterView]:
    """Letters by id or key (REFS), else by filters; refuses to act on everything without --all."""
    if not refs and not (task_name or tenant is not None or reason or every):
        raise click.UsageError("name letters (ids or keys), filter them (--task/--tenant/--reason), or pass --all")
    ids = [int(r) for r in refs if r.isdigit()]
    keys = [r for r in refs if not r.isdigit()]
    found: list[LetterView] = []
    if ids:
        found += letters.list(ids=ids, task_name=task_name, tenant=tenant, reason=reason, limit=None)
    if keys:
        found += letters.list(keys=keys, task_name=task_name, tenant=tenant, reason=reason, limit=None)
    if not refs:
        found = letters.list(task_name=task_name, tenant=tenant, reason=reason, limit=None)
    return found


@dlq.command("list")
@_filters
@click.option("--all", "include_replayed", is_flag=True, help="Include letters already replayed.")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@json_option()
@click.option(
    "--jsonl",
    "as_jsonl",
    is_flag=True,
    help="One JSON object per line, as `--json` printed in 0.1.0 (no `replay`; times as Python prints them).",
)
@click.pass_context
def dlq_list(
    ctx: click.Context,
    task_name: str | None,
    tenant: str | None,
    reason: str | None,
    include_replayed: bool,
    limit: int,
    as_json: bool,
    as_jsonl: bool,
) -> None:
    """List dead letters, the most recent failure first (times in UTC)."""
    if as_json and as_jsonl:
        raise click.UsageError("--json and --jsonl: choose one")
    found = DeadLetters(resolve_database_url(ctx)).list(
        task_name=task_name, tenant=tenant, reason=reason, include_replayed=include_replayed, limit=limit
    )
    if as_json:
        echo_json({"count": len(found), "letters": [_letter_json(x, payload=False, replay=True) for x in found]})
        return
    if as_jsonl:
        for letter in found:
            click.echo(json.dumps(_letter_json(letter, payload=False), sort_keys=True, default=str))
        return
    rows = [
        (
            x.letter_id,
            x.task_name,
            x.key,
            x.reason,
            x.attempts,
            (x.error or "").splitlines()[0][:60] if x.error else None,
            x.last_failed_at,
            x.replayed_at,
            _replay_text(x),
        )
        for x in found
    ]
    headers = ("id", "task", "key", "reason", "attempts", "error", "last_failed_at", "replayed_at", "replay")
    click.echo(format_table(headers, rows))
    click.echo(f"({len(found)} letter{'s' if len(found) != 1 else ''})")


def _replay_text(x: LetterView) -> str | None:
    return None if x.replay is None else _REPLAY_TEXT[x.replay]


def _replay_detail(x: LetterView) -> str | None:
    """`dlq show`'s replay line: where the message is, and why its last publish failed if it did."""
    if x.replay is not ReplayState.QUEUED:
        return _replay_text(x)
    tried = f"; last try: {x.replay_error}" if x.replay_error else ""
    return f"{_replay_text(x)} (`oncelery relay` publishes it{tried})"


def _letter_json(x: LetterView, payload: bool, replay: bool = False) -> dict[str, Any]:
    """One letter as JSON-ready data; `replay` adds where a replayed letter's message is (the --json shape)."""
    out = {
        "id": x.letter_id,
        "run_id": x.run_id,
        "task": x.task_name,
        "tenant": x.tenant,
        "key": x.key,
        "reason": x.reason,
        "error": x.error,
        "attempts": x.attempts,
        "first_failed_at": x.first_failed_at,
        "last_failed_at": x.last_failed_at,
        "replayed_at": x.replayed_at,
        "replays": x.replays,
        "run_status": x.run_status.value if x.run_status else None,
    }
    if replay:
        out["replay"] = x.replay.value if x.replay else None
        out["replay_error"] = x.replay_error
    if payload:
        out["traceback"] = x.traceback
        out["message"] = x.message
    return out


#: What `dlq show` (and Flower's run page) prints instead of a letter's message.
LETTER_PAYLOAD_KEPT = "<kept to replay it; --show-payload prints it>"


def letter_detail(x: LetterView, show_payload: bool = False) -> dict[str, Any]:
    """Everything `dlq show` prints of a letter, as JSON-ready data, its message redacted unless `show_payload`."""
    data = _letter_json(x, payload=True, replay=True)
    if not show_payload and x.message is not None:
        data["message"] = LETTER_PAYLOAD_KEPT
    return data


@dlq.command("show")
@click.argument("ref")
@click.option("--show-payload", is_flag=True, help="Print the message's arguments (redacted otherwise).")
@json_option()
@click.pass_context
def dlq_show(ctx: click.Context, ref: str, show_payload: bool, as_json: bool) -> None:
    """Show a dead letter (by id or key): why it died, its error, traceback, attempts, failures and replay."""
    letters = DeadLetters(resolve_database_url(ctx))
    if ref.isdigit():
        found = letters.list(ids=[int(ref)], include_replayed=True, limit=None)
    else:
        found = letters.list(keys=[ref], include_replayed=True, limit=None)
    if not found:
        raise click.ClickException(f"No dead letter {ref!r}: see `oncelery dlq list`")
    shown = [letter_detail(x, show_payload) for x in found]
    if as_json:
        echo_json({"count": len(shown), "letters": shown})
        return
    for i, (x, data) in enumerate(zip(found, shown, strict=True)):
        if i:
            click.echo()
        data["replay"] = _replay_detail(x)
        del data["replay_error"]
        for name, value in data.items():
            if name != "traceback":
                click.echo(f"{name:16}  {'-' if value is None else value}")
        click.echo("traceback:")
        click.echo("\n".join("  " + line for line in (x.traceback or "-").splitlines()))


def _selection(func: Any) -> Any:
    """REFS (ids or keys), the filters, and --all: how replay and purge choose their letters."""
    func = click.option("--all", "every", is_flag=True, help="Every letter not yet replayed (with the filters).")(func)
    return click.argument("refs", nargs=-1)(_filters(func))


@dlq.command("replay")
@_selection
@click.option("--app", "app_path", metavar="MODULE[:APP]", default=None, help=APP_HELP)
@click.option("--queue", default=None, help="Send to this queue (default: the one it came from).")
@json_option()
@click.pass_context
def dlq_replay(
    ctx: click.Context,
    refs: tuple[str, ...],
    task_name: str | None,
    tenant: str | None,
    reason: str | None,
    every: bool,
    app_path: str | None,
    queue: str | None,
    as_json: bool,
) -> None:
    """Re-enqueue dead runs with the same key (completed steps replay from checkpoints). REFS: ids or keys.

    Each replay is written to the outbox with its run's reset, then published; one still queued there (the
    broker refused it) makes the command exit 1: `oncelery relay` publishes it.
    """
    app, url = resolve_publisher(ctx, app_path, "dlq replay")
    found = _select(DeadLetters(url), refs, task_name, tenant, reason, every)
    report, replayed = replay_letters(app, url, found, queue)
    queued = [x for x in replayed if x.replay is ReplayState.QUEUED]
    if as_json:
        echo_json(
            {
                "count": len(replayed),
                "replayed": [_letter_json(x, payload=False, replay=True) for x in replayed],
                "skipped": [{**_letter_json(x, payload=False, replay=True), "why": why} for x, why in report.skipped],
                "publish_error": report.publish_error,
            }
        )
    else:
        for x in replayed:
            where = f": {_replay_text(x)}" if x.replay is ReplayState.QUEUED else ""
            click.echo(f"replayed {x.letter_id} {x.task_name}[{x.key}]{where}")
        for x, why in report.skipped:
            click.echo(f"skipped  {x.letter_id} {x.task_name}[{x.key}]: {why}")
        click.echo(f"{len(report.replayed)} replayed, {len(report.skipped)} skipped")
    if not found:
        raise click.ClickException("no dead letter matched")
    if queued:
        cause = report.publish_error or next((x.replay_error for x in queued if x.replay_error), None)
        raise click.ClickException(_unpublished(len(queued), cause, app_path))


def replay_letters(
    app: Any, url: str, found: Sequence[LetterView], queue: str | None = None
) -> tuple[ReplayReport, list[LetterView]]:
    """Replay `found` as `dlq replay` does (Flower's Runs section too), and read back where each message is now.

    Refused (BrokerNotConfigured, ConfigurationError) before any letter is touched when the app would publish to
    a broker no worker of `url` reads, or when its broker does not answer; a letter whose run is not DEAD, or that
    kept no message, is skipped with why (DeadLetters.replay).
    """
    refuse_unread_broker(str(app.conf.broker_url or ""), url, "dlq replay")
    check_app(app, backend=False)  # before a letter is marked replayed: its message must reach the broker
    letters = DeadLetters(url)
    report = letters.replay(app, found, queue)
    # Read back: where each replayed message is now (published, or still queued in the outbox).
    ids = [x.letter_id for x in report.replayed]
    return report, letters.list(ids=ids, include_replayed=True, limit=None) if ids else []


def _unpublished(queued: int, why: str | None, app_path: str | None) -> str:
    """What to do when replays are committed to the outbox but not published: run the relay."""
    return (
        f"{queued} replayed letter{'s are' if queued != 1 else ' is'} queued in the outbox, not yet published "
        f"({why or 'the broker did not take them'}): run `oncelery relay --app {app_path or 'MODULE:APP'}` "
        "(or keep one running) to publish them"
    )


@dlq.command("purge")
@_selection
@click.pass_context
def dlq_purge(
    ctx: click.Context,
    refs: tuple[str, ...],
    task_name: str | None,
    tenant: str | None,
    reason: str | None,
    every: bool,
) -> None:
    """Delete dead letters and their DEAD runs (their keys may then be sent again). REFS: ids or keys."""
    letters = DeadLetters(resolve_database_url(ctx))
    n = letters.purge(_select(letters, refs, task_name, tenant, reason, every))
    click.echo(f"{n} dead letter{'s' if n != 1 else ''} purged")
