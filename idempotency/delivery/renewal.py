"""Lease renewal while a body runs (the liveness rule itself is `clock.lease_live`).

Renewal: one daemon thread per process renews every live claim every lease/3 seconds.

One shared thread instead of a thread per job: starting and joining a thread per job cost more CPU than
the job's two database statements. A thread (not the body's own code) renews, so a frozen process
(SIGSTOP, GC pause) also stops renewing, which is what lets another worker take over.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from oncelery.errors import LeaseLost
from oncelery.runs.faults import fault_point
from oncelery.settings import HEARTBEATS_PER_LEASE

if TYPE_CHECKING:
    from oncelery.runs.claims import RunStore
    from oncelery.runs.decisions import Claim

__all__ = [
    "Heartbeat",
]

logger = logging.getLogger("oncelery.leases")  # a stable name (users filter on it)


class Heartbeat:
    """Renews `claim`'s lease every lease/3 seconds until stopped; `check()` raises LeaseLost after a takeover."""

    def __init__(
        self, store: RunStore, claim: Claim, max_lease: float | None = None, watch: Callable[[], bool] | None = None
    ) -> None:
        self.store = store
        self.claim = claim
        self.interval = claim.lease / HEARTBEATS_PER_LEASE
        # A hung body must not hold its key for ever: after max_lease seconds of running (measured by this
        # process, which only decides when to stop asking), renewals stop; the lease then expires by the
        # database clock and another delivery can take the run over, while this holder stays fenced out.
        self.renew_until = time.monotonic() + max_lease if max_lease is not None else None
        self.lost = False
        self.stopped = False
        # Asked after each renewal (a debounced run: runs/debounce.py): True when it fenced this run out (a newer
        # edit superseded it), which this holder then learns as a lost lease.
        self.watch = watch
        self.superseded = False
        # Clear while the watch is being asked: its fence may commit before it returns, and a body that meets the
        # fence (LeaseLost) in that moment must wait for the answer, or it would count a lease lost.
        self._answered: threading.Event | None = None
        if watch is not None:  # only a debounced run's: no Event per job on the hot path
            self._answered = threading.Event()
            self._answered.set()

    def start(self) -> Heartbeat:
        """Register with this process's renewal thread (started on first use, again after a fork)."""
        _service().add(self)
        return self

    def stop(self) -> None:
        """Stop renewing; a renewal in flight for this claim can no longer mark it lost."""
        if not self.stopped:
            self.stopped = True
            _service().forget()

    def check(self) -> None:
        """Raise LeaseLost if a renewal found the claim taken over."""
        if self.lost:
            c = self.claim
            raise LeaseLost.for_holder(c.task_name, c.key, c.token, "a renewal found the run taken over")

    def renew(self) -> bool:
        """Renew once; return whether to keep renewing."""
        if self.stopped:
            return False
        if self.renew_until is not None and time.monotonic() >= self.renew_until:
            logger.warning(
                "%s[%s] token=%d ran past its max_lease: no longer renewing; another worker may take it over",
                self.claim.task_name,
                self.claim.key,
                self.claim.token,
            )
            return False
        try:
            fault_point("heartbeat", task=self.claim.task_name, key=self.claim.key, token=self.claim.token)
            ok = self.store.heartbeat(self.claim)
        except Exception as exc:
            # A database blip is not a takeover: keep trying; the fenced completion decides.
            logger.warning("heartbeat for %s failed: %s", self.claim.key, exc)
            return not self.stopped
        if ok and self.watch is not None and not self.stopped and self._superseded():
            return False
        if ok or self.stopped:
            return not self.stopped  # a renewal racing the run's own completion is not a takeover
        logger.warning("lease lost for %s token=%d", self.claim.key, self.claim.token)
        self.lost = True
        return False

    def was_superseded(self, wait: float = 10.0) -> bool:
        """Whether a newer edit fenced this run out, once a question in flight has its answer (at most `wait` s)."""
        if self._answered is None:
            return False
        self._answered.wait(wait)
        return self.superseded

    def _superseded(self) -> bool:
        """Ask the watch; if it fenced the run out, this holder has lost it (its writes fail with LeaseLost)."""
        answered = self._answered
        if answered is None:
            return False
        answered.clear()
        try:
            try:
                fenced = bool(self.watch and self.watch())
            except Exception as exc:  # a blip: the next renewal asks again
                logger.warning("supersede check for %s failed: %s", self.claim.key, exc)
                return False
            if fenced:
                logger.info("%s token=%d superseded by a newer edit", self.claim.key, self.claim.token)
                self.superseded = self.lost = True
            return fenced
        finally:
            answered.set()  # after the flags: a waiting body reads the answer


_COMPACT_AFTER = 64


class _Service:
    """The renewal thread of one process: a heap of (due time, heartbeat)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Heartbeat]] = []
        self._stopped = 0  # stopped heartbeats still in the heap
        self._seq = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="oncelery-heartbeat", daemon=True)
        self._thread.start()

    def add(self, hb: Heartbeat) -> None:
        with self._cond:
            heapq.heappush(self._heap, (time.monotonic() + hb.interval, next(self._seq), hb))
            # Wake the thread only if this renewal is due before the one it sleeps for: leases of one process
            # are alike, so a new claim rarely is, and a short job costs no thread switch (docs/benchmarks.md).
            if self._heap[0][2] is hb:
                self._cond.notify()

    def forget(self) -> None:
        """Count one more stopped heartbeat; drop them all once they are half the heap (memory stays bounded)."""
        # The thread sleeps until the first renewal is due (a lease/3 away), so the heartbeats of short jobs
        # would pile up until then (~10,000 at 500 jobs/s, lease 60 s): compacting here, amortized O(1) per
        # job, keeps the heap at most twice the live ones, with no thread switch.
        with self._cond:
            self._stopped += 1
            if self._stopped > _COMPACT_AFTER and 2 * self._stopped > len(self._heap):
                self._heap = [entry for entry in self._heap if not entry[2].stopped]
                heapq.heapify(self._heap)
                self._stopped = 0

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._heap and self._heap[0][2].stopped:
                    heapq.heappop(self._heap)  # finished runs leave without a database trip
                    self._stopped = max(0, self._stopped - 1)
                if not self._heap:
                    self._cond.wait()
                    continue
                due, _, hb = self._heap[0]
                delay = due - time.monotonic()
                if delay > 0:
                    self._cond.wait(delay)
                    continue
                heapq.heappop(self._heap)
            if hb.renew():
                self.add(hb)


_services: dict[int, _Service] = {}
_lock = threading.Lock()


def _service() -> _Service:
    pid = os.getpid()
    service = _services.get(pid)
    if service is None:
        with _lock:
            service = _services.get(pid)
            if service is None:
                service = _services[pid] = _Service()
    return service
