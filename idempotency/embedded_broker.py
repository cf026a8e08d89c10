"""The embedded default's broker: kombu's filesystem transport, woken as soon as a worker's prefetch window frees.

kombu's virtual transports poll: when a worker's prefetch window is full (prefetch 1 per child), its drain loop
finds nothing it may take and sleeps a whole `polling_interval` before it looks again, however soon a child
acks. With prefetch 1 that caps a worker near concurrency / polling_interval jobs/s, whatever the jobs cost.

kombu's filesystem channel also lists and sorts the whole folder (every queue's files) to take one message,
and to find none in an empty queue: with N messages queued, each poll costs O(N log N), and draining a
backlog costs O(N² log N) in the worker's main process.

kombu's filesystem channel also creates a message's file under its final name and then writes it: a consumer
listing the folder in between takes an empty file, fails to decode it and has removed it (the message is lost);
and it names files by `time.monotonic()`, which restarts at boot and differs between hosts sharing a folder.

This transport is the filesystem transport with these changes:
- an ack or a reject (which frees a slot of the window, in the pool's result thread) wakes the drain loop at
  once. An empty queue is still polled every `polling_interval` (another process's new message has no such
  signal);
- one listing of the folder, sorted into queues, serves every queue's fetches; the folder is listed again
  when the asked queue's part of it is used up, at most once per `polling_interval` (an empty queue is
  seen again as often as kombu's poll would see it). Each message is still taken by moving its file away
  (a file another consumer took meanwhile is skipped), oldest first;
- a message is written to `<name>.part` and renamed to `<name>` (`.msg`) once whole: a listing sees whole
  messages only. It is taken by renaming it to `<name>.taken` in the same folder (atomic: one consumer wins,
  where kombu moves it to the temporary directory, a copy if that is another filesystem);
- names start with the wall clock in nanoseconds (20 digits), strictly increasing in each process: one
  producer's messages are taken in the order sent (kombu's millisecond names tie, and ties go by a uuid);
- a file that is not a JSON message is kept as `<name>.malformed` and logged, not lost, and the next is taken;
- an exchange's table file found empty (another process is creating it) means no bindings yet, not an error;
- a worker told to stop (Celery's shutdown flag is set) takes no more messages, and its drain returns at once
  instead of polling out Celery's 2 s drain timeout twice.
Messages, folders, options and semantics are otherwise the filesystem transport's own. It has its own URL scheme,
`oncelery-fs://`, registered with kombu when `oncelery` is imported; `oncelery.celeryconfig` uses it for the
embedded default. (Not Celery's `broker_transport` setting: that would apply to any broker URL given later,
e.g. `celery --broker=redis://... flower` in a folder holding the config, and silently read files instead.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
import uuid
from collections import deque
from queue import Empty
from time import monotonic
from typing import Any

from celery.worker import state as worker_state
from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem, virtual
from kombu.utils.json import dumps, loads

__all__ = [
    "SCHEME",
    "TRANSPORT",
    "URL",
    "Channel",
    "QoS",
    "Transport",
    "is_embedded_broker",
]

logger = logging.getLogger("oncelery.embedded_broker")  # a stable name (users filter on it)

#: The transport, and its URL: `broker_url = "oncelery-fs://"` (with the filesystem transport's options).
TRANSPORT = "oncelery.embedded_broker:Transport"
SCHEME = "oncelery-fs"
URL = f"{SCHEME}://"
# Brokers whose messages are files on this host: a worker killed with a message fetched loses it (no acks).
_SPOOL_URLS = ("filesystem://", URL)


def is_embedded_broker(broker_url: str | None) -> bool:
    """Whether `broker_url` is a file spool on this host (this transport or kombu's filesystem://): no server."""
    return str(broker_url or "").startswith(_SPOOL_URLS)


class _Names:
    """Message file names that sort in the order this process sent them (wall clock, strictly increasing)."""

    def __init__(self) -> None:
        self._last = 0
        self._lock = threading.Lock()
        # A child forked while another thread held the lock would wait on it for ever: it gets a new one.
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    def next(self, queue: str) -> str:
        with self._lock:
            # The wall clock, not kombu's monotonic one: comparable across processes, hosts and reboots. A
            # clock that steps back still gives this process's next name a later place (max with last + 1).
            self._last = max(time.time_ns(), self._last + 1)
            stamp = self._last
        return f"{stamp:020d}_{uuid.uuid4()}.{queue}.msg"


def _worker_stopping() -> bool:
    """Whether this process is a Celery worker told to stop: Celery's own flags, as `state.maybe_shutdown` reads
    them (set by its SIGTERM/SIGINT/SIGQUIT handlers; 0, EX_OK, is set too)."""
    return any(
        flag is not None and flag is not False for flag in (worker_state.should_stop, worker_state.should_terminate)
    )


_names = _Names()
_SKIPPED = object()  # _take's answer for a file that is not (or no longer) a message to deliver


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
    """The filesystem channel with a waking prefetch window, taking messages from one listing at a time."""

    QoS = QoS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._listed: dict[str, deque[str]] = {}  # per queue: its files at the last listing, oldest first
        self._listed_at = float("-inf")  # monotonic time of the last listing

    def _get(self, queue: str, timeout: Any = None) -> Any:
        """Take the oldest message of `queue` that no other consumer took; raise Empty if there is none."""
        pending = self._listed.get(queue)
        if not pending and monotonic() - self._listed_at >= (self.connection.polling_interval or 0.0):
            self._list_folder()
            pending = self._listed.get(queue)
        while pending:
            message = self._take(pending.popleft())
            if message is not _SKIPPED:
                return message
        raise Empty()

    def _list_folder(self) -> None:
        """Sort the folder's message files (`<time>_<uuid>.<queue>.msg`) into their queues, oldest first."""
        listed: dict[str, deque[str]] = {}
        for name in sorted(os.listdir(self.data_folder_in)):
            queue, dot, ext = name.partition(".")[2].rpartition(".")
            if dot and ext == "msg":
                listed.setdefault(queue, deque()).append(name)
        self._listed, self._listed_at = listed, monotonic()

    def _take(self, name: str) -> Any:
        """Take the message file `name` and decode it; _SKIPPED if another consumer took it first, or if it is
        not a JSON message (then kept beside the queue as `<name>.malformed`, and logged)."""
        path = os.path.join(self.data_folder_in, name)
        taken = f"{path}.taken"
        try:
            os.rename(path, taken)  # atomic in one folder: of consumers racing for it, one wins
        except OSError:
            return _SKIPPED  # taken by another consumer
        try:
            with open(taken, "rb") as file:
                payload = file.read()
        except OSError as exc:
            raise ChannelError(f"Cannot read file {taken!r} from queue.") from exc
        try:
            message = loads(payload)
        except ValueError as exc:
            kept = f"{path}.malformed"
            os.replace(taken, kept)
            logger.error(
                "embedded broker: %s is not a JSON message (%s); kept as %s and not delivered: read it, then "
                "delete it, or fix it and rename it back to %s to send it again",
                name,
                exc,
                kept,
                name,
            )
            return _SKIPPED
        if self.store_processed:
            os.makedirs(self.processed_folder, exist_ok=True)
            shutil.move(taken, os.path.join(self.processed_folder, name))
        else:
            os.remove(taken)
        return message

    def get_table(self, exchange: Any) -> Any:
        """The exchange's bindings; none yet while its table file is being created (kombu raised on it)."""
        try:
            return super().get_table(exchange)
        except ValueError:
            # kombu creates the table file (empty) before it locks and writes it: a reader in between sees
            # an empty file, the same as a table not written yet. Anything else is a broken table: raise.
            if self._exchange_file(exchange).stat().st_size == 0:
                return []
            raise

    # kombu's filesystem channel adds **kwargs to its base's _put(queue, message): mypy can't match both.
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Write the message whole under a temporary name, then rename it into the queue (atomic)."""
        path = os.path.join(self.data_folder_out, _names.next(queue))
        part = f"{path}.part"
        try:
            with open(part, "wb") as file:
                file.write(dumps(payload).encode("utf-8"))
            os.rename(part, path)
        except OSError as exc:
            with contextlib.suppress(OSError):  # never created, or already renamed: nothing of it to leave behind
                os.remove(part)
            raise ChannelError(f"Cannot add file {path!r} to directory") from exc


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
            if _worker_stopping():
                # Celery's blocking worker loop (synloop, the loop of every non-evented transport like this one)
                # looks at the shutdown flag only between drain_events(timeout=2.0) calls, and drains once more
                # after seeing it (in a `finally`): polling out both calls held every warm shutdown 2-4 s. A
                # stopping worker takes no new message (taking one deletes its file), and nothing it still owes
                # runs here: acks and rejects are settled by the QoS itself, and unacked messages are put back
                # when the channel closes. So answer "nothing came" at once, as the poll would have.
                raise TimeoutError()
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


# kombu resolves a URL's scheme through this table (a URL may not name a module itself).
TRANSPORT_ALIASES.setdefault(SCHEME, TRANSPORT)
