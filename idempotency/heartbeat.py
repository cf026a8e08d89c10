"""A holder's lease renewal thread: keeps a claim alive while the body runs, notices a takeover."""

from __future__ import annotations

import logging
import threading

from idempotency.errors import LeaseLost
from idempotency.settings import HEARTBEATS_PER_LEASE
from idempotency.store import Claim, RunStore

logger = logging.getLogger(__name__)


class Heartbeat:
    """Renews `claim`'s lease every lease/3 seconds until stopped; `check()` raises LeaseLost after a takeover."""

    def __init__(self, store: RunStore, claim: Claim) -> None:
        self.store = store
        self.claim = claim
        self.interval = claim.lease / HEARTBEATS_PER_LEASE
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"oncelery-heartbeat-{claim.run_id}", daemon=True)

    def start(self) -> Heartbeat:
        """Start renewing in a daemon thread (a thread, so a frozen process also stops renewing)."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop renewing and wait for an in-flight renewal to finish."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def check(self) -> None:
        """Raise LeaseLost if a renewal found the claim taken over."""
        if self.lost:
            raise LeaseLost(
                f"{self.claim.task_name}[{self.claim.key}]: lease lost (token {self.claim.token} was taken over)",
                task_name=self.claim.task_name,
                key=self.claim.key,
                token=self.claim.token,
            )

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                ok = self.store.heartbeat(self.claim)
            except Exception as exc:
                # A database blip is not a takeover: keep trying; the fenced completion decides.
                logger.warning("heartbeat for %s failed: %s", self.claim.key, exc)
                continue
            if not ok:
                if self._stop.is_set():
                    return  # the run completed (or failed) while this renewal ran: not a takeover
                logger.warning("lease lost for %s token=%d", self.claim.key, self.claim.token)
                self.lost = True
                return
