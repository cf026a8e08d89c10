"""A Celery worker in a child process, started and stopped by its PID (for the demo and benchmarks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
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
    ) -> None:
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
            NODE_NAME,
            # No neighbours to sync with: mingle would wait a second for replies at every start.
            "--without-mingle",
            "--without-gossip",
        ]
        self.log_path = log_path
        self.env = dict(os.environ if env is None else env)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> LocalWorker:
        """Start the worker process (it consumes as soon as it has booted)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
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

    def log_tail(self, lines: int = 20) -> str:
        """Return the last `lines` lines of the worker's output."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])
