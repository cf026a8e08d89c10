"""Batch steps at scale: `--jobs` jobs of `--steps` sequential batch steps each, pooled into provider batches.

Each job is one task whose `--steps` model calls are batch steps (`self.llm(..., mode="batch")`); step k+1's
request carries step k's answer, so a job's next item is queued only once its previous batch returned. All
items share one policy, `BatchPolicy(max_items=jobs, max_wait_s=--max-wait)`: a step round whose items are all
queued within `--max-wait` of its first makes one provider batch (one more for each straggler group). The
worker is one `celery worker` subprocess (`--pool prefork`, the default, `--slots` children; it imports this
module as `bench.batches`, configured through $BENCH_BATCHES_CONFIG) or an in-process worker (`--pool threads`).
The relay's loop runs in a thread of this process (0.1 s rounds), its batcher polling batches every
`--batch-poll` s; the fake provider (a thread of this process too) ends a batch after `--batch-polls` retrieves
in progress. Redis (DB 12 by default) and a fresh database: PostgreSQL (created and dropped) or SQLite (a file
in a temporary directory). Every delivery's slot time is pushed to a Redis list by the worker's task_prerun and
task_postrun handlers.

Then the same jobs (same texts, other idempotency keys, a second task) run again with synchronous calls
(`mode="call"`) on the same fake, to compare the ledgers.

Printed:
1. provider batches created against the steps (goal: `steps`, plus at most one straggler batch per round),
   submissions per `custom_id` (goal: each once), synchronous creates during the batch run (goal: 0), and each
   step round's spread (first to last item queued): a spread above `--max-wait` is what splits a round;
2. the ledger (`model_calls.cost_micros`) of the batch run against the synchronous run: the batch sum x 2
   against the synchronous sum (goal: equal, exactly), and each batch row against ceil(its sync row / 2);
3. worker-slot seconds: every delivery's time in its slot (task_prerun to task_postrun), and the
   part of it that falls while one of the run's items is pending (queued_at to done_at): "slot-seconds per
   item while waiting" (goal: ~0), against the parked seconds per item;
4. the parked-to-done time of each item (`queued_at`, epoch on the database clock, to `done_at`): percentiles
   and a text histogram; and the done-to-woken time (done_at to the start of the run's next delivery);
5. wall time (first submit to last result) and items/s, for both runs.

    python bench/batches.py [--jobs 1000] [--steps 10] [--store postgresql|sqlite] [--quick] [--json FILE]
                            [--pool prefork|threads] [--slots 4] [--max-wait 300] [--no-sync]
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from decimal import ROUND_CEILING, Decimal
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis
from celery import Celery
from celery.signals import task_postrun, task_prerun, worker_ready
from sqlalchemy import select, text
from sqlalchemy.engine import make_url

from bench.support.harness import spawn_redis, stop_process
from oncelery import CELERY_DELIVERY_DEFAULTS, BatchPolicy, IdempotentTask, output_text
from oncelery.fake_provider import FakeProvider, Knobs
from oncelery.llm.adapters.batch import OpenAIBatches
from oncelery.llm.adapters.openai_responses import OpenAIResponses
from oncelery.store.database import dispose_engines, get_engine
from oncelery.store.schema import upgrade_schema
from oncelery.store.tables import BATCH_ITEMS, BATCHES, CALLS, RUNS
from oncelery.testing import in_process_worker, relay_running

ROOT = Path(__file__).resolve().parents[1]  # where `celery -A bench.batches` imports this module from
MODEL = "gpt-bench"
# USD per 1M tokens (gpt-4.1's list price): whole micro-USD per token, so every synchronous cost is an even
# number of micro-USD and its half is exact. ODD_PRICE (gpt-4.1-mini's) is used only for the rounding note.
PRICE = {"input": 2, "output": 8}
ODD_PRICE = {"input": 0.40, "output": 1.60}
OUT = 40  # max_output_tokens of every step
BATCH_TASK = "bench.batch_chain"
SYNC_TASK = "bench.sync_chain"
ENV_CONFIG = "BENCH_BATCHES_CONFIG"  # JSON: what a worker subprocess builds the app from (see `build`)

_redis: dict[int, Any] = {}  # one client per process (the prefork children are forked)
_open: dict[tuple[str, int], tuple[float, str, str]] = {}  # (task id, thread) -> (start, task name, doc)
_conf: dict[str, Any] = {}


def _client() -> Any:
    pid = os.getpid()
    if pid not in _redis:
        _redis[pid] = redis.Redis.from_url(_conf["redis_url"])
    return _redis[pid]


@task_prerun.connect
def _prerun(task_id: str | None = None, task: Any = None, args: Any = None, **_: Any) -> None:
    doc = str(args[0]) if args else ""
    _open[(str(task_id), threading.get_ident())] = (time.time(), str(getattr(task, "name", "")), doc)


@task_postrun.connect
def _postrun(task_id: str | None = None, **_: Any) -> None:
    """Every delivery's time in its slot, wherever the worker runs: one line on a Redis list."""
    end = time.time()
    began = _open.pop((str(task_id), threading.get_ident()), None)
    if began is not None and _conf:
        _client().rpush(_conf["deliveries_key"], json.dumps([began[1], began[2], began[0], end]))


@worker_ready.connect
def _ready(**_: Any) -> None:
    if _conf:
        _client().set(_conf["ready_key"], "1", ex=3600)


_sync_adapters: dict[int, OpenAIResponses] = {}


def _sync_adapter() -> OpenAIResponses:
    """The synchronous adapter of this process (an httpx client is not shared across a fork)."""
    pid = os.getpid()
    if pid not in _sync_adapters:
        _sync_adapters[pid] = OpenAIResponses(_conf["fake_url"], "sk")
    return _sync_adapters[pid]


def build(conf: dict[str, Any]) -> tuple[Celery, Any, Any]:
    """The app and its two tasks (the batch chain and the synchronous chain), from `conf` (see `run`)."""
    _conf.clear()
    _conf.update(conf)
    app = Celery("bench-batches")
    app.conf.update(
        **CELERY_DELIVERY_DEFAULTS,
        broker_url=conf["redis_url"],
        result_backend=conf["redis_url"],
        oncelery_database_url=conf["url"],
        oncelery_prices={MODEL: PRICE},
        task_default_queue=conf["queue"],
        worker_hijack_root_logger=False,
    )
    policy = BatchPolicy(max_items=conf["jobs"], max_wait_s=conf["max_wait"])
    steps = int(conf["steps"])

    def chain(task: IdempotentTask, n: int, batch: bool) -> str:
        answer = article(n)
        options: dict[str, Any] = {"mode": "batch", "batch": policy} if batch else {}
        for k in range(steps):
            reply = task.llm(f"step{k}", adapter=_sync_adapter(), model=MODEL, input=step_input(k, answer),
                             max_output_tokens=OUT, **options)  # fmt: skip
            answer = output_text(reply)
        return answer

    @app.task(base=IdempotentTask, bind=True, name=BATCH_TASK, idempotency_key="batch:{doc}",
              llm_batch_adapter=lambda: OpenAIBatches(conf["fake_url"], "sk"))  # fmt: skip
    def batch_chain(self: IdempotentTask, doc: str, n: int) -> str:
        return chain(self, n, True)

    @app.task(base=IdempotentTask, bind=True, name=SYNC_TASK, idempotency_key="sync:{doc}")
    def sync_chain(self: IdempotentTask, doc: str, n: int) -> str:
        return chain(self, n, False)

    return app, batch_chain, sync_chain


# `celery -A bench.batches worker` (the prefork workers `run` starts): the app from the parent's configuration.
app = build(json.loads(os.environ[ENV_CONFIG]))[0] if os.environ.get(ENV_CONFIG) else None


def article(n: int) -> str:
    return f"Article {n}: the council met on Tuesday to discuss the harbour's new budget and the ferry timetable."


def step_input(k: int, previous: str) -> str:
    return f"Step {k + 1}: tighten this into one better sentence. {previous}"


def percentile(values: list[float], p: float) -> float:
    """The nearest-rank percentile of `values` (sorted)."""
    if not values:
        return float("nan")
    rank = max(1, math.ceil(p / 100 * len(values)))
    return values[rank - 1]


def histogram(values: list[float], buckets: int = 12, width: int = 50) -> list[str]:
    """A text histogram of `values` in `buckets` equal-width bins from 0 to the maximum."""
    if not values:
        return ["  (no values)"]
    top = max(values) or 1.0
    step = top / buckets
    edges = [step * (i + 1) for i in range(buckets)]
    counts = Counter(min(bisect.bisect_left(edges, v), buckets - 1) for v in values)
    most = max(counts.values())
    lines = []
    for i in range(buckets):
        n = counts.get(i, 0)
        bar = "#" * (round(n / most * width) if n else 0)
        lines.append(f"  {step * i:7.2f}-{step * (i + 1):7.2f} s {n:7d} {bar}")
    return lines


def epoch_of(value: Any) -> float:
    """A DateTime column's value (aware on PostgreSQL, naive UTC on SQLite) as epoch seconds."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.timestamp()


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU jiffies of the whole machine so far (/proc/stat): other sessions share these cores."""
    fields = [float(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


def machine_note(before: tuple[float, float], after: tuple[float, float]) -> dict[str, float]:
    """How busy the machine was between two `machine_cpu` readings, and its load average now."""
    busy, total = after[0] - before[0], after[1] - before[1]
    return {"cpus": float(os.cpu_count() or 1), "busy": busy / total if total else 0.0, "load1": os.getloadavg()[0]}


def overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=1000, help="jobs (default 1000)")
    parser.add_argument("--steps", type=int, default=10, help="sequential batch steps per job (default 10)")
    parser.add_argument("--store", choices=("postgresql", "sqlite"), default="postgresql", help="claims database")
    parser.add_argument("--quick", action="store_true", help="100 jobs x 3 steps (about a minute)")
    parser.add_argument("--pool", choices=("prefork", "threads"), default="prefork",
                        help="prefork: one `celery worker` subprocess; threads: an in-process worker")  # fmt: skip
    parser.add_argument("--slots", type=int, default=4, help="the worker's concurrency (default 4)")
    parser.add_argument(
        "--max-wait",
        type=float,
        default=300.0,
        help="BatchPolicy.max_wait_s (default 300: covers a step round's queueing spread)",
    )
    parser.add_argument("--batch-poll", type=float, default=0.1, help="the batcher's poll interval, s (default 0.1)")
    parser.add_argument("--batch-polls", type=int, default=2, help="retrieves a fake batch stays in progress")
    parser.add_argument("--no-sync", action="store_true", help="skip the synchronous comparison run")
    parser.add_argument("--admin-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/12")
    parser.add_argument("--spawn-redis", type=int, metavar="PORT",
                        help="a private redis-server on PORT for broker, results and the slot log (a shared Redis "
                        "may be flushed by other sessions' tests)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the results")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON to FILE")
    args = parser.parse_args()
    if args.quick:
        args.jobs, args.steps = 100, 3
    return args


class Database:
    """A fresh claims database for the run: created on enter, dropped (or deleted) on exit."""

    def __init__(self, store: str, admin_url: str) -> None:
        self.store, self.admin_url = store, admin_url
        self.name = f"bench_batches_{uuid.uuid4().hex[:10]}"
        self.tmp: tempfile.TemporaryDirectory[str] | None = None
        self.url = ""

    def __enter__(self) -> str:
        if self.store == "sqlite":
            self.tmp = tempfile.TemporaryDirectory(prefix="bench-batches-")
            self.url = f"sqlite:///{Path(self.tmp.name) / 'claims.db'}"
        else:
            with get_engine(self.admin_url).connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.execute(text(f'CREATE DATABASE "{self.name}"'))
            self.url = make_url(self.admin_url).set(database=self.name).render_as_string(hide_password=False)
        upgrade_schema(self.url)
        return self.url

    def __exit__(self, *_: Any) -> None:
        dispose_engines()
        if self.tmp is not None:
            self.tmp.cleanup()
        elif self.url:
            with get_engine(self.admin_url).connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)'))
            dispose_engines()


@contextmanager
def workers(args: argparse.Namespace, app: Celery, conf: dict[str, Any]) -> Iterator[None]:
    """The worker for the block: in this process (threads pool) or a `celery worker` subprocess (prefork)."""
    if args.pool == "threads":
        with in_process_worker(app, concurrency=args.slots):
            yield
        return
    command = [
        *(sys.executable, "-W", "ignore::UserWarning", "-m", "celery", "-q", "-A", "bench.batches", "worker"),
        *("-P", "prefork", "-c", str(args.slots)),
        *("-Q", conf["queue"], "-l", "warning", "--without-gossip", "--without-mingle", "--without-heartbeat"),
    ]
    env = {**os.environ, ENV_CONFIG: json.dumps(conf)}
    proc = subprocess.Popen(command, cwd=ROOT, env=env)
    try:
        deadline = time.time() + 60
        while not _client().get(conf["ready_key"]):
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the worker did not start (exit code {proc.poll()})")
            time.sleep(0.1)
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    knobs = Knobs(batch_polls=args.batch_polls, generation_s=0.0, poll_after_ms=5)
    out: dict[str, Any] = {}
    queue = f"bench-batches-{uuid.uuid4().hex[:6]}"
    with FakeProvider(knobs) as fake, OpenAIBatches(fake.openai_base_url, "sk") as batches:
        conf = {
            "url": url, "redis_url": args.redis_url, "queue": queue, "fake_url": fake.openai_base_url,
            "jobs": args.jobs, "steps": args.steps, "max_wait": args.max_wait,
            "deliveries_key": f"bench:{queue}:deliveries", "ready_key": f"bench:{queue}:ready",
        }  # fmt: skip
        app, batch_chain, sync_chain = build(conf)
        sentinel = f"bench:{queue}:sentinel"
        _client().set(sentinel, "1")  # gone at the end: someone flushed this Redis database during the run
        try:
            with (
                workers(args, app, conf),
                relay_running(app, url, interval=0.1, batch_poll_s=args.batch_poll, batch_adapters={"openai": batches}),
            ):
                cpu = machine_cpu()
                began = time.time()
                pending = [batch_chain.delay(f"d{n}", n) for n in range(args.jobs)]
                batch_answers = [p.get(timeout=args.timeout) for p in pending]
                out["batch_wall_s"] = time.time() - began
                out["machine"] = machine_note(cpu, machine_cpu())
                out["batch_began"] = began
                out["stats_batch"] = fake.stats()
                if not args.no_sync:
                    began = time.time()
                    pending = [sync_chain.delay(f"d{n}", n) for n in range(args.jobs)]
                    sync_answers = [p.get(timeout=args.timeout) for p in pending]
                    out["sync_wall_s"] = time.time() - began
                    out["same_answers"] = sync_answers == batch_answers
                out["stats_all"] = fake.stats()
            out["outcomes_batch"] = batch_chain.outcome_counts()
            out["outcomes_sync"] = {} if args.no_sync else sync_chain.outcome_counts()
            out["deliveries"] = [json.loads(d) for d in _client().lrange(conf["deliveries_key"], 0, -1)]
            out["redis_flushed"] = not _client().exists(sentinel)
        finally:
            _client().delete(conf["deliveries_key"], conf["ready_key"], sentinel)
            for adapter in _sync_adapters.values():
                adapter.close()
    return out


def analyse(args: argparse.Namespace, url: str, out: dict[str, Any]) -> dict[str, Any]:
    engine = get_engine(url)
    with engine.connect() as conn:
        run_rows = conn.execute(
            select(RUNS.c.id, RUNS.c.idempotency_key, RUNS.c.replays, RUNS.c.finished_at, RUNS.c.fencing_token)
        ).all()
        runs = {r.id: r.idempotency_key for r in run_rows}
        items = conn.execute(
            select(
                BATCH_ITEMS.c.run_id, BATCH_ITEMS.c.position, BATCH_ITEMS.c.batch_id, BATCH_ITEMS.c.state,
                BATCH_ITEMS.c.attempts, BATCH_ITEMS.c.queued_at, BATCH_ITEMS.c.done_at,
            )
        ).all()  # fmt: skip
        batch_rows = conn.execute(
            select(BATCHES.c.id, BATCHES.c["items"], BATCHES.c.polls, BATCHES.c.state).order_by(BATCHES.c.created_at)
        ).all()
        calls = conn.execute(
            select(CALLS.c.task_name, CALLS.c.idempotency_key, CALLS.c.step, CALLS.c.cost_micros,
                   CALLS.c.input_tokens, CALLS.c.output_tokens, CALLS.c.meta)
        ).all()  # fmt: skip
    figures: dict[str, Any] = {
        **{"jobs": args.jobs, "steps": args.steps, "store": args.store, "pool": args.pool, "slots": args.slots},
        **{"max_wait_s": args.max_wait, "batch_poll_s": args.batch_poll},
    }
    n_items = args.jobs * args.steps

    # 1. Provider batches per step round.
    stats = out["stats_batch"]
    figures["batches_created"] = sum(stats["batches_created"].values())
    figures["batch_rows"] = len(batch_rows)
    per_id = Counter(stats["items_by_custom_id"].values())
    figures["custom_ids"] = len(stats["items_by_custom_id"])
    figures["submissions_per_custom_id"] = {str(k): v for k, v in sorted(per_id.items())}
    figures["sync_creates_in_batch_run"] = sum(stats["creates_by_intent"].values()) + stats["creates_without_intent"]
    figures["item_states"] = dict(Counter(i.state.value for i in items))
    positions_in: dict[str, Counter[int]] = defaultdict(Counter)
    for i in items:
        positions_in[str(i.batch_id)][i.position] += 1
    figures["batches"] = [
        {
            "items": b.items,
            "polls": b.polls,
            "state": b.state.value,
            "positions": dict(sorted(positions_in[b.id].items())),
        }
        for b in batch_rows
    ]
    rounds: dict[int, list[Any]] = defaultdict(list)
    for i in items:
        rounds[i.position].append(i)
    figures["rounds"] = []
    for position in sorted(rounds):
        queued = sorted(float(i.queued_at) for i in rounds[position])
        done = sorted(epoch_of(i.done_at) for i in rounds[position] if i.done_at is not None)
        figures["rounds"].append({
            "position": position,
            "items": len(queued),
            "batches": len({i.batch_id for i in rounds[position]}),
            "queued_spread_s": queued[-1] - queued[0],
            "first_queued_s": queued[0] - out["batch_began"],
            "last_done_s": (done[-1] - out["batch_began"]) if done else None,
        })  # fmt: skip

    # 2. The ledger, batch against synchronous.
    by_step: dict[tuple[str, str], dict[str, Any]] = {}
    for c in calls:
        mode = "batch" if c.task_name == BATCH_TASK else "sync"
        doc = str(c.idempotency_key).split(":", 1)[1]
        by_step.setdefault((doc, str(c.step)), {})[mode] = c
    batch_rows_l = [c for c in calls if c.task_name == BATCH_TASK]
    sync_rows_l = [c for c in calls if c.task_name == SYNC_TASK]
    figures["ledger_rows"] = {"batch": len(batch_rows_l), "sync": len(sync_rows_l)}
    figures["ledger_batch_micros"] = sum(int(c.cost_micros) for c in batch_rows_l)
    figures["ledger_sync_micros"] = sum(int(c.cost_micros) for c in sync_rows_l)
    figures["ledger_batch_modes"] = dict(Counter((c.meta or {}).get("mode") for c in batch_rows_l))
    pairs = [v for v in by_step.values() if "batch" in v and "sync" in v]
    figures["ledger_pairs"] = len(pairs)
    figures["ledger_same_tokens"] = sum(
        (p["batch"].input_tokens, p["batch"].output_tokens) == (p["sync"].input_tokens, p["sync"].output_tokens)
        for p in pairs
    )
    figures["ledger_rows_at_half_up"] = sum(
        int(p["batch"].cost_micros) == -(-int(p["sync"].cost_micros) // 2) for p in pairs
    )
    figures["ledger_odd_sync_rows"] = sum(int(p["sync"].cost_micros) % 2 for p in pairs)
    # The same token counts at a price that is not whole micro-USD per token: what per-row rounding does.
    odd_in, odd_out = Decimal(str(ODD_PRICE["input"])), Decimal(str(ODD_PRICE["output"]))
    odd_exact = [c.input_tokens * odd_in + c.output_tokens * odd_out for c in sync_rows_l]  # micro-USD, exact
    odd_sync = [int(v.to_integral_value(rounding=ROUND_CEILING)) for v in odd_exact]
    odd_exact = sum(odd_exact, Decimal(0))
    figures["odd_price"] = {
        "price": ODD_PRICE,
        "exact_sync_micros": float(odd_exact),
        "sync_micros": sum(odd_sync),
        "batch_micros": sum(-(-s // 2) for s in odd_sync),
        "odd_rows": sum(s % 2 for s in odd_sync),
    }
    if sync_rows_l:
        figures["tokens_per_call"] = {
            "input": statistics.mean(c.input_tokens for c in sync_rows_l),
            "output": statistics.mean(c.output_tokens for c in sync_rows_l),
        }

    # 3. Worker-slot seconds, and the part of them while the run's item was pending.
    doc_of_run = {rid: str(key).split(":", 1)[1] for rid, key in runs.items() if str(key).startswith("batch:")}
    pending_of: dict[str, list[tuple[float, float]]] = defaultdict(list)
    parked: list[float] = []
    for i in items:
        if i.done_at is None:
            continue
        window = (float(i.queued_at), epoch_of(i.done_at))
        pending_of[doc_of_run[i.run_id]].append(window)
        parked.append(window[1] - window[0])
    deliveries = [d for d in out["deliveries"] if d[0] == BATCH_TASK]
    slot_total = sum(d[3] - d[2] for d in deliveries)
    tail = inside = 0.0  # slot time while pending: the queuing delivery's tail, and deliveries begun while pending
    inside_n = 0
    for _, doc, start, end in deliveries:
        for window in pending_of.get(doc, []):
            part = overlap((start, end), window)
            if start < window[0]:
                tail += part
            elif part > 0:
                inside += part
                inside_n += 1
    figures["deliveries"] = len(deliveries)
    per_doc = Counter(d[1] for d in deliveries)
    figures["deliveries_per_run"] = {str(k): v for k, v in sorted(Counter(per_doc.values()).items())}
    batch_runs = [r for r in run_rows if str(r.idempotency_key).startswith("batch:")]
    figures["runs_replays"] = sum(int(r.replays) for r in batch_runs)
    figures["runs_fencing_tokens"] = {
        str(k): v for k, v in sorted(Counter(r.fencing_token for r in batch_runs).items())
    }
    finished = {str(r.idempotency_key).split(":", 1)[1]: epoch_of(r.finished_at) for r in batch_runs if r.finished_at}
    figures["deliveries_after_finish"] = [
        round(start - finished[doc], 3) for _, doc, start, _e in deliveries if doc in finished and start > finished[doc]
    ]
    figures["deliveries_per_item"] = len(deliveries) / n_items
    figures["deliveries_begun_while_pending"] = inside_n
    figures["slot_s_total"] = slot_total
    figures["slot_s_per_item"] = slot_total / n_items
    figures["slot_s_while_waiting"] = tail + inside
    figures["slot_s_while_waiting_per_item"] = (tail + inside) / n_items
    figures["slot_s_park_tail_per_item"] = tail / n_items
    figures["slot_s_begun_while_pending"] = inside
    figures["parked_s_total"] = sum(parked)
    figures["parked_s_per_item"] = sum(parked) / max(1, len(parked))
    sync_deliveries = [d for d in out["deliveries"] if d[0] == SYNC_TASK]
    if sync_deliveries:
        figures["sync_slot_s_per_item"] = sum(d[3] - d[2] for d in sync_deliveries) / n_items

    # 4. Parked-to-done, and done-to-woken (the start of the run's first delivery after its item was done).
    parked.sort()
    figures["parked_to_done_s"] = {f"p{p}": percentile(parked, p) for p in (50, 90, 99)} | {"max": parked[-1]}
    figures["parked_histogram"] = histogram(parked)
    starts: dict[str, list[float]] = defaultdict(list)
    for _, doc, start, _end in deliveries:
        starts[doc].append(start)
    for values in starts.values():
        values.sort()
    woken: list[float] = []
    for doc, windows in pending_of.items():
        for _q, done in windows:
            later = starts[doc][bisect.bisect_left(starts[doc], done) :]
            if later:
                woken.append(later[0] - done)
    woken.sort()
    if woken:
        figures["done_to_woken_s"] = {f"p{p}": percentile(woken, p) for p in (50, 90, 99)} | {"max": woken[-1]}

    # 5. Wall time.
    figures["batch_wall_s"] = out["batch_wall_s"]
    figures["machine"] = out["machine"]
    figures["redis"] = args.redis_url
    figures["redis_flushed"] = out["redis_flushed"]
    figures["items_per_s"] = n_items / out["batch_wall_s"]
    if "sync_wall_s" in out:
        figures["sync_wall_s"] = out["sync_wall_s"]
        figures["sync_items_per_s"] = n_items / out["sync_wall_s"]
        figures["same_answers"] = out["same_answers"]
    figures["outcomes_batch"] = out["outcomes_batch"]
    figures["outcomes_sync"] = out["outcomes_sync"]
    figures["fake"] = {k: out["stats_all"][k] for k in ("batch_retrieves", "files_uploaded", "files_deleted")}
    return figures


def report(f: dict[str, Any]) -> None:
    steps = f["steps"]
    print(f"{f['store']} + Redis; {f['jobs']} jobs x {steps} batch steps = {f['jobs'] * steps} items")
    worker = "one `celery worker` subprocess, prefork" if f["pool"] == "prefork" else "one in-process worker, threads"
    print(f"  {worker} x {f['slots']}; relay loop 0.1 s (in this process), batcher poll {f['batch_poll_s']:g} s;")
    print(f"  BatchPolicy(max_items={f['jobs']}, max_wait_s={f['max_wait_s']:g}); price {PRICE} USD/1M tokens")
    print()
    print("1. provider batches")
    print(
        f"  batches created: {f['batches_created']} for {steps} step rounds (goal {steps}, + <=1 straggler per round)"
    )
    spread = max(r["queued_spread_s"] for r in f["rounds"])
    print(f"  the widest round: its items were queued over {spread:.2f} s, against max_wait_s {f['max_wait_s']:g}")
    print(f"  custom_ids submitted: {f['custom_ids']}; submissions per custom_id: {f['submissions_per_custom_id']}")
    print(f"  synchronous creates during the batch run: {f['sync_creates_in_batch_run']} (goal 0)")
    print(f"  item states: {f['item_states']}")
    print("  round  items  batches  queued spread   first queued  last done (s from the first submit)")
    for r in f["rounds"]:
        last = "-" if r["last_done_s"] is None else f"{r['last_done_s']:.2f}"
        print(
            f"  {r['position']:5d} {r['items']:6d} {r['batches']:8d} {r['queued_spread_s']:12.2f} s "
            f"{r['first_queued_s']:12.2f} {last:>10}"
        )
    print("  batches (items, polls, items per step position):")
    for b in f["batches"]:
        print(f"    {b['items']:6d} items, {b['polls']} polls, {b['state']}: {b['positions']}")
    print()
    print("2. ledger (model_calls.cost_micros)")
    print(f"  rows: {f['ledger_rows']}; batch rows' meta.mode: {f['ledger_batch_modes']}")
    if f["ledger_rows"]["sync"]:
        b, s = f["ledger_batch_micros"], f["ledger_sync_micros"]
        print(f"  batch sum {b} micro-USD, x2 = {2 * b}; synchronous sum {s}: {'EQUAL' if 2 * b == s else 'NOT EQUAL'}")
        print(
            f"  pairs (same job and step): {f['ledger_pairs']}, same tokens: {f['ledger_same_tokens']}, batch row "
            f"== ceil(sync row / 2): {f['ledger_rows_at_half_up']}, odd sync rows: {f['ledger_odd_sync_rows']}"
        )
        o = f["odd_price"]
        print(
            f"  same tokens at {o['price']}: exact {o['exact_sync_micros']:.2f}, sync rows sum {o['sync_micros']}, "
            f"batch rows sum {o['batch_micros']} (x2 = {2 * o['batch_micros']}; odd rows {o['odd_rows']})"
        )
        print(f"  tokens per call: {f.get('tokens_per_call')}; same final answers as the batch run: "
              f"{f.get('same_answers')}")  # fmt: skip
    print()
    print("3. worker-slot seconds (task_prerun to task_postrun)")
    print(f"  deliveries: {f['deliveries']} ({f['deliveries_per_item']:.2f} per item); runs by deliveries: "
          f"{f['deliveries_per_run']}; fencing tokens: {f['runs_fencing_tokens']}")  # fmt: skip
    late = f["deliveries_after_finish"]
    print(f"  deliveries begun after their run finished (duplicates answered from the result): {len(late)}"
          + (f", {min(late):.2f} to {max(late):.2f} s after it" if late else ""))  # fmt: skip
    print(f"  slot-seconds per item, all deliveries: {f['slot_s_per_item']:.4f} s ({f['slot_s_total']:.1f} s in all)")
    print(f"  slot-seconds per item while its batch was pending: {f['slot_s_while_waiting_per_item']:.4f} s (goal ~0)")
    print(f"    of which the queuing delivery's own end (queued_at to its postrun: commit, park, ack): "
          f"{f['slot_s_park_tail_per_item']:.4f} s")  # fmt: skip
    print(f"    of which deliveries begun while an item was pending: {f['deliveries_begun_while_pending']}, "
          f"{f['slot_s_begun_while_pending']:.2f} s in all")  # fmt: skip
    print(f"  parked seconds per item: {f['parked_s_per_item']:.2f} s ({f['parked_s_total']:.0f} s in all)")
    if "sync_slot_s_per_item" in f:
        print(f"  synchronous run, slot-seconds per call: {f['sync_slot_s_per_item']:.4f} s")
    print()
    print("4. parked (queued_at) to done (done_at), per item")
    print("  " + ", ".join(f"{k} {v:.2f} s" for k, v in f["parked_to_done_s"].items()))
    print("\n".join(f["parked_histogram"]))
    if "done_to_woken_s" in f:
        print(
            "  done to the run's next delivery: " + ", ".join(f"{k} {v:.3f} s" for k, v in f["done_to_woken_s"].items())
        )
    print()
    print("5. wall time")
    print(f"  batch run: {f['batch_wall_s']:.1f} s, {f['items_per_s']:.1f} items/s")
    m = f["machine"]
    print(f"  machine during the batch run: {m['busy']:.0%} of {m['cpus']:.0f} CPUs busy (all processes, other "
          f"sessions' included); load average (1 min) at its end {m['load1']:.1f}")  # fmt: skip
    if "sync_wall_s" in f:
        print(f"  synchronous run: {f['sync_wall_s']:.1f} s, {f['sync_items_per_s']:.1f} calls/s")
    print(f"  outcomes: batch {f['outcomes_batch']}; sync {f['outcomes_sync']}")
    if f["redis_flushed"]:
        print(f"  INVALID: {f['redis']} was flushed during the run (the bench's sentinel key vanished): messages and "
              "the slot log were lost; re-run with --spawn-redis PORT")  # fmt: skip
    print(f"  fake: {f['fake']}")


def main() -> None:
    """Run the jobs and print the figures (see the module's docstring)."""
    args = parse()
    private = spawn_redis(args.spawn_redis) if args.spawn_redis else None
    if args.spawn_redis:
        args.redis_url = f"redis://127.0.0.1:{args.spawn_redis}/0"
    try:
        with Database(args.store, args.admin_url) as url:
            out = run(args, url)
            figures = analyse(args, url, out)
    finally:
        stop_process(private)
    report(figures)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2, default=str))


if __name__ == "__main__":
    main()
