"""`oncelery debounce`: the debounce rows (docs/debounce.md): each key's burst, pending or sent, and when it is due.

A pending burst holds its latest edit's arguments (payload at rest): they are described, never printed, unless
`--show-arguments` is given (runs/kept.py's redaction: name, type, size and a keyed digest per argument).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import click
from sqlalchemy import select

from oncelery.cli.context import resolve_database_url
from oncelery.cli.format import echo_json, format_table, json_option
from oncelery.runs.kept import redact_arguments
from oncelery.store.database import Database
from oncelery.store.tables import DEBOUNCE

__all__ = ["debounce"]

_HEADERS = ("task", "tenant", "debounce key", "edits", "sent", "state", "due in s", "burst task id", "arguments")


@click.command()
@click.option("--task", "task_name", default=None, help="Only this task's rows.")
@click.option("--pending", is_flag=True, help="Only bursts not yet sent (edits newer than the last dispatch).")
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1, 100_000), help="Rows at most.")
@click.option("--show-arguments", is_flag=True, help="Print the kept arguments' values (they may hold personal data).")
@json_option()
@click.pass_context
def debounce(
    ctx: click.Context, task_name: str | None, pending: bool, limit: int, show_arguments: bool, as_json: bool
) -> None:
    """Print each debounce key: its edits, the last one sent, whether a burst is pending and when it is due.

    A pending burst's latest arguments are kept until it is sent; they are shown redacted unless --show-arguments.
    """
    db = Database(resolve_database_url(ctx))
    d = DEBOUNCE.c
    query = select(DEBOUNCE)
    if task_name is not None:
        query = query.where(d.task_name == task_name)
    if pending:
        query = query.where(d.seq > d.dispatched_seq)
    with db.read() as conn:
        clock = float(conn.execute(select(db.dialect.epoch())).scalar_one())  # due times are on the database clock
        rows = conn.execute(query.order_by(d.due_at).limit(limit)).all()
    records = [_record(row, clock, show_arguments) for row in rows]
    if as_json:
        echo_json({"count": len(records), "rows": records})
        return
    table = [
        (r["task"], r["tenant"] or "-", r["debounce_key"], r["seq"], r["dispatched_seq"], r["state"],
         "-" if r["due_in_s"] is None else f"{r['due_in_s']:.1f}", r["task_id"], _short(r["arguments"]))
        for r in records
    ]  # fmt: skip
    click.echo(format_table(_HEADERS, table) if table else "no debounce rows")


def _seconds_until(clock: float, moment: datetime) -> float:
    # PostgreSQL returns aware datetimes, SQLite naive UTC ones.
    aware = moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    return aware.timestamp() - clock


def _record(row: Any, clock: float, show_arguments: bool) -> dict[str, Any]:
    pending = int(row.seq) > int(row.dispatched_seq)
    message = {"args": row.args, "kwargs": row.kwargs} if pending and row.args is not None else None
    if message is None:
        arguments: Any = {"kept": False}
    else:
        arguments = message if show_arguments else redact_arguments(message)
    return {
        "task": row.task_name,
        "tenant": row.tenant,
        "debounce_key": row.debounce_key,
        "seq": int(row.seq),
        "dispatched_seq": int(row.dispatched_seq),
        "state": "pending" if pending else "sent",
        "due_in_s": round(_seconds_until(clock, row.due_at), 3) if pending else None,
        "task_id": row.task_id,
        "arguments": arguments,
    }


def _short(arguments: Any) -> str:
    if not isinstance(arguments, dict) or not arguments.get("kept", True):
        return "-"
    if "args" in arguments and arguments.get("kept") is True:
        return f"{len(arguments['args'])} args, {len(arguments['kwargs'])} kwargs (redacted)"
    return str(arguments)[:60]
