"""A Celery app for the crash tests' `celery worker` subprocesses, configured only from the environment.

The test that starts a worker sets:

    ONCELERY_DATABASE_URL              the claims database (a SQLite file or the PostgreSQL test database)
    ONCELERY_BROKER_URL                the Redis broker (the test Redis database)
    ONCELERY_RESULT_BACKEND            the Redis result backend (another Redis database)
    ONCELERY_CRASH_QUEUE               the queue, unique per test (tests.services.unique_queue())
    ONCELERY_VISIBILITY_TIMEOUT        seconds before Redis re-delivers an unacked message (default 3600)
    ONCELERY_UNACKED_RESTORE_INTERVAL  seconds between the worker's re-delivery sweeps (default 1)
    ONCELERY_CRASH_LEASE               the idempotent task's lease in seconds (default 60)
    ONCELERY_FAKE_PROVIDER_URL         the fake model provider `oncelery.crash_llm` calls (the test's own)
    ONCELERY_CRASH_MARKS               a folder: a job stopped at its fault point leaves a mark there (once only)
    ONCELERY_CRASH_RELEASE             a folder: a file named after a job's key there ends its work at once
    ONCELERY_CRASH_BUDGET_USD          if set, a global day budget (USD) the model calls reserve in
    ONCELERY_CRASH_OTEL_DIR            if set, tracing is on, and each pool process exports its metrics there
                                       (one JSON line per export, every ONCELERY_CRASH_OTEL_INTERVAL_MS)

Delivery settings are oncelery.CELERY_DELIVERY_DEFAULTS (what celeryconfig.py deploys): late ack, reject on
worker lost, prefetch 1, JSON only.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from celery import Celery
from sqlalchemy import insert

from oncelery import CELERY_DELIVERY_DEFAULTS, ConfigurationError, IdempotentTask, output_text
from oncelery.llm.adapters.openai_responses import OpenAIResponses
from oncelery.runs.faults import fault_injected
from oncelery.store.database import get_engine
from tests.services import effects_table, executions_table

ENV_DATABASE_URL = "ONCELERY_DATABASE_URL"
ENV_BROKER_URL = "ONCELERY_BROKER_URL"
ENV_RESULT_BACKEND = "ONCELERY_RESULT_BACKEND"
ENV_QUEUE = "ONCELERY_CRASH_QUEUE"
ENV_VISIBILITY_TIMEOUT = "ONCELERY_VISIBILITY_TIMEOUT"
ENV_RESTORE_INTERVAL = "ONCELERY_UNACKED_RESTORE_INTERVAL"
ENV_LEASE = "ONCELERY_CRASH_LEASE"
ENV_RELEASE = "ONCELERY_CRASH_RELEASE"
ENV_BUDGET = "ONCELERY_CRASH_BUDGET_USD"
logger = logging.getLogger(__name__)
REQUIRED = (ENV_DATABASE_URL, ENV_BROKER_URL, ENV_RESULT_BACKEND, ENV_QUEUE)


def transport_options(environ: Mapping[str, str]) -> dict[str, Any]:
    """Return the Redis transport options: visibility timeout and re-delivery sweep from the environment."""
    queue = environ[ENV_QUEUE]
    return {
        "visibility_timeout": float(environ.get(ENV_VISIBILITY_TIMEOUT) or 3600),
        "unacked_restore_interval": float(environ.get(ENV_RESTORE_INTERVAL) or 1),
        # Scan on every sweep, so the interval alone sets how soon an expired message comes back.
        "unacked_restore_throttle": 1,
        # Unacked bookkeeping per test: a worker with a short visibility timeout must never restore
        # (duplicate) in-flight messages of another test or another suite sharing this Redis database.
        "unacked_key": f"{queue}.unacked",
        "unacked_index_key": f"{queue}.unacked_index",
        "unacked_mutex_key": f"{queue}.unacked_mutex",
    }


def create_app(environ: Mapping[str, str]) -> Celery:
    """Build the crash-test app from `environ`, raising ConfigurationError naming any missing variable."""
    missing = [name for name in REQUIRED if not environ.get(name)]
    if missing:
        raise ConfigurationError(f"tests.apps.crash_app needs the environment variables {', '.join(missing)}")
    app = Celery("oncelery-crash")
    app.conf.update(
        **CELERY_DELIVERY_DEFAULTS,
        broker_url=environ[ENV_BROKER_URL],
        result_backend=environ[ENV_RESULT_BACKEND],
        oncelery_database_url=environ[ENV_DATABASE_URL],
        broker_transport_options=transport_options(environ),
        task_default_queue=environ[ENV_QUEUE],
        task_acks_on_failure_or_timeout=True,
        broker_connection_retry_on_startup=True,
        timezone="UTC",
        enable_utc=True,
    )
    if environ.get(ENV_BUDGET):  # a fleet-wide day budget: `oncelery.crash_llm` reserves before its call
        app.conf.oncelery_prices = {"gpt-crash": {"input": 2.0, "output": 8.0}}
        app.conf.oncelery_budgets = {"global": {"day": environ[ENV_BUDGET]}}
    return app


app = create_app(os.environ)
if os.environ.get("ONCELERY_CRASH_OTEL_DIR"):
    from tests.apps.otel_export import export_metrics_from_pool_processes

    export_metrics_from_pool_processes(app, Path(os.environ["ONCELERY_CRASH_OTEL_DIR"]))
DATABASE_URL = os.environ[ENV_DATABASE_URL]
LEASE = float(os.environ.get(ENV_LEASE) or 60)


def record_execution(key: str) -> None:
    """Count one execution of a body in its own committed transaction (it survives the run's rollback)."""
    with get_engine(DATABASE_URL).begin() as conn:
        conn.execute(insert(executions_table).values(key=key, pid=os.getpid()))
    logger.info("executing %s in pid %d", key, os.getpid())


@app.task(base=IdempotentTask, bind=True, name="oncelery.crash_effect", idempotency_key="crash:{key}", lease=LEASE)
def crash_effect(self: IdempotentTask, key: str, seconds: float) -> dict[str, Any]:
    """Execute once per key: count the execution, work `seconds`, write one effect, return who did it."""
    record_execution(key)
    time.sleep(seconds)
    logger.info("writing the effect of %s", key)
    with self.effects() as session:
        session.execute(insert(effects_table).values(key=key, pid=os.getpid()))
    return {"key": key, "pid": os.getpid()}


@app.task(name="oncelery.crash_plain")
def crash_plain(key: str, seconds: float) -> dict[str, Any]:
    """The control: the same body as a plain Celery task, so every delivery executes it."""
    record_execution(key)
    time.sleep(seconds)
    with get_engine(DATABASE_URL).begin() as conn:
        conn.execute(insert(effects_table).values(key=key, pid=os.getpid()))
    return {"key": key, "pid": os.getpid()}


def _counted_step(key: str, step: str, seconds: float) -> str:
    record_execution(f"{key}:{step}")
    time.sleep(seconds)
    return f"{step}-done"


@app.task(base=IdempotentTask, bind=True, name="oncelery.crash_steps", idempotency_key="steps:{key}", lease=LEASE)
def crash_steps(self: IdempotentTask, key: str, seconds: float) -> dict[str, Any]:
    """Three checkpointed steps (step 2 slow), each counted per execution, then one effect."""
    done = [self.step(step, _counted_step, key, step, seconds if step == "s2" else 0.0) for step in ("s1", "s2", "s3")]
    with self.effects() as session:
        session.execute(insert(effects_table).values(key=key, pid=os.getpid()))
    return {"key": key, "steps": done, "pid": os.getpid()}


def _work(key: str, seconds: float) -> None:
    """Work `seconds`, or less once the test releases `key` (a file of that name in $ONCELERY_CRASH_RELEASE):
    a body long enough to be killed inside need not be waited out when it runs again."""
    release = os.environ.get(ENV_RELEASE)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if release and (Path(release) / key).exists():
            return
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


def _entity_body(self: IdempotentTask, doc: str, version: int, seconds: float) -> dict[str, Any]:
    key = f"entity:{doc}:v{version}"
    record_execution(key)
    _work(key, seconds)
    with self.effects() as session:
        session.execute(insert(effects_table).values(key=key, pid=os.getpid()))
    return {"doc": doc, "version": version, "pid": os.getpid()}


def _entity_task(name: str, **options: Any) -> Any:
    """Register an entity task `name`: one run per (doc, version), one RUNNING run per doc, its message kept for
    the sweeper, and `options` (e.g. entity_version) on top."""

    def body(self: IdempotentTask, doc: str, version: int, seconds: float) -> dict[str, Any]:
        return _entity_body(self, doc, version, seconds)

    return app.task(
        base=IdempotentTask,
        bind=True,
        name=name,
        idempotency_key="entity:{doc}:v{version}",
        concurrency_key="entity:{doc}",
        store_message=True,
        lease=LEASE,
        **options,
    )(body)


crash_entity = _entity_task("oncelery.crash_entity")
# As crash_entity, and a version not newer than the doc's applied one is stale (never applied).
crash_entity_versioned = _entity_task("oncelery.crash_entity_versioned", entity_version="version")


@contextmanager
def _signal_once_at(point: str, key: str, sig: signal.Signals) -> Iterator[None]:
    """Within the block, send `sig` to this process at fault point `point`, the first time `key` reaches it."""
    mark = Path(os.environ["ONCELERY_CRASH_MARKS"]) / f"{key}.{point}"

    def hook(_name: str, _context: dict[str, Any]) -> None:
        try:
            mark.touch(exist_ok=False)  # once per key and point: the next holder passes
        except FileExistsError:
            return
        logger.info("signal %s at %s for %s in pid %d", sig.name, point, key, os.getpid())
        os.kill(os.getpid(), sig)

    with fault_injected(point, hook):
        yield


@app.task(
    base=IdempotentTask,
    bind=True,
    name="oncelery.crash_llm",
    idempotency_key="llm:{key}",
    fingerprint=("key", "text"),  # where it is stopped is not what it computes
    lease=LEASE,
    store_message=True,  # a message a killed worker took from Redis before kombu noted it: the relay re-sends it
)
def crash_llm(self: IdempotentTask, key: str, text: str, at: str | None = None, sig: str = "SIGKILL") -> dict[str, Any]:
    """One model call (background, on the test's fake provider) then one effect; `at`: a fault point where this
    process gets `sig` the first time (SIGKILL: a crash; SIGSTOP: a zombie)."""
    record_execution(key)
    with OpenAIResponses(os.environ["ONCELERY_FAKE_PROVIDER_URL"] + "/v1", "sk-crash") as adapter:
        stop = _signal_once_at(at, key, signal.Signals[sig]) if at else nullcontext()
        with stop:
            response = self.llm("summary", adapter=adapter, model="gpt-crash", input=text, max_output_tokens=40)
    with self.effects() as session:
        session.execute(insert(effects_table).values(key=key, pid=os.getpid()))
    return {"key": key, "text": output_text(response), "pid": os.getpid()}


@app.task(
    base=IdempotentTask,
    bind=True,
    name="oncelery.crash_llm_sync",
    idempotency_key="llmsync:{key}",
    fingerprint=("key", "text"),
    lease=LEASE,  # and no store_message: what a user's task declares (the default keeps no message on Redis)
)
def crash_llm_sync(
    self: IdempotentTask, key: str, text: str, at: str | None = None, sig: str = "SIGKILL"
) -> dict[str, Any]:
    """One synchronous model call (no provider reference to re-attach to) then one effect; `at`: a fault point
    where this process gets `sig` the first time."""
    record_execution(key)
    with OpenAIResponses(os.environ["ONCELERY_FAKE_PROVIDER_URL"] + "/v1", "sk-crash") as adapter:
        stop = _signal_once_at(at, key, signal.Signals[sig]) if at else nullcontext()
        with stop:
            response = self.llm(
                "summary", adapter=adapter, model="gpt-crash", input=text, max_output_tokens=40, background=False
            )
    with self.effects() as session:
        session.execute(insert(effects_table).values(key=key, pid=os.getpid()))
    return {"key": key, "text": output_text(response), "pid": os.getpid()}


@app.task(
    base=IdempotentTask, bind=True, name="oncelery.crash_llm_twice", idempotency_key="llm2:{key}",
    fingerprint=("key", "text"), lease=LEASE, store_message=True,
)  # fmt: skip
def crash_llm_twice(self: IdempotentTask, key: str, text: str, at: str | None = None) -> dict[str, Any]:
    """Two model calls; `at`: a fault point of the second where this process is SIGKILLed the first time (the
    first call's ledger row is then committed, and its OpenTelemetry points may not have been exported)."""
    record_execution(key)
    with OpenAIResponses(os.environ["ONCELERY_FAKE_PROVIDER_URL"] + "/v1", "sk-crash") as adapter:
        first = self.llm("summary", adapter=adapter, model="gpt-crash", input=text, max_output_tokens=40)
        with _signal_once_at(at, key, signal.SIGKILL) if at else nullcontext():
            title = self.llm("title", adapter=adapter, model="gpt-crash", input=output_text(first), max_output_tokens=9)
    with self.effects() as session:
        session.execute(insert(effects_table).values(key=key, pid=os.getpid()))
    return {"key": key, "text": output_text(title), "pid": os.getpid()}
