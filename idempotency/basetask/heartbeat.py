"""The heartbeat file: a long-running process touches it while it works; its age is the container's health check.

Why a file: `celery inspect ping` starts a whole Celery client and a broker round trip per check per worker,
and answers "the broker and one consumer thread are up", not "this container's worker loop turns". Touching a
file costs one utime() call, and `deploy/bin/oncelery-healthcheck heartbeat` reads its age with `stat`, no
Python. Who touches it ($ONCELERY_HEARTBEAT_FILE; unset: nobody):

- a worker, on every Celery heartbeat (`heartbeat_sent`, every 2 s from the consumer's timer: with the
  default prefork pool that timer runs in the worker's event loop, so a stuck loop stops the beats);
- the relay, after every round that reached the database (`Relay.serve`): an outage makes it stale.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from celery import signals

from oncelery.settings import ENV_HEARTBEAT_FILE

__all__ = [
    "HeartbeatFile",
    "heartbeat_file",
    "watch_worker_heartbeat",
]

logger = logging.getLogger("oncelery.heartbeat")


class HeartbeatFile:
    """A file whose modification time says when its process last proved it was working."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._failing = False

    def beat(self) -> None:
        """Set the file's modification time to now, creating it; a failure is logged once, never raised."""
        try:
            try:
                os.utime(self.path)
            except FileNotFoundError:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.path.touch()
        except OSError as exc:  # a health signal must never take the worker or the relay down
            if not self._failing:
                logger.warning("cannot touch the heartbeat file %s (%s): health checks will fail", self.path, exc)
            self._failing = True
            return
        self._failing = False


_files: dict[str, HeartbeatFile] = {}  # one per path, so a failing file warns once, not every beat


def heartbeat_file() -> HeartbeatFile | None:
    """The heartbeat file $ONCELERY_HEARTBEAT_FILE names, or None when it is unset."""
    path = os.environ.get(ENV_HEARTBEAT_FILE, "").strip()
    if not path:
        return None
    return _files.setdefault(path, HeartbeatFile(path))


def watch_worker_heartbeat() -> None:
    """Make every worker of this process touch $ONCELERY_HEARTBEAT_FILE on each Celery heartbeat (when set)."""

    def beat(sender: Any = None, **_: Any) -> None:
        target = heartbeat_file()  # read per beat: cheap, and a test or a wrapper may set it after import
        if target is not None:
            target.beat()

    # Celery's Heart reads whether the signal has receivers when it starts, in the consumer: connected at
    # import of the task module, it is there before any worker starts.
    signals.heartbeat_sent.connect(beat, weak=False, dispatch_uid="oncelery.heartbeat")
