"""`oncelery runs list|show`: the runs of the claims database, each with its steps and model calls."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click

from oncelery.cli.context import resolve_database_url
from oncelery.cli.format import _cell, _utc, echo_json, format_table, json_option
from oncelery.ledger.unknown import ESTIMATED_LABELS
from oncelery.models import RunStatus
from oncelery.runs.timeline import IntentView, ledger_label, read_intents
from oncelery.runs.views import CallView, Runs, RunView, StepView
from oncelery.store.database import safe_url

__all__ = [
    "PAYLOAD_KEPT",
    "run_detail",
    "runs",
    "runs_list",
    "runs_show",
    "shown_message",
]

_KEY_WIDTH = 48  # `runs list` shortens longer keys; `runs show` prints them whole
_OWNER_WIDTH = 8


def _shorten(text: str | None, width: int) -> str | None:
    if text is None or len(text) <= width:
        return text
    return text[: width - 3] + "..."


def _short_owner(owner: str | None) -> str | None:
    return owner[:_OWNER_WIDTH] if owner else owner


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
@json_option()
@click.pass_context
def runs_list(
    ctx: click.Context, status: str | None, task_name: str | None, tenant: str | None, limit: int, as_json: bool
) -> None:
    """List the most recently updated runs (times in UTC)."""
    # Imported here: oncelery.cli adds this module's commands to its group when it is imported.
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
@click.option(
    "--show-payload",
    "--show-arguments",
    "show_payload",
    is_flag=True,
    help="Print the stored message's arguments, kept ones included (redacted otherwise).",
)
@json_option()
@click.pass_context
def runs_show(
    ctx: click.Context, key: str, task_name: str | None, tenant: str | None, show_payload: bool, as_json: bool
) -> None:
    """Show every field of the run(s) with KEY: result, error, steps (timing, replayed or executed), model calls."""
    # Imported here: oncelery.cli adds this module's commands to its group when it is imported.
    url = resolve_database_url(ctx)
    reader = Runs(url)
    found = reader.find(key, task_name, tenant)
    if not found:
        where = f" for task {task_name}" if task_name else ""
        raise click.ClickException(f"No run with key {key!r}{where} in {safe_url(url)}")
    details = [
        (run, reader.steps(run.run_id), reader.model_calls(run.run_id), read_intents(reader, run.run_id))
        for run in found
    ]
    if as_json:
        shown = [
            {**run_detail(run, steps, calls, show_payload), "intents": [_intent(i, calls) for i in intents]}
            for run, steps, calls, intents in details
        ]
        echo_json({"count": len(shown), "runs": shown})
        return
    for i, (run, steps, calls, intents) in enumerate(details):
        if i:
            click.echo()
        _echo_run(run, steps, calls, show_payload)
        _echo_intents(intents, calls)


#: What `runs show` (and Flower's run page) prints instead of a run's stored message.
PAYLOAD_KEPT = "<kept for recovery until the run completes; --show-payload prints it>"


def shown_message(run: RunView, show_payload: bool = False) -> Any:
    """The run's stored message as it may be shown: PAYLOAD_KEPT unless `show_payload` (None stays None).

    Arguments may hold prompts, personal data or secrets: every reader of a run (`runs show`, its --json, Flower's
    run page) shows the message through this function only.
    """
    return PAYLOAD_KEPT if run.message is not None and not show_payload else run.message


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


def run_detail(
    run: RunView, steps: Sequence[StepView], calls: Sequence[CallView], show_payload: bool
) -> dict[str, Any]:
    """Everything `runs show` prints of one run, as JSON-ready data, its message redacted (`shown_message`)."""
    return {
        **_run_summary(run),
        "fingerprint": run.fingerprint,
        "not_before": run.not_before,
        "retry_wait": run.retry_wait,
        "concurrency_key": run.concurrency_key,
        "celery_task_id": run.celery_task_id,
        "result": run.result,
        "error": run.error,
        "message": shown_message(run, show_payload),
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


def call_outcome(call: CallView) -> str:
    """How a model call ended, as far as anyone can know: `ok`, `failed` (the provider said so), or `unknown`
    (its holder died or its run ended before the answer was recorded: the row is at the intent's estimate)."""
    if call.reason in ESTIMATED_LABELS:
        return "unknown"
    return "ok" if call.ok else "failed"


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
        "outcome": call_outcome(call),
        "error": call.error,
        "cost": None if call.cost is None else float(call.cost),  # USD, at most 6 decimals (as `costs --json`)
        "token": call.token,
        "created_at": call.created_at,
    }


def _echo_run(
    run: RunView, steps: Sequence[StepView], calls: Sequence[CallView] = (), show_payload: bool = False
) -> None:
    """Print one run as `runs show` does: its fields, result, error, message, steps and model calls."""
    _echo_fields(run)
    _echo_stored(run, show_payload)
    _echo_steps(run, steps)
    _echo_calls(calls)


def _echo_fields(run: RunView) -> None:
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


def _echo_stored(run: RunView, show_payload: bool) -> None:
    # The run's stored JSON and text: its result, its error, and the message kept for its recovery.
    click.echo("result:")
    click.echo(_indent(json.dumps(run.result, indent=2, sort_keys=True, ensure_ascii=False)))
    click.echo("error:")
    click.echo(_indent(run.error or "-"))
    click.echo("message:")
    shown = shown_message(run, show_payload)  # arguments may hold prompts, personal data or secrets
    click.echo(_indent(shown if shown == PAYLOAD_KEPT else json.dumps(shown, sort_keys=True, ensure_ascii=False)))


def _echo_steps(run: RunView, steps: Sequence[StepView]) -> None:
    click.echo(f"steps ({len(steps)}):")
    if steps:
        rows = [
            (s["position"], s["name"], s["token"], s["created_at"], _seconds(s["seconds"]), s["by_last_attempt"])
            for s in _step_timeline(run, steps)
        ]
        click.echo(_indent(format_table(("position", "step", "token", "created_at", "seconds", "last attempt"), rows)))


def _echo_calls(calls: Sequence[CallView]) -> None:
    click.echo(f"model calls ({len(calls)}):")
    if calls:
        call_headers = (
            *("step", "model", "prompt", "tokens in", "tokens out"),
            *("latency ms", "outcome", "cost USD", "token"),
        )
        call_rows = [
            (
                c.step,
                c.model,
                c.prompt,
                c.input_tokens,
                c.output_tokens,
                f"{c.latency_ms:.1f}",
                call_outcome(c),
                None if c.cost is None else f"{c.cost:.6f}",
                c.token,
            )
            for c in calls
        ]
        click.echo(_indent(format_table(call_headers, call_rows)))


def _intent(intent: IntentView, calls: Sequence[CallView]) -> dict[str, Any]:
    return {
        "id": intent.public_id,
        "step": intent.step,
        "position": intent.position,
        "attempt": intent.attempt,
        "token": intent.token,
        "state": intent.state,
        "provider": intent.provider,
        "model": intent.model,
        "mode": intent.mode,
        "reference": intent.reference,
        "repeat_reason": intent.repeat_reason,
        "label": ledger_label(intent, list(calls)),
        "prepared_at": intent.prepared_at,
        "sent_at": intent.sent_at,
        "ended_at": intent.ended_at,
    }


def _echo_intents(intents: Sequence[IntentView], calls: Sequence[CallView]) -> None:
    # The intents, not only the ledger: a call in flight has no ledger row and no checkpoint yet, and a call
    # whose outcome is unknown shows its own state (lost, abandoned) beside the row's label.
    click.echo(f"model call intents ({len(intents)}):")
    if intents:
        headers = ("step", "attempt", "state", "provider", "model", "reference", "repeat reason", "label", "sent_at")
        rows = [
            (i.step, i.attempt, i.state, i.provider, i.model, i.reference, i.repeat_reason, x["label"], i.sent_at)
            for i, x in ((i, _intent(i, calls)) for i in intents)
        ]
        click.echo(_indent(format_table(headers, rows)))


def _seconds(value: float | None) -> str | None:
    return None if value is None else f"{value:.3f}"


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())
