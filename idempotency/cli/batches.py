"""`oncelery batches`: the provider batches of batch steps, and their items (requests and answers redacted)."""

from __future__ import annotations

from typing import Any

import click
from sqlalchemy import func, select

from oncelery.cli.context import resolve_database_url
from oncelery.cli.format import echo_json, format_table, json_option
from oncelery.store.database import Database
from oncelery.store.tables import BATCH_ITEMS, BATCHES

_HEADERS = ("batch", "provider", "model", "state", "items", "provider batch", "status", "polls", "created")
_ITEM_HEADERS = ("custom_id", "run", "step", "state", "batch", "attempts", "request", "error")


@click.command()
@click.option("--items", "show_items", is_flag=True, help="List the items too (their requests redacted).")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True, help="Newest batches shown.")
@json_option()
@click.pass_context
def batches(ctx: click.Context, show_items: bool, limit: int, as_json: bool) -> None:
    """Print the batches the relay's batcher formed (newest first) and how many items wait in each state.

    A batch item holds its full request until its batch is uploaded and applied: this command never prints it
    (only its size), nor an answer (docs/batches.md).
    """
    db = Database(resolve_database_url(ctx))
    b, i = BATCHES.c, BATCH_ITEMS.c
    with db.read() as conn:
        rows = conn.execute(select(BATCHES).order_by(b.created_at.desc()).limit(limit)).all()
        counts: dict[Any, int] = dict(conn.execute(select(i.state, func.count()).group_by(i.state)).all())
        items = conn.execute(select(BATCH_ITEMS).order_by(i.id.desc()).limit(limit)).all() if show_items else []
    records = [_batch(row) for row in rows]
    by_state = {state.value: int(n) for state, n in counts.items()}
    listed = [_item(row) for row in items]
    if as_json:
        echo_json({"count": len(records), "batches": records, "items_by_state": by_state, "items": listed})
        return
    table = [tuple(r[k] for k in ("batch", "provider", "model", "state", "items", "provider_batch_id",
                                  "provider_status", "polls", "created_at")) for r in records]  # fmt: skip
    click.echo(format_table(_HEADERS, table) if table else "no batch formed yet")
    click.echo("items: " + (", ".join(f"{k} {v}" for k, v in sorted(by_state.items())) or "none"))
    if show_items:
        rows_ = [tuple(r[k] for k in ("custom_id", "run_id", "position", "state", "batch", "attempts", "request",
                                      "error")) for r in listed]  # fmt: skip
        click.echo(format_table(_ITEM_HEADERS, rows_) if rows_ else "no item")


def _batch(row: Any) -> dict[str, Any]:
    return {
        "batch": row.id,
        "provider": row.provider,
        "model": row.model,
        "state": row.state.value,
        "items": int(row.items),
        "provider_batch_id": row.provider_batch_id,
        "provider_status": row.provider_status,
        "polls": int(row.polls),
        "created_at": row.created_at,
        "ended_at": row.ended_at,
        # Anthropic, after a create repeated past the search bound: the batches watched, and how each was resolved.
        "suspects": row.suspects,
    }


def _item(row: Any) -> dict[str, Any]:
    # Redacted: the size of what is kept, never its text.
    kept = None if row.request is None else f"<redacted: {len(str(row.request))} chars>"
    return {
        "custom_id": row.custom_id,
        "run_id": int(row.run_id),
        "position": int(row.position),
        "state": row.state.value,
        "batch": row.batch_id,
        "attempts": int(row.attempts),
        "request": kept,
        "error": row.error,
    }
