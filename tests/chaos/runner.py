"""The chaos run: start everything, submit the jobs, inject the fault schedule, settle, check, stop everything.

Timeline: the jobs are submitted at a steady rate over `window` seconds (originals through the outbox, p % of
them a second time, through the outbox or straight to the broker), the last few held back until every fault
was tried, so the faults always find jobs in flight. The faults run one at a time, spread over the window in a
seeded order. Then the run settles: every submitted job has its effect and nothing is RUNNING or unpublished
(bounded), and the checker compares the ledger with the committed effects.
"""

from __future__ import annotations

import heapq
import math
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from decimal import ROUND_UP, Decimal
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

from tests.chaos.ledger import Ledger
from tests.chaos.model import estimate_usd
from tests.chaos.procs import FakeProvider, RabbitServer, RedisServer, Relay, Sessions, Worker, wait_for
from tests.chaos.proxy import BlackholeProxy
from tests.pg_cluster import PgCluster, postgres_bindir
from tests.services import clean_env

STARTUP_TIMEOUT = 90.0
RESERVE = 0.3  # the share of jobs held back to trickle while faults remain
TRICKLE = 2.0  # jobs per second while they trickle, at most
# A fault's usual time, its wait for a victim included: the trickle slows down so that the jobs held back last
# as long as the faults still to run (at least one job every TRICKLE_SLOWEST seconds, so victims keep coming).
FAULT_SECONDS = 5.0
TRICKLE_SLOWEST = 1.5
BURST = 10  # originals sent at once when a fault asks for a backlog
QUIET_IDLE = 3.0  # seconds past the last delivery and the last copy's ETA (nothing queued, held, running)


@dataclass
class Options:
    """The run's parameters (see __main__ for their meaning and the presets)."""

    jobs: int
    duplicates: float  # percent
    kills: int
    flushes: int
    backend_kills: int
    restarts: int
    cuts: int
    zombies: int
    timeout: float
    workers: int
    seed: int
    window: float
    lease: float
    visibility_timeout: float
    long_share: float  # percent of jobs longer than the visibility timeout
    republish_after: float
    keep: bool = False
    broker: str = "redis"  # or "rabbitmq": a private node is the broker, Redis keeps the results and the cache
    queue_type: str = "classic"  # RabbitMQ's task queue: classic or quorum
    broker_restarts: int = 0  # RabbitMQ node restarts (the rabbitmq preset)
    producer_dedupe: bool = True  # the runner's direct copies are asked of the claims database first (the default)
    # The model-call layer's faults (tests/chaos/model_faults.py) and the fake provider's pace.
    create_kills: int = 0  # SIGKILLs in the create window (the create reached the provider, the intent prepared)
    poll_kills: int = 0  # SIGKILLs of a holder polling its sent call
    relay_kills: int = 0  # SIGKILLs of the relay between a wake's mark and its send
    revokes: int = 0  # app.control.revoke of a parked (WAITING) run's message
    provider_errors: int = 0  # bursts of errors on creates, 5xx and 429 in turn
    forgets: int = 0  # a parked run's response forgotten by the provider (404 on its next poll)
    generation: tuple[float, float] = (0.1, 1.2)  # seconds a call takes at the provider, from, to
    inline_wait: float = 0.6  # seconds a delivery polls before it parks its run
    rewake_after: float = 15.0  # the relay re-sends a wake no delivery took after this
    release_after: float = 20.0  # oncelery_budget_release_s: a dead holder's prepared call's reservation
    rate_headroom: float = 1.2  # the shared limit: this times the submission rate (it throttles the bursts)


class Run:
    """One chaos run; `execute()` returns the exit code and always stops every process it started."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.rng = random.Random(opts.seed)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + opts.timeout
        self.workdir = Path(tempfile.mkdtemp(prefix="oncelery-chaos-"))
        self.sessions = Sessions()
        self.ledger = Ledger(self.workdir / "ledger.db")
        self.cluster: PgCluster | None = None
        self.proxy: BlackholeProxy | None = None
        self.workers: dict[str, Worker] = {}
        self.relay: Relay | None = None
        self.fake: FakeProvider | None = None
        self.broker: RedisServer | RabbitServer | None = None
        self.stopping = threading.Event()
        self.faults_done = threading.Event()
        self.faults_left = 0  # faults not yet tried (the trickle's pace follows it)
        self.burst_left = 0  # originals to send at once (a fault asked for a backlog in the queue)
        self.seconds: dict[int, float | None] = {}
        self.sent = {"outbox": 0, "direct": 0, "fault": 0}
        self.errors: list[str] = []
        self.threads: list[threading.Thread] = []
        self.settled = False
        self.failed = False
        self._last_note = 0.0

    def log(self, line: str) -> None:
        """Print a progress line with the elapsed time."""
        print(f"[{time.monotonic() - self.t0:6.1f}s] {line}", flush=True)

    def left(self) -> float:
        """Seconds left before the overall timeout."""
        return max(0.0, self.deadline - time.monotonic())

    # -- setup -----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start Redis (and RabbitMQ), the cluster (migrated), the proxy, the workers and the relay; wait for all."""
        opts = self.opts
        self.ledger.create()
        redis = RedisServer(self.sessions, self.workdir)
        rabbit = RabbitServer(self.sessions, self.workdir) if opts.broker == "rabbitmq" else None
        bindir = postgres_bindir()
        if bindir is None:
            raise RuntimeError("no PostgreSQL binaries (initdb, pg_ctl, postgres)")
        self.cluster = PgCluster(bindir)
        self.cluster.start()
        self.database, url = self.cluster.create_database("chaos")
        rpm, budget = self.model_limits()
        generation = opts.generation
        self.fake = FakeProvider(self.sessions, self.workdir, {
            "generation_s": generation[0], "generation_max_s": generation[1], "poll_after_ms": 250,
            "hold_timeout_s": 20.0,
            # The provider's own limit, above the fleet's shared one: a 429 it serves means the limiter let too many
            # through (the injected 429 bursts are counted apart).
            "rpm_limit": int(rpm * 1.5),
        })  # fmt: skip
        self.proxy = BlackholeProxy("127.0.0.1", self.cluster.port).start()
        cut_url = make_url(url).set(port=self.proxy.port).render_as_string(hide_password=False)
        if not redis.wait_ready():
            raise RuntimeError(f"redis-server did not start: see {self.workdir / 'redis.log'}")
        self.redis = redis
        if rabbit is not None and not rabbit.wait_ready():
            raise RuntimeError(f"rabbitmq-server did not start: see {self.workdir / 'rabbitmq.log'}")
        if not self.fake.wait_ready():
            raise RuntimeError(f"the fake provider did not start: see {self.fake.log}")
        (self.workdir / "arm").mkdir()
        self.broker = rabbit or redis
        env = clean_env(
            ONCELERY_DATABASE_URL=url,
            ONCELERY_BROKER_URL=rabbit.url if rabbit is not None else f"{redis.url}/0",
            ONCELERY_RESULT_BACKEND=f"{redis.url}/1",
            ONCELERY_VISIBILITY_TIMEOUT=f"{opts.visibility_timeout:g}",
            ONCELERY_UNACKED_RESTORE_INTERVAL="1",
            ONCELERY_DATA_DIR=str(self.workdir / "data"),
            CHAOS_LEDGER=str(self.ledger.path),
            CHAOS_LEASE=f"{opts.lease:g}",
            CHAOS_QUEUE_TYPE=opts.queue_type,
            CHAOS_PRODUCER_DEDUPE="1" if opts.producer_dedupe else "0",
            CHAOS_FAKE_URL=self.fake.url,
            CHAOS_INLINE_WAIT=f"{opts.inline_wait:g}",
            CHAOS_RPM=str(rpm),
            CHAOS_BUDGET_USD=str(budget),
            CHAOS_RELEASE_S=f"{opts.release_after:g}",
            CHAOS_ARM_DIR=str(self.workdir / "arm"),
        )
        # This process is a client of the same app (outbox writes, direct sends): the same settings.
        os.environ.update({k: v for k, v in env.items() if k.startswith(("ONCELERY_", "CHAOS_"))})
        os.environ["CHAOS_ROLE"] = "runner"
        from oncelery import upgrade_schema
        from tests.chaos import jobs
        from tests.chaos.checker import Sut

        self.jobs = jobs
        self.url = url
        self.log(upgrade_schema(url))
        self.sut = Sut(url)
        jobs.metadata.create_all(self.sut.engine)
        names = ["w1", "w2"] + [f"w{i}" for i in range(3, opts.workers + 1)]
        # A mixed fleet: w2 answers duplicates of finished runs from the replay cache (the same Redis, database
        # 3: a FLUSHALL empties it too), the others from the database.
        cached = {"w2": {"ONCELERY_REPLAY_CACHE": f"{redis.url}/3"}}
        for name in names:
            self.workers[name] = Worker(self.sessions, name, 2, {**env, **cached.get(name, {})}, self.workdir)
        # The cut-off host: one pool child (it takes no other job while its holder hangs), through the proxy.
        self.workers["cut"] = Worker(self.sessions, "cut", 1, {**env, "ONCELERY_DATABASE_URL": cut_url}, self.workdir)
        for worker in self.workers.values():
            worker.start()
        self.relay = Relay(self.sessions, env, self.workdir, opts.republish_after, opts.rewake_after)
        ready = wait_for(lambda: all(w.ready() for w in self.workers.values()) and self.relay.ready(), STARTUP_TIMEOUT)
        if not ready:
            raise RuntimeError(f"workers or relay not ready after {STARTUP_TIMEOUT}s: see {self.workdir}")
        broker = f"rabbitmq {rabbit.port} ({opts.queue_type}), " if rabbit is not None else ""
        self.log(
            f"ready: {broker}redis {redis.port}, postgres {self.cluster.port}, proxy {self.proxy.port}, "
            f"fake provider {self.fake.url} (shared limit {rpm} rpm, day budget ${budget}), {self.workdir}"
        )

    def model_limits(self) -> tuple[int, Decimal]:
        """The shared limit (requests per minute) and the fleet's day budget (USD) for this run.

        The limit is `rate_headroom` times the submission rate: the steady flow fits, the bursts (a flush's
        backlog, the duplicates' copies that find nothing to replay yet, the retries after a fault) wait for it.
        The budget is what every job's call reserves, 1.5 times over (repeats, unknown outcomes at their estimate).
        """
        opts = self.opts
        rpm = max(60, math.ceil(60 * opts.jobs / opts.window * opts.rate_headroom))
        budget = (estimate_usd() * opts.jobs * Decimal("1.5")).quantize(Decimal("0.01"), ROUND_UP)
        return rpm, budget

    # -- submissions ---------------------------------------------------------------------------------

    def plan(self) -> list[tuple[bool, str | None]]:
        """Per job, seeded: whether it is long (outlasts the visibility timeout) and how its duplicate is sent."""
        opts, rng = self.opts, self.rng
        plan = []
        for job in range(opts.jobs):
            long = rng.random() * 100 < opts.long_share
            self.seconds[job] = opts.visibility_timeout + 2.0 if long else None
            duplicate = rng.random() * 100 < opts.duplicates
            plan.append((long, rng.choice(("outbox", "direct")) if duplicate else None))
        return plan

    def submit(self, job: int, copy: int, via: str) -> None:
        """Record, then send one copy of `job` (the outbox write retried through database faults)."""
        from sqlalchemy.orm import Session

        from oncelery import outbox

        self.ledger.submitted(job, copy, via)
        self.sent[via] += 1
        args = (job, self.seconds[job])
        # Sent as the job's tenant: the app's resolver reads it here, in the sender, once per copy.
        sending = self.jobs.sender_tenant.set(self.jobs.tenant_for(job))
        try:
            if via != "outbox":
                self.jobs.chaos_job.apply_async(args)
                return
            while not self.stopping.is_set():
                try:
                    with Session(self.sut.engine) as session, session.begin():
                        outbox.enqueue(session, self.jobs.chaos_job, *args)
                    return
                except Exception as exc:  # a killed backend or a restart: the row was not written, write it again
                    self.errors.append(f"enqueue {job}: {type(exc).__name__}")
                    time.sleep(0.2)
        finally:
            self.jobs.sender_tenant.reset(sending)

    def ask_burst(self) -> None:
        """Send the next BURST originals at once (a backlog for the flush to lose)."""
        self.burst_left = BURST

    def resend(self, job: int) -> None:
        """A client's retry of `job` (a fault's contender for the key), straight to the broker."""
        self.submit(job, 2, "fault")

    def submitter(self, plan: list[tuple[bool, str | None]]) -> None:
        """Send the originals at jobs/window per second, each duplicate 0.05-3 s after its original.

        The last RESERVE of the jobs trickle, at most TRICKLE per second and slower while many faults remain,
        until every fault was tried, so the faults always find jobs in flight; a fault may ask for a burst (a
        backlog in the queue) through ask_burst().
        """
        jobs = self.opts.jobs
        interval = self.opts.window / jobs
        trickle_from = int(jobs * (1 - RESERVE))
        copies: list[tuple[float, int, str]] = []
        next_at = time.monotonic()
        job = 0
        while not self.stopping.is_set() and (job < jobs or copies):
            now = time.monotonic()
            while copies and copies[0][0] <= now:
                _, dup, via = heapq.heappop(copies)
                self.send(dup, 1, via)
            burst = self.burst_left > 0
            if job < jobs and (now >= next_at or burst):
                self.send(job, 0, "outbox")
                if plan[job][1] is not None:
                    heapq.heappush(copies, (now + self.rng.uniform(0.05, 3.0), job, plan[job][1]))
                job += 1
                if burst:
                    self.burst_left -= 1
                slow = job >= trickle_from and not self.faults_done.is_set()
                pace = min(TRICKLE_SLOWEST, max(1 / TRICKLE, FAULT_SECONDS * self.faults_left / max(1, jobs - job)))
                next_at = max(next_at + interval, now + pace) if slow else next_at + interval
                continue
            wakes = [c[0] for c in copies[:1]] + ([next_at] if job < jobs else [])
            wake = min(wakes, default=now + 0.5)
            self.stopping.wait(min(0.5, max(0.0, wake - now)))

    def send(self, job: int, copy: int, via: str) -> None:
        """submit(), and a failed direct send noted (the job's outbox copy still carries it)."""
        try:
            self.submit(job, copy, via)
        except Exception as exc:
            self.errors.append(f"send {job}/{copy}: {type(exc).__name__}: {exc}")

    def keeper(self) -> None:
        """Restart every worker that exited (killed, or refused to start during a restart), and the relay."""
        while not self.stopping.wait(0.2):
            for worker in self.workers.values():
                if worker.exited():
                    worker.restarts += 1
                    worker.start()
            if self.relay is not None and self.relay.keep_alive():
                self.log("relay restarted")

    # -- the run ---------------------------------------------------------------------------------------

    def schedule(self) -> list[str]:
        """The faults in a seeded order (kills cycle child, main, host; backend kills cycle claim, step, commit)."""
        opts = self.opts
        kinds = [("kill_child", "kill_main", "kill_host")[i % 3] for i in range(opts.kills)]
        kinds += [f"backend_{('claim', 'step', 'commit')[i % 3]}" for i in range(opts.backend_kills)]
        kinds += ["flush"] * opts.flushes + ["restart"] * opts.restarts + ["broker_restart"] * opts.broker_restarts
        kinds += ["cut"] * opts.cuts + ["zombie"] * opts.zombies
        kinds += ["kill_create"] * opts.create_kills + ["kill_poll"] * opts.poll_kills
        kinds += ["kill_relay"] * opts.relay_kills + ["revoke"] * opts.revokes + ["forget"] * opts.forgets
        kinds += [("provider_5xx", "provider_429")[i % 2] for i in range(opts.provider_errors)]
        self.rng.shuffle(kinds)
        return kinds

    def execute(self) -> int:
        """Run everything; return 0 for a clean verdict with the minimum faults, else 1 (2: could not start)."""
        try:
            try:
                self.start()
            except Exception as exc:
                self.log(f"could not start: {type(exc).__name__}: {exc}")
                self.failed = True
                return 2
            return self.drive()
        except BaseException:
            self.failed = True  # an interrupt or a runner error: keep the logs and the ledger
            raise
        finally:
            self.stop()

    def drive(self) -> int:
        """Submit, inject, settle and check (the processes are up)."""
        from tests.chaos.faults import Chaos
        from tests.chaos.report import report

        if self.cluster is None or self.proxy is None or self.broker is None:
            raise RuntimeError("drive() needs start() first")
        chaos = Chaos(self.cluster, self.database, self.broker, self.workers, self.proxy, self.ledger, self.sut,
                      self.resend, self.ask_burst, self.log, fake=self.fake, relay=self.relay, app=self.jobs.app,
                      arm=self.workdir / "arm")  # fmt: skip
        self.threads = threads = [
            threading.Thread(target=self.submitter, args=(self.plan(),), name="submitter", daemon=True),
            threading.Thread(target=self.keeper, name="keeper", daemon=True),
        ]
        kinds = self.schedule()  # after the plan: the seed draws the plan first, then the faults' order
        self.faults_left = len(kinds)
        for thread in threads:
            thread.start()
        started = time.monotonic()
        fault_window = self.opts.window * 0.85
        for i, kind in enumerate(kinds):
            due = started + fault_window * (i + 0.5) / max(1, len(kinds))
            if self.left() < 30 or self.stopping.wait(max(0.0, due - time.monotonic())):
                break
            chaos.inject(kind)
            self.faults_left = len(kinds) - i - 1
        self.faults_done.set()
        threads[0].join(self.left())
        self.log(f"submitted: {self.sent}; settling")
        self.settle()
        self.wait_released()
        self.stopping.set()
        return report(self, chaos)

    def settle(self) -> None:
        """Wait (bounded) until every submitted job has an effect, then until the system is quiet.

        Quiet, on two polls in a row: nothing RUNNING, nothing unpublished in the outbox, no message queued or
        held unacked by a worker, no copy sent with a later ETA than QUIET_IDLE seconds ago (a copy waiting out
        its backoff is held in a worker's memory until then, even after a FLUSHALL emptied the unacked
        bookkeeping; the ledger records every copy's ETA before it is sent), and no delivery for QUIET_IDLE
        seconds. A system that keeps delivering copies after every job finished (e.g. duplicates answered "in
        progress" for ever) has not settled: a failed run.
        """
        from oncelery import WAIT_BACKOFF_CAP

        jobs = self.opts.jobs
        quiet_for = max(WAIT_BACKOFF_CAP, self.opts.visibility_timeout) + 2.0

        def progress() -> bool:
            # A DEAD run never runs again (a revoked job's, or one the checker will count lost): waiting for it
            # would only wait out the timeout.
            done, dead = self.sut.jobs_done(), self.sut.dead_runs()
            if time.monotonic() - self._last_note > 10:
                self._last_note = time.monotonic()
                self.log(f"  {done}/{jobs} jobs have their effect, {dead} runs are DEAD")
            return done + dead >= jobs

        def looks_quiet() -> bool:
            latest = max(self.ledger.last_delivery(), self.ledger.last_due())
            if time.time() - latest < QUIET_IDLE:
                return False
            broker = self.broker
            return broker is not None and self.sut.unsettled() == 0 and broker.queued() == 0 and broker.held() == 0

        polls = [False]

        def quiet() -> bool:
            # Twice in a row: a message the broker moves from unacked back to the queue is in neither for a moment.
            polls.append(looks_quiet())
            return polls[-1] and polls[-2]

        self._last_note = time.monotonic()
        if not wait_for(progress, max(0.0, self.left() - 15), 0.5):
            self.log("settle: not every job has its effect before the timeout")
        # Copies still in flight (duplicates, waits, redeliveries) must be answered before the final read:
        # a late one that wrongly applied an effect again must be counted.
        self.settled = bool(wait_for(quiet, min(quiet_for + 60.0, self.left()), 0.5))
        self.log("settled" if self.settled else "settle: deliveries, runs or messages still in flight at the end")

    def wait_released(self) -> None:
        """Wait (bounded) until no budget holds a reservation: every call ended, or its prepared intent's
        reservation released by the relay (`release_after` past its prepare, once no live holder has it)."""
        if not wait_for(lambda: self.sut.reserved_micros() == 0, min(self.opts.release_after + 15.0, self.left()), 0.5):
            self.log(f"reservations still held after {self.opts.release_after + 15:g}s: {self.sut.reserved_micros()}")

    def stop(self) -> None:
        """Stop every process this run started, by PID, and remove the cluster (always: also on errors)."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal must not cut the cleanup short
                signal.signal(sig, signal.SIG_IGN)
        self.stopping.set()
        self.faults_done.set()
        for thread in self.threads:  # the keeper must not start a worker the stop below would miss
            thread.join(30)
        if self.proxy is not None:
            self.proxy.heal()
        if isinstance(self.broker, RabbitServer):
            self.broker.close()
        # Settled, the system is idle: a warm shutdown has nothing left to finish (2-3 s of pool teardown per
        # worker); otherwise each process gets its warm shutdown first, its logs complete.
        self.sessions.stop_all(grace=0.0 if self.settled else 10.0)
        if self.proxy is not None:
            self.proxy.close()
        if hasattr(self, "sut"):
            self.sut.close()
        if self.cluster is not None:
            self.cluster.remove()
        self.ledger.close()
        if not self.opts.keep and not self.failed:
            shutil.rmtree(self.workdir, ignore_errors=True)
        else:
            self.log(f"logs and ledger kept in {self.workdir}")


def options_from(values: dict[str, Any]) -> Options:
    """Build Options from a dict of argparse values."""
    names = Options.__dataclass_fields__
    return Options(**{k: v for k, v in values.items() if k in names})
