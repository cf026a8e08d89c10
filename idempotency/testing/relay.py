"""A relay in a thread of the test: publishes the outbox, sweeps lost runs, and wakes WAITING runs when due."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from oncelery.relay.loop import Relay, RelayRound

__all__ = ["relay_running"]


@contextmanager
def relay_running(
    app: Any, url: str, interval: float = 0.05, sweep_interval: float | None = None, **relay_options: Any
) -> Iterator[Relay]:
    """Run `oncelery relay`'s loop for `app` on the claims database `url` in a thread for the block, then stop it.

    What a parked run (a model call past its inline wait) needs to wake in a test, as production needs
    `oncelery relay`. It publishes where the app routes: inside a kit worker's block or fixture, to the test's
    queues (oncelery.testing.isolation); it does not isolate the app itself, so that it serves a worker of your
    own too. `interval`: seconds between idle rounds (short, so a test waits on wakes, not on the
    loop); `sweep_interval`: the lost-run sweeper's interval (None: off, so a kill test decides when runs return);
    `relay_options`: the rest of `Relay`'s (e.g. `batch_poll_s=0.05` to poll provider batches often).
    """
    relay = Relay(app, url, sweep_interval=sweep_interval, **relay_options)
    stop = threading.Event()
    totals: list[RelayRound] = []
    thread = threading.Thread(
        target=lambda: totals.append(relay.serve(stop, interval=interval)), name="oncelery-test-relay", daemon=True
    )
    thread.start()
    try:
        yield relay
    finally:
        stop.set()
        thread.join(timeout=30)
