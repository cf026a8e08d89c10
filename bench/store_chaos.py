"""Store faults under a real worker: 500 jobs, backends killed every ~0.5 s, one server restart (issue 8, G8).

The last proof of issue 8, item 1: "one run of 500 jobs through a real `celery worker`, with >= 10 backend
kills and 1 restart, that prints `lost=0 duplicated=0`".

What it does:

- starts a throwaway PostgreSQL cluster (tests/pg_cluster.py: initdb/pg_ctl as the `postgres` user, a free
  port, never the shared server on 5432), creates a database, migrates it (framework and jobs branches) and
  creates an effects table;
- writes a small Celery app module to a temporary folder: one `IdempotentTask` with two checkpointed steps
  and one effect row per key written in `self.effects()`, lease 3 s, Redis broker (a unique queue), the
  delivery defaults, a 30 s visibility timeout;
- starts `celery -A chaos_app worker --pool prefork --concurrency 2` as a subprocess (its own session,
  logging to a file) and sends the jobs;
- meanwhile a thread terminates every client backend of the database every ~0.5 s and, once about half of
  the jobs have completed, restarts the cluster once (`pg_ctl`-style fast stop, then start);
- waits (bounded) until every key has a COMPLETED run, then counts from the database:
  lost = keys without a COMPLETED run or without an effect row; duplicated = keys with more than one effect
  row; wrong = COMPLETED runs whose stored result is not the job's value.

Prints `lost=N duplicated=M` and the chaos figures; exits 1 if anything was lost or duplicated (or the run
did not get its >= 10 kill rounds and 1 restart). The worker (by its PID, then its session), the cluster and
the Redis queue keys are always cleaned up.

    python bench/store_chaos.py [--jobs 500] [--broker-url redis://127.0.0.1:6379/12] [--deadline 600]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import suppress
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.pg_cluster (the throwaway cluster helper)

from sqlalchemy import create_engine, text  # noqa: E402
from sqlalchemy.exc import DBAPIError  # noqa: E402
from sqlalchemy.pool import NullPool  # noqa: E402

from bench.chaos_parts import (  # noqa: E402
    APP_MODULE,
    Chaos,
    delete_queue_keys,
    expected,
    key_of,
    queue_length,
    retrying,
    start_worker,
    stop_worker,
)
from oncelery import Runs  # noqa: E402
from oncelery.models.migrate import JOBS, upgrade  # noqa: E402
from oncelery.store.database import dispose_engines, get_engine  # noqa: E402
from tests.pg_cluster import PgCluster, postgres_bindir, postgres_runnable  # noqa: E402

T = TypeVar("T")
TASK_NAME = "oncelery.chaos_job"
MIN_KILL_ROUNDS = 10

# The worker's app, written to a temporary folder on PYTHONPATH. Everything it needs comes from env vars set
# by this script, so the same module serves the worker and this script's producer.
APP_SOURCE = '''
"""The app of bench/store_chaos.py (written by it to a temporary folder)."""

import os
import time

from celery import Celery
from sqlalchemy import Column, Integer, MetaData, String, Table, insert

from oncelery import CELERY_DELIVERY_DEFAULTS, IdempotentTask

app = Celery("oncelery_store_chaos")
app.conf.update(
    **CELERY_DELIVERY_DEFAULTS,
    broker_url=os.environ["CHAOS_BROKER_URL"],
    result_backend=None,
    task_ignore_result=True,
    oncelery_database_url=os.environ["CHAOS_DATABASE_URL"],
    task_default_queue=os.environ["CHAOS_QUEUE"],
    broker_transport_options={"visibility_timeout": 30},
    broker_connection_retry_on_startup=True,
    worker_send_task_events=False,
)

metadata = MetaData()
effects = Table(
    "chaos_effects",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("key", String(255), nullable=False),
    Column("pid", Integer, nullable=False),
)
STEP_SECONDS = float(os.environ.get("CHAOS_STEP_SECONDS", "0.01"))

if os.environ.get("CHAOS_LOG_DB_ERRORS"):
    # Diagnostics (--log-db-errors): name the statement each driver error hit, and whether SQLAlchemy
    # took it for a disconnect.
    import logging

    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    @event.listens_for(Engine, "handle_error")
    def _log_db_error(context):
        stmt = " ".join(str(context.statement or "<connect>").split())[:90]
        logging.getLogger("chaos").warning(
            "db error (disconnect=%s) on: %s", context.is_disconnect, stmt
        )


def first(n):
    time.sleep(STEP_SECONDS)
    return 2 * n


def second(value):
    return value + 1


@app.task(base=IdempotentTask, bind=True, name="oncelery.chaos_job", idempotency_key="chaos:{n}", lease=3.0)
def chaos_job(self, n):
    a = self.step("first", first, n)
    b = self.step("second", second, a)
    with self.effects() as session:
        session.execute(insert(effects).values(key="chaos:%d" % n, pid=os.getpid()))
    return {"n": n, "first": a, "second": b}
'''


def main() -> int:
    """Run the chaos, count lost and duplicated effects, print them; 1 if any (or too little chaos)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--broker-url", default="redis://127.0.0.1:6379/12")
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds for every key to complete")
    parser.add_argument("--send-interval", type=float, default=0.03, help="seconds between two sends")
    parser.add_argument("--step-seconds", type=float, default=0.01, help="sleep in the first step")
    parser.add_argument("--keep-log", default="", help="copy the worker's log to this path")
    parser.add_argument("--log-db-errors", action="store_true", help="the worker logs each failing statement")
    opts = parser.parse_args()

    bindir = postgres_bindir()
    if bindir is None or not postgres_runnable():
        print("needs the PostgreSQL server binaries (initdb, pg_ctl) and a `postgres` user", file=sys.stderr)
        return 2

    # `timeout` or a Ctrl-C must still reach the cleanup below.
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)

    queue = f"oncelery-chaos-{uuid.uuid4().hex[:12]}"
    workdir = Path(tempfile.mkdtemp(prefix="oncelery-chaos-"))
    logfile = workdir / "worker.log"
    cluster = PgCluster(bindir)
    worker: subprocess.Popen[bytes] | None = None
    chaos: Chaos | None = None
    observer = None
    code = 1
    try:
        cluster.start()
        dbname, url = cluster.create_database("chaos")
        (workdir / f"{APP_MODULE}.py").write_text(APP_SOURCE)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ONCELERY_", "CELERY_"))}
        env.update(
            CHAOS_BROKER_URL=opts.broker_url,
            CHAOS_DATABASE_URL=url,
            CHAOS_QUEUE=queue,
            CHAOS_STEP_SECONDS=str(opts.step_seconds),
            CHAOS_LOG_DB_ERRORS="1" if opts.log_db_errors else "",
            PYTHONPATH=os.pathsep.join([str(workdir), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        )
        os.environ.update({k: env[k] for k in ("CHAOS_BROKER_URL", "CHAOS_DATABASE_URL", "CHAOS_QUEUE")})
        sys.path.insert(0, str(workdir))
        import chaos_app  # type: ignore[import-not-found]

        engine = get_engine(url)
        upgrade(engine)
        upgrade(engine, branch=JOBS)
        chaos_app.metadata.create_all(engine)
        dispose_engines()  # this script keeps no pooled connection through the chaos
        observer = create_engine(url, poolclass=NullPool)

        def completed() -> int:
            with observer.connect() as conn:
                return int(
                    conn.execute(
                        text("SELECT count(*) FROM task_runs WHERE task_name = :t AND status = 'COMPLETED'"),
                        {"t": TASK_NAME},
                    ).scalar_one()
                )

        t0 = time.monotonic()
        worker = start_worker(env, workdir, logfile)
        print(f"worker pid {worker.pid}, queue {queue}, database {url}, log {logfile}", flush=True)

        chaos = Chaos(cluster, dbname)
        chaos.start()  # jobs queue up while the worker boots; the first kills land as it connects
        for i in range(opts.jobs):
            chaos_app.chaos_job.delay(i)
            if i % 20 == 19 and not chaos.restart_now.is_set():
                with suppress(DBAPIError):  # restart once about half of the jobs have completed
                    if completed() >= opts.jobs // 2:
                        chaos.restart_now.set()
                        print(f"restarting the cluster ({i + 1} jobs sent)", flush=True)
            if opts.send_interval:
                time.sleep(opts.send_interval)
        sent_at = time.monotonic()
        print(f"sent {opts.jobs} jobs in {sent_at - t0:.1f}s", flush=True)

        done = 0
        deadline = t0 + opts.deadline
        last_report = 0.0
        while time.monotonic() < deadline:
            with suppress(DBAPIError):
                done = completed()
            if done >= opts.jobs // 2 and not chaos.restart_now.is_set():
                chaos.restart_now.set()
                print(f"restarting the cluster ({done} jobs completed)", flush=True)
            if done >= opts.jobs and chaos.restarts:
                break
            if worker.poll() is not None:
                print(f"the worker exited ({worker.returncode})", flush=True)
                break
            if time.monotonic() - last_report > 10:
                last_report = time.monotonic()
                print(
                    f"  {last_report - t0:5.0f}s completed={done} kill_rounds={chaos.rounds} restarts={chaos.restarts}",
                    flush=True,
                )
            time.sleep(0.25)
        settled = time.monotonic() - t0
        chaos.stop()

        # Let re-sent copies still in flight be answered (they must not add effects), bounded.
        quiet_deadline = time.monotonic() + 60
        previous: dict[str, int] | None = None
        while time.monotonic() < quiet_deadline and worker.poll() is None:
            now = retrying(lambda: Runs(url).outcome_counts(TASK_NAME), "reading outcomes")
            if now == previous and queue_length(opts.broker_url, queue) == 0:
                break
            previous = now
            time.sleep(3)

        with observer.connect() as conn:
            runs = {
                key: (status, result, (error or "")[:300], attempts)
                for key, status, result, error, attempts in conn.execute(
                    text("SELECT idempotency_key, status, result, error, attempts FROM task_runs WHERE task_name = :t"),
                    {"t": TASK_NAME},
                )
            }
            effects: dict[str, int] = {
                str(k): int(c)
                for k, c in conn.execute(text("SELECT key, count(*) FROM chaos_effects GROUP BY key")).all()
            }
        counts = retrying(lambda: Runs(url).outcome_counts(TASK_NAME), "reading outcomes")
        wall = time.monotonic() - t0

        keys = [key_of(i) for i in range(opts.jobs)]
        lost = [k for k in keys if runs.get(k, ("",))[0] != "COMPLETED" or effects.get(k, 0) == 0]
        duplicated = [k for k in keys if effects.get(k, 0) > 1]
        wrong = []
        for i, k in enumerate(keys):
            run = runs.get(k)
            if run and run[0] == "COMPLETED":
                result = run[1] if not isinstance(run[1], str) else json.loads(run[1])
                if result != expected(i):
                    wrong.append(k)

        print(f"lost={len(lost)} duplicated={len(duplicated)}")
        print(
            f"jobs={opts.jobs} wrong_results={len(wrong)} kill_rounds={chaos.rounds} "
            f"backends_killed={chaos.backends_killed} empty_rounds={chaos.empty_rounds} "
            f"restarts={chaos.restarts} restart_took={chaos.restart_seconds:.1f}s chaos_errors={len(chaos.errors)}"
        )
        log_text = logfile.read_text(errors="replace")
        faults_seen = len(re.findall(r"claims database failed", log_text))
        errors_logged = len(re.findall(r"\bERROR/", log_text))
        print(f"outcomes={dict(sorted(counts.items()))}")
        print(f"worker_log: store_faults_reported={faults_seen} error_lines={errors_logged}")
        print(f"all_completed_after={settled:.1f}s wall={wall:.1f}s sent_in={sent_at - t0:.1f}s")
        if chaos.errors:
            print(f"chaos thread errors: {[repr(e)[:200] for e in chaos.errors[:5]]}")

        ok = not lost and not duplicated and not wrong
        if not ok:
            log = log_text.splitlines()
            for k in (lost + duplicated + wrong)[:10]:
                pattern = re.compile(re.escape(k) + r"\b")
                print(f"--- {k}: run={runs.get(k, ('no run',))[0::2]} effects={effects.get(k, 0)}")
                for line in [line for line in log if pattern.search(line)][:20]:
                    print(f"    {line[:400]}")
        if chaos.rounds < MIN_KILL_ROUNDS or chaos.restarts != 1:
            print(f"not enough chaos: {chaos.rounds} kill rounds (need {MIN_KILL_ROUNDS}), {chaos.restarts} restarts")
            ok = False
        code = 0 if ok else 1
    finally:
        if chaos is not None and chaos.is_alive():
            chaos.stop()
        if worker is not None:
            rc = stop_worker(worker)
            print(f"worker stopped (exit {rc})", flush=True)
        if observer is not None:
            observer.dispose()
        dispose_engines()
        with suppress(Exception):
            delete_queue_keys(opts.broker_url, queue)
        if opts.keep_log and logfile.exists():
            with suppress(OSError):
                Path(opts.keep_log).write_bytes(logfile.read_bytes())
        cluster.remove()
        if code == 0:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"worker log kept: {logfile}")
    return code


if __name__ == "__main__":
    sys.exit(main())
