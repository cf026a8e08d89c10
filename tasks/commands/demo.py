"""`oncelery demo`: score generated documents with duplicate deliveries and show each body ran once."""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import click
from kombu.utils.url import maybe_sanitize_url

from oncelery import Outcome, Runs, RunStatus, is_embedded_broker
from oncelery.cli import check_services, format_table, refuse_unread_broker, resolve_database_url
from oncelery.tasks.commands.local_worker import LocalWorker
from oncelery.tasks.commands.producer import (
    plan_deliveries,
    prepare_database,
    sigterm_as_interrupt,
    start_local_worker,
)

# Outcomes that end a delivery. in_progress and lease_lost re-send the message, so they do not.
_SETTLED = (
    Outcome.EXECUTED,
    Outcome.REPLAYED,
    Outcome.RESUMED,
    Outcome.CONFLICT,
    Outcome.STALE,
    Outcome.FAILED,
    Outcome.DEAD,
)
_POLL_SECONDS = 0.1
_PROGRESS_EVERY = 2.0  # seconds between progress lines when stdout is not a terminal

_SUBJECTS = (
    "The new model",
    "Our support team",
    "The quarterly report",
    "A small startup",
    "The city council",
    "The research group",
    "This short summary",
    "The night shift",
    "Our latest release",
    "A careful reviewer",
)
_VERBS = ("explains", "improves", "questions", "describes", "reduces", "reviews", "compares", "predicts", "tracks")
_OBJECTS = (
    "the cost of shipping",
    "response times across regions",
    "how people read long articles",
    "the risks of a late launch",
    "energy use in older buildings",
    "the tone of incoming emails",
    "errors in scanned invoices",
    "demand for electric bikes",
    "the quality of translated manuals",
    "traffic during the holidays",
)
_TAILS = (
    "in plain words",
    "with clear examples",
    "after a long delay",
    "for the first time",
    "despite a tight budget",
    "without extra staff",
    "using public data",
    "better than last year",
)


def sample_documents(count: int) -> list[tuple[str, str]]:
    """Return `count` (doc_id, text) pairs of short English prose, the same on every run and machine."""
    docs = []
    for i in range(count):
        rng = random.Random(f"oncelery-demo:{i}")  # str seeds are hashed with sha512: stable everywhere
        sentences = [
            f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."
            for _ in range(rng.randint(2, 5))
        ]
        docs.append((f"demo-{i:05d}", " ".join(sentences)))
    return docs


@click.command()
@click.option("--jobs", type=click.IntRange(1, 10_000), default=40, show_default=True, help="Documents to score.")
@click.option(
    "--duplicates",
    type=click.FloatRange(0.0, 1.0),
    default=0.3,
    show_default=True,
    help="Fraction of the documents delivered a second time (same arguments).",
)
@click.option(
    "--work-seconds",
    type=click.FloatRange(min=0.0),
    default=0.05,
    show_default=True,
    help="Simulated model latency per job.",
)
@click.option(
    "--doc-version",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Version in every document's key; rerunning with the same version replays every document.",
)
@click.option(
    "--start-worker/--no-start-worker",
    default=None,
    help="Start a local worker. Default: only on the embedded (oncelery-fs://, or filesystem://) broker.",
)
@click.option("--concurrency", type=click.IntRange(min=1), default=2, show_default=True, help="Worker processes.")
@click.option("--timeout", type=click.FloatRange(min=1.0), default=180.0, show_default=True, help="Seconds to wait.")
@click.pass_context
def demo(
    ctx: click.Context,
    jobs: int,
    duplicates: float,
    work_seconds: float,
    doc_version: int,
    start_worker: bool | None,
    concurrency: int,
    timeout: float,
) -> None:
    """Score sample documents with duplicate deliveries and show that each body ran exactly once."""
    from oncelery.tasks.app import app  # imported here: loading celeryconfig creates the embedded broker's folders
    from oncelery.tasks.demo import demo_score

    check_services(app)  # a broker or result backend that is down: one line now, not a hang while sending
    url = resolve_database_url(ctx, app, embedded=True)
    broker = str(app.conf.broker_url)
    if start_worker is None:
        start_worker = is_embedded_broker(broker)
    if not start_worker:  # on the embedded broker, only the demo's own workers would read the jobs
        refuse_unread_broker(broker, url, "demo --no-start-worker")
    for line in prepare_database(url):
        click.echo(line)

    docs = sample_documents(jobs)
    calls = [(doc_id, doc_version, text, work_seconds) for doc_id, text in docs]
    keys = [str(demo_score.key_of(args).key) for args in calls]
    order = plan_deliveries(jobs, duplicates)
    runs = Runs(url)
    before = runs.outcome_counts(demo_score.name)
    already = runs.statuses(demo_score.name, keys).get(RunStatus.COMPLETED, 0)

    click.echo(f"broker {maybe_sanitize_url(broker)}")
    worker = None
    # A SIGTERM to this command unwinds through `finally` like Ctrl-C, so its worker is never orphaned.
    with sigterm_as_interrupt():
        try:
            if start_worker:
                worker = start_local_worker(url, "demo-worker.log", concurrency)
                click.echo(f"started a worker: pid {worker.pid}, {concurrency} processes, log {worker.log_path}")
            else:
                click.echo("no local worker: waiting for the broker's workers (--start-worker starts one)")
            started = time.monotonic()
            for i in order:
                demo_score.delay(*calls[i])
            first, settled = _wait(runs, demo_score.name, keys, before, len(order), started, timeout, worker)
            finished = time.monotonic()
        except KeyboardInterrupt:
            raise click.ClickException("interrupted") from None
        finally:
            if worker is not None:
                worker.stop()

    delta = {o.value: n - before.get(o.value, 0) for o, n in _counts(runs, demo_score.name).items()}
    _report(delta, jobs, len(order), already, first, started, finished)
    expected = jobs - already
    if not settled:
        raise click.ClickException(f"timed out after {timeout:.0f}s; see `oncelery runs list`")
    if delta["failed"] or delta["executed"] != expected:
        raise click.ClickException(f"expected {expected} executions and no failures; see `oncelery runs list`")
    earlier = f" ({already} completed by an earlier run)" if already else ""
    click.echo(f"exactly once: {expected} bodies ran for {len(order)} deliveries of {jobs} documents{earlier}")


def _counts(runs: Runs, task_name: str) -> dict[Outcome, int]:
    counts = runs.outcome_counts(task_name)
    return {o: counts.get(o.value, 0) for o in Outcome}


def _report(
    delta: dict[str, int], jobs: int, sent: int, already: int, first: float | None, started: float, finished: float
) -> None:
    """Print the demo's table: deliveries, what each became, and the time it took."""
    busy = finished - first if first is not None and finished > first else None
    rows: list[tuple[str, Any]] = [
        ("documents", jobs),
        ("deliveries sent", sent),
        ("executed", delta["executed"]),
        ("replayed (duplicates absorbed)", delta["replayed"]),
        ("in_progress waits", delta["in_progress"]),
        ("failed", delta["failed"]),
        ("wall time", f"{finished - started:.2f} s"),
        ("jobs/s (after the first result)", f"{jobs / busy:.1f}" if busy else "-"),
    ]
    if already:
        rows.insert(1, ("completed before this run", already))
    click.echo(format_table(("metric", "value"), rows))


def _wait(
    runs: Runs,
    task_name: str,
    keys: Sequence[str],
    before: dict[str, int],
    sent: int,
    started: float,
    timeout: float,
    worker: LocalWorker | None,
) -> tuple[float | None, bool]:
    """Poll until every run is COMPLETED/FAILED and every delivery settled; return (first result time, ok)."""
    deadline = started + timeout
    first: float | None = None
    last_line = 0.0
    tty = sys.stdout.isatty()
    while True:
        statuses = runs.statuses(task_name, keys)
        counts = runs.outcome_counts(task_name)
        done = sum(statuses.get(s, 0) for s in (RunStatus.COMPLETED, RunStatus.FAILED))
        settled = sum(counts.get(o.value, 0) - before.get(o.value, 0) for o in _SETTLED)
        now = time.monotonic()
        if first is None and settled > 0:
            first = now
        finished = done >= len(keys) and settled >= sent
        if tty or finished or now - last_line >= _PROGRESS_EVERY:
            line = f"runs done {done}/{len(keys)}, deliveries settled {settled}/{sent}, {now - started:.1f}s"
            click.echo(("\r" + line) if tty else line, nl=not tty or finished)
            last_line = now
        if finished:
            return first, True
        if worker is not None and worker.exited() is not None:
            click.echo()
            raise click.ClickException(
                f"the worker exited with code {worker.exited()}; its log ends:\n{worker.log_tail()}"
            )
        if now > deadline:
            click.echo()
            return first, False
        time.sleep(_POLL_SECONDS)
