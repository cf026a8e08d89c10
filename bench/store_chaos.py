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
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import suppress
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.pg_cluster (the throwaway cluster helper)

from sqlalchemy import create_engine, text  # noqa: E402
from sqlalchemy.engine import Engine  # noqa: E402
from sqlalchemy.exc import DBAPIError  # noqa: E402
from sqlalchemy.pool import NullPool  # noqa: E402

from bench.support.chaos_parts import (  # noqa: E402
    APP_MODULE,
    Chaos,
    ChaosRun,
    cleanup,
    expected,
    key_of,
    queue_length,
    retrying,
    start_worker,
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


def parse_args() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--broker-url", default="redis://127.0.0.1:6379/12")
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds for every key to complete")
    parser.add_argument("--send-interval", type=float, default=0.03, help="seconds between two sends")
    parser.add_argument("--step-seconds", type=float, default=0.01, help="sleep in the first step")
    parser.add_argument("--keep-log", default="", help="copy the worker's log to this path")
    parser.add_argument("--log-db-errors", action="store_true", help="the worker logs each failing statement")
    return parser.parse_args()


def interrupt(signum: int, frame: object) -> None:
    """The SIGTERM handler: `timeout` or a Ctrl-C must still reach the cleanup in `main`."""
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    """Run the chaos, count lost and duplicated effects, print them; 1 if any (or too little chaos)."""
    opts = parse_args()
    bindir = postgres_bindir()
    if bindir is None or not postgres_runnable():
        print("needs the PostgreSQL server binaries (initdb, pg_ctl) and a `postgres` user", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, interrupt)
    queue = f"oncelery-chaos-{uuid.uuid4().hex[:12]}"
    workdir = Path(tempfile.mkdtemp(prefix="oncelery-chaos-"))
    run = ChaosRun(opts, queue, workdir, PgCluster(bindir))
    code = 1
    try:
        code = run_chaos(run)
    finally:
        cleanup(run, code)
    return code


def run_chaos(run: ChaosRun) -> int:
    """Set up, send the jobs under chaos, wait for them, count and print; 0 if nothing went wrong."""
    opts = run.opts
    env, chaos_app = set_up(run)
    observer = run.observer = create_engine(run.url, poolclass=NullPool)
    t0 = time.monotonic()
    worker = run.worker = start_worker(env, run.workdir, run.logfile)
    print(f"worker pid {worker.pid}, queue {run.queue}, database {run.url}, log {run.logfile}", flush=True)

    chaos = run.chaos = Chaos(run.cluster, run.dbname)
    chaos.start()  # jobs queue up while the worker boots; the first kills land as it connects
    send_jobs(opts, chaos_app, chaos, observer)
    sent_in = time.monotonic() - t0
    print(f"sent {opts.jobs} jobs in {sent_in:.1f}s", flush=True)

    wait_until_completed(opts.jobs, t0 + opts.deadline, chaos, worker, observer, t0)
    settled = time.monotonic() - t0
    chaos.stop()
    wait_until_quiet(run, worker)

    runs, effects = read_runs_and_effects(observer)
    counts = retrying(lambda: Runs(run.url).outcome_counts(TASK_NAME), "reading outcomes")
    wall = time.monotonic() - t0
    keys = [key_of(i) for i in range(opts.jobs)]
    lost, duplicated, wrong = judge(keys, runs, effects)
    log_text = print_figures(run, chaos, (lost, duplicated, wrong), counts, (settled, wall, sent_in))
    ok = not lost and not duplicated and not wrong
    if not ok:
        explain(lost + duplicated + wrong, runs, effects, log_text)
    if chaos.rounds < MIN_KILL_ROUNDS or chaos.restarts != 1:
        print(f"not enough chaos: {chaos.rounds} kill rounds (need {MIN_KILL_ROUNDS}), {chaos.restarts} restarts")
        ok = False
    return 0 if ok else 1


def set_up(run: ChaosRun) -> tuple[dict[str, str], Any]:
    """Start the cluster, write and import the app, migrate; return the worker's env and the app module."""
    opts = run.opts
    run.cluster.start()
    run.dbname, run.url = run.cluster.create_database("chaos")
    (run.workdir / f"{APP_MODULE}.py").write_text(APP_SOURCE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ONCELERY_", "CELERY_"))}
    env.update(
        CHAOS_BROKER_URL=opts.broker_url,
        CHAOS_DATABASE_URL=run.url,
        CHAOS_QUEUE=run.queue,
        CHAOS_STEP_SECONDS=str(opts.step_seconds),
        CHAOS_LOG_DB_ERRORS="1" if opts.log_db_errors else "",
        PYTHONPATH=os.pathsep.join([str(run.workdir), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    os.environ.update({k: env[k] for k in ("CHAOS_BROKER_URL", "CHAOS_DATABASE_URL", "CHAOS_QUEUE")})
    sys.path.insert(0, str(run.workdir))
    import chaos_app  # type: ignore[import-not-found]

    engine = get_engine(run.url)
    upgrade(engine)
    upgrade(engine, branch=JOBS)
    chaos_app.metadata.create_all(engine)
    dispose_engines()  # this script keeps no pooled connection through the chaos
    return env, chaos_app


def completed(observer: Engine) -> int:
    """How many runs of the chaos task are COMPLETED."""
    with observer.connect() as conn:
        return int(
            conn.execute(
                text("SELECT count(*) FROM task_runs WHERE task_name = :t AND status = 'COMPLETED'"),
                {"t": TASK_NAME},
            ).scalar_one()
        )


def send_jobs(opts: argparse.Namespace, chaos_app: Any, chaos: Chaos, observer: Engine) -> None:
    """Send the jobs, one every --send-interval; ask for the restart once about half of them have completed."""
    for i in range(opts.jobs):
        chaos_app.chaos_job.delay(i)
        if i % 20 == 19 and not chaos.restart_now.is_set():
            with suppress(DBAPIError):  # restart once about half of the jobs have completed
                if completed(observer) >= opts.jobs // 2:
                    chaos.restart_now.set()
                    print(f"restarting the cluster ({i + 1} jobs sent)", flush=True)
        if opts.send_interval:
            time.sleep(opts.send_interval)


def wait_until_completed(
    jobs: int, deadline: float, chaos: Chaos, worker: subprocess.Popen[bytes], observer: Engine, t0: float
) -> None:
    """Wait (until `deadline`) for every job to complete after the restart; progress every 10 s."""
    done = 0
    last_report = 0.0
    while time.monotonic() < deadline:
        with suppress(DBAPIError):
            done = completed(observer)
        if done >= jobs // 2 and not chaos.restart_now.is_set():
            chaos.restart_now.set()
            print(f"restarting the cluster ({done} jobs completed)", flush=True)
        if done >= jobs and chaos.restarts:
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


def wait_until_quiet(run: ChaosRun, worker: subprocess.Popen[bytes]) -> None:
    """Let re-sent copies still in flight be answered (they must not add effects), bounded."""
    quiet_deadline = time.monotonic() + 60
    previous: dict[str, int] | None = None
    while time.monotonic() < quiet_deadline and worker.poll() is None:
        now = retrying(lambda: Runs(run.url).outcome_counts(TASK_NAME), "reading outcomes")
        if now == previous and queue_length(run.opts.broker_url, run.queue) == 0:
            break
        previous = now
        time.sleep(3)


def read_runs_and_effects(observer: Engine) -> tuple[dict[str, tuple[Any, ...]], dict[str, int]]:
    """Each key's (status, result, error head, attempts), and each key's number of effect rows."""
    with observer.connect() as conn:
        runs = {
            key: (status, result, (error or "")[:300], attempts)
            for key, status, result, error, attempts in conn.execute(
                text("SELECT idempotency_key, status, result, error, attempts FROM task_runs WHERE task_name = :t"),
                {"t": TASK_NAME},
            )
        }
        effects: dict[str, int] = {
            str(k): int(c) for k, c in conn.execute(text("SELECT key, count(*) FROM chaos_effects GROUP BY key")).all()
        }
    return runs, effects


def judge(
    keys: list[str], runs: dict[str, tuple[Any, ...]], effects: dict[str, int]
) -> tuple[list[str], list[str], list[str]]:
    """The lost, duplicated and wrong keys (see the module docstring)."""
    lost = [k for k in keys if runs.get(k, ("",))[0] != "COMPLETED" or effects.get(k, 0) == 0]
    duplicated = [k for k in keys if effects.get(k, 0) > 1]
    wrong = []
    for i, k in enumerate(keys):
        run = runs.get(k)
        if run and run[0] == "COMPLETED":
            result = run[1] if not isinstance(run[1], str) else json.loads(run[1])
            if result != expected(i):
                wrong.append(k)
    return lost, duplicated, wrong


def print_figures(
    run: ChaosRun,
    chaos: Chaos,
    verdict: tuple[list[str], list[str], list[str]],
    counts: dict[str, int],
    times: tuple[float, float, float],
) -> str:
    """Print the counts, the chaos and the timings (settled, wall, sent in); return the worker's log."""
    lost, duplicated, wrong = verdict
    settled, wall, sent_in = times
    print(f"lost={len(lost)} duplicated={len(duplicated)}")
    print(
        f"jobs={run.opts.jobs} wrong_results={len(wrong)} kill_rounds={chaos.rounds} "
        f"backends_killed={chaos.backends_killed} empty_rounds={chaos.empty_rounds} "
        f"restarts={chaos.restarts} restart_took={chaos.restart_seconds:.1f}s chaos_errors={len(chaos.errors)}"
    )
    log_text = run.logfile.read_text(errors="replace")
    faults_seen = len(re.findall(r"claims database failed", log_text))
    errors_logged = len(re.findall(r"\bERROR/", log_text))
    print(f"outcomes={dict(sorted(counts.items()))}")
    print(f"worker_log: store_faults_reported={faults_seen} error_lines={errors_logged}")
    print(f"all_completed_after={settled:.1f}s wall={wall:.1f}s sent_in={sent_in:.1f}s")
    if chaos.errors:
        print(f"chaos thread errors: {[repr(e)[:200] for e in chaos.errors[:5]]}")
    return log_text


def explain(bad: list[str], runs: dict[str, tuple[Any, ...]], effects: dict[str, int], log_text: str) -> None:
    """For the first ten bad keys: the run's status and error, the effect rows, the worker's log lines."""
    log = log_text.splitlines()
    for k in bad[:10]:
        pattern = re.compile(re.escape(k) + r"\b")
        print(f"--- {k}: run={runs.get(k, ('no run',))[0::2]} effects={effects.get(k, 0)}")
        for line in [line for line in log if pattern.search(line)][:20]:
            print(f"    {line[:400]}")


if __name__ == "__main__":
    sys.exit(main())
