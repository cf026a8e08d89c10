"""The Celery app the chaos workers load (`celery -A tests.chaos.jobs worker`), configured from the environment.

It loads Oncelery's deployed configuration (`oncelery.celeryconfig`: broker, result backend, claims database,
visibility timeout, delivery defaults all from ONCELERY_* variables), then adds the runner's settings:

    CHAOS_LEDGER        the runner's SQLite ledger (tests/chaos/ledger.py)
    CHAOS_ROLE          this process's name in the ledger and in PostgreSQL's application_name (w1, cut, relay...)
    CHAOS_LEASE         the job's lease in seconds
    CHAOS_COMMIT_PAUSE  seconds between staging the effect and writing it (default 0.1)
    CHAOS_QUEUE_TYPE    `quorum`: on RabbitMQ, the task queue is a quorum queue, configured as Celery's docs say
                        (a topic exchange, so countdowns go through RabbitMQ's native delayed delivery)
    CHAOS_FAKE_URL      the fake model provider the job calls (`python -m oncelery.fake_provider`, a process of
                        the runner)
    CHAOS_INLINE_WAIT   seconds a delivery polls a background call before it parks the run WAITING (default 1)
    CHAOS_RPM           the shared limit of the model, requests per minute (`oncelery_limits`; tokens: CHAOS_RPM x
                        the call's admission cost, so both kinds bind alike)
    CHAOS_BUDGET_USD    the fleet's day budget (`oncelery_budgets["global"]`); tenant acme gets a third of it
    CHAOS_RELEASE_S     `oncelery_budget_release_s`: a dead holder's prepared call's reservation released after it
    CHAOS_ARM_DIR       a folder: the file `wake` there arms the relay's pause between a wake's mark and its send

Every third job belongs to tenant `acme`: the app's tenant resolver (`oncelery_tenant`) reads who is sending
from `sender_tenant`, which the runner sets around every copy it sends (outbox or direct); workers never ask it.

One job: three checkpointed steps, the second a model call made with `self.llm()` in background mode (a
write-ahead intent, the create, polls inline up to CHAOS_INLINE_WAIT, then the run parks WAITING and the relay
wakes it), admitted through the shared limit and reserved in the budgets (the fleet's day, tenant acme's day and
the job's own `max_cost_usd`); then one effect row written through the fenced `self.effects()` session and staged
in the runner's ledger first. The provider's counters (creates per intent) are the runner's ledger of calls.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import uuid
from contextvars import ContextVar
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from celery import Celery, signals
from sqlalchemy import Column, Integer, MetaData, String, Table, event, insert
from sqlalchemy.engine import Engine

from oncelery import (
    IdempotentTask,
    LeaseLost,
    OpenAIResponses,
    ProviderCallFailed,
    ProviderRateLimited,
    ProviderUnavailable,
    output_text,
)
from oncelery.settings import HEADER_WOKEN
from tests.chaos.ledger import Ledger
from tests.chaos.model import MAX_OUTPUT_TOKENS, MODEL, PRICE, PROVIDER, admission_tokens, estimate_usd, prompt_of

TASK_NAME = "oncelery.chaos_job"
ROLE = os.environ.get("CHAOS_ROLE", "client")
LEASE = float(os.environ.get("CHAOS_LEASE") or 3.0)
INLINE_WAIT = float(os.environ.get("CHAOS_INLINE_WAIT") or 1.0)
# Between the staged record and the fenced write: the answer being rendered. A window, outside any transaction,
# in which a fault can freeze or cut off a holder that is about to commit (its late completion is then refused).
COMMIT_PAUSE = float(os.environ.get("CHAOS_COMMIT_PAUSE") or 0.1)
# How long the relay pauses, once armed, between a wake's mark and its send (the runner SIGKILLs it meanwhile).
WAKE_PAUSE = 20.0

# Who is sending (set by the runner around each copy of a job); the app-wide resolver answers with it.
sender_tenant: ContextVar[str | None] = ContextVar("chaos_sender_tenant", default=None)
TENANT = "acme"


def tenant_for(job: int) -> str:
    """The tenant job `job` belongs to: every third job is acme's, the others have none ("")."""
    return TENANT if job % 3 == 0 else ""


def _tenant_of(task_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    return sender_tenant.get()


def _conf_from_env() -> dict[str, Any]:
    """The model call's prices, shared limit, budgets and reservation release, from the runner's variables."""
    conf: dict[str, Any] = {"oncelery_prices": {MODEL: dict(PRICE)}}
    rpm = int(os.environ.get("CHAOS_RPM") or 0)
    if rpm:
        conf["oncelery_limits"] = {f"{PROVIDER}:{MODEL}": {"rpm": rpm, "tpm": rpm * admission_tokens()}}
    budget = os.environ.get("CHAOS_BUDGET_USD")
    if budget:
        day = Decimal(budget)
        conf["oncelery_budgets"] = {"global": {"usd_per_day": day}, f"tenant:{TENANT}": {"usd_per_day": day / 3}}
    if os.environ.get("CHAOS_RELEASE_S"):
        conf["oncelery_budget_release_s"] = float(os.environ["CHAOS_RELEASE_S"])
    return conf


app = Celery("oncelery_chaos")
app.config_from_object("oncelery.celeryconfig")
app.conf.update(
    # Task events only feed Flower; on a 2-core machine their publishes would compete with the jobs.
    worker_send_task_events=False,
    task_send_sent_event=False,
    oncelery_tenant=_tenant_of,
    **_conf_from_env(),
)
if os.environ.get("CHAOS_PRODUCER_DEDUPE") == "0":  # the runner sends every copy to the broker
    app.conf.oncelery_producer_dedupe = False
if os.environ.get("CHAOS_QUEUE_TYPE") == "quorum":
    app.conf.update(task_default_queue_type="quorum", task_default_exchange_type="topic")

metadata = MetaData()
# The system under test's effect: one row per committed effect, tagged with the attempt that wrote it.
effects = Table(
    "chaos_effects",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("job", Integer, nullable=False),
    Column("attempt", String(32), nullable=False),
    Column("host", String(64), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("token", Integer, nullable=False),
)

_ledger: Ledger | None = None


def ledger() -> Ledger:
    """The runner's ledger (CHAOS_LEDGER), opened lazily in each process."""
    global _ledger
    if _ledger is None:
        _ledger = Ledger(os.environ["CHAOS_LEDGER"])
    return _ledger


class ProviderOfThisProcess:
    """The task's `llm_adapter`: a factory (an object, so Celery does not bind it as a method) of one adapter per
    process. An httpx client must not cross a fork: the worker's main process cancels a revoked run's calls with
    it, and the prefork pool forks replacement children from that process after a kill."""

    def __init__(self) -> None:
        self._pid = -1
        self._adapter: OpenAIResponses | None = None
        self._lock = threading.Lock()

    def __call__(self) -> OpenAIResponses:
        with self._lock:
            if self._adapter is None or self._pid != os.getpid():
                self._adapter = OpenAIResponses(os.environ["CHAOS_FAKE_URL"] + "/v1", "sk-chaos")
                self._pid = os.getpid()
            return self._adapter


provider = ProviderOfThisProcess()


@event.listens_for(Engine, "do_connect")
def _name_connection(dialect: Any, conn_rec: Any, cargs: Any, cparams: dict[str, Any]) -> None:
    # Every PostgreSQL connection says which process opened it: the runner aims backend kills and checks that a
    # frozen or cut-off process holds no transaction (pg_stat_activity.application_name = chaos:<role>:<pid>).
    if dialect.name == "postgresql":
        cparams["application_name"] = f"chaos:{ROLE}:{os.getpid()}"


@signals.before_task_publish.connect
def _record_publish(sender: Any = None, headers: dict[str, Any] | None = None, body: Any = None, **_: Any) -> None:
    # Every copy of a job any process sends (runner, relay, a worker re-sending a waiting copy or a faulted one),
    # before it is sent, with its ETA: a copy a worker holds in memory (even after a FLUSHALL) runs by then.
    if sender != TASK_NAME:
        return
    headers = headers or {}
    eta = headers.get("eta")
    when = datetime.fromisoformat(eta) if isinstance(eta, str) else None
    due = None if when is None else (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()
    ledger().published(headers.get("id"), ROLE, due)
    if ROLE == "relay" and headers.get(HEADER_WOKEN):
        _pause_if_armed(body)


def _pause_if_armed(body: Any) -> None:
    """In the relay, a wake about to be sent: its run is marked woken (committed), the message not yet sent. When
    the runner armed it (CHAOS_ARM_DIR/wake), record where this relay is and wait there for its SIGKILL (bounded:
    a runner that does not kill it lets the wake go on)."""
    arm = Path(os.environ.get("CHAOS_ARM_DIR") or "/nonexistent") / "wake"
    try:
        arm.unlink()  # once per arming, whoever of the relay's incarnations gets there first
    except OSError:
        return
    args = body[0] if isinstance(body, (list, tuple)) and body else []
    job = int(args[0]) if args else -1
    ledger().mark("wake_marked", job, ROLE)
    threading.Event().wait(WAKE_PAUSE)


@signals.task_prerun.connect
def _record_delivery(sender: Any = None, task_id: str | None = None, args: Any = None, **_: Any) -> None:
    # Every delivery a pool child starts (duplicates and redeliveries included), before the claim decides.
    if getattr(sender, "name", None) != TASK_NAME:
        return
    info = getattr(sender.request, "delivery_info", None) or {}
    job = int(args[0]) if args else None
    ledger().delivery(str(task_id), job, ROLE, bool(info.get("redelivered")))


def prepare(job: int) -> dict[str, Any]:
    """Step 1: build the prompt (pure)."""
    return {"job": job, "prompt": prompt_of(job)}


def score(text: str, seconds: float | None) -> int:
    """Step 3: score the draft; a long job works `seconds` here (past the broker's visibility timeout)."""
    if seconds:
        time.sleep(seconds)
    return int(hashlib.sha256(text.encode()).hexdigest()[:4], 16) % 100


@app.task(
    base=IdempotentTask,
    bind=True,
    name=TASK_NAME,
    idempotency_key="chaos:{job}",
    lease=LEASE,
    total_steps=3,
    llm_adapter=provider,  # also what a revoke cancels the run's calls with, in the worker's main process
    llm_inline_wait=INLINE_WAIT,
    llm_models=(MODEL,),  # its price is checked at the worker's start
    max_cost_usd=estimate_usd() * 10,  # one job's calls: room for a few labelled repeats, not for a runaway
    # A 5xx on the create leaves the intent prepared (maybe sent): the retry re-sends it labelled create_window.
    autoretry_for=(ProviderUnavailable, ProviderRateLimited, ProviderCallFailed),
    max_retries=20,
    retry_backoff=1,
    retry_backoff_max=2,
    retry_jitter=False,
)
def chaos_job(self: IdempotentTask, job: int, seconds: float | None = None) -> dict[str, Any]:
    """Run the job's three steps once per key and commit its one effect with the run's completion."""
    attempt = uuid.uuid4().hex
    token = int(self.run_context().claim.token)
    book = ledger()
    book.attempt_started(attempt, job, ROLE, token)
    try:
        prompt = self.step("prepare", prepare, job)["prompt"]
        response = self.llm("draft", model=MODEL, input=prompt, max_output_tokens=MAX_OUTPUT_TOKENS)
        text = output_text(response)
        points = self.step("score", score, text, seconds)
        book.staged(attempt, job, token)  # before the fenced write: a committed effect always has a record
        time.sleep(COMMIT_PAUSE)
        with self.effects() as session:
            session.execute(insert(effects).values(job=job, attempt=attempt, host=ROLE, pid=os.getpid(), token=token))
    except LeaseLost:
        book.attempt_ended(attempt, "fenced")
        raise
    except BaseException as exc:  # RunParked too: the run waits WAITING, this delivery ends
        book.attempt_ended(attempt, "parked" if type(exc).__name__ == "RunParked" else f"error:{type(exc).__name__}")
        raise
    book.attempt_ended(attempt, "returned")  # the framework now commits the completion, or refuses it
    return {"job": job, "attempt": attempt, "token": token, "draft": text, "score": points}
