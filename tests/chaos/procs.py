"""The processes the runner starts: its own redis-server (and RabbitMQ node), the fake model provider, the
`celery worker`s, the outbox relay.

Each runs in a session of its own (`start_new_session=True`), so it is stopped by its PID and its process
group (pool children included), never by name: tests.services.stop_sessions does it for every incarnation,
including the sessions of workers that were SIGKILLed and restarted (their orphaned pool children too).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from contextlib import suppress
from pathlib import Path
from typing import Any

import amqp
import redis

from oncelery.testing import FakeProviderControl
from oncelery.testing.faults import poll
from tests.pg_cluster import free_port
from tests.services import alive, stop_sessions

REPO = Path(__file__).resolve().parents[2]
QUEUE = "celery"  # Celery's default queue, on a Redis server nobody else uses
UNACKED = "unacked"  # kombu's hash of the messages workers took and have not acked (ETA waits included)
# RabbitMQ's own scripts: /usr/sbin/rabbitmq-server switches to the `rabbitmq` user, and its cookie, when run as root.
RABBITMQ_BIN = Path("/usr/lib/rabbitmq/bin")


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

    def flush(self) -> str:
        """The flush fault as a broker: FLUSHALL (the queue, the unacked bookkeeping, results, the replay cache)."""
        self.flushall()
        return "FLUSHALL"

    def queued(self) -> int:
        """Return how many messages wait in the queue."""
        with self.client() as client:
            return int(client.llen(QUEUE))

    def held(self) -> int:
        """Return how many messages workers took and have not acked (running, reserved, or waiting out an ETA)."""
        with self.client() as client:
            return int(client.hlen(UNACKED))


def rabbitmq_bindir() -> Path | None:
    """The folder of RabbitMQ's own `rabbitmq-server` and `rabbitmqctl` scripts, or None if it is not installed."""
    if (RABBITMQ_BIN / "rabbitmq-server").exists():
        return RABBITMQ_BIN
    found = shutil.which("rabbitmq-server")
    return Path(found).parent if found else None


class RabbitServer:
    """A RabbitMQ node of the runner's own: its node name, ports, cookie, data and logs in `workdir`, no plugins.

    A fault purges or restarts it and hurts nobody else. Its data folder outlives a restart, as a real node's
    disk does: durable queues and persistent messages (Celery's defaults) come back; unacked ones are requeued
    (redelivered) the moment a consumer's channel or connection closes.
    """

    def __init__(self, sessions: Sessions, workdir: Path) -> None:
        bindir = rabbitmq_bindir()
        if bindir is None:
            raise RuntimeError("no RabbitMQ server (rabbitmq-server): apt-get install rabbitmq-server")
        self.bindir = bindir
        self.sessions = sessions
        self.port = free_port()
        self.node = f"oncelery-{self.port}@localhost"
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}//"
        self.home = workdir / "rabbitmq"
        self.home.mkdir(parents=True, exist_ok=True)
        self.log = workdir / "rabbitmq.log"
        (self.home / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.port}\n"
            "disk_free_limit.absolute = 50MB\n"
            "log.console = false\n"
            "log.file.level = warning\n"
        )
        (self.home / "enabled_plugins").write_text("[].\n")  # the management plugin off
        (self.home / "rabbitmq-env.conf").write_text("")  # not the system's (its NODENAME, its port)
        self.env = {
            **os.environ,
            "HOME": str(self.home),  # its own Erlang cookie, for rabbitmqctl too
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(free_port()),
            "RABBITMQ_MNESIA_BASE": str(self.home / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.home / "log"),
            "RABBITMQ_CONFIG_FILE": str(self.home / "rabbitmq.conf"),
            "RABBITMQ_CONF_ENV_FILE": str(self.home / "rabbitmq-env.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.home / "enabled_plugins"),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
            "ERL_EPMD_ADDRESS": "127.0.0.1",
        }
        self._conn: amqp.Connection | None = None
        self.proc = self.start()

    def start(self) -> subprocess.Popen[bytes]:
        """Start the node (in a session of its own; its data folder kept from any earlier start)."""
        self.proc = self.sessions.spawn([str(self.bindir / "rabbitmq-server")], self.env, self.log)
        return self.proc

    def _channel(self) -> Any:
        # One connection for the polls (a fault polls every few ms), opened again after a restart or an error.
        if self._conn is None:
            self._conn = amqp.Connection(f"127.0.0.1:{self.port}", connect_timeout=5)
            self._conn.connect()
        return self._conn.channel(1)

    def _drop(self) -> None:
        if self._conn is not None:
            with suppress(Exception):
                self._conn.collect()
        self._conn = None

    def wait_ready(self, timeout: float = 60.0) -> bool:
        """Wait until the node accepts AMQP connections."""

        def connects() -> bool:
            try:
                self._channel()
                return True
            except Exception:
                self._drop()
                return False

        return bool(wait_for(connects, timeout, 0.1))

    def queued(self, queue: str = QUEUE) -> int:
        """Return how many messages wait in `queue`, ready (not delivered, or requeued); 0 if it does not exist."""
        for attempt in (1, 2):  # once more on a fresh connection: the node may have restarted since the last poll
            try:
                return int(self._channel().queue_declare(queue, passive=True).message_count)
            except amqp.NotFound:
                self._drop()  # the channel is closed by the error
                return 0
            except (amqp.AMQPError, OSError):
                self._drop()
                if attempt == 2:
                    raise
        return 0

    def held(self) -> int:
        """Return how many messages consumers took and have not acked, in every queue (ETA waits included), plus
        the countdowns waiting in Celery's native delayed delivery queues (`celery_delayed_*`, quorum queues).

        AMQP does not tell; rabbitmqctl does (an Erlang VM per call: called only when all else is quiet).
        """
        out = self.ctl(
            "list_queues", "--quiet", "--no-table-headers", "name", "messages_ready", "messages_unacknowledged"
        )
        held = 0
        for name, ready, unacked in (line.split() for line in out.splitlines() if len(line.split()) == 3):
            held += int(unacked) + (int(ready) if name.startswith("celery_delayed_") else 0)
        return held

    def ctl(self, *args: str) -> str:
        """Run `rabbitmqctl -n <node> args` and return its output."""
        argv = [str(self.bindir / "rabbitmqctl"), "-n", self.node, *args]
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60, check=True)
        return done.stdout

    def flush(self) -> str:
        """The flush fault on RabbitMQ: purge the task queue (every message waiting in it is gone; the unacked
        ones stay with their consumers, as a purge leaves them)."""
        purged = int(self._channel().queue_purge(QUEUE) or 0)
        return f"queue.purge of {purged} messages"

    def restart(self, timeout: float = 60.0) -> bool:
        """Stop the node (SIGTERM: a clean stop, connections closed) and start it again on the same data."""
        self._drop()
        with suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.start()
        return self.wait_ready(timeout)

    def close(self) -> None:
        """Close the polling connection (the node itself is stopped with the other sessions)."""
        self._drop()


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
    """The outbox relay on the chaos app (tests/chaos/relay.py: `oncelery relay` with a short `rewake_after`):
    publishes the outbox, re-publishes what a Redis flush lost, wakes parked runs, releases stale reservations."""

    def __init__(
        self, sessions: Sessions, env: dict[str, str], logdir: Path, republish_after: float, rewake_after: float
    ) -> None:
        self.log = logdir / "relay.log"
        argv = [sys.executable, "-m", "tests.chaos.relay", "--interval", "0.2"]
        argv += ["--republish-after", f"{republish_after:g}", "--rewake-after", f"{rewake_after:g}"]
        self.env = {**env, "CHAOS_ROLE": "relay"}
        self.argv = argv
        self.sessions = sessions
        self.proc = sessions.spawn(argv, self.env, self.log)
        self.restarts = 0

    @property
    def pid(self) -> int:
        """The current incarnation's PID (also its session and process group id)."""
        return self.proc.pid

    def ready(self) -> bool:
        """Whether the relay runs its rounds (it printed its start line)."""
        try:
            return self.proc.poll() is None and "relay: publishing" in self.log.read_text(errors="replace")
        except OSError:
            return False

    def keep_alive(self) -> bool:
        """Restart the relay if it exited (killed, or it could not start while the database restarted)."""
        if self.proc.poll() is None:
            return False
        self.proc = self.sessions.spawn(self.argv, self.env, self.log)
        self.restarts += 1
        return True


class FakeProvider:
    """The fake model provider as a process of its own (`python -m oncelery.fake_provider`), driven over its HTTP
    control API: its counters (creates per intent, errors served, cancels, calls forgotten) are the runner's
    ledger of what the provider billed, kept outside everything the faults hit."""

    def __init__(self, sessions: Sessions, workdir: Path, knobs: dict[str, Any]) -> None:
        self.log = workdir / "fake-provider.log"
        argv = [sys.executable, "-m", "oncelery.fake_provider", "--port", "0", "--knobs", json.dumps(knobs)]
        self.proc = sessions.spawn(argv, dict(os.environ), self.log)
        self.url = ""
        self.control: FakeProviderControl | None = None

    def wait_ready(self, timeout: float = 30.0) -> bool:
        """Wait until it printed its URL (its first line) and answers its health check."""

        def answers() -> bool:
            if self.proc.poll() is not None:
                return False
            if not self.url:
                first = self.log.read_text(errors="replace").split("\n", 1)[0].strip() if self.log.exists() else ""
                if not first.startswith("http://"):
                    return False
                self.url = first
            try:
                self.control = FakeProviderControl(self.url)
                self.control.stats()
                return True
            except OSError:
                return False

        return bool(wait_for(answers, timeout, 0.05))

    def stats(self) -> dict[str, Any]:
        """Its counters now."""
        return self._control().stats()

    def knobs(self, **knobs: Any) -> dict[str, Any]:
        """Change knobs (all or none); return every knob's value."""
        return self._control().set_knobs(**knobs)

    def release(self) -> int:
        """Answer every held create now; return how many were held."""
        return self._control().release()

    def forget(self, call_id: str) -> int:
        """Drop one call, as past the provider's retention (its retrieve answers 404); 1 if it was there."""
        return self._control().forget(call_id)

    def _control(self) -> FakeProviderControl:
        if self.control is None:
            raise RuntimeError("the fake provider is not ready")
        return self.control
