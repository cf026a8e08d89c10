"""The outbox relay is a database client too: it serves through killed backends and a server restart.

Faults strike right after the relay publishes a batch, before it marks the rows SENT: those rounds roll back
and their rows are published again, and the claim absorbs every copy. No row is lost, no job runs twice.
The faults and the checks: tests/store_faults.py.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import insert

from oncelery import IdempotentTask, Relay, RelayRound, outbox
from oncelery.runs.faults import fault_injected
from tests.conftest import running_worker
from tests.services import effects_table, wait_for
from tests.store_faults import JOB_TIMEOUT, LEASE, Db, LogLines, fault_of, query

RELAY_JOBS = 200
RELAY_BATCH = 20
# The relay's publishing rounds (1-based) that meet a fault right after publishing, before marking rows SENT.
RELAY_FAULTS = {2: "terminate", 4: "terminate", 6: "restart", 8: "terminate"}
RELAY_TIMEOUT = 120.0


@pytest.mark.timeout(240)
def test_the_relay_serves_through_killed_backends_and_a_restart(pg_db: Db, pg_app: Celery, logs: LogLines) -> None:
    """200 outbox rows; the relay publishes them in batches of 20 while a worker runs the jobs.

    Right after publishing its 2nd, 4th and 8th batches (before marking them SENT) the relay's database is
    cut off (every backend of the database terminated: the relay's, the worker's), and after the 6th the
    server restarts. Each of those rounds fails and rolls back, so its 20 rows are published again by a
    later round: 80 jobs reach the broker twice, and the claim absorbs every copy.
    """
    name = "oncelery.t_edge_relay"

    @pg_app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name=name,
        idempotency_key="relay:{n}",
        lease=LEASE,
        ignore_result=True,
    )
    def job(self: IdempotentTask, n: int) -> dict[str, int]:
        with self.effects() as session:
            session.execute(insert(effects_table).values(key=f"relay:{n}", pid=os.getpid()))
        return {"n": n}

    pg_app.finalize()
    with pg_db.observer.begin() as conn:
        for i in range(RELAY_JOBS):
            outbox.enqueue(conn, job, i)

    rounds = [0]
    killed: list[int] = []
    injected: list[str] = []
    hook_errors: list[BaseException] = []

    def after_publishing(point: str, ctx: dict[str, Any]) -> None:
        if not ctx.get("rows"):
            return
        rounds[0] += 1
        kind = RELAY_FAULTS.get(rounds[0])
        if kind is None:
            return
        try:
            fault_of(kind, pg_db, killed)()
            injected.append(kind)
        except BaseException as exc:
            hook_errors.append(exc)
            raise

    relay = Relay(pg_app, pg_db.url, batch=RELAY_BATCH, republish_after=5.0, sweep_interval=1.0)
    stop = threading.Event()
    totals: list[RelayRound] = []
    serve_errors: list[BaseException] = []

    def serve() -> None:
        try:
            totals.append(relay.serve(stop, interval=0.05))
        except BaseException as exc:
            serve_errors.append(exc)

    server = threading.Thread(target=serve, name="relay", daemon=True)
    started = time.monotonic()

    def statuses() -> dict[str, int]:
        return {str(s): int(c) for s, c in query(pg_db, "SELECT status, count(*) FROM outbox GROUP BY status")}

    def completed() -> int:
        rows = query(pg_db, "SELECT count(*) FROM task_runs WHERE task_name = :t AND status = 'COMPLETED'", t=name)
        return int(rows[0][0])

    with running_worker(pg_app, concurrency=4), fault_injected("relay_published", after_publishing):
        server.start()
        try:
            try:
                wait_for(lambda: completed() == RELAY_JOBS, timeout=RELAY_TIMEOUT, interval=0.25, what="every run")
            except pytest.fail.Exception:
                pytest.fail(f"{completed()} of {RELAY_JOBS} runs completed; outbox={statuses()}\n{logs.text()}")
            settled = time.monotonic() - started
            at_completion = statuses()
            # Every duplicate copy is delivered and answered from the stored result.
            wait_for(
                lambda: pg_db.counts(name).get("replayed", 0) >= len(injected) * RELAY_BATCH,
                timeout=JOB_TIMEOUT,
                interval=0.25,
                what="the duplicate copies to be replayed",
            )
            # The relay kept serving after the faults: it closes every row whose run finished.
            wait_for(lambda: statuses() == {"DONE": RELAY_JOBS}, timeout=JOB_TIMEOUT, interval=0.25, what="DONE")
        finally:
            stop.set()
            server.join(60)
    assert not server.is_alive(), "serve() did not return after its stop event was set"

    failed_rounds = sum("relay round failed" in line for line in logs.lines)
    effects = {str(k): int(c) for k, c in query(pg_db, "SELECT key, count(*) FROM test_effects GROUP BY key")}
    counts = pg_db.counts(name)
    print(
        f"relay: settled_in={settled:.1f}s faults={injected} killed={killed} failed_rounds={failed_rounds} "
        f"totals={totals} outbox_at_completion={at_completion} outcomes={counts}"
    )
    assert not hook_errors and not serve_errors, f"{hook_errors!r} {serve_errors!r}"
    assert injected == [RELAY_FAULTS[k] for k in sorted(RELAY_FAULTS)], injected
    assert all(k != 0 for k in killed), killed
    assert failed_rounds >= len(RELAY_FAULTS), logs.text()
    # No row lost: at the moment every run had completed, every row had been published and marked.
    assert set(at_completion) <= {"SENT", "DONE"} and sum(at_completion.values()) == RELAY_JOBS, at_completion
    [total] = totals
    assert total.published == RELAY_JOBS and total.dead == 0 and total.failed == 0, total
    assert len(effects) == RELAY_JOBS and set(effects.values()) == {1}, {k: c for k, c in effects.items() if c != 1}
    assert counts.get("executed", 0) + counts.get("resumed", 0) == RELAY_JOBS, counts
    assert counts.get("failed", 0) == 0 and counts.get("dead", 0) == 0, counts
