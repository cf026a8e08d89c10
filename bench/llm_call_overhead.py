"""What a durable model call costs on top of a plain checkpointed step: database writes and p50 time per call.

Three ways to make the same call to the fake provider (answers at once), interleaved call by call inside one
task body on a real in-process worker, on PostgreSQL:

- `step`: `self.step(name, fn)` where fn makes a synchronous chat completion and records it with `model_call`
  (today's API: a ledger row in its own transaction, then the checkpoint);
- `llm sync`: `self.llm(name, adapter=OpenAIChat)`: the intent prepared (durably), the call, then the intent's end,
  the ledger row and the checkpoint in one transaction;
- `llm background`: `self.llm(name, adapter=OpenAIResponses)`: prepared, created in the background, `sent`
  saved, one poll, then the end as above.

Writes are the statements (INSERT/UPDATE/DELETE) and commits the call's thread sends while it runs, counted by
SQLAlchemy's events. The goal (issue "an LLM call that outlives its worker"): at most 2 extra database writes
per call, and the p50 added on PostgreSQL, stated.

    python bench/llm_call_overhead.py [--calls 200] [--admin-url postgresql+psycopg://postgres@127.0.0.1:5432/postgres]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from celery import Celery
from sqlalchemy import event, text
from sqlalchemy.engine import Engine, make_url

from oncelery import CELERY_DELIVERY_DEFAULTS, FakeProvider, IdempotentTask, OpenAIChat, OpenAIResponses, model_call
from oncelery.store.database import dispose_engines, get_engine
from oncelery.store.schema import upgrade_schema
from oncelery.testing import in_process_worker

MODES = ("step", "llm sync", "llm background")
_counting = threading.local()


def _count(kind: str) -> None:
    counts: Counter[str] | None = getattr(_counting, "counts", None)
    if counts is not None:
        counts[kind] += 1


@event.listens_for(Engine, "before_cursor_execute")
def _statement(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
    verb = statement.lstrip().split(None, 1)[0].upper()
    if verb in ("INSERT", "UPDATE", "DELETE"):
        _count("writes")
    _count("statements")


@event.listens_for(Engine, "commit")
def _commit(_conn: Any) -> None:
    _count("commits")


def measured(fn: Any) -> tuple[float, Counter[str]]:
    """Run fn() on this thread, counting its statements and commits; return (seconds, counts)."""
    _counting.counts = Counter()
    started = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - started
    counts, _counting.counts = _counting.counts, None
    return elapsed, counts


def build(app: Celery, chat: OpenAIChat, responses: OpenAIResponses) -> Any:
    def plain(i: int) -> str:
        with model_call("bench-model", prompt="bench") as call:
            answer = chat.create(
                {"model": "bench-model", "messages": [{"role": "user", "content": f"m{i}"}]}, "x", background=False
            )
            call.usage(answer.response.get("usage"))
        return str(answer.response["id"])

    @app.task(base=IdempotentTask, bind=True, name="bench.llm_overhead", idempotency_key="bench:{run}")
    def job(self: IdempotentTask, run: str, calls: int) -> dict[str, Any]:
        figures: dict[str, list[Any]] = {mode: [] for mode in MODES}
        for i in range(calls):
            mode = MODES[i % len(MODES)]
            if mode == "step":
                took = measured(lambda i=i: self.step(f"s{i}", plain, i))
            elif mode == "llm sync":
                message = [{"role": "user", "content": f"m{i}"}]
                took = measured(lambda i=i, m=message: self.llm(f"c{i}", adapter=chat, model="bench-model", messages=m))
            else:
                took = measured(lambda i=i: self.llm(f"r{i}", adapter=responses, model="bench-model", input=f"m{i}"))
            figures[mode].append([took[0], dict(took[1])])
        return figures

    return job


def main() -> None:
    """Run the comparison and print a table of p50 ms and writes, statements and commits per call."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--admin-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    name = f"llm_overhead_{uuid.uuid4().hex[:10]}"
    admin = get_engine(args.admin_url)
    with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(args.admin_url).set(database=name).render_as_string(hide_password=False)
    try:
        upgrade_schema(url)
        app = Celery("bench-llm")
        app.conf.update(
            **CELERY_DELIVERY_DEFAULTS,
            broker_url=args.redis_url,
            result_backend=args.redis_url,
            oncelery_database_url=url,
            task_default_queue=f"bench-llm-{uuid.uuid4().hex[:6]}",
            worker_hijack_root_logger=False,
        )
        with FakeProvider() as fake:
            # 5 ms per call: a background create answers `queued`, so its reference is saved and polled once.
            fake.set_knobs(poll_after_ms=5, generation_s=0.005)
            with OpenAIChat(fake.openai_base_url, "sk") as chat, OpenAIResponses(fake.openai_base_url, "sk") as resp:
                job = build(app, chat, resp)
                with in_process_worker(app, concurrency=1):
                    figures = job.delay(uuid.uuid4().hex, args.calls).get(timeout=600)
        print(f"PostgreSQL, {args.calls} calls interleaved ({args.calls // 3} per way), one worker thread")
        print(f"{'way':<16}{'p50 ms':>8}{'p90 ms':>8}{'writes':>8}{'statements':>12}{'commits':>9}")
        base = None
        for mode in MODES:
            rows = figures[mode][2:]  # the first of each way warms connections and caches
            times = sorted(t * 1000 for t, _ in rows)
            p50, p90 = statistics.median(times), times[int(len(times) * 0.9)]
            per = {k: statistics.mean(c.get(k, 0) for _, c in rows) for k in ("writes", "statements", "commits")}
            base = base or (p50, per)
            print(
                f"{mode:<16}{p50:8.2f}{p90:8.2f}{per['writes']:8.1f}{per['statements']:12.1f}{per['commits']:9.1f}"
                + (
                    ""
                    if mode == "step"
                    else f"   (+{p50 - base[0]:.2f} ms, +{per['writes'] - base[1]['writes']:.1f} writes)"
                )
            )
    finally:
        dispose_engines()
        with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


if __name__ == "__main__":
    main()
