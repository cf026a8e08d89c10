"""The Celery app the chaos workers load (`celery -A tests.chaos.jobs worker`), configured from the environment.

It loads Oncelery's deployed configuration (`oncelery.celeryconfig`: broker, result backend, claims database,
visibility timeout, delivery defaults all from ONCELERY_* variables), then adds the runner's settings:

    CHAOS_LEDGER        the runner's SQLite ledger (tests/chaos/ledger.py)
    CHAOS_ROLE          this process's name in the ledger and in PostgreSQL's application_name (w1, cut, relay...)
    CHAOS_LEASE         the job's lease in seconds
    CHAOS_STEP_SECONDS  the fake model call's latency in seconds (a long job passes its own, in its arguments)
    CHAOS_COMMIT_PAUSE  seconds between staging the effect and writing it (default 0.1)
    CHAOS_QUEUE_TYPE    `quorum`: on RabbitMQ, the task queue is a quorum queue, configured as Celery's docs say
                        (a topic exchange, so countdowns go through RabbitMQ's native delayed delivery)

Every third job belongs to tenant `acme`: the app's tenant resolver (`oncelery_tenant`) reads who is sending
from `sender_tenant`, which the runner sets around every copy it sends (outbox or direct); workers never ask it.

One job: three checkpointed steps (the second one a fake "LLM call" metered through `oncelery.model_call`), then
one effect row written through the fenced `self.effects()` session and staged in the runner's ledger first.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

from celery import Celery, signals
from sqlalchemy import Column, Integer, MetaData, String, Table, event, insert
from sqlalchemy.engine import Engine

import oncelery
from oncelery import IdempotentTask, LeaseLost
from tests.chaos.ledger import Ledger

TASK_NAME = "oncelery.chaos_job"
MODEL = "chaos-llm"
ROLE = os.environ.get("CHAOS_ROLE", "client")
LEASE = float(os.environ.get("CHAOS_LEASE") or 3.0)
STEP_SECONDS = float(os.environ.get("CHAOS_STEP_SECONDS") or 0.02)
# Between the staged record and the fenced write: the answer being rendered. A window, outside any transaction,
# in which a fault can freeze or cut off a holder that is about to commit (its late completion is then refused).
COMMIT_PAUSE = float(os.environ.get("CHAOS_COMMIT_PAUSE") or 0.1)

# Who is sending (set by the runner around each copy of a job); the app-wide resolver answers with it.
sender_tenant: ContextVar[str | None] = ContextVar("chaos_sender_tenant", default=None)
TENANT = "acme"


def tenant_for(job: int) -> str:
    """The tenant job `job` belongs to: every third job is acme's, the others have none ("")."""
    return TENANT if job % 3 == 0 else ""


def _tenant_of(task_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    return sender_tenant.get()


app = Celery("oncelery_chaos")
app.config_from_object("oncelery.celeryconfig")
app.conf.update(
    # Task events only feed Flower; on a 2-core machine their publishes would compete with the jobs.
    worker_send_task_events=False,
    task_send_sent_event=False,
    # Oncelery's prices table: the ledger summary shows model calls made and saved, with a cost.
    oncelery_prices={MODEL: {"input": 0.15, "output": 0.60}},
    oncelery_tenant=_tenant_of,
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
_current_attempt: str | None = None  # a pool child runs one delivery at a time


def ledger() -> Ledger:
    """The runner's ledger (CHAOS_LEDGER), opened lazily in each process."""
    global _ledger
    if _ledger is None:
        _ledger = Ledger(os.environ["CHAOS_LEDGER"])
    return _ledger


@event.listens_for(Engine, "do_connect")
def _name_connection(dialect: Any, conn_rec: Any, cargs: Any, cparams: dict[str, Any]) -> None:
    # Every PostgreSQL connection says which process opened it: the runner aims backend kills and checks that a
    # frozen or cut-off process holds no transaction (pg_stat_activity.application_name = chaos:<role>:<pid>).
    if dialect.name == "postgresql":
        cparams["application_name"] = f"chaos:{ROLE}:{os.getpid()}"


@signals.before_task_publish.connect
def _record_publish(sender: Any = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
    # Every copy of a job any process sends (runner, relay, a worker re-sending a waiting copy or a faulted one),
    # before it is sent, with its ETA: a copy a worker holds in memory (even after a FLUSHALL) runs by then.
    if sender != TASK_NAME:
        return
    eta = (headers or {}).get("eta")
    when = datetime.fromisoformat(eta) if isinstance(eta, str) else None
    due = None if when is None else (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()
    ledger().published((headers or {}).get("id"), ROLE, due)


@signals.task_prerun.connect
def _record_delivery(sender: Any = None, task_id: str | None = None, args: Any = None, **_: Any) -> None:
    # Every delivery a pool child starts (duplicates and redeliveries included), before the claim decides.
    if getattr(sender, "name", None) != TASK_NAME:
        return
    info = getattr(sender.request, "delivery_info", None) or {}
    job = int(args[0]) if args else None
    ledger().delivery(str(task_id), job, ROLE, bool(info.get("redelivered")))


def expected_draft(job: int, seed: int) -> str:
    """The fake model's answer for `job` under `seed` (what a correct stored result must hold)."""
    return hashlib.sha256(f"{job}:{seed}".encode()).hexdigest()[:16]


def prepare(job: int) -> dict[str, Any]:
    """Step 1: build the prompt (pure)."""
    return {"job": job, "prompt": f"summarize document {job}"}


def draft(job: int, prompt: str, seconds: float, seed: int) -> str:
    """Step 2: the fake LLM call, metered in Oncelery's model-call ledger and in the runner's."""
    with oncelery.model_call(MODEL, prompt="draft", meta={"seed": seed}) as call:
        ledger().llm_call(job, _current_attempt, ROLE)
        time.sleep(seconds)
        call.tokens(len(prompt), 16)
    return expected_draft(job, seed)


def score(text: str) -> int:
    """Step 3: score the draft (pure)."""
    return int(text[:4], 16) % 100


@app.task(base=IdempotentTask, bind=True, name=TASK_NAME, idempotency_key="chaos:{job}", lease=LEASE, total_steps=3)
def chaos_job(self: IdempotentTask, job: int, seconds: float | None = None) -> dict[str, Any]:
    """Run the job's three steps once per key and commit its one effect with the run's completion."""
    global _current_attempt
    attempt = uuid.uuid4().hex
    token = int(self.run_context().claim.token)
    book = ledger()
    book.attempt_started(attempt, job, ROLE, token)
    _current_attempt = attempt
    try:
        prompt = self.step("prepare", prepare, job)["prompt"]
        text = self.step("draft", draft, job, prompt, STEP_SECONDS if seconds is None else seconds)
        points = self.step("score", score, text)
        book.staged(attempt, job, token)  # before the fenced write: a committed effect always has a record
        time.sleep(COMMIT_PAUSE)
        with self.effects() as session:
            session.execute(insert(effects).values(job=job, attempt=attempt, host=ROLE, pid=os.getpid(), token=token))
    except LeaseLost:
        book.attempt_ended(attempt, "fenced")
        raise
    except BaseException as exc:
        book.attempt_ended(attempt, f"error:{type(exc).__name__}")
        raise
    finally:
        _current_attempt = None
    book.attempt_ended(attempt, "returned")  # the framework now commits the completion, or refuses it
    return {"job": job, "attempt": attempt, "token": token, "draft": text, "score": points}
