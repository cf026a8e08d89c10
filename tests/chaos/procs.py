"""The processes the runner starts: its own redis-server, the `celery worker`s, the outbox relay.

Each runs in a session of its own (`start_new_session=True`), so it is stopped by its PID and its process
group (pool children included), never by name: tests.services.stop_sessions does it for every incarnation,
including the sessions of workers that were SIGKILLed and restarted (their orphaned pool children too).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import redis

from oncelery.testing.faults import poll
from tests.pg_cluster import free_port
from tests.services import alive, stop_sessions

REPO = Path(__file__).resolve().parents[2]
QUEUE = "celery"  # Celery's default queue, on a Redis server nobody else uses
UNACKED = "unacked"  # kombu's hash of the messages workers took and have not acked (ETA waits included)


# The runner is not a test: a condition that never comes is an answer (None), not a failure.
wait_for = poll


class Sessions:
    """Every process the runner started, by Popen object: stopped together by PID at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        """Start `argv` in a session of its own, output to `log`."""
        with log.open("ab") as out:
            proc = subprocess.Popen(
                argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(proc)
        return proc

    def stop_all(self, grace: float = 10.0) -> None:
        """SIGCONT + SIGTERM each session leader, then SIGKILL each session's group (tests.services.stop_sessions)."""
        stop_sessions(self.procs, grace=grace)


class RedisServer:
    """A redis-server of the runner's own on a free port (FLUSHALL hits nobody else), no persistence."""

    def __init__(self, sessions: Sessions, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        argv += ["--dir", str(workdir)]
        self.proc = sessions.spawn(argv, dict(os.environ), workdir / "redis.log")

    def client(self) -> redis.Redis:
        """A client of database 0 (the broker)."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10)

    def wait_ready(self, timeout: float = 30.0) -> bool:
        """Wait until the server answers PING."""

        def ping() -> bool:
            try:
                with self.client() as client:
                    return bool(client.ping())
            except redis.RedisError:
                return False

        return bool(wait_for(ping, timeout, 0.05))

    def flushall(self) -> None:
        """FLUSHALL: queues, unacked bookkeeping, bindings and results are gone."""
        with self.client() as client:
            client.flushall()

    def queued(self) -> int:
        """Return how many messages wait in the queue."""
        with self.client() as client:
            return int(client.llen(QUEUE))

    def held(self) -> int:
        """Return how many messages workers took and have not acked (running, reserved, or waiting out an ETA)."""
        with self.client() as client:
            return int(client.hlen(UNACKED))


class Worker:
    """One `celery worker` (prefork) with a fixed hostname; restarted under the same name after a kill."""

    def __init__(self, sessions: Sessions, name: str, concurrency: int, env: dict[str, str], logdir: Path) -> None:
        self.sessions = sessions
        self.name = name
        self.hostname = f"{name}@chaos"
        self.concurrency = concurrency
        self.env = {**env, "CHAOS_ROLE": name}
        self.logdir = logdir
        self.incarnation = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = logdir / f"worker-{name}-0.log"
        self.restarts = 0

    def start(self) -> None:
        """Start a new incarnation (its own log file, so `ready()` reads only its own lines)."""
        self.incarnation += 1
        self.log = self.logdir / f"worker-{self.name}-{self.incarnation}.log"
        argv = [sys.executable, "-m", "celery", "-A", "tests.chaos.jobs", "worker", "-n", self.hostname]
        argv += ["--pool", "prefork", "--concurrency", str(self.concurrency), "--loglevel", "INFO"]
        argv += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
        self.proc = self.sessions.spawn(argv, self.env, self.log)

    @property
    def pid(self) -> int:
        """The main process's PID (also its session and process group id)."""
        return self.proc.pid if self.proc is not None else -1

    def exited(self) -> bool:
        """Whether the current incarnation has exited (killed, or refused to start)."""
        return self.proc is None or self.proc.poll() is not None

    def ready(self) -> bool:
        """Whether the current incarnation consumes (its log says `<hostname> ready.`)."""
        if self.exited():
            return False
        try:
            return f"{self.hostname} ready." in self.log.read_text(errors="replace")
        except OSError:
            return False

    def children(self) -> list[int]:
        """Return the PIDs of the current incarnation's pool children."""
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if fields[1] == str(self.pid) and alive(int(entry.name)):
                    found.append(int(entry.name))
        return found

    def owns(self, pid: int) -> bool:
        """Whether `pid` is alive and belongs to the current incarnation (its main process or a pool child)."""
        try:
            return alive(pid) and os.getpgid(pid) == self.pid and not self.exited()
        except OSError:
            return False


class Relay:
    """`oncelery relay` on the chaos app: publishes the outbox and re-publishes what a Redis flush lost."""

    def __init__(self, sessions: Sessions, env: dict[str, str], logdir: Path, republish_after: float) -> None:
        self.log = logdir / "relay.log"
        oncelery = str(Path(sys.executable).parent / "oncelery")
        argv = [oncelery, "relay", "--app", "tests.chaos.jobs:app", "--interval", "0.2"]
        argv += ["--republish-after", f"{republish_after:g}s", "--sweep-interval", "off", "--retention", "off"]
        self.env = {**env, "CHAOS_ROLE": "relay"}
        self.argv = argv
        self.sessions = sessions
        self.proc = sessions.spawn(argv, self.env, self.log)

    def ready(self) -> bool:
        """Whether the relay runs its rounds (it printed its start line)."""
        try:
            return self.proc.poll() is None and "relay: publishing" in self.log.read_text(errors="replace")
        except OSError:
            return False

    def keep_alive(self) -> bool:
        """Restart the relay if it exited (e.g. it could not start while the database restarted); True if it did."""
        if self.proc.poll() is None:
            return False
        self.proc = self.sessions.spawn(self.argv, self.env, self.log)
        return True
