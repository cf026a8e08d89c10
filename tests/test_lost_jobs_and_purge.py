"""Lost jobs on the embedded default, found again by the relay's sweeper; retention purge in bounded batches.

1. A real prefork `celery worker` (tests/apps/embedded_app.py) on the filesystem:// broker and a SQLite
   claims file, SIGKILLed with two jobs in flight: those messages are gone from the spool, and only the
   runs' stored messages, re-sent by `Relay.run_once()`, bring them back. Each body commits once.
2. `purge()` over 10,000 runs on PostgreSQL, in batches of 500, while a worker serves jobs on the same
   database; the CLI; a purged key executes again.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import insert, select, text
from sqlalchemy.engine import Engine

from oncelery import (
    CELERY_DELIVERY_DEFAULTS,
    ConfigurationError,
    Database,
    IdempotentTask,
    PurgeReport,
    Relay,
    RelayRound,
    Runs,
    RunStatus,
    parse_age,
    purge,
)
from oncelery.relay.retention import MAX_BATCH_SECONDS
from oncelery.runs.claims import RunStore
from oncelery.runs.faults import fault_injected
from oncelery.runs.keys import Identity
from oncelery.store.database import get_engine
from oncelery.store.dialects import dialect_of
from oncelery.tasks.commands.local_worker import LocalWorker
from tests.conftest import close_app, migrated
from tests.services import (
    ONCELERY,
    alive,
    clean_env,
    count_rows,
    effects_table,
    executions_table,
    stop_sessions,
    unique_queue,
    wait_for,
)

REPO = Path(__file__).resolve().parent.parent
DAY = 86400.0
WEEK = 7 * DAY

# -- unit: ages ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("age", "seconds"),
    [("7d", 604800), ("24h", 86400), ("90m", 5400), ("30s", 30), ("2w", 1209600), ("15", 15), ("1.5h", 5400)],
)
def test_parse_age(age: str, seconds: float) -> None:
    assert parse_age(age) == seconds


@pytest.mark.parametrize("age", ["", "d", "7 days", "-1d", "7y", "abc", "7dd", "1e3"])
def test_parse_age_refuses_what_is_not_an_age(age: str) -> None:
    with pytest.raises(ConfigurationError, match="give a number with a unit"):
        parse_age(age)


# -- 1. lost jobs on the embedded default ------------------------------------------------------------------

LOST_TASK = "oncelery.embedded_wait"
JOBS = 10
IN_FLIGHT = 2  # prefork concurrency 2, prefetch multiplier 1: the jobs a worker holds
LEASE = 2.0
STARTUP_TIMEOUT = 60.0
SETTLE_TIMEOUT = 120.0


def embedded_sender(data_dir: Path, queue: str) -> Celery:
    """An app that publishes to the embedded broker under `data_dir`, laid out as oncelery.celeryconfig does."""
    spool = data_dir / "broker"
    (spool / "queue").mkdir(parents=True, exist_ok=True)
    app = Celery(f"lost-jobs-sender-{os.getpid()}")
    app.conf.update(
        **CELERY_DELIVERY_DEFAULTS,
        broker_url="filesystem://",
        broker_transport_options={
            "data_folder_in": str(spool / "queue"),
            "data_folder_out": str(spool / "queue"),
            "store_processed": False,
            "control_folder": str(spool / "control"),
        },
        task_default_queue=queue,
    )
    return app


def spooled(data_dir: Path, queue: str) -> int:
    """How many messages of `queue` wait in the embedded broker's spool."""
    return len(list((data_dir / "broker" / "queue").glob(f"*.{queue}.msg")))


def runs_by_status(engine: Engine, task_name: str) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT status, COUNT(*) FROM task_runs WHERE task_name = :t GROUP BY status"), {"t": task_name}
        ).all()
    return {str(status): int(n) for status, n in rows}


def execution_pids(engine: Engine, key: str) -> list[int]:
    with engine.connect() as conn:
        rows = conn.execute(
            select(executions_table.c.pid).where(executions_table.c.key == key).order_by(executions_table.c.id)
        )
        return [int(pid) for (pid,) in rows]


def test_lost_in_flight_jobs_are_swept_back_and_commit_once(tmp_path: Path) -> None:
    data_dir = tmp_path / ".oncelery"
    url = f"sqlite:///{tmp_path / 'claims.db'}"
    engine = migrated(url)
    queue = unique_queue()
    release = tmp_path / "release"
    env = clean_env(
        PYTHONPATH=str(REPO),
        ONCELERY_DATA_DIR=str(data_dir),
        ONCELERY_DATABASE_URL=url,
        ONCELERY_EMBEDDED_QUEUE=queue,
        ONCELERY_EMBEDDED_LEASE=str(LEASE),
        ONCELERY_EMBEDDED_RELEASE=str(release),
    )
    first = LocalWorker("tests.apps.embedded_app", tmp_path / "worker-a.log", 2, env, "INFO", [queue])
    second = LocalWorker("tests.apps.embedded_app", tmp_path / "worker-b.log", 2, env, "INFO", [queue])
    sender = embedded_sender(data_dir, queue)
    keys = [f"job-{i}-{uuid.uuid4().hex[:6]}" for i in range(JOBS)]
    rounds: list[RelayRound] = []
    try:
        first.start()
        for key in keys:  # the producer sends each job once, and never again
            sender.send_task(LOST_TASK, args=[key])

        def two_running() -> bool:
            if first.exited() is not None:
                pytest.fail(f"worker a exited with {first.exited()}:\n{first.log_tail(40)}")
            return runs_by_status(engine, LOST_TASK) == {"RUNNING": IN_FLIGHT} and (
                count_rows(engine, executions_table) == IN_FLIGHT
            )

        wait_for(two_running, timeout=STARTUP_TIMEOUT, what="worker a to run its two in-flight jobs")
        holders = {pid for key in keys for pid in execution_pids(engine, key)}
        pool = set(first.pool_pids())
        assert len(holders) == IN_FLIGHT and holders <= pool, (holders, pool)
        lost = [key for key in keys if execution_pids(engine, key)]

        # Host loss: the worker and its pool die at once, with two unacked messages it had taken off the spool.
        victims = first.kill()
        assert first.pid in victims and holders <= set(victims)
        wait_for(lambda: not any(alive(pid) for pid in victims), timeout=30, what="the killed processes to be gone")
        assert spooled(data_dir, queue) == JOBS - IN_FLIGHT  # the in-flight messages are gone with the worker
        assert runs_by_status(engine, LOST_TASK) == {"RUNNING": IN_FLIGHT}

        release.touch()
        second.start()
        relay = Relay(sender, url, sweep_interval=1.0)

        def all_completed() -> bool:
            if second.exited() is not None:
                pytest.fail(f"worker b exited with {second.exited()}:\n{second.log_tail(40)}")
            rounds.append(relay.run_once())
            return runs_by_status(engine, LOST_TASK) == {"COMPLETED": JOBS}

        wait_for(all_completed, timeout=SETTLE_TIMEOUT, interval=0.2, what="all ten runs to complete")
        # The relay has stopped: every message now in the system is one of the eight the killed worker never
        # took or one the sweeper re-sent (a run re-sent twice while worker b booted has a copy left). Each is
        # answered exactly once (in_progress answers re-send themselves and are not counted).
        swept = sum(r.swept for r in rounds)

        def answered() -> int:
            counts = Runs(url).outcome_counts(LOST_TASK)
            return sum(n for outcome, n in counts.items() if outcome != "in_progress")

        wait_for(
            lambda: answered() == JOBS - IN_FLIGHT + swept and spooled(data_dir, queue) == 0,
            timeout=SETTLE_TIMEOUT,
            what=f"every message to be answered ({JOBS - IN_FLIGHT} sent once, {swept} re-sent by the sweeper)",
        )
    finally:
        codes = stop_sessions([w.proc for w in (first, second) if w.proc is not None], grace=30)
        for w in (first, second):
            print(f"===== {w.log_path.name} pid={w.pid} =====\n{w.log_tail(200)}")
        close_app(sender)

    assert codes[1] == 0, f"worker b did not stop cleanly: {codes}"
    runs = Runs(url)
    for key in keys:
        assert count_rows(engine, effects_table, key) == 1, key  # each body committed its effect exactly once
        run = runs.get(LOST_TASK, f"lost:{key}")
        assert run is not None and run.status is RunStatus.COMPLETED, key
        pids = execution_pids(engine, key)
        if key in lost:
            # Claimed by the killed worker, then re-sent by the sweeper and taken over by the new one.
            assert len(pids) == 2 and pids[0] in victims and pids[1] not in victims, (key, pids)
            assert run.token == 2 and run.attempts == 2 and run.lost == 1, (key, run)
        else:
            assert len(pids) == 1 and pids[0] not in victims, (key, pids)
            assert run.token == 1 and run.attempts == 1 and run.lost == 0, (key, run)
        assert run.result == {"key": key, "pid": pids[-1]}
        assert run.message is None  # the stored message is dropped once the run completes
    assert swept >= len(lost), rounds
    print(f"relay rounds: {len(rounds)}, runs re-sent by the sweeper: {swept}")
    assert sum(r.published + r.republished for r in rounds) == 0  # nothing came from an outbox
    counts = runs.outcome_counts(LOST_TASK)
    assert counts.get("executed") == JOBS and set(counts) <= {"executed", "replayed", "in_progress"}, counts
    assert counts.get("replayed", 0) == swept - len(lost), counts  # extra re-sends answered from the result
    assert spooled(data_dir, queue) == 0
    engine.dispose()
    get_engine(url, "read").dispose()


# -- 2. purge --------------------------------------------------------------------------------------------------

BULK_TASK = "oncelery.t_purge_bulk"
LIVE_TASK = "oncelery.t_purge_live"
LIVE_JOBS = 50
# 500 a batch over the 7,001 runs purged: at least 14 batches, as 5,000 over 70,001 were (the jobs are served by
# the 7th); the batching is the same code whatever the table's size.
PURGE_BATCH = 500
# (key prefix, how many, status, age in days, finished, retry pending): 10,000 runs in all.
BULK = [
    ("c-old", 6_000, "COMPLETED", 10, True, False),
    ("c-new", 1_990, "COMPLETED", 1, True, False),
    ("f-old", 1_000, "FAILED", 10, False, False),
    ("f-retry", 10, "FAILED", 10, False, True),  # Celery will retry it (not_before set): kept
    ("d-old", 500, "DEAD", 10, True, False),
    ("r-old", 500, "RUNNING", 10, False, False),
]
PURGED = {"c-old", "f-old"}
STEPS_PER_RUN = 2
STEPPED = {"c-old": 1_000, "c-new": 100, "d-old": 100}  # runs with steps (the first N of each kind)


def bulk_insert_runs(engine: Engine) -> None:
    """10,000 task_runs rows, their steps, dead letters and outbox rows, with INSERT ... SELECT."""
    first = 1
    with engine.begin() as conn:
        for prefix, n, status, days, finished, retry in BULK:
            conn.execute(
                text(
                    """
                    INSERT INTO task_runs (task_name, tenant, idempotency_key, fingerprint, field_digests, status,
                        fencing_token, owner, lease_expires_at, attempts, retries, lost, not_before, result, error,
                        created_at, updated_at, finished_at)
                    SELECT :task, '', :prefix || ':' || g, md5(g::text), '{}'::json, s.status,
                        1, 'bulk', CASE WHEN s.status = 'RUNNING' THEN ts END, 1, 0, 0,
                        CASE WHEN :retry THEN clock_timestamp() + interval '1 day' END,
                        CASE WHEN s.status = 'COMPLETED' THEN to_json(g) END,
                        CASE WHEN s.status IN ('FAILED', 'DEAD') THEN 'boom' END,
                        ts, ts, CASE WHEN :finished THEN ts END
                    FROM (SELECT CAST(:status AS varchar) AS status) AS s,
                        generate_series(CAST(:lo AS bigint), CAST(:hi AS bigint)) AS g,
                        LATERAL (SELECT clock_timestamp() - make_interval(days => :days) AS ts) AS t
                    """
                ),
                {
                    "task": BULK_TASK,
                    "prefix": prefix,
                    "status": status,
                    "retry": retry,
                    "finished": finished,
                    "days": days,
                    "lo": first,
                    "hi": first + n - 1,
                },
            )
            first += n
        for prefix, n in STEPPED.items():
            conn.execute(
                text(
                    """
                    INSERT INTO step_results (run_id, position, step_name, result, token, created_at)
                    SELECT r.id, p, 'step' || p, to_json(p), 1, r.updated_at
                    FROM (SELECT id, updated_at FROM task_runs WHERE task_name = :task AND idempotency_key LIKE :like
                          ORDER BY id LIMIT :n) AS r,
                        generate_series(0, :last) AS p
                    """
                ),
                {"task": BULK_TASK, "like": f"{prefix}:%", "n": n, "last": STEPS_PER_RUN - 1},
            )
        # Dead letters: on DEAD runs (kept with them), on FAILED runs replayed earlier (purged with them), and
        # run-less ones (a bad message), purged by their own age: 5 ten days old, 2 written an hour ago.
        for prefix, n in (("d-old", 20), ("f-old", 10)):
            conn.execute(
                text(
                    """
                    INSERT INTO dead_letters (run_id, task_name, tenant, idempotency_key, reason, error, attempts,
                        first_failed_at, last_failed_at, replayed_at, replays)
                    SELECT id, task_name, '', idempotency_key, 'retries_exhausted', 'boom', 1, updated_at,
                        updated_at, CASE WHEN status = 'FAILED' THEN updated_at END,
                        CASE WHEN status = 'FAILED' THEN 1 ELSE 0 END
                    FROM task_runs WHERE task_name = :task AND idempotency_key LIKE :like ORDER BY id LIMIT :n
                    """
                ),
                {"task": BULK_TASK, "like": f"{prefix}:%", "n": n},
            )
        conn.execute(
            text(
                """
                INSERT INTO dead_letters (run_id, task_name, tenant, idempotency_key, reason, error, attempts,
                    first_failed_at, last_failed_at)
                SELECT NULL, :task, '', NULL, 'bad_message', 'no identity', 1, ts, ts
                FROM generate_series(1, 7) AS g,
                     LATERAL (SELECT clock_timestamp() - CASE WHEN g <= 5 THEN interval '10 days'
                                                              ELSE interval '1 hour' END AS ts) AS t
                """
            ),
            {"task": BULK_TASK},
        )
        # Outbox rows: DONE/DEAD ones older than the cutoff are purged; SENT ones and recent ones are kept.
        for status, n, days in (("DONE", 30, 10), ("DEAD", 10, 10), ("SENT", 10, 10), ("DONE", 10, 1)):
            conn.execute(
                text(
                    """
                    INSERT INTO outbox (task_name, args, kwargs, options, celery_task_id, idempotency_key, tenant,
                        status, attempts, publishes, next_attempt_at, created_at, sent_at)
                    SELECT :task, '[]'::json, '{}'::json, '{}'::json, gen_random_uuid()::text, 'ob:' || g, '',
                        :status, 1, 1, ts, ts, ts
                    FROM generate_series(1, :n) AS g,
                        LATERAL (SELECT clock_timestamp() - make_interval(days => :days) AS ts) AS t
                    """
                ),
                {"task": BULK_TASK, "status": status, "n": n, "days": days},
            )


def bulk_counts(engine: Engine) -> dict[str, dict[str, int]]:
    """Per key prefix of the bulk runs: runs, their steps and their dead letters."""
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                """
                SELECT split_part(r.idempotency_key, ':', 1) AS kind, COUNT(*) AS runs,
                    SUM((SELECT COUNT(*) FROM step_results s WHERE s.run_id = r.id)) AS steps,
                    SUM((SELECT COUNT(*) FROM dead_letters d WHERE d.run_id = r.id)) AS letters
                FROM task_runs r WHERE r.task_name = :task GROUP BY 1
                """
            ),
            {"task": BULK_TASK},
        ).all()
    return {kind: {"runs": int(n), "steps": int(steps), "letters": int(letters)} for kind, n, steps, letters in rows}


def db_now(engine: Engine) -> Any:
    with engine.connect() as conn:
        return conn.execute(text("SELECT clock_timestamp()")).scalar_one()


def backdate(url: str, task_name: str, key: str, days: float = 10) -> None:
    """Make a finished run look `days` old, by the database clock."""
    past = dialect_of(url).past(days * DAY)
    with get_engine(url).begin() as conn:
        n = conn.execute(
            text(
                f"UPDATE task_runs SET finished_at = {past}, updated_at = {past}, created_at = {past} "
                "WHERE task_name = :t AND idempotency_key = :k"
            ),
            {"t": task_name, "k": key},
        ).rowcount
    assert n == 1


@pytest.fixture
def pg_clean(pg_session_url: str) -> Iterator[Engine]:
    """The session's PostgreSQL database with no runs, letters, outbox rows or test rows, before and after."""
    engine = get_engine(pg_session_url)

    def truncate() -> None:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "TRUNCATE task_runs, step_results, dead_letters, delivery_outcomes, outbox, test_effects, "
                    "test_executions RESTART IDENTITY CASCADE"
                )
            )

    truncate()
    yield engine
    truncate()


def _live_task(app: Celery, bodies: list[int]) -> Any:
    lock = threading.Lock()

    @app.task(shared=False, base=IdempotentTask, bind=True, name=LIVE_TASK, idempotency_key="live:{n}")
    def live(self: IdempotentTask, n: int) -> int:
        with lock:
            bodies.append(n)
        with self.effects() as session:
            session.execute(insert(effects_table).values(key=f"live:{n}", pid=os.getpid()))
        return n

    return live


@pytest.mark.timeout(240)
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_purge_of_10k_runs_in_batches_while_a_worker_serves(
    app: Celery, worker_factory: Any, db_url: str, pg_clean: Engine, tmp_path: Path
) -> None:
    engine = pg_clean
    bulk_insert_runs(engine)
    before = bulk_counts(engine)
    assert sum(c["runs"] for c in before.values()) == 10_000
    assert before["c-old"]["steps"] == 2_000 and before["f-old"]["letters"] == 10

    bodies: list[int] = []
    live = _live_task(app, bodies)
    batches: list[int] = []
    served: list[int] = []
    jobs_failed: list[BaseException] = []
    jobs_done = threading.Event()

    def serve_jobs() -> None:
        try:
            results = [live.delay(n) for n in range(LIVE_JOBS)]
            served.extend(r.get(timeout=90) for r in results)
        except BaseException as exc:
            jobs_failed.append(exc)
        finally:
            jobs_done.set()

    jobs = threading.Thread(target=serve_jobs, name="purge-live-jobs", daemon=True)

    def on_batch(report: PurgeReport) -> None:
        batches.append(report.runs - sum(batches))
        if report.batches == 1:
            jobs.start()  # the jobs are sent once the purge has begun
        if report.batches == 7:
            # Half way: every job must have been served while the purge ran (bounded wait, then fail).
            assert jobs_done.wait(90), "the jobs did not complete during the purge"

    with worker_factory(app, concurrency=4):
        # A key that ran before, then aged past the retention: purged with the rest, it executes again.
        assert live.delay(1000).get(timeout=60) == 1000
        backdate(db_url, LIVE_TASK, "live:1000")
        started_at = db_now(engine)
        began = time.monotonic()
        report = purge(Database(db_url), WEEK, batch=PURGE_BATCH, on_batch=on_batch)
        took = time.monotonic() - began
        ended_at = db_now(engine)
        jobs.join(30)
        assert not jobs.is_alive() and jobs_failed == [], jobs_failed
        assert sorted(served) == list(range(LIVE_JOBS))

        assert live.delay(1000).get(timeout=60) == 1000  # the purged key runs its body again

    purged_runs = 6_000 + 1_000 + 1
    assert report.runs == purged_runs, report
    assert report.steps == 2_000 and report.dead_letters == 10 + 5 and report.outbox == 40, report
    assert report.ledger == 0 and report.kept_referenced == 0, report
    # At least the batches of the size asked for; more where a slow batch halved the next (MAX_BATCH_SECONDS).
    assert report.batches == len(batches) >= -(-purged_runs // PURGE_BATCH) >= 14, report
    assert all(0 < n <= PURGE_BATCH for n in batches) and sum(batches) == purged_runs, batches
    print(f"purged {report.runs} runs in {report.batches} batches in {took:.1f}s")

    after = bulk_counts(engine)
    assert set(after) == {prefix for prefix, *_ in BULK} - PURGED, after
    for prefix, *_ in BULK:
        if prefix not in PURGED:
            assert after[prefix] == before[prefix], prefix  # runs, steps and letters all kept
    with engine.connect() as conn:
        runless = conn.execute(text("SELECT COUNT(*) FROM dead_letters WHERE run_id IS NULL")).scalar_one()
        orphans = conn.execute(
            text("SELECT COUNT(*) FROM step_results s LEFT JOIN task_runs r ON r.id = s.run_id WHERE r.id IS NULL")
        ).scalar_one()
        outbox: dict[str, int] = dict(
            conn.execute(
                text(
                    "SELECT status || CASE WHEN created_at < clock_timestamp() - interval '7 days' "
                    "THEN '-old' ELSE '-new' END, COUNT(*) FROM outbox GROUP BY 1"
                )
            ).all()
        )
        live_finished = conn.execute(
            text(
                "SELECT MIN(finished_at), MAX(finished_at) FROM task_runs "
                "WHERE task_name = :t AND idempotency_key <> 'live:1000'"
            ),
            {"t": LIVE_TASK},
        ).one()
    assert runless == 2 and orphans == 0  # the recent ones stay
    assert outbox == {"SENT-old": 10, "DONE-new": 10}, outbox
    # Every live job was claimed and completed between the purge's start and its end (database clock).
    assert started_at < live_finished[0] and live_finished[1] < ended_at, (started_at, live_finished, ended_at)

    runs = Runs(db_url)
    for n in range(LIVE_JOBS):
        run = runs.get(LIVE_TASK, f"live:{n}")
        assert run is not None and run.status is RunStatus.COMPLETED and run.result == n
    assert sorted(bodies) == sorted([1000, *range(LIVE_JOBS), 1000])
    assert count_rows(engine, effects_table, "live:1000") == 2
    assert live.outcome_counts() == {"executed": LIVE_JOBS + 2}

    # The CLI finds nothing left to purge.
    cli = subprocess.run(
        [ONCELERY, "--database-url", db_url, "purge", "--older-than", "7d"],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.startswith("purged 0 runs "), cli.stdout
    assert bulk_counts(engine) == after


def test_a_purged_key_sent_again_executes_again(app: Celery, worker_factory: Any, db_url: str) -> None:
    bodies: list[int] = []
    live = _live_task(app, bodies)
    engine = get_engine(db_url)
    with worker_factory(app, concurrency=4):
        assert live.delay(1).get(timeout=60) == 1
        assert live.delay(2).get(timeout=60) == 2
        backdate(db_url, LIVE_TASK, "live:1")  # finished 10 days ago; live:2 just now

        report = purge(Database(db_url), WEEK, batch=PURGE_BATCH)
        assert (report.runs, report.batches) == (1, 1), report
        assert Runs(db_url).get(LIVE_TASK, "live:1") is None

        assert live.delay(1).get(timeout=60) == 1  # no run for its key: executed again
        assert live.delay(2).get(timeout=60) == 2  # kept: answered from its stored result

    assert bodies == [1, 2, 1]
    assert count_rows(engine, effects_table, "live:1") == 2
    assert count_rows(engine, effects_table, "live:2") == 1
    assert live.outcome_counts() == {"executed": 3, "replayed": 1}
    run = Runs(db_url).get(LIVE_TASK, "live:1")
    assert run is not None and run.status is RunStatus.COMPLETED and run.token == 1


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_slow_purge_batch_halves_the_next_one(db_url: str) -> None:
    """A batch that holds its transaction past MAX_BATCH_SECONDS (SQLite's one writer lock, which workers'
    lease renewals wait for) halves the next batch; quick batches grow back to the size asked for. SQLite only:
    the writer lock is what makes a long batch dangerous there."""
    store = RunStore(db_url)
    for n in range(48):
        held = store.claim("oncelery.t_purge_slow", Identity(f"s:{n}", "f", {}), lease=30).claim
        assert held is not None
        store.complete(held, n)
    sizes: list[int] = []
    seen = [0]

    def slow_first(_name: str, context: dict[str, Any]) -> None:
        sizes.append(int(context["runs"]))
        if len(sizes) == 1:
            time.sleep(MAX_BATCH_SECONDS * 1.5)  # a slow disk: the first batch holds the lock too long

    def counted(report: PurgeReport) -> None:
        seen[0] = report.runs

    with fault_injected("purge_batch", slow_first):
        report = purge(Database(db_url), older_than=0, batch=16, on_batch=counted)
    assert report.runs == seen[0] == 48
    assert sizes[:2] == [16, 8], sizes  # halved after the slow one
    assert max(sizes[2:]) == 16, sizes  # and grown back to the size asked for
