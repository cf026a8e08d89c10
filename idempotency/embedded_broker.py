"""The embedded default's broker: kombu's filesystem transport, woken as soon as a worker's prefetch window frees.

kombu's virtual transports poll: when a worker's prefetch window is full (prefetch 1 per child), its drain loop
finds nothing it may take and sleeps a whole `polling_interval` before it looks again, however soon a child
acks. With prefetch 1 that caps a worker near concurrency / polling_interval jobs/s, whatever the jobs cost.

This transport is the filesystem transport with one change: an ack or a reject (which frees a slot of the
window, in the pool's result thread) wakes the drain loop at once. An empty queue is still polled every
`polling_interval` (another process's new message has no such signal). Messages, folders, options and
semantics are the filesystem transport's own: `oncelery.celeryconfig` selects it with `broker_transport` for
the embedded default (`broker_url` stays `filesystem://`).
"""

from __future__ import annotations

import threading
from queue import Empty
from time import monotonic
from typing import Any

from kombu.transport import filesystem, virtual

#: The `broker_transport` setting that selects this transport (with broker_url = "filesystem://").
TRANSPORT = "oncelery.embedded_broker:Transport"


class QoS(virtual.QoS):
    """The virtual prefetch window, which tells its transport when a slot frees."""

    def ack(self, delivery_tag: Any) -> None:
        """Settle the message, then wake the drain loop: a child is free for the next one."""
        super().ack(delivery_tag)
        self.channel.connection.slot_freed.set()

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        """Settle (or requeue) the message, then wake the drain loop."""
        super().reject(delivery_tag, requeue=requeue)
        self.channel.connection.slot_freed.set()


class Channel(filesystem.Channel):
    """The filesystem channel with a waking prefetch window."""

    QoS = QoS


class Transport(filesystem.Transport):
    """kombu's filesystem transport whose drain loop waits for a freed slot instead of sleeping blind."""

    Channel = Channel

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        self.slot_freed = threading.Event()

    def drain_events(self, connection: Any, timeout: Any = None, **kwargs: Any) -> None:
        """Deliver one message; between empty polls wait up to `polling_interval`, less if a slot frees."""
        cycle: Any = self.cycle  # a FairCycle, set by the virtual transport's __init__
        deadline = None if timeout is None else monotonic() + timeout
        while True:
            # Cleared before looking: an ack that lands after the look and before the wait ends the wait.
            self.slot_freed.clear()
            try:
                cycle.get(self._deliver, timeout=timeout)
                return
            except Empty:
                pass
            wait = self.polling_interval
            if deadline is not None:
                left = deadline - monotonic()
                if left <= 0:
                    raise TimeoutError()  # socket.timeout, which Celery's worker loop expects
                wait = left if wait is None else min(wait, left)
            if wait is not None:  # None: poll again at once, as kombu does
                self.slot_freed.wait(wait)
