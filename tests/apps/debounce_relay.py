"""One relay round, SIGKILLed mid-dispatch, for the debounce tests (`python -m tests.apps.debounce_relay POINT`).

The app is tests/apps/outbox_app.py's (configured from the environment, no task registered: the dispatcher sends
by task name, and the test's in-process worker runs the body). POINT is where the process kills itself:

    debounce_dispatched   the due bursts' outbox rows are written, their transaction not yet committed
    relay_published       the bursts are committed and published, their outbox rows not yet marked SENT
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from oncelery import Relay
from oncelery.runs.faults import fault_injected
from tests.apps.outbox_app import ENV_DATABASE_URL, app

POINTS = ("debounce_dispatched", "relay_published")


def _die(_name: str, _context: dict[str, Any]) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def crash_at(point: str) -> None:
    """Run one relay round that is SIGKILLed at `point` (exit status -9)."""
    with fault_injected(point, _die):
        done = Relay(app, os.environ[ENV_DATABASE_URL], sweep_interval=None).run_once()
    # Only reached if the round never got to the point: the test sees exit status 3, not -9.
    print(f"the relay round ended without reaching {point}: {done}", flush=True)
    sys.exit(3)


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in POINTS:
        sys.exit(f"usage: python -m tests.apps.debounce_relay {'|'.join(POINTS)}")
    crash_at(sys.argv[1])
