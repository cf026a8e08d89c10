"""`oncelery fork`: fork a past run from step N with another model or prompt, preview its cost, diff it, or
apply one change to a cohort of runs (docs/fork.md).

    oncelery fork KEY --task NAME --from-step quality --set quality.model=... [--dry-run] [--effects dry|shadow|live]
    oncelery fork diff FORK_ID [--scorer module:function]
    oncelery fork cohort --task NAME --since 7d --limit 200 --from-step quality --set ... [--batch] \
        --max-cost-usd 5 --yes
"""

from __future__ import annotations

import json
from typing import Any

import click

from oncelery.cli.context import APP_HELP, resolve_database_url, resolve_publisher
from oncelery.cli.format import echo_json, format_table, json_option
from oncelery.ops.fork import EFFECTS_MODES, find_source, fork_run, preview_fork
from oncelery.ops.fork_cohort import fork_cohort
from oncelery.ops.fork_preview import ForkPreview, fork_diff, load_scorer
from oncelery.runs.kept import redact_arguments
from oncelery.store.database import Database

__all__ = [
    "fork",
]


class _ForkGroup(click.Group):
    """`oncelery fork KEY ...` forks a run; `oncelery fork diff|cohort ...` are its other commands."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


def _usd(micros: int | None) -> str:
    return "-" if micros is None else f"{micros / 1e6:.6f}"


def _echo_preview(seen: ForkPreview) -> None:
    rows = [
        (s["step"], s["source_model"] or "-", s["model"], s["input_tokens"], s["output_tokens"],
         _usd(s["source_cost_micros"]), _usd(s["cost_micros"]))
        for s in seen.steps
    ]  # fmt: skip
    headers = ("step", "source model", "model", "tokens in", "tokens out (source)", "source USD", "preview USD")
    click.echo(format_table(headers, rows))
    click.echo(f"preview total: {_usd(seen.total_micros)} USD")
    if seen.unpriced:
        click.echo(f"(no price in oncelery_prices or the price file for: {', '.join(sorted(set(seen.unpriced)))})")


_SET_HELP = "STEP.NAME=VALUE with NAME one of model, prompt, temperature, seed (repeatable)."


@click.group(cls=_ForkGroup)
def fork() -> None:
    """Fork a past run from step N with another model or prompt; diff it; apply a change to a cohort."""


@fork.command("run")
@click.argument("key")
@click.option("--task", "task_name", metavar="NAME", required=True, help="The task of the run to fork.")
@click.option("--tenant", default="", help="The run's tenant ('' for none).")
@click.option("--from-step", required=True, metavar="STEP", help="Re-run from this step on (earlier ones replay).")
@click.option("--set", "sets", multiple=True, metavar="STEP.NAME=VALUE", help=_SET_HELP)
@click.option("--effects", type=click.Choice(EFFECTS_MODES), default="dry", show_default=True,
              help="dry: rolled back; shadow: written to --shadow-url; live: production.")  # fmt: skip
@click.option("--shadow-url", metavar="URL", default=None, help="The database a shadow fork's effects go to.")
@click.option("--args", "args_json", metavar="JSON", default=None, help="The run's args (when it kept none).")
@click.option("--kwargs", "kwargs_json", metavar="JSON", default=None, help="The run's kwargs (when it kept none).")
@click.option("--dry-run", is_flag=True, help="Only preview the cost from the ledger: nothing is sent.")
@click.option("--show-arguments", is_flag=True, help="Print the kept argument values (default: sizes and digests).")
@click.option("--app", "app_path", metavar="MODULE[:APP]", default=None, help=APP_HELP)
@json_option()
@click.pass_context
def fork_command(
    ctx: click.Context, key: str, task_name: str, tenant: str, from_step: str, sets: tuple[str, ...], effects: str,
    shadow_url: str | None, args_json: str | None, kwargs_json: str | None, dry_run: bool, show_arguments: bool,
    app_path: str | None, as_json: bool,
) -> None:  # fmt: skip
    """Fork run KEY of --task from --from-step: preview its cost, then (without --dry-run) send it."""
    app, url = resolve_publisher(ctx, app_path, "fork")
    app.conf.oncelery_database_url = url
    seen = preview_fork(app, task_name, key, from_step=from_step, overrides=list(sets), tenant=tenant)
    with Database(url).read() as conn:
        message = find_source(conn, task_name, key, tenant).message
    shown = message if show_arguments else redact_arguments(message)
    document: dict[str, Any] = {"preview": seen.as_json(), "arguments": shown}
    if not dry_run:
        args = None if args_json is None else json.loads(args_json)
        kwargs = None if kwargs_json is None else json.loads(kwargs_json)
        handle = fork_run(
            app, task_name, key, from_step=from_step, overrides=list(sets), effects=effects, shadow_url=shadow_url,
            tenant=tenant, args=args, kwargs=kwargs,
        )  # fmt: skip
        document["fork"] = {"id": handle.id, "key": handle.key, "effects": effects, "task_id": handle.result.id}
    if as_json:
        echo_json(document)
        return
    _echo_preview(seen)
    click.echo(f"arguments: {json.dumps(shown, sort_keys=True)}")
    if "fork" in document:
        made = document["fork"]
        click.echo(
            f"fork {made['id']} sent: run {made['key']} (effects {effects}); see `oncelery fork diff {made['id']}`"
        )


@fork.command("diff")
@click.argument("fork_id", type=int)
@click.option("--scorer", metavar="MODULE:FUNCTION", default=None, help="score(source_output, fork_output).")
@json_option()
@click.pass_context
def diff_command(ctx: click.Context, fork_id: int, scorer: str | None, as_json: bool) -> None:
    """Per step: the outputs diffed, the token, cost and latency deltas, and the scorer's score."""
    steps = fork_diff(Database(resolve_database_url(ctx)), fork_id, load_scorer(scorer) if scorer else None)
    if as_json:
        echo_json({"fork": fork_id, "steps": [s.as_json() for s in steps], "count": len(steps)})
        return
    rows = [
        (s.step, "replayed" if s.replayed else ("changed" if s.diff else "same"), s.tokens_delta,
         _usd(s.cost_delta_micros), f"{s.latency_delta_ms:+.1f}", "-" if s.score is None else s.score)
        for s in steps
    ]  # fmt: skip
    click.echo(format_table(("step", "output", "tokens delta", "cost delta USD", "latency delta ms", "score"), rows))
    for s in steps:
        if s.diff:
            click.echo("\n".join(s.diff))


@fork.command("cohort")
@click.option("--task", "task_name", metavar="NAME", required=True, help="The task whose past runs to fork.")
@click.option("--since", default="7d", show_default=True, help="Runs completed within this age (7d, 24h).")
@click.option("--limit", type=int, default=200, show_default=True, help="At most this many runs (newest first).")
@click.option("--from-step", required=True, metavar="STEP", help="Re-run from this step on.")
@click.option("--set", "sets", multiple=True, metavar="STEP.NAME=VALUE", help=_SET_HELP)
@click.option("--batch", is_flag=True, help="Send the changed calls as batch items (self.llm(mode='batch')).")
@click.option("--max-cost-usd", default=None, help="The cohort's cap: refused above it, and never spent past it.")
@click.option("--yes", is_flag=True, help="Send the forks (they make real, paid calls); without it: preview only.")
@click.option("--effects", type=click.Choice(EFFECTS_MODES), default="dry", show_default=True)
@click.option("--shadow-url", metavar="URL", default=None)
@click.option("--app", "app_path", metavar="MODULE[:APP]", default=None, help=APP_HELP)
@json_option()
@click.pass_context
def cohort_command(
    ctx: click.Context, task_name: str, since: str, limit: int, from_step: str, sets: tuple[str, ...], batch: bool,
    max_cost_usd: str | None, yes: bool, effects: str, shadow_url: str | None, app_path: str | None, as_json: bool,
) -> None:  # fmt: skip
    """Apply one change to many past runs: the preview first; sent only with --yes, within --max-cost-usd."""
    app, url = resolve_publisher(ctx, app_path, "fork cohort")
    app.conf.oncelery_database_url = url
    plan = fork_cohort(
        app, task_name, since=since, limit=limit, from_step=from_step, overrides=list(sets), max_cost_usd=max_cost_usd,
        confirm=yes, batch=batch, effects=effects, shadow_url=shadow_url,
    )  # fmt: skip
    if as_json:
        echo_json(plan.as_json())
        return
    rows = [(t or "-", k, _usd(c)) for (t, k), c in zip(plan.keys, plan.costs, strict=True)]
    click.echo(format_table(("tenant", "key", "preview USD"), rows))
    click.echo(f"preview total: {_usd(plan.total_micros)} USD for {len(plan.keys)} runs (cap {_usd(plan.cap_micros)})")
    if not yes:
        click.echo("nothing sent: add --yes to send these forks (they make real, paid calls)")
    else:
        click.echo(f"sent {len(plan.forks)} forks" + (f" (cohort {plan.forks[0].cohort_id})" if plan.forks else ""))
