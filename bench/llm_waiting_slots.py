"""Many long background model calls on few worker slots: parked runs hold no slot while the provider works.

`--calls` jobs (default 200), each one background call that takes `--call-seconds` (default 60) at the fake
provider, on one in-process worker with `--slots` threads (default 4), the relay in a thread waking parked runs,
on PostgreSQL and Redis. Each run polls for the inline wait (`--inline-wait`, 5 s, the default), parks WAITING,
and is woken (re-attach, one poll, park again) until its call is done.

Printed: the wall time from the first submit to the last result (goal: about `--call-seconds` plus the polling,
not calls x call-seconds / slots), the worker-slot seconds held per call (every delivery's time in a slot,
summed, per call), deliveries per call, and the fake provider's counters (creates per intent, most calls
generating at once). Without parking (`inline_wait=None`) each call would hold its slot for the whole call:
`--calls` x `--call-seconds` / `--slots` of wall time.

    python bench/llm_waiting_slots.py [--calls 200] [--call-seconds 60] [--slots 4] [--inline-wait 5]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from celery import Celery
from celery.signals import task_postrun, task_prerun
from sqlalchemy import text
from sqlalchemy.engine import make_url

from oncelery import CELERY_DELIVERY_DEFAULTS, FakeProvider, IdempotentTask, OpenAIResponses, output_text
from oncelery.runs.views import Runs
from oncelery.store.database import dispose_engines, get_engine
from oncelery.store.schema import upgrade_schema
from oncelery.testing import in_process_worker, relay_running

_lock = threading.Lock()
_started: dict[str, float] = {}
_held: list[float] = []  # seconds each delivery held its worker slot


@task_prerun.connect
def _prerun(task_id: str | None = None, **_: Any) -> None:
    with _lock:
        _started[str(task_id)] = time.perf_counter()


@task_postrun.connect
def _postrun(task_id: str | None = None, **_: Any) -> None:
    with _lock:
        began = _started.pop(str(task_id), None)
        if began is not None:
            _held.append(time.perf_counter() - began)


def main() -> None:
    """Run the jobs and print the figures (see the module's docstring)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--admin-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/11")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--call-seconds", type=float, default=60.0)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--inline-wait", type=float, default=5.0)
    args = parser.parse_args()
    name = f"llm_waiting_{uuid.uuid4().hex[:10]}"
    admin = get_engine(args.admin_url)
    with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(args.admin_url).set(database=name).render_as_string(hide_password=False)
    try:
        upgrade_schema(url)
        app = Celery("bench-waiting")
        app.conf.update(
            **CELERY_DELIVERY_DEFAULTS,
            broker_url=args.redis_url,
            result_backend=args.redis_url,
            oncelery_database_url=url,
            task_default_queue=f"bench-waiting-{uuid.uuid4().hex[:6]}",
            worker_hijack_root_logger=False,
        )
        # OpenAI's hint is about a second between polls; the fake sends the same.
        with FakeProvider() as fake, OpenAIResponses(fake.openai_base_url, "sk") as adapter:
            fake.set_knobs(poll_after_ms=1000, generation_s=args.call_seconds)

            @app.task(
                base=IdempotentTask, bind=True, name="bench.wait", idempotency_key="doc:{doc}",
                llm_inline_wait=args.inline_wait,
            )  # fmt: skip
            def summarize(self: IdempotentTask, doc: str) -> str:
                return output_text(self.llm("summary", adapter=adapter, model="bench", input=f"article {doc}"))

            with in_process_worker(app, concurrency=args.slots), relay_running(app, url, interval=0.1):
                began = time.perf_counter()
                pending = [summarize.delay(str(i)) for i in range(args.calls)]
                for p in pending:
                    p.get(timeout=args.call_seconds * 10 + 600)
                wall = time.perf_counter() - began
            stats = fake.stats()
        counts = Runs(url).outcome_counts()
        held = sum(_held)
        creates = stats["creates_by_intent"]
        print(f"PostgreSQL + Redis; {args.calls} background calls of {args.call_seconds:g} s on {args.slots} slots")
        print(f"  inline wait {args.inline_wait:g} s; relay round 0.1 s; provider poll-after hint 1 s")
        print(f"  wall time, first submit to last result:   {wall:8.1f} s")
        print(f"  without parking (calls x seconds / slots): {args.calls * args.call_seconds / args.slots:8.1f} s")
        print(f"  worker-slot seconds held per call:          {held / args.calls:8.2f} s")
        print(f"  deliveries per call:                        {len(_held) / args.calls:8.2f}")
        print(f"  outcomes: {dict(sorted(counts.items()))}")
        print(
            f"  provider: {sum(creates.values())} creates for {len(creates)} intents, "
            f"max {max(creates.values())} per intent; at most {stats['max_in_flight']} calls generating at once"
        )
    finally:
        dispose_engines()
        with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


if __name__ == "__main__":
    main()
