"""`oncelery limits`: the shared limiters (oncelery_limits) as the database holds them, one row each."""

from __future__ import annotations

from typing import Any

import click
from sqlalchemy import select

from oncelery.cli.context import resolve_database_url
from oncelery.cli.format import echo_json, format_table, json_option
from oncelery.llm.limits import backlog_s
from oncelery.store.database import Database
from oncelery.store.tables import LIMITERS

_HEADERS = ("limiter", "per minute", "backlog s", "capacity", "admitted", "waited (local)", "429s (provider)")
_KEYS = ("limiter", "per_minute", "backlog_s", "capacity", "admitted", "throttled_local", "throttled_provider")


@click.command()
@json_option()
@click.pass_context
def limits(ctx: click.Context, as_json: bool) -> None:
    """Print each shared limiter: its rate, the admitted work it holds ahead of now, its capacity after 429s.

    A limiter's row is made by its first admission (configure them with app.conf.oncelery_limits; docs/limits.md).
    """
    db = Database(resolve_database_url(ctx))
    c = LIMITERS.c
    with db.read() as conn:
        now = conn.execute(select(db.dialect.epoch())).scalar_one()
        rows = conn.execute(select(LIMITERS).order_by(c.name)).all()
    records = [_record(row, float(now)) for row in rows]
    if as_json:
        echo_json({"count": len(records), "limiters": records})
        return
    table = [tuple(r[k] for k in _KEYS) for r in records]
    click.echo(format_table(_HEADERS, table) if table else "no limiter has admitted a call yet")


def _record(row: Any, now: float) -> dict[str, Any]:
    return {
        "limiter": row.name,
        # Per 60 s, whatever window the rule was written with (seconds_per_unit is the pace).
        "per_minute": round(60.0 / row.seconds_per_unit, 3) if row.seconds_per_unit else 0.0,
        "backlog_s": round(backlog_s(float(row.tat), now), 3),
        "capacity": round(float(row.factor), 3),
        "admitted": int(row.admitted),
        "throttled_local": int(row.throttled_local),
        "throttled_provider": int(row.throttled_provider),
    }
