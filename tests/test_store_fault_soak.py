"""A soak: 200 jobs while backends are killed every ~0.3 s and the server restarts once; nothing lost or doubled.

The job, the faults and the checks: tests/store_faults.py.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
from celery import Celery
from sqlalchemy import text

from tests.conftest import running_worker
from tests.store_faults import Db, LogLines, define_job, expected, job_key

SOAK_JOBS = 200
SOAK_DEADLINE = 240.0


@pytest.mark.timeout(SOAK_DEADLINE + 60)
def test_soak_backends_killed_and_a_restart_lose_and_duplicate_nothing(
    pg_db: Db, pg_app: Celery, logs: LogLines
) -> None:
    cluster = pg_db.cluster
    assert cluster is not None
    job = define_job(pg_app, pg_db, "oncelery.t_soak", step_seconds=0.02)
    keys = [job_key(i) for i in range(SOAK_JOBS)]
    stop = threading.Event()
    chaos = {"terminations": 0, "killed": 0, "restarts": 0}
    errors: list[BaseException] = []
    rng = random.Random(8)

    def break_things() -> None:
        try:
            rounds = 0
            while not stop.wait(rng.uniform(0.2, 0.4)):
                rounds += 1
                if rounds == 12 and not chaos["restarts"]:
                    cluster.restart("fast")
                    chaos["restarts"] += 1
                    continue
                killed = cluster.terminate_backends(database=pg_db.name)
                if killed:
                    chaos["terminations"] += 1
                    chaos["killed"] += killed
        except BaseException as exc:
            errors.append(exc)

    started = time.monotonic()
    results = []
    breaker = threading.Thread(target=break_things, name="chaos", daemon=True)
    with running_worker(pg_app, concurrency=4):
        results.append(job.delay(0))  # derives (and caches) the identity's secret before the chaos starts
        breaker.start()
        try:
            for i in range(1, SOAK_JOBS):
                results.append(job.delay(i))
                time.sleep(0.03)  # jobs arrive over ~6 s, so the faults land among them
            # Every job settles: SUCCESS, or a FAILURE (acked as final, which the asserts below report).
            deadline = started + SOAK_DEADLINE
            pending = list(results)
            while pending and time.monotonic() < deadline:
                pending = [r for r in pending if not r.ready()]
                time.sleep(0.25)
            settled = time.monotonic() - started
        finally:
            stop.set()
            breaker.join(60)
        values = {}
        for i, r in enumerate(results):
            try:
                values[i] = r.get(timeout=5)
            except Exception as exc:
                values[i] = repr(exc)

    elapsed = time.monotonic() - started
    with pg_db.observer.connect() as conn:
        runs = {
            key: (status, (error or "")[:200])
            for key, status, error in conn.execute(
                text("SELECT idempotency_key, status, error FROM task_runs WHERE task_name = :t"), {"t": job.name}
            )
        }
        statuses = {key: status for key, (status, _) in runs.items()}
        effects: dict[str, int] = dict(conn.execute(text("SELECT key, count(*) FROM test_effects GROUP BY key")).all())
    lost = sorted(k for k in keys if statuses.get(k) != "COMPLETED" or effects.get(k, 0) == 0)
    duplicated = sorted(k for k in keys if effects.get(k, 0) > 1)
    wrong = sorted(i for i, v in values.items() if v != expected(i))
    counts = pg_db.counts(job.name)
    print(
        f"soak: jobs={SOAK_JOBS} lost={len(lost)} duplicated={len(duplicated)} wrong_results={len(wrong)} "
        f"settled_in={settled:.1f}s elapsed={elapsed:.1f}s terminations={chaos['terminations']} "
        f"backends_killed={chaos['killed']} restarts={chaos['restarts']} outcomes={counts}"
    )
    detail = (
        f"lost={lost[:20]} duplicated={duplicated[:20]} wrong={[(i, values[i]) for i in wrong[:5]]} "
        f"runs_of_lost={[(k, *runs.get(k, ('no run', ''))) for k in lost[:5]]}\n"
        + "\n".join(line for line in logs.lines if any(f"[{k}]" in line for k in lost[:5]))
    )
    assert not errors, f"the chaos thread failed: {errors!r}"
    assert chaos["terminations"] >= 10 and chaos["restarts"] == 1, chaos
    assert len(lost) == 0 and len(duplicated) == 0, detail
    assert not wrong, detail
    assert counts.get("executed", 0) + counts.get("resumed", 0) == SOAK_JOBS, f"{counts}\n{detail}"
    assert counts.get("failed", 0) == 0, f"{counts}\n{detail}"
