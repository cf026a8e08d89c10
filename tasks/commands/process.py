"""`oncelery process FILE.jsonl`: score every article exactly once on the configured broker and database.

The command writes every delivery of `score_article` (optionally duplicates, and SIGKILLs of its own worker,
to show the guarantees hold) to the transactional outbox in one transaction, and an in-process relay
publishes them. The producer never re-sends: the relay's sweeper re-sends a job whose worker was lost (from
its run's stored message), and the outbox re-publishes one lost before it was claimed. The claim absorbs
any copy that was not needed; a job lost with a killed worker is never lost for the user.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import click
from kombu.utils.url import maybe_sanitize_url
from rich.console import Console

from oncelery import (
    Database,
    Identity,
    InvalidKey,
    OpenAIBatches,
    Relay,
    Runs,
    batch_savings,
    differing_fields,
    is_embedded_broker,
    outbox,
)
from oncelery.cli import check_services, refuse_unread_broker, resolve_database_url
from oncelery.tasks.commands.article_file import Article, load_articles, load_sample
from oncelery.tasks.commands.local_worker import LocalWorker
from oncelery.tasks.commands.producer import (
    ENV_LEASE,
    WORKER_APP,
    plan_deliveries,
    prepare_database,
    sigterm_as_interrupt,
    start_local_worker,
)
from oncelery.tasks.commands.report import Summary, render, scored, summarize, take_snapshot, write_json
from oncelery.tasks.commands.watch import Watch
from oncelery.tasks.llm.openai_compat import ENV_BASE_URL
from oncelery.tasks.llm.served import ENV_FAKE_PROVIDER_URL, ENV_LLM_MODE, start_provider

LOG_NAME = "process-worker.log"
NON_TTY_WIDTH = 110


@click.command()
@click.argument("path", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--sample",
    is_flag=True,
    help="Score the sample articles shipped with oncelery (112 of them) instead of a FILE: runs from a pip install.",
)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Only the first N articles of the file.")
@click.option(
    "--duplicates",
    type=click.FloatRange(0.0, 1.0),
    default=0.0,
    show_default=True,
    help="Fraction of the articles delivered a second time (same arguments); half right behind the first copy.",
)
@click.option(
    "--temperature",
    type=click.FloatRange(0.0, 2.0),
    default=0.0,
    show_default=True,
    help="Sampling temperature of every model call (part of each article's payload).",
)
@click.option(
    "--kill-worker-every",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="SIGKILL the worker this command started (main process and pool) every N scored articles, then restart it.",
)
@click.option(
    "--start-worker/--no-start-worker",
    default=None,
    help="Start a local worker. Default: only on the embedded (oncelery-fs://, or filesystem://) broker.",
)
@click.option("--concurrency", type=click.IntRange(min=1), default=2, show_default=True, help="Worker processes.")
@click.option(
    "--lease",
    type=click.FloatRange(min=1.0),
    default=None,
    help="Article lease (seconds) in the worker this command starts: a killed holder's job is taken over "
    "after this long. Default: the task's own (60).",
)
@click.option(
    "--call-seconds",
    default="0.02-0.1",
    show_default=True,
    metavar="MIN[-MAX]",
    help="How long each model call takes at the local provider (spread between MIN and MAX): 0.2-1 lets a "
    "--kill-worker-every kill land mid-call, and the next holder re-attach to it.",
)
@click.option("--queue", default=None, help="Queue to send to (and for the started worker to consume).")
@click.option(
    "--quiet-seconds",
    type=click.FloatRange(min=0.5),
    default=3.0,
    show_default=True,
    help="Re-send unfinished articles after this long without progress once the queue has drained.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=1.0),
    default=600.0,
    show_default=True,
    help="Give up (exit 1) if articles are still unfinished after this many seconds.",
)
@click.option(
    "--batch",
    "batch",
    is_flag=True,
    help="Run the steps as items of provider batches (about half the price): each run waits WAITING, holding no "
    "worker slot, until its step's batch returns; this command's relay submits and polls the batches.",
)
@click.option(
    "--summary-json",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the summary as JSON to this file.",
)
@click.pass_context
def process(
    ctx: click.Context,
    path: Path | None,
    sample: bool,
    limit: int | None,
    duplicates: float,
    temperature: float,
    kill_worker_every: int | None,
    start_worker: bool | None,
    concurrency: int,
    lease: float | None,
    call_seconds: str,
    queue: str | None,
    quiet_seconds: float,
    timeout: float,
    batch: bool,
    summary_json: Path | None,
) -> None:
    """Score every article of a JSON Lines FILE (id, version, text), or --sample, exactly once: summary, keywords,
    quality."""
    if sample == (path is not None):
        raise click.UsageError("give a FILE.jsonl of articles, or --sample for the ones shipped with oncelery")
    # The whole file is checked first: a bad line sends nothing.
    articles = (load_sample() if path is None else load_articles(path))[:limit]
    from oncelery.tasks.app import app  # imported here: loading celeryconfig creates the embedded broker's folders
    from oncelery.tasks.articles import STEPS, score_article
    from oncelery.tasks.llm import default_client

    # Up front, before anything is sent: a bad ONCELERY_LLM_* value or a server that is down is one line now,
    # not a worker's error (or a publish retried for ever) later.
    default_client()
    check_services(app)
    seconds = _call_seconds(call_seconds)

    broker = str(app.conf.broker_url)
    if start_worker is None:
        start_worker = is_embedded_broker(broker)
    if (kill_worker_every or lease) and not start_worker:
        raise click.UsageError(
            "--kill-worker-every and --lease act on a worker this command starts: add --start-worker"
        )
    if batch and os.environ.get(ENV_BASE_URL):
        raise click.UsageError(f"--batch runs on the local provider's batch API: unset {ENV_BASE_URL}")
    if batch and not start_worker:
        raise click.UsageError(f"--batch needs the workers to run in batch mode: add --start-worker (or set "
                               f"{ENV_LLM_MODE}=batch on your workers and use this command's relay)")  # fmt: skip
    if not start_worker:  # on the embedded broker, only the demo's own workers would read the jobs
        refuse_unread_broker(broker, resolve_database_url(ctx, app, embedded=True), "process --no-start-worker")
    if queue:
        app.conf.task_default_queue = queue  # before the first send: Celery reads it when routing
    calls = [(a.id, a.version, a.text, temperature) for a in articles]
    url, keys = _prepare(ctx, app, score_article, articles, calls)
    runs = Runs(url)
    order = plan_deliveries(len(articles), duplicates, seed="oncelery-process-plan")
    before = take_snapshot(runs, score_article.name, keys)
    console = Console(highlight=False, soft_wrap=True)
    if not console.is_terminal:
        console.width = max(console.width, NON_TTY_WIDTH)  # a CI log is not 80 columns wide
    click.echo(f"broker {maybe_sanitize_url(broker)}, queue {app.conf.task_default_queue}")
    # The relay re-publishes an unstarted row, or re-sends a lost run, after `quiet_seconds` without progress.
    # A parked article's wake is sent again after 30 s if no delivery took it (lost in a killed worker's prefetch).
    relay = Relay(app, url, republish_after=quiet_seconds, sweep_interval=quiet_seconds, rewake_after=30.0)
    watch = Watch(app, score_article, runs, keys, calls, before.outcomes, None, console, kill_worker_every, relay)
    fresh = watch.pending_keys()
    worker_options = (concurrency, queue, lease) if start_worker else None
    with _provider(seconds) as provider_env:
        if batch:
            provider_env = {**provider_env, ENV_LLM_MODE: "batch"}
            base = (provider_env.get(ENV_FAKE_PROVIDER_URL) or os.environ[ENV_FAKE_PROVIDER_URL]).rstrip("/")
            # The steps' items are pooled and submitted by this command's relay, polled every 0.2 s.
            relay.use_batch_adapters({"local": OpenAIBatches(base + "/v1", "sk-local", provider="local")}, poll_s=0.2)
        finished = _deliver(
            url, watch, score_article, calls, order, worker_options, timeout, quiet_seconds, fresh, provider_env
        )

    rows, missing = scored(url, [(a.id, a.version) for a in articles])
    summary = summarize(
        runs,
        score_article.name,
        keys,
        fresh,
        before,
        len(STEPS),
        articles=len(articles),
        completed_before=len(articles) - len(fresh),
        sent_first=watch.sent_first,
        sent_duplicates=watch.sent_duplicates,
        sent_again=watch.sent_again,
        worker_kills=watch.kills,
        jobs_interrupted=watch.interrupted,
        wall_seconds=(finished or time.monotonic()) - watch.started,
        steady_seconds=(finished - watch.first_result) if finished and watch.first_result else None,
        score_rows=rows,
        missing=missing,
        batch=batch_savings(url, app.conf, score_article.name, keys) if batch else None,
    )
    render(console, summary)
    if summary_json is not None:
        write_json(summary_json, summary)
    _verdict(summary, finished is not None, timeout, str(app.conf.task_default_queue))


def _prepare(
    ctx: click.Context, app: Any, task: Any, articles: list[Article], calls: list[tuple[Any, ...]]
) -> tuple[str, list[str]]:
    """Check every key, migrate the database, refuse reused keys with other arguments; return (url, keys)."""
    # Keys first (a bad article id is reported before any database is touched), then, with the database
    # ready, the full identities whose keyed field digests name a conflict's fields.
    keys = [_key(task, a, args) for a, args in zip(articles, calls, strict=True)]
    url = resolve_database_url(ctx, app, embedded=True)
    for line in prepare_database(url):
        click.echo(line)
    idents = [_identity(task, a, args) for a, args in zip(articles, calls, strict=True)]
    _refuse_conflicts(Runs(url), task.name, articles, idents)
    return url, keys


def _deliver(
    url: str,
    watch: Watch,
    task: Any,
    calls: list[tuple[Any, ...]],
    order: list[int],
    worker_options: tuple[int, str | None, float | None] | None,
    timeout: float,
    quiet_seconds: float,
    fresh: list[str],
    provider_env: dict[str, str],
) -> float | None:
    """Start the worker (if asked), send every delivery, follow them to the end; return when the last finished."""
    worker: LocalWorker | None = None
    # A SIGTERM to this command unwinds through `finally` like Ctrl-C, so its worker is never orphaned.
    with sigterm_as_interrupt():
        try:
            if worker_options is not None:
                concurrency, queue, lease = worker_options
                lease_env = {ENV_LEASE: str(lease)} if lease else {}
                worker = start_local_worker(url, LOG_NAME, concurrency, queue, WORKER_APP, lease_env | provider_env)
                click.echo(f"started a worker: pid {worker.pid}, {concurrency} processes, log {worker.log_path}")
            else:
                click.echo("no local worker: the broker's workers will run the jobs (--start-worker starts one)")
            watch.worker = worker
            watch.start()
            # One transaction writes every delivery to the outbox (all or none); the relay publishes them.
            with Database(url).begin() as conn:
                for i in order:
                    outbox.enqueue(conn, task, *calls[i])
            watch.sent_first, watch.sent_duplicates = len(calls), len(order) - len(calls)
            while watch.relay is not None and watch.relay.publish_pending().published:
                pass
            finished = watch.run_until_done(timeout, quiet_seconds)
            if finished is not None:
                answered = watch.settle(timeout, finished)
                finished = finished if fresh else answered  # a re-run scores nothing: time its answers
            return finished
        except KeyboardInterrupt:
            raise click.ClickException("interrupted") from None
        finally:
            if worker is not None:
                worker.stop()
            watch.close()


def _call_seconds(text: str) -> tuple[float, float]:
    """Parse --call-seconds: "0.2" or "0.2-1" (seconds, MIN <= MAX)."""
    try:
        low, _, high = text.partition("-")
        span = (float(low), float(high or low))
    except ValueError:
        span = (-1.0, -1.0)
    if not 0 <= span[0] <= span[1] <= 600:
        raise click.BadParameter(f"{text!r}: give seconds as MIN or MIN-MAX, e.g. 0.2-1", param_hint="--call-seconds")
    return span


@contextmanager
def _provider(seconds: tuple[float, float]) -> Iterator[dict[str, str]]:
    """Run the local model provider in this process for the whole run (its calls outlive a killed worker), and
    yield the environment that points the started worker at it; nothing when a real server is configured."""
    if os.environ.get(ENV_BASE_URL) or os.environ.get(ENV_FAKE_PROVIDER_URL):
        yield {}
        return
    provider = start_provider(seconds)
    try:
        yield {ENV_FAKE_PROVIDER_URL: provider.url}
    finally:
        provider.stop()


def _key(task: Any, article: Article, args: tuple[Any, ...]) -> str:
    # The task's key template, checked with no database (the database is prepared after every key is good).
    try:
        return str(task.key_of(args).key)
    except InvalidKey as exc:
        raise click.ClickException(f"line {article.line}: article id {article.id!r} makes a bad key: {exc}") from exc


def _identity(task: Any, article: Article, args: tuple[Any, ...]) -> Identity:
    try:
        return cast(Identity, task.identity_of(args))
    except InvalidKey as exc:
        raise click.ClickException(f"line {article.line}: article id {article.id!r} makes a bad key: {exc}") from exc


def _refuse_conflicts(runs: Runs, task_name: str, articles: list[Article], idents: list[Identity]) -> None:
    """Stop before sending if an article's key was used with other arguments (G5 would refuse every delivery)."""
    for article, ident in zip(articles, idents, strict=True):
        run = runs.get(task_name, ident.key)
        if run is None or ident.same_payload(run.fingerprint):
            continue
        fields = differing_fields(run.field_digests, ident.field_digests)
        raise click.ClickException(
            f"line {article.line}: article {article.id!r} version {article.version} was already processed with "
            f"different {', '.join(fields) or 'arguments'}; its first result stands — bump the article's version "
            f"(or use the same --temperature) to process it again"
        )


def _verdict(s: Summary, finished: bool, timeout: float, queue: str) -> None:
    if not finished:
        raise click.ClickException(
            f"timed out after {timeout:.0f}s with {len(s.missing)} articles unscored; is a worker consuming queue "
            f"{queue!r}? See `oncelery runs list` and the worker's log"
        )
    if s.missing or s.score_rows != s.articles:
        shown = ", ".join(f"{a} v{v}" for a, v in s.missing[:10])
        raise click.ClickException(
            f"{s.score_rows} ArticleScore rows for {s.articles} articles; missing: {shown or '-'}"
        )
    click.echo(
        f"exactly once: {s.score_rows} scores for {s.articles} articles from {s.deliveries_sent} deliveries; "
        f"{s.llm_calls} model calls ({s.wasted_calls} wasted, {s.calls_reattached} re-attached, "
        f"{s.repeated} repeated), {s.llm_calls_saved} saved"
    )
