"""The faults, each injected when an observable condition says it will hit a job in flight.

A victim is an attempt the ledger shows running (started, not ended) whose run the claims database shows
RUNNING under that attempt's fencing token, in a process that is alive and belongs to a ready worker. Every wait
is bounded; a fault whose condition never held is not counted (and the run then fails its minimum counts).

- kill_child / kill_main / kill_host: SIGKILL of the victim's pool child, of its worker's main process only
  (children orphaned), or of the worker's whole process group (host loss); the keeper restarts the worker.
- zombie: SIGSTOP of the victim's pool child at a moment it holds no transaction (PostgreSQL) and no ledger
  lock, past its lease; a client re-sends the job, another worker takes the run over (a higher token) and
  commits; SIGCONT; the zombie's attempt must end without its effect, counted lease_lost. Every other zombie
  (and every other cut, starting with the first) is aimed at a holder about to commit (its effect staged):
  its late effects write and completion are refused by the fence.
- cut: the same with the cut-off worker's database proxy blackholed instead of a signal, healed at the end.
- flush: Redis FLUSHALL (on RabbitMQ: a purge of the task queue) while messages wait in the queue and a body
  runs; the relay re-publishes from the outbox.
- broker_restart: the RabbitMQ node stopped and started while a job runs (its data kept): every connection
  closes, the unacked messages are requeued and redelivered, workers and the relay reconnect.
- backend_<phase>: pg_terminate_backend of a worker's backend caught inside a claim, a step or a commit.
- restart: the throwaway cluster stopped ("fast", then "immediate" on the next one) and started, mid-job.
- the model-call layer's (tests/chaos/model_faults.py): kill_create, kill_poll, kill_relay, revoke, provider_5xx,
  provider_429, forget.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from tests.chaos.checker import Sut
from tests.chaos.ledger import Attempt, Ledger
from tests.chaos.model_faults import MODEL_FAULTS, ModelFaults
from tests.chaos.procs import FakeProvider, RabbitServer, RedisServer, Relay, Worker, wait_for
from tests.chaos.proxy import BlackholeProxy
from tests.pg_cluster import PgCluster
from tests.services import proc_state

KILLS = ("kill_child", "kill_main", "kill_host")
PHASES = ("claim", "step", "commit")
FAULT_TIMEOUT = 40.0  # seconds one fault may wait for its condition (a loaded machine slows the jobs)
SETTLE_TIMEOUT = 60.0  # seconds a taker may need to take over and commit (lease, backoff, a loaded machine)


def classify(state: str, query: str) -> str | None:
    """Which part of a delivery a worker's backend is in, from its state and current (or last) statement."""
    q = " ".join(query.lower().split())
    # The claim: PostgreSQL's claim-or-replay CTE, the plain INSERT, or the takeover UPDATE (new token).
    if q.startswith(("with cur as", "insert into task_runs")) or "fencing_token=(task_runs.fencing_token" in q:
        return "claim"
    # The completion: the effect row, the fenced complete-and-count CTE, or its COMMIT on the wire.
    if "chaos_effects" in q or q.startswith("with done as") or (q == "commit" and state == "active"):
        return "commit"
    if "step_results" in q:
        return "step"
    return None


class Admin:
    """One autocommit superuser connection for the polls (reconnected after a restart or a kill)."""

    def __init__(self, cluster: PgCluster) -> None:
        self.cluster = cluster
        self.conn: psycopg.Connection[Any] | None = None

    def rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Run `sql`; an error (server restarting) gives no rows and a fresh connection next time."""
        try:
            if self.conn is None or self.conn.closed:
                dsn = f"host=127.0.0.1 port={self.cluster.port} user=postgres dbname=postgres connect_timeout=5"
                self.conn = psycopg.connect(dsn, autocommit=True, application_name="chaos-admin")
            cur = self.conn.execute(sql.encode(), params)  # type: ignore[arg-type]
            return list(cur.fetchall()) if cur.description else []
        except psycopg.Error:
            self.close()
            return []

    def close(self) -> None:
        """Close the connection."""
        if self.conn is not None:
            with contextlib.suppress(psycopg.Error):
                self.conn.close()
        self.conn = None


@dataclass
class Chaos(ModelFaults):
    """What the faults act on, and what they did."""

    cluster: PgCluster
    database: str
    broker: RedisServer | RabbitServer
    workers: dict[str, Worker]
    proxy: BlackholeProxy
    ledger: Ledger
    sut: Sut
    resend: Callable[[int], None]  # a client sends the job again (same key), directly to the broker
    burst: Callable[[], None]  # the runner sends its next few jobs at once (a backlog in the queue)
    log: Callable[[str], None]
    fake: FakeProvider | None = None
    relay: Relay | None = None
    app: Any = None  # the chaos app (a revoke is its control broadcast)
    arm: Path | None = None  # the folder whose files arm a fault inside another process (the relay's wake pause)
    counts: Counter[str] = field(default_factory=Counter)
    missed: Counter[str] = field(default_factory=Counter)
    victims: list[int] = field(default_factory=list)
    revoked: list[int] = field(default_factory=list)  # jobs whose parked run the runner revoked
    revokes_not_applied: list[int] = field(default_factory=list)  # of those, runs not DEAD soon after the revoke
    killed: set[int] = field(default_factory=set)  # pids SIGKILLed: never a victim again (dying is not instant)

    def __post_init__(self) -> None:
        self.admin = Admin(self.cluster)

    def inject(self, kind: str) -> bool:
        """Inject one fault of `kind`; True (and counted) if it hit what it aims at."""
        started = time.monotonic()
        try:
            if kind in KILLS:
                hit = self.kill(kind)
            elif kind.startswith("backend_"):
                hit = self.backend_kill(kind.removeprefix("backend_"))
            elif kind in MODEL_FAULTS:
                hit = getattr(self, kind)(FAULT_TIMEOUT)
            else:
                hit = getattr(self, kind)()
        except Exception as exc:  # a fault that could not be injected is missed, and the run goes on
            self.log(f"  {kind}: {type(exc).__name__}: {exc}")
            hit = False
        (self.counts if hit else self.missed)[kind] += 1
        self.log(f"fault {kind}: {'hit' if hit else 'MISSED'} ({time.monotonic() - started:.1f}s)")
        return bool(hit)

    # -- victims -------------------------------------------------------------------------------------

    def ordinary(self) -> tuple[str, ...]:
        """The workers that reach the database directly (all but the cut-off one)."""
        return tuple(name for name in self.workers if name != "cut")

    def victim(
        self, names: tuple[str, ...], timeout: float = FAULT_TIMEOUT, staged: bool = False
    ) -> tuple[Worker, Attempt] | None:
        """Wait for a running attempt on one of the ready workers `names` that holds its run (about to commit)."""

        def find() -> tuple[Worker, Attempt] | None:
            ready = {n: self.workers[n] for n in names if self.workers[n].ready()}
            for att in self.ledger.open_attempts(tuple(ready), staged) if ready else []:
                worker = ready[att.host]
                if att.pid in self.killed or att.pid == worker.pid or not worker.owns(att.pid):
                    continue
                if self.sut.holds(att.job, att.token):
                    return worker, att
            return None

        return wait_for(find, timeout, 0.02)  # type: ignore[no-any-return]

    def backends(self, app_pattern: str) -> list[tuple[int, str, str]]:
        """Return (pid, state, query) of the chaos database's client backends whose application_name matches."""
        rows = self.admin.rows(
            "SELECT pid, state, query FROM pg_stat_activity WHERE datname = %s AND application_name LIKE %s",
            (self.database, app_pattern),
        )
        return [(int(p), str(s or ""), str(q or "")) for p, s, q in rows]

    def quiet(self, app_pattern: str) -> bool:
        """Whether every backend of `app_pattern` is idle (no open transaction, no lock held), twice in a row."""
        for _ in range(2):
            if any(state != "idle" for _, state, _ in self.backends(app_pattern)):
                return False
            time.sleep(0.03)  # a statement already on the wire shows up as active in the second sample
        return True

    # -- the faults ------------------------------------------------------------------------------------

    def kill(self, how: str) -> bool:
        """SIGKILL a pool child running a job, its worker's main process, or its whole process group."""
        found = self.victim(self.ordinary())
        if found is None:
            return False
        worker, att = found
        self.killed.add(att.pid)
        if how == "kill_child":
            os.kill(att.pid, signal.SIGKILL)
        elif how == "kill_main":
            os.kill(worker.pid, signal.SIGKILL)  # its pool children are orphaned, mid-job
        else:
            os.killpg(worker.pid, signal.SIGKILL)
        self.victims.append(att.job)
        self.log(f"  {how}: {worker.name} pid {worker.pid}, job {att.job} in pid {att.pid} token {att.token}")
        return True

    def at_commit(self, kind: str) -> bool:
        """Whether this `kind` fault aims at a holder about to commit (every other one: mid-steps)."""
        return (self.counts[kind] + self.missed[kind]) % 2 == (1 if kind == "zombie" else 0)

    def zombie(self) -> bool:
        """Freeze a holder past its lease; after another worker took over and committed, thaw it: it is fenced."""
        deadline = time.monotonic() + FAULT_TIMEOUT
        staged = self.at_commit("zombie")
        while time.monotonic() < deadline:
            found = self.victim(self.ordinary(), deadline - time.monotonic(), staged)
            if found is None:
                return False
            worker, att = found
            pid = att.pid
            os.kill(pid, signal.SIGSTOP)
            stopped = wait_for(lambda: proc_state(pid) in ("T", "t", ""), 10, 0.01)  # noqa: B023 (called now)
            if (
                stopped
                and self.quiet(f"chaos:{worker.name}:{pid}")
                and self.ledger.writable()
                and self.still_holds(att)
            ):
                where = "about to commit" if staged else "mid-steps"
                self.log(f"  zombie: froze pid {pid} ({worker.name}) {where}, job {att.job} token {att.token}")
                return self.fence(att, functools.partial(os.kill, pid, signal.SIGCONT), "zombie")
            os.kill(pid, signal.SIGCONT)  # inside a transaction (or done): let it go on, pick again
            time.sleep(0.05)
        return False

    def cut(self) -> bool:
        """Blackhole the cut-off worker's database path mid-job; heal after the takeover: its holder is fenced."""
        deadline = time.monotonic() + FAULT_TIMEOUT
        staged = self.at_commit("cut")
        while time.monotonic() < deadline:
            found = self.victim(("cut",), deadline - time.monotonic(), staged)
            if found is None:
                return False
            _, att = found
            self.proxy.blackhole()
            if self.quiet("chaos:cut:%") and self.still_holds(att):
                where = "about to commit" if staged else "mid-steps"
                self.log(f"  cut: blackholed the proxy, {where}, job {att.job} pid {att.pid} token {att.token}")
                return self.fence(att, self.proxy.heal, "cut")
            self.proxy.heal()
            time.sleep(0.05)
        return False

    def still_holds(self, att: Attempt) -> bool:
        """Whether the attempt is still running (ledger) and still holds its run (database)."""
        now = self.ledger.attempt(att.attempt)
        return now is not None and now.ended is None and self.sut.holds(att.job, att.token)

    def fence(self, att: Attempt, release: Callable[[], None], kind: str) -> bool:
        """With the holder frozen or cut off: re-send the job, wait for a takeover and its effect, release the holder.

        A hit needs the takeover (a higher token) before the release and the released attempt's effect never
        committed once it ended; otherwise the fault did not test the fence (counted missed).
        """
        self.victims.append(att.job)
        try:
            self.resend(att.job)  # a client retry: another worker contends for the key
            took = wait_for(lambda: (self.sut.run_of(att.job) or ("", 0))[1] > att.token, SETTLE_TIMEOUT, 0.1)
            committed = took and wait_for(lambda: self.sut.effect_attempts(att.job), SETTLE_TIMEOUT, 0.1)
            lease_lost = self.sut.outcomes().get("lease_lost", 0)
        finally:
            release()
        ended = wait_for(lambda: (self.ledger.attempt(att.attempt) or att).ended, SETTLE_TIMEOUT, 0.05)
        how = (self.ledger.attempt(att.attempt) or att).how
        refused = att.attempt not in self.sut.effect_attempts(att.job)
        # The released holder's delivery is counted lease_lost (G7): its body raised LeaseLost, or its
        # completion was refused by the fence.
        counted = wait_for(lambda: self.sut.outcomes().get("lease_lost", 0) > lease_lost, SETTLE_TIMEOUT, 0.1)
        self.log(
            f"  {kind}: takeover={bool(took)} taker_committed={bool(committed)} ended={how} refused={refused} "
            f"lease_lost_counted={bool(counted)}"
        )
        return bool(took and committed and ended and refused and counted)

    def flush(self) -> bool:
        """Empty the broker (Redis FLUSHALL, RabbitMQ queue.purge) while messages wait in the queue and a body runs."""

        def due() -> bool:
            return self.broker.queued() > 0 and bool(self.ledger.open_attempts(tuple(self.workers)))

        self.burst()  # the relay publishes them in one round: more than the free pool slots take at once
        if not wait_for(due, FAULT_TIMEOUT, 0.005):
            return False
        queued = self.broker.queued()
        how = self.broker.flush()
        self.log(f"  flush: {how}, {queued} messages queued")
        return True

    def broker_restart(self) -> bool:
        """Stop and start the RabbitMQ node while a job runs: its unacked messages come back, redelivered."""
        if not isinstance(self.broker, RabbitServer):
            raise RuntimeError("broker_restart needs --broker rabbitmq")
        if self.victim(tuple(self.workers)) is None:
            return False
        started = time.monotonic()
        back = self.broker.restart()
        self.log(f"  broker_restart: stop and start in {time.monotonic() - started:.1f}s (up: {back})")
        return back

    def backend_kill(self, phase: str) -> bool:
        """pg_terminate_backend of a worker's backend caught in `phase` (claim, step or commit)."""
        workers = "chaos:w%"  # w1, w2, ... (the cut-off worker's backends are behind the proxy: killable too)

        def caught() -> tuple[int, str] | None:
            for pattern in (workers, "chaos:cut:%"):
                for pid, state, query in self.backends(pattern):
                    if state != "idle" and classify(state, query) == phase:
                        return pid, query
            return None

        found = wait_for(caught, FAULT_TIMEOUT, 0.005)
        if not found:
            return False
        killed = self.admin.rows("SELECT pg_terminate_backend(%s)", (found[0],))
        self.log(f"  backend_{phase}: terminated {found[0]} in {' '.join(found[1].split())[:90]!r}")
        return bool(killed and killed[0][0])

    def restart(self) -> bool:
        """Stop and start the throwaway cluster while a job runs (fast stop first, an immediate one next)."""
        if self.victim(tuple(self.workers)) is None:
            return False
        mode = "fast" if self.counts["restart"] % 2 == 0 else "immediate"
        started = time.monotonic()
        self.admin.close()
        self.cluster.restart(mode)
        self.log(f"  restart: {mode} stop and start in {time.monotonic() - started:.1f}s")
        return True
