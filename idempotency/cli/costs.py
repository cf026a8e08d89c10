"""`oncelery costs`: what model calls cost per task, tenant and model, and what replays saved (the cost ledger)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import click

from oncelery.cli.context import resolve_database_url
from oncelery.cli.format import echo_json, format_table, json_option
from oncelery.ops.costs import Spend, cost_report

_HEADERS = (
    "task",
    "tenant",
    "model",
    "calls",
    "failed",
    "tokens in",
    "tokens out",
    "cost USD",
    "saved calls",
    "saved in",
    "saved out",
    "saved USD",
)


@click.command()
@click.option("--task", "task_name", metavar="NAME", default=None, help="Only this task's calls.")
@click.option("--tenant", metavar="TENANT", default=None, help="Only this tenant's calls ('' for none).")
@json_option()
@click.pass_context
def costs(ctx: click.Context, task_name: str | None, tenant: str | None, as_json: bool) -> None:
    """Print model calls made (ok/failed), tokens and estimated cost, what replays saved, and what batch steps
    saved against the synchronous price.

    Saved: each duplicate delivery answered from a run's stored result made none of that run's calls, so a
    run saved its replays times its ok calls, tokens and cost. Costs are USD at the price of the day each
    call was recorded (app.conf.oncelery_prices, else the price file); '-' where no model had a price.
    """
    # Imported here: oncelery.cli adds this module's command to its group when it is imported.
    report = cost_report(resolve_database_url(ctx), task_name, tenant)
    if as_json:
        document = report.as_dict()
        echo_json({**document, "count": len(document["lines"])})  # the one --json shape: records and their count
        return
    rows = [_row(line.task_name or "-", line.tenant or "-", line.model, line.made, line.saved) for line in report.lines]
    rows.append(_row("total", "", "", report.made, report.saved))
    click.echo(format_table(_HEADERS, rows))
    unpriced = report.made.unpriced_calls
    if unpriced:
        plural = "s" if unpriced != 1 else ""
        click.echo(f"({unpriced} call{plural} of models without a price in oncelery_prices or the price file)")
    if report.labels:
        click.echo(_labelled(dict(report.labels)))
    batched = report.batched
    if batched.calls:
        click.echo(
            f"batch calls: {batched.calls} of {report.made.calls} ({batched.failed_calls} failed), cost "
            f"{_usd(batched.cost) or '-'} USD at the batch price; saved by batching: "
            f"{_usd(report.batch_saved) or '-'} USD against the synchronous price"
        )


def _row(task: str, tenant: str, model: str, made: Spend, saved: Spend) -> tuple[Any, ...]:
    return (
        task,
        tenant,
        model,
        made.calls,
        made.failed_calls,
        made.input_tokens,
        made.output_tokens,
        _usd(made.cost),
        saved.calls,
        saved.input_tokens,
        saved.output_tokens,
        _usd(saved.cost),
    )


def _labelled(labels: dict[str, int]) -> str:
    """One line: calls made again by reason, estimated calls of unknown outcome, calls re-attached."""
    unknown, reattached = labels.pop("unknown_outcome", 0), labels.pop("reattached", 0)
    repeated = ", ".join(f"{n} {reason}" for reason, n in sorted(labels.items())) or "none"
    return (
        f"repeated calls: {repeated}; calls of unknown outcome (estimated rows): {unknown}; "
        f"re-attached calls: {reattached}"
    )


def _usd(value: Decimal | None) -> str | None:
    return None if value is None else f"{value:.6f}"


__all__ = ["costs"]
