"""A Celery worker in a child process, started, stopped and SIGKILLed by its PID (demo, process, benchmarks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from contextlib import suppress
from pathlib import Path

# A stable node name: the embedded broker keeps a pidbox queue per node name, so a fresh name per run
# would leave an orphaned queue behind each time.
NODE_NAME = "oncelery-demo@%h"
STOP_TIMEOUT = 30.0  # seconds a warm shutdown may take (running jobs finish) before SIGKILL


class LocalWorker:
    """`celery -A <app> worker` as a child process in its own session, its output in `log_path`."""

    def __init__(
        self,
        app: str,
        log_path: Path,
        concurrency: int = 2,
        env: Mapping[str, str] | None = None,
        loglevel: str = "WARNING",
        queues: Sequence[str] | None = None,
    ) -> None:
        node = NODE_NAME if not queues else f"oncelery-{'-'.join(queues)}@%h"
        self.argv = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            app,
            "worker",
            "--pool",
            "prefork",
            "-c",
            str(concurrency),
            "--loglevel",
            loglevel,
            "-n",
            node,
            # No neighbours to sync with: mingle would wait a second for replies at every start.
            "--without-mingle",
            "--without-gossip",
            *(["-Q", ",".join(queues)] if queues else []),
        ]
        self.log_path = log_path
        self.env = dict(os.environ if env is None else env)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> LocalWorker:
        """Start the worker process (it consumes as soon as it has booted); a restart appends to the log."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab" if self.proc is not None else "wb") as log:
            # Its own session: a Ctrl-C meant for the parent does not cold-stop the worker mid-job, and the
            # SIGKILL fallback can reach its pool children through the process group it leads.
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        return self

    @property
    def pid(self) -> int | None:
        """The worker's main process id, once started."""
        return self.proc.pid if self.proc is not None else None

    def exited(self) -> int | None:
        """Return the exit code if the worker has exited, else None."""
        return self.proc.poll() if self.proc is not None else None

    def stop(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """SIGTERM (warm shutdown: running jobs finish), then SIGKILL its process group after `timeout`."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return proc.returncode if proc is not None else None
        os.kill(proc.pid, signal.SIGTERM)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this worker leads (start_new_session)
            return proc.wait(timeout=timeout)

    def pool_pids(self) -> list[int]:
        """Return the PIDs of the worker's pool processes (its direct children; Linux /proc)."""
        if self.proc is None:
            return []
        pids: set[int] = set()
        # Any of its threads may have forked a replacement child: read every thread's list.
        for listing in Path(f"/proc/{self.proc.pid}/task").glob("*/children"):
            with suppress(OSError):
                pids.update(int(pid) for pid in listing.read_text().split())
        return sorted(pids)

    def kill(self) -> list[int]:
        """SIGKILL the worker and its pool processes at once (host loss) and reap it; return the PIDs killed.

        `start()` restarts it. (Killing only pool processes is not offered: a job dispatched to a pool process
        that dies before starting it is never rejected, its prefetch slot stays taken, and the worker can stop
        consuming altogether.)
        """
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return []
        victims = [proc.pid, *self.pool_pids()]
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group it leads (start_new_session): its pool dies too
        proc.wait(timeout=STOP_TIMEOUT)
        return victims

    def log_tail(self, lines: int = 20) -> str:
        """Return the last `lines` lines of the worker's output."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])
