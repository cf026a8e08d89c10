"""The Celery app of the throughput benchmark (`celery -A bench.support.bench_app worker`), configured from env vars.

Environment (set by `bench/throughput.py` for the worker it starts):

    BENCH_BROKER_URL    Redis broker (default redis://127.0.0.1:6379/13), or RabbitMQ (amqp://...)
    BENCH_DATABASE_URL  Oncelery claims database (default postgresql://postgres@127.0.0.1:5432/oncelery_bench)
    BENCH_STATS_URL     Redis for the benchmark's own counters (default: the broker URL if it is Redis)
    BENCH_QUEUE_TYPE    RabbitMQ: `quorum` declares the phase's queue as a quorum queue (default classic)

`bench_plain` and `bench_idem` are no-ops with the same signature; the only difference is
`base=IdempotentTask`. `bench_floor` is a yardstick, not Oncelery: the least a database claim can cost
(raw psycopg on one autocommit connection per process, no SQLAlchemy, no heartbeat): one
`INSERT .. ON CONFLICT DO NOTHING RETURNING` claim and one fenced completion `UPDATE` + outcome upsert
(a counter row per process, so the two children never wait on one row lock) in a single CTE statement,
i.e. two round trips and two commits (the claim's without a WAL flush wait under the floor-async-claim
what-if). It uses tables of its own (FLOOR_DDL), so Oncelery's schema can change under it. Every
finished delivery (executed or answered from the stored result) is counted by a `task_postrun` handler
that sends one Redis MULTI/EXEC per job for both tasks alike:

    INCR  bench:<queue>:done              exact count of finished deliveries
    SET   bench:<queue>:last <unix time>  written by the transaction that finished the last job
    SETNX bench:<queue>:first <unix time>
    HINCRBY bench:<queue>:db <counter> n  statements, commits, rollbacks, checkouts, pings, round_trips

The database counters come from SQLAlchemy and pool events registered on every engine of the worker
child; round_trips follows how psycopg 3 talks to the server (see `_on_statement`).

BENCH_WHAT_IF (comma-separated) monkeypatches Oncelery's internals *in the benchmark worker only*
(bench/support/what_if.py says which experiments there are and what each weakens).

`bench_once` is the same no-op as a celery-once `QueueOnce` task (defined only where celery-once is
installed: `pip install -e '.[bench]'`): its lock per job key lives in the broker's Redis, taken by the
producer's apply_async (graceful: a duplicate is dropped there) and released by the worker after the run.

BENCH_BROKER_URL=embedded (bench/embedded.py) takes the broker of Oncelery's embedded default from
oncelery.celeryconfig (kombu's filesystem transport, under $ONCELERY_DATA_DIR); BENCH_POLLING_INTERVAL
overrides its polling interval.

BENCH_OTEL=1 switches Oncelery's OpenTelemetry tracing on, with the SDK in each pool process
(bench/support/otel_sdk.py).
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery, signals
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.pool import Pool

from oncelery import CELERY_DELIVERY_DEFAULTS, IdempotentTask
from oncelery.store.driver import statement_listeners

DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/13"
DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/oncelery_bench"

PLAIN_TASK = "oncelery.bench_plain"
IDEM_TASK = "oncelery.bench_idem"
FLOOR_TASK = "oncelery.bench_floor"
FLOOR_DUP_TASK = "oncelery.bench_floordup"
CACHE_DUP_TASK = "oncelery.bench_cachedup"
ONCE_TASK = "oncelery.bench_once"
WHAT_IF = {w.strip() for w in os.environ.get("BENCH_WHAT_IF", "").split(",") if w.strip()}


def broker_url() -> str:
    """The broker URL: $BENCH_BROKER_URL (`embedded`: the embedded default's), else the default Redis."""
    return os.environ.get("BENCH_BROKER_URL") or DEFAULT_BROKER_URL


def database_url() -> str:
    """The claims database: $BENCH_DATABASE_URL, else the bench's PostgreSQL database."""
    return os.environ.get("BENCH_DATABASE_URL") or DEFAULT_DATABASE_URL


def stats_url() -> str:
    """The Redis of the bench's own counters: $BENCH_STATS_URL, else the broker if it is Redis, else the default."""
    url = broker_url()
    return os.environ.get("BENCH_STATS_URL") or (url if url.startswith("redis") else DEFAULT_BROKER_URL)


def broker_settings() -> dict[str, Any]:
    """The broker settings: Redis, RabbitMQ (classic or quorum queues), or the embedded default's transport."""
    if broker_url().startswith(("amqp", "pyamqp")):
        # A queue named on the command line (-Q, apply_async(queue=...)) is declared with this type. A quorum
        # queue is detected by the worker (worker_detect_quorum_queues): per-consumer prefetch, no global QoS.
        return {
            "broker_url": broker_url(),
            "task_create_missing_queue_type": os.environ.get("BENCH_QUEUE_TYPE") or "classic",
        }
    if broker_url() != "embedded":
        return {"broker_url": broker_url(), "broker_transport_options": {"visibility_timeout": 3600}}
    os.environ.pop("ONCELERY_BROKER_URL", None)  # celeryconfig picks the embedded broker only without it
    from oncelery import celeryconfig

    options = dict(celeryconfig.broker_transport_options)
    if os.environ.get("BENCH_POLLING_INTERVAL"):
        options["polling_interval"] = float(os.environ["BENCH_POLLING_INTERVAL"])
    return {
        # BENCH_TRANSPORT=filesystem: kombu's stock filesystem transport instead of the embedded default's.
        "broker_url": f"{os.environ['BENCH_TRANSPORT']}://"
        if os.environ.get("BENCH_TRANSPORT")
        else celeryconfig.broker_url,
        "broker_transport_options": options,
        "worker_prefetch_multiplier": int(os.environ.get("BENCH_PREFETCH") or celeryconfig.worker_prefetch_multiplier),
    }


app = Celery("oncelery_bench")
app.conf.update(
    # The delivery semantics Oncelery is deployed with (what celeryconfig.py deploys; the embedded broker's
    # prefetch included).
    **{**CELERY_DELIVERY_DEFAULTS, **broker_settings()},
    # Measure the queue, not a result backend.
    result_backend=None,
    task_ignore_result=True,
    task_store_errors_even_if_ignored=False,
    # No events: Flower is not part of the measurement.
    worker_send_task_events=False,
    task_send_sent_event=False,
    task_track_started=False,
    broker_connection_retry_on_startup=True,
    oncelery_database_url=database_url(),
    # The phases measure what a WORKER does with each job (dup: its answer to a duplicate): the producer's own
    # answer to a duplicate (producer dedupe, on where a database is configured) is bench/producer_dedupe.py's.
    oncelery_producer_dedupe=False,
    # bench/throughput.py's idemc and dupc phases: the replay cache on (oncelery.replay_cache).
    oncelery_replay_cache=os.environ.get("BENCH_REPLAY_CACHE") or None,
    timezone="UTC",
    enable_utc=True,
)


if os.environ.get("BENCH_OTEL"):
    from bench.support.otel_sdk import trace_in_pool_processes

    trace_in_pool_processes(app)


@app.task(name=PLAIN_TASK, ignore_result=True)
def bench_plain(run: str, i: int) -> None:
    """A plain Celery no-op."""
    return None


@app.task(
    base=IdempotentTask,
    bind=True,
    name=IDEM_TASK,
    ignore_result=True,
    idempotency_key="bench:{run}:{i}",
)
def bench_idem(self: IdempotentTask, run: str, i: int) -> None:
    """The same no-op, run at most once per key by Oncelery."""
    return None


def _nothing(i: int) -> int:
    return i


@app.task(
    base=IdempotentTask,
    bind=True,
    name="oncelery.bench_steps",
    ignore_result=True,
    idempotency_key="bench:{run}:{i}",
)
def bench_steps(self: IdempotentTask, run: str, i: int) -> None:
    """The no-op in three checkpointed steps (bench/otel_overhead.py: a span per step when tracing is on)."""
    for name in ("first", "second", "third"):
        self.step(name, _nothing, i)


try:
    from celery_once import QueueOnce
except ImportError:  # optional: pip install -e '.[bench]'
    QueueOnce = None

if QueueOnce is not None:
    # celery-once's lock backend: the stats Redis (the broker's unless BENCH_STATS_URL says otherwise).
    app.conf.ONCE = {"backend": "celery_once.backends.Redis", "settings": {"url": stats_url(), "default_timeout": 3600}}

    @app.task(base=QueueOnce, name=ONCE_TASK, ignore_result=True, once={"graceful": True})
    def bench_once(run: str, i: int) -> None:
        """The same no-op, queued at most once per (run, i) by celery-once's Redis lock."""
        return None


FLOOR_DDL = [
    """CREATE TABLE IF NOT EXISTS bench_floor_runs (
        id bigserial PRIMARY KEY,
        task_name varchar(255) NOT NULL,
        idempotency_key varchar(255) NOT NULL,
        fingerprint varchar(64) NOT NULL,
        status varchar(16) NOT NULL,
        fencing_token integer NOT NULL,
        owner varchar(64),
        lease_expires_at timestamptz,
        result json,
        created_at timestamptz NOT NULL,
        updated_at timestamptz NOT NULL,
        finished_at timestamptz,
        UNIQUE (task_name, idempotency_key)
    )""",
    """CREATE TABLE IF NOT EXISTS bench_floor_outcomes (
        task_name varchar(255) NOT NULL,
        outcome varchar(16) NOT NULL,
        shard integer NOT NULL,
        count integer NOT NULL,
        PRIMARY KEY (task_name, outcome, shard)
    )""",
]
_FLOOR_CLAIM = """
INSERT INTO bench_floor_runs (task_name, idempotency_key, fingerprint, status, fencing_token, owner,
                              lease_expires_at, created_at, updated_at)
VALUES (%(task)s, %(key)s, %(fp)s, 'RUNNING', 1, %(owner)s, clock_timestamp() + interval '60 seconds',
        clock_timestamp(), clock_timestamp())
ON CONFLICT (task_name, idempotency_key) DO NOTHING
RETURNING id
"""
_FLOOR_COMPLETE = """
WITH done AS (
    UPDATE bench_floor_runs SET status = 'COMPLETED', result = 'null', finished_at = clock_timestamp(),
                         updated_at = clock_timestamp(), lease_expires_at = NULL
    WHERE id = %(id)s AND fencing_token = 1 AND owner = %(owner)s AND status = 'RUNNING'
    RETURNING id
)
INSERT INTO bench_floor_outcomes (task_name, outcome, shard, count)
SELECT %(task)s, 'executed', %(shard)s, 1 FROM done
ON CONFLICT (task_name, outcome, shard) DO UPDATE SET count = bench_floor_outcomes.count + 1
RETURNING count
"""
_FLOOR_ANSWER = """
WITH run AS (SELECT status, result FROM bench_floor_runs WHERE task_name = %(task)s AND idempotency_key = %(key)s)
INSERT INTO bench_floor_outcomes (task_name, outcome, shard, count)
SELECT %(task)s, 'replayed', %(shard)s, 1 FROM run WHERE status = 'COMPLETED'
ON CONFLICT (task_name, outcome, shard) DO UPDATE SET count = bench_floor_outcomes.count + 1
RETURNING (SELECT result FROM run)
"""
_floor_conns: dict[int, Any] = {}


def _floor_conn(async_commit: bool) -> Any:
    import psycopg

    key = os.getpid() * 2 + int(async_commit)
    conn = _floor_conns.get(key)
    if conn is None:
        dsn = database_url().replace("postgresql+psycopg://", "postgresql://", 1)
        conn = psycopg.connect(dsn, autocommit=True, prepare_threshold=0)
        if async_commit:
            conn.execute("SET synchronous_commit = off")
        _floor_conns[key] = conn
    return conn


@app.task(name=FLOOR_TASK, ignore_result=True)
def bench_floor(run: str, i: int) -> Any:
    """Yardstick: the cheapest claim + fenced completion (two statements) around the same no-op."""
    import uuid

    params = {
        "task": FLOOR_TASK,
        "key": f"bench:{run}:{i}",
        "fp": "0" * 64,
        "owner": uuid.uuid4().hex,
        "shard": os.getpid(),
    }
    claim_conn = _floor_conn("floor-async-claim" in WHAT_IF)
    row = claim_conn.execute(_FLOOR_CLAIM, params).fetchone()
    _db_counts["statements"] += 1
    _db_counts["round_trips"] += 1
    if row is None:  # a duplicate: answer from the stored result, counting the replay, in one statement
        answer = _floor_conn(False).execute(_FLOOR_ANSWER, params).fetchone()
        _db_counts["statements"] += 1
        _db_counts["round_trips"] += 1
        return answer[0] if answer else None
    result = None  # the body
    done = _floor_conn(False).execute(_FLOOR_COMPLETE, {**params, "id": row[0]}).fetchone()
    _db_counts["statements"] += 1
    _db_counts["round_trips"] += 1
    if done is None:
        raise RuntimeError("lease lost")
    return result


@app.task(name=FLOOR_DUP_TASK, ignore_result=True)
def bench_floordup(run: str, i: int) -> Any:
    """Yardstick: the least a duplicate answered by the database costs, one statement (read + count, async commit)."""
    params = {"task": FLOOR_TASK, "key": f"bench:{run}:{i}", "shard": os.getpid()}
    answer = _floor_conn(True).execute(_FLOOR_ANSWER, params).fetchone()
    _db_counts["statements"] += 1
    _db_counts["round_trips"] += 1
    if answer is None:
        raise RuntimeError(f"floordup: no COMPLETED run for {params['key']}: run the floor phase first")
    return answer[0]


@app.task(name=CACHE_DUP_TASK, ignore_result=True)
def bench_cachedup(run: str, i: int) -> Any:
    """Yardstick: a duplicate answered by one Redis GET of a cached result (no database, nothing counted)."""
    return _stats_client().get(f"bench:cache:{run}:{i}")


# -- what-if experiments (benchmark worker only): bench/support/what_if.py --------------------------------

if WHAT_IF:
    from bench.support.what_if import apply_what_if

    apply_what_if(WHAT_IF)


# -- per-child counters ----------------------------------------------------------------------------

_db_counts: dict[str, int] = {
    "statements": 0,
    "commits": 0,
    "rollbacks": 0,
    "checkouts": 0,
    "pings": 0,
    "round_trips": 0,
}
_redis: dict[int, redis.Redis] = {}


def _stats_client() -> redis.Redis:
    pid = os.getpid()
    client = _redis.get(pid)
    if client is None:
        client = redis.Redis.from_url(stats_url())
        _redis.clear()
        _redis[pid] = client
    return client


def _in_transaction(dbapi_conn: Any) -> bool | None:
    """Whether a psycopg connection is inside a server transaction (None: not psycopg)."""
    info = getattr(dbapi_conn, "info", None)
    status = getattr(info, "transaction_status", None)
    if status is None:
        return None
    return int(status) != 0  # psycopg.pq.TransactionStatus.IDLE


def _dbapi(conn: Any) -> Any:
    fairy = getattr(conn, "connection", None)
    return getattr(fairy, "dbapi_connection", fairy)


# Class-level listeners: they apply to every engine the store creates in this process (one per pid).
# Wire round trips are counted the way psycopg 3 talks (checked against log_statement=all): a statement on
# a non-autocommit connection outside a transaction is preceded by its own `BEGIN`; COMMIT/ROLLBACK
# go to the server only inside a transaction; pool_pre_ping sends `;` at every checkout.
@event.listens_for(Engine, "before_cursor_execute")
def _on_statement(conn: Any, *_args: Any) -> None:
    _db_counts["statements"] += 1
    _db_counts["round_trips"] += 1
    dbapi = _dbapi(conn)
    if not getattr(dbapi, "autocommit", True) and _in_transaction(dbapi) is False:
        _db_counts["round_trips"] += 1  # BEGIN


def _on_driver_statement(_sql: str, _params: Any) -> None:
    # PostgreSQL's one-statement calls skip SQLAlchemy's execution (oncelery.driver): one autocommit round trip.
    _db_counts["statements"] += 1
    _db_counts["round_trips"] += 1


statement_listeners.append(_on_driver_statement)


def _on_end(name: str) -> Any:
    def listener(conn: Any, *_args: Any) -> None:
        _db_counts[name] += 1
        if _in_transaction(_dbapi(conn)):
            _db_counts["round_trips"] += 1

    return listener


event.listen(Engine, "commit", _on_end("commits"))
event.listen(Engine, "rollback", _on_end("rollbacks"))


@event.listens_for(Pool, "checkout")
def _on_checkout(_dbapi_conn: Any, _record: Any, fairy: Any) -> None:
    _db_counts["checkouts"] += 1
    if getattr(getattr(fairy, "_pool", None), "_pre_ping", False):
        _db_counts["pings"] += 1
        _db_counts["round_trips"] += 1


@signals.task_postrun.connect
def _job_done(task: Any = None, **_kwargs: Any) -> None:
    queue = (getattr(task.request, "delivery_info", None) or {}).get("routing_key") or "unknown"
    prefix = f"bench:{queue}"
    now = time.time()
    pipe = _stats_client().pipeline(transaction=True)
    pipe.incr(f"{prefix}:done")
    pipe.set(f"{prefix}:last", repr(now))
    pipe.setnx(f"{prefix}:first", repr(now))
    for name, n in _db_counts.items():
        if n:
            pipe.hincrby(f"{prefix}:db", name, n)
            _db_counts[name] = 0
    pipe.execute()


@signals.worker_ready.connect
def _worker_ready(sender: Any = None, **_kwargs: Any) -> None:
    queue = os.environ.get("BENCH_QUEUE")
    if queue:
        _stats_client().set(f"bench:{queue}:ready", repr(time.time()))
