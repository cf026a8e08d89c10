"""Debounce at the issue's scale: 1,000 edits to 100 documents in bursts, and 100 runs superseded mid-call.

    python bench/debounce.py [--store sqlite|postgresql] [--docs 100] [--edits 10]

One in-process worker (threads), the relay in a thread (its dispatcher sends due bursts through the outbox), Redis
on 127.0.0.1:6379, the fake provider, a two-call task debounced per document. Two phases:

1. bursts: `--edits` edits per document, sent in interleaved rounds while the relay runs (period 2 s, max_wait
   30 s): printed are the runs, those on their document's latest version, the ledger's calls against runs x
   steps, the provider's creates, the outcomes, and the seconds from the last edit to the last result.
2. supersede: one edit per document whose run is made to be mid-call (12 s calls, in waves of 25 runs in flight),
   and a newer edit of each as soon as its old run has paid its first call (its second is then in flight):
   printed are the runs superseded, the effect rows written by superseded runs (goal 0), their ledger rows
   labelled, and the calls cancelled at the provider.
Goals (docs/benchmarks.md): runs = documents, each on its latest version; calls = documents x steps; 0 effect rows
from superseded runs.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from celery import Celery
from sqlalchemy import Column, Integer, MetaData, String, Table, func, select, text
from sqlalchemy.engine import make_url

from oncelery import (
    CELERY_DELIVERY_DEFAULTS,
    Debounce,
    FakeProvider,
    IdempotentTask,
    OpenAIResponses,
    Runs,
    output_text,
    upgrade_schema,
)
from oncelery.store.database import dispose_engines, get_engine
from oncelery.store.tables import CALLS, DEBOUNCE, RUNS
from oncelery.testing import in_process_worker, relay_running
from oncelery.testing.waiting import wait_until

STEPS = ("summarize", "score")
META = MetaData()
EFFECTS = Table("bench_debounce_effects", META, Column("id", Integer, primary_key=True), Column("key", String(255)))


def database(store: str, admin_url: str) -> tuple[str, Any]:
    """A fresh claims database (a temp SQLite file, or a new PostgreSQL database) and how to drop it."""
    if store == "sqlite":
        folder = Path(tempfile.mkdtemp(prefix="oncelery-debounce-bench-"))
        return f"sqlite:///{folder / 'claims.db'}", lambda: None
    name = f"debounce_{uuid.uuid4().hex[:10]}"
    admin = get_engine(admin_url)
    with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))

    def drop() -> None:
        dispose_engines()
        with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))

    return make_url(admin_url).set(database=name).render_as_string(hide_password=False), drop


def main() -> None:
    """Run both phases and print the figures (see the module's docstring)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--admin-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/11")
    parser.add_argument("--docs", type=int, default=100)
    parser.add_argument("--edits", type=int, default=10)
    parser.add_argument("--period", type=float, default=2.0)
    # Worker threads: one per run of a phase-2 wave by default, so every run of a wave is in flight at once.
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--phases", default="bursts,supersede")
    # Phase 2's calls in flight: longer than the newer edit's way to its fencing (renewal interval + backlog).
    parser.add_argument("--call-seconds", type=float, default=12.0)
    # Phase 2's runs in flight at once: the fake provider reset connections with 100 calls created at once.
    parser.add_argument("--wave", type=int, default=25)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    url, drop = database(args.store, args.admin_url)
    try:
        upgrade_schema(url)
        META.create_all(get_engine(url))
        app = Celery("bench-debounce")
        app.conf.update(
            **CELERY_DELIVERY_DEFAULTS, broker_url=args.redis_url, result_backend=args.redis_url,
            oncelery_database_url=url, task_default_queue=f"bench-debounce-{uuid.uuid4().hex[:6]}",
            worker_hijack_root_logger=False, oncelery_producer_dedupe=False,
        )  # fmt: skip
        with FakeProvider() as fake, OpenAIResponses(fake.openai_base_url, "sk") as adapter:
            fake.set_knobs(poll_after_ms=20, generation_s=0.05)

            @app.task(
                base=IdempotentTask, bind=True, name="bench.debounce", idempotency_key="doc:{doc}:v{version}",
                debounce=Debounce(key="doc:{doc}", period=args.period, max_wait=30.0), llm_adapter=adapter,
                llm_inline_wait=None, lease=3.0,
            )  # fmt: skip
            def score(self: IdempotentTask, doc: str, version: int, body: str) -> dict[str, Any]:
                for step in STEPS:
                    body = output_text(self.llm(step, adapter=adapter, model="bench", input=body, max_output_tokens=40))
                with self.effects() as session:
                    session.execute(EFFECTS.insert().values(key=f"{doc}:v{version}"))
                return {"doc": doc, "version": version}

            threads = args.threads or max(8, args.wave)
            with in_process_worker(app, concurrency=threads), relay_running(app, url, interval=0.05):
                if "bursts" in args.phases:
                    bursts(score, url, fake, args)
                if "supersede" in args.phases:
                    supersede(score, url, fake, args)
    finally:
        drop()


def bursts(task: Any, url: str, fake: Any, args: Any) -> None:
    """Phase 1: `edits` edits per document in interleaved rounds; one run per document, on its latest version."""
    began = time.perf_counter()
    last: dict[str, Any] = {}
    for version in range(1, args.edits + 1):
        for d in range(args.docs):
            last[f"b{d}"] = task.delay(f"b{d}", version, f"Document {d}, version {version}. " * 5)
    sent = time.perf_counter()
    got = [h.get(timeout=args.timeout) for h in last.values()]
    done = time.perf_counter()
    engine = get_engine(url)
    with engine.connect() as conn:
        runs = conn.execute(select(RUNS.c.idempotency_key).where(RUNS.c.idempotency_key.like("doc:b%"))).scalars().all()
        calls = conn.execute(select(func.count()).select_from(CALLS).where(CALLS.c.idempotency_key.like("doc:b%")))
        effects = conn.execute(select(func.count()).select_from(EFFECTS).where(EFFECTS.c.key.like("b%"))).scalar_one()
        n_calls = calls.scalar_one()
    latest = sum(1 for g in got if g["version"] == args.edits)
    print(f"{args.store}: {args.docs * args.edits} edits to {args.docs} documents (period {args.period:g} s)")
    print(f"  edits sent in {sent - began:.2f} s ({args.docs * args.edits / (sent - began):.0f} upserts/s)")
    print(f"  runs: {len(runs)}; on the latest version: {latest}; effect rows: {effects}")
    print(f"  ledger calls: {n_calls} (runs x steps = {len(runs) * len(STEPS)})")
    print(f"  provider creates: {sum(fake.stats()['creates_by_intent'].values())}")
    print(f"  last edit to last result: {done - sent:.2f} s; outcomes: {Runs(url).outcome_counts()}")


def paid_first(engine: Any, docs: list[str]) -> list[str]:
    """The documents among `docs` whose version-1 run has a ledger row (its first call paid)."""
    if not docs:
        return []
    keys = {f"doc:{doc}:v1": doc for doc in docs}
    with engine.connect() as conn:
        query = select(CALLS.c.idempotency_key).where(CALLS.c.idempotency_key.in_(list(keys))).distinct()
        return [keys[key] for key in conn.execute(query).scalars()]


def fence_lags(engine: Any, period: float) -> list[float]:
    """Seconds from each newer edit (its burst's due time - period) to its old run's fencing (finished_at), sorted."""
    d, r = DEBOUNCE.c, RUNS.c
    with engine.connect() as conn:
        due = dict(conn.execute(select(d.debounce_key, d.due_at).where(d.debounce_key.like("doc:s%"))).all())
        fenced = conn.execute(
            select(r.idempotency_key, r.finished_at).where(
                r.idempotency_key.like("doc:s%:v1"), r.error.like("superseded%")
            )
        ).all()
    lags = []
    for key, finished in fenced:
        edit = due[key.removesuffix(":v1")]
        lags.append((finished - edit).total_seconds() + period)
    return sorted(lags)


def supersede(task: Any, url: str, fake: Any, args: Any) -> None:
    """Phase 2: runs mid-call, then a newer edit of each: superseded, 0 effect rows from them (in waves)."""
    engine = get_engine(url)
    cancels_before = fake.stats()["cancels"]
    began = time.perf_counter()
    superseded_s: list[float] = []
    for first in range(0, args.docs, args.wave):
        docs = [f"s{d}" for d in range(first, min(args.docs, first + args.wave))]
        # Long enough that an old run is still in its second call at the renewal after its newer edit.
        fake.set_knobs(generation_s=args.call_seconds)
        old = [task.delay(doc, 1, f"Old {doc}.") for doc in docs]
        expected = task.outcome_counts().get("superseded", 0) + len(docs)

        # Each document's newer edit goes as soon as its old run has paid its first call: that run is then
        # mid-call (its second call in flight for call_seconds), whenever the worker got to it.
        sent = time.perf_counter()
        new: dict[str, Any] = {}
        deadline = time.monotonic() + 600
        while len(new) < len(docs) and time.monotonic() < deadline:
            for doc in paid_first(engine, [d for d in docs if d not in new]):
                new[doc] = task.delay(doc, 2, f"New {doc}.")
            time.sleep(0.05)
        wait_until(
            lambda n=expected: task.outcome_counts().get("superseded", 0) >= n,
            timeout=600,
            what="superseded",
        )
        superseded_s.append(time.perf_counter() - sent)
        fake.set_knobs(generation_s=0.05)
        for h in list(new.values()) + old:
            h.get(timeout=300)
    with engine.connect() as conn:
        old_effects = conn.execute(select(func.count()).select_from(EFFECTS).where(EFFECTS.c.key.like("s%:v1")))
        new_effects = conn.execute(select(func.count()).select_from(EFFECTS).where(EFFECTS.c.key.like("s%:v2")))
        labelled = conn.execute(select(func.count()).select_from(CALLS).where(CALLS.c.reason == "run_superseded"))
        n_old, n_new, n_labelled = old_effects.scalar_one(), new_effects.scalar_one(), labelled.scalar_one()
    print(f"  supersede: {args.docs} runs mid-call ({args.call_seconds:g} s calls, waves of {args.wave}), then a newer")
    print(f"  edit of each; superseded: {task.outcome_counts().get('superseded', 0)}; effect rows from superseded")
    print(f"  runs: {n_old}; effect rows of the newer runs: {n_new}; ledger rows labelled: {n_labelled}")
    print(f"  calls cancelled at the provider: {fake.stats()['cancels'] - cancels_before}")
    lags = fence_lags(engine, args.period)
    if lags:
        p50, p95 = lags[len(lags) // 2], lags[min(len(lags) - 1, int(len(lags) * 0.95))]
        print(f"  newer edit to its old run fenced out: p50 {p50:.2f} s, p95 {p95:.2f} s, max {lags[-1]:.2f} s")
    took = time.perf_counter() - began
    print(f"  first newer edit of a wave to all superseded: max {max(superseded_s):.2f} s; phase {took:.1f} s")


if __name__ == "__main__":
    os.environ.setdefault("ONCELERY_LOG_LEVEL", "WARNING")
    main()
