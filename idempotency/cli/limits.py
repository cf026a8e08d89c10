"""`oncelery limits` and `oncelery budgets`: the shared limiters and the budgets as the database holds them, and
the caps an operator sets (stored in the database, winning over the configuration, every change recorded)."""

from __future__ import annotations

import getpass
import socket
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import click
from sqlalchemy import Connection, select, update

from oncelery.cli.context import resolve_database_url
from oncelery.cli.format import echo_json, format_table, json_option
from oncelery.errors import ConfigurationError
from oncelery.llm.budgets import PERIODS, cap_name, parse_usd, set_cap
from oncelery.llm.limits import KINDS, LimiterView, limiter_views, rows_of
from oncelery.models.money import usd
from oncelery.store.database import Database
from oncelery.store.tables import BUDGETS, CAP_CHANGES, CAPS, LIMITERS

_HEADERS = (
    "limiter", "per minute", "backlog s", "capacity", "admitted", "waited (local)", "429s (provider)", "cap", "shards",
)  # fmt: skip
_KEYS = (
    "limiter", "per_minute", "backlog_s", "capacity", "admitted", "throttled_local", "throttled_provider", "cap",
    "shards",
)  # fmt: skip
_BUDGET_HEADERS = ("budget", "limit $", "spent $", "reserved $", "left $", "overrun $", "refused", "resets (UTC)")
_BUDGET_KEYS = ("budget", "limit_usd", "spent_usd", "reserved_usd", "left_usd", "overrun_usd", "refused", "resets_at")


def _who(by: str | None) -> str:
    return by or f"{getpass.getuser()}@{socket.gethostname()}"


_BY = click.option("--by", default=None, help="Who makes the change (default: user@host), kept in the history.")


@click.group(invoke_without_command=True)
@json_option()
@click.pass_context
def limits(ctx: click.Context, as_json: bool) -> None:
    """Print each shared limiter: its rate, the admitted work it holds ahead of now, its capacity after 429s.

    A limiter's row is made by its first admission (configure them with app.conf.oncelery_limits; docs/limits.md).
    `oncelery limits set` caps one for the whole fleet, winning over the configuration.
    """
    if ctx.invoked_subcommand is not None:
        return
    db = Database(resolve_database_url(ctx))
    c = LIMITERS.c
    with db.read() as conn:
        now = conn.execute(select(db.dialect.epoch())).scalar_one()
        rows = conn.execute(select(LIMITERS).order_by(c.name)).all()
    records = [_record(view) for view in limiter_views(rows, float(now))]
    if as_json:
        echo_json({"count": len(records), "limiters": records})
        return
    table = [tuple(r[k] for k in _KEYS) for r in records]
    click.echo(format_table(_HEADERS, table) if table else "no limiter has admitted a call yet")


def _record(view: LimiterView) -> dict[str, Any]:
    return {k: getattr(view, k) for k in ("per_minute", "backlog_s", "capacity", "admitted", "throttled_local",
                                          "throttled_provider", "cap", "shards")} | {"limiter": view.name}  # fmt: skip


@limits.command("set")
@click.argument("limiter")
@click.option(
    "--per-minute", type=click.IntRange(min=1), default=None, help="The limit per minute (units of its kind)."
)
@click.option("--unset", is_flag=True, help="Remove the operator's cap: the configuration's limit applies again.")
@_BY
@click.pass_context
def set_limit(ctx: click.Context, limiter: str, per_minute: int | None, unset: bool, by: str | None) -> None:
    """Cap LIMITER ("openai:gpt-4.1-mini/rpm", as `oncelery limits` names it) for every worker, at once."""
    if (per_minute is None) == (not unset) or limiter.rsplit("/", 1)[-1] not in KINDS:
        raise click.UsageError(f"give LIMITER as <scope>/<{'|'.join(KINDS)}> and one of --per-minute N or --unset")
    db = Database(resolve_database_url(ctx))
    with db.begin() as conn:
        old = set_cap(conn, db.dialect, f"limit:{limiter}", per_minute, _who(by))
        spu = None if per_minute is None else 60.0 / per_minute
        # Every shard of the limiter: the cap is the whole limiter's pace (each shard takes its share of it).
        if conn.execute(update(LIMITERS).where(rows_of([limiter])).values(capped_spu=spu)).rowcount == 0:
            # Not admitted yet: its row is made now, at rest, carrying the cap (the first admission keeps it).
            row = {"name": limiter, "tat": 0.0, "seconds_per_unit": spu or 60.0, "capped_spu": spu}
            conn.execute(db.dialect.insert(LIMITERS).values(**row).on_conflict_do_nothing(index_elements=["name"]))
    click.echo(f"{limiter}: cap {old if old is not None else '(configuration)'} -> {per_minute or '(configuration)'}")


@click.group(invoke_without_command=True)
@json_option()
@click.pass_context
def budgets(ctx: click.Context, as_json: bool) -> None:
    """Print each budget window: its limit, what was spent (the ledger's sum) and what calls in flight reserved.

    Configure budgets with app.conf.oncelery_budgets and a task's max_cost_usd (docs/limits.md); `oncelery
    budgets set` caps one for the whole fleet, winning over the configuration; `oncelery budgets history` lists
    every change of a cap.
    """
    if ctx.invoked_subcommand is not None:
        return
    db = Database(resolve_database_url(ctx))
    with db.read() as conn:
        rows = conn.execute(select(BUDGETS).order_by(BUDGETS.c.name)).all()
        caps = dict(conn.execute(select(CAPS.c.name, CAPS.c.value)).all())
    records = [_budget(row) for row in rows]
    if as_json:
        echo_json({"count": len(records), "budgets": records, "caps": _caps(caps)})
        return
    table = [tuple(r[k] for k in _BUDGET_KEYS) for r in records]
    click.echo(format_table(_BUDGET_HEADERS, table) if table else "no call has reserved in a budget yet")
    if caps:
        click.echo("\noperator caps (win over the configuration):")
        click.echo(format_table(("cap", "value"), sorted(_caps(caps).items())))


def _caps(caps: dict[str, Any]) -> dict[str, Any]:
    return {name: (usd(int(v)) if name.startswith("budget:") else int(v)) for name, v in caps.items()}


def _budget(row: Any) -> dict[str, Any]:
    left = int(row.limit_micros) - int(row.spent_micros) - int(row.reserved_micros)
    resets = None if row.resets_at is None else datetime.fromtimestamp(float(row.resets_at), UTC)
    return {
        "budget": row.name,
        "limit_usd": usd(int(row.limit_micros)),
        "spent_usd": usd(int(row.spent_micros)),
        "reserved_usd": usd(int(row.reserved_micros)),
        "left_usd": usd(left),
        "overrun_usd": usd(int(row.overrun_micros)),
        "refused": int(row.refused),
        "resets_at": resets,
    }


@budgets.command("set")
@click.argument("scope")
@click.option("--day", "period", flag_value="day", help="The cap is per UTC day.")
@click.option("--month", "period", flag_value="month", help="The cap is per UTC month.")
@click.option("--usd", "amount", default=None, help="The cap in USD (exact: '12.50').")
@click.option("--unset", is_flag=True, help="Remove the operator's cap: the configuration's applies again.")
@_BY
@click.pass_context
def set_budget(
    ctx: click.Context, scope: str, period: str | None, amount: str | None, unset: bool, by: str | None
) -> None:
    """Cap SCOPE ("global", "tenant:*", "tenant:acme") per --day or --month, for every worker, at once.

    Raising a cap lets the runs it dead-lettered be replayed (`oncelery dlq replay`); lowering it never cancels
    a call in flight (the window's limit stops at what it already holds).
    """
    if period not in PERIODS or (amount is None) == (not unset):
        raise click.UsageError("give --day or --month, and one of --usd AMOUNT or --unset")
    if scope != "global" and not (scope.startswith("tenant:") and scope[7:]):
        raise click.UsageError("SCOPE is 'global', 'tenant:*' or 'tenant:<id>'")
    try:
        micros = None if amount is None else parse_usd(amount, "--usd")
    except ConfigurationError as exc:
        raise click.UsageError(str(exc)) from exc
    db = Database(resolve_database_url(ctx))
    with db.begin() as conn:
        old = set_cap(conn, db.dialect, cap_name(scope, period), micros, _who(by))
    click.echo(f"{scope} per {period}: cap {_usd(old)} -> {_usd(micros)}")


def _usd(micros: int | None) -> str:
    return "(configuration)" if micros is None else f"${usd(micros)}"


@budgets.command("history")
@json_option()
@click.pass_context
def history(ctx: click.Context, as_json: bool) -> None:
    """Print every change of an operator's cap (limits and budgets): who, when, from what to what."""
    db = Database(resolve_database_url(ctx))
    with db.read() as conn:
        records = [_change(row) for row in _changes(conn)]
    if as_json:
        echo_json({"count": len(records), "changes": records})
        return
    table = [(r["at"], r["cap"], r["from"], r["to"], r["by"]) for r in records]
    click.echo(format_table(("at", "cap", "from", "to", "by"), table) if table else "no cap was ever set")


def _changes(conn: Connection) -> list[Any]:
    return list(conn.execute(select(CAP_CHANGES).order_by(CAP_CHANGES.c.id)).all())


def _change(row: Any) -> dict[str, Any]:
    money = row.name.startswith("budget:")

    def show(value: int | None) -> Decimal | int | None:
        return None if value is None else (usd(int(value)) if money else int(value))

    return {"at": row.set_at, "cap": row.name, "from": show(row.old_value), "to": show(row.new_value), "by": row.set_by}
