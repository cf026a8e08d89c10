"""The loop of `oncelery process`: progress, worker kills, and the relay that recovers what a dead worker lost.

The producer never re-sends. Every delivery was written to the outbox (the durable record of intent), and
an in-process `oncelery.Relay` publishes it, then recovers what a broker loses with its worker (the embedded
filesystem broker deletes a message when a worker takes it, so a SIGKILLed worker's jobs are gone):
- its sweeper re-sends the stored message of a run whose holder vanished, once the lease has expired by
  the database clock;
- once nothing has moved for `quiet` seconds and the queue is empty, it re-publishes each outbox row whose
  run never started or whose holder vanished (a message lost before it was claimed).
The claim absorbs every copy that was not needed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import click
from celery import Celery
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from oncelery import WAIT_BACKOFF_CAP, Outcome, Relay, Runs, RunStatus
from oncelery.tasks.commands.local_worker import LocalWorker

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.2
LINE_EVERY = 2.0  # seconds between progress lines when the output is not a terminal
KILL_AIM_SECONDS = 1.0  # how long a kill waits for a moment when exactly one job is mid-pipeline
# A waiting delivery re-checks at least every WAIT_BACKOFF_CAP seconds: this long without a new outcome
# means no delivery is left in flight.
SETTLE_QUIET = WAIT_BACKOFF_CAP + 1.0
# A test (or a script that does not mind copies left for a later run) shortens that wait with this variable.
ENV_SETTLE_QUIET = "ONCELERY_PROCESS_SETTLE_S"


def settle_quiet() -> float:
    """Seconds without a new outcome after which `process` stops waiting for copies: SETTLE_QUIET, or the env's."""
    try:
        return max(0.0, float(os.environ.get(ENV_SETTLE_QUIET, SETTLE_QUIET)))
    except ValueError:
        return SETTLE_QUIET


# Outcomes that end a delivery; in_progress and lease_lost re-send the message, so they do not.
SETTLED = (Outcome.EXECUTED, Outcome.REPLAYED, Outcome.RESUMED, Outcome.CONFLICT, Outcome.STALE, Outcome.FAILED)
SETTLED_NAMES = tuple(o.value for o in (*SETTLED, Outcome.DEAD))


class Watch:
    """Follows one `process` run to the end: every article COMPLETED, killing and re-sending on the way."""

    def __init__(
        self,
        app: Celery,
        task: Any,
        runs: Runs,
        keys: Sequence[str],
        calls: Sequence[tuple[Any, ...]],
        outcomes_before: dict[str, int],
        worker: LocalWorker | None,
        console: Console,
        kill_every: int | None,
        relay: Relay | None = None,
    ) -> None:
        self.app, self.task, self.runs = app, task, runs
        self.keys, self.calls = list(keys), list(calls)
        self.index = {k: i for i, k in enumerate(self.keys)}
        self.outcomes_before = outcomes_before
        self.worker, self.console = worker, console
        self.kill_every = kill_every
        self.relay = relay
        self.sent_first = self.sent_duplicates = self.sent_again = 0
        self.kills = self.interrupted = 0
        self.dead: set[tuple[str, int]] = set()  # (key, token) of claims whose holder this command killed
        self.started = 0.0
        self.first_result: float | None = None
        self.completed_before = runs.statuses(task.name, self.keys).get(RunStatus.COMPLETED, 0)
        self.next_kill = kill_every
        self.status = ""
        self._progress: Progress | None = None
        self._bar: Any = None
        self._last_line = 0.0
        self._connection: Any = None

    # -- the loop ------------------------------------------------------------------------------------

    def pending_keys(self) -> list[str]:
        """Return the keys whose run is not COMPLETED."""
        done = self._completed_keys()
        return [k for k in self.keys if k not in done]

    def start(self) -> None:
        """Start the clock (and the progress bar on a terminal)."""
        self.started = time.monotonic()
        if self.console.is_terminal:
            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("scoring"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[detail]}"),
                console=self.console,
            )
            self._progress.start()
            self._bar = self._progress.add_task("scoring", total=len(self.keys), detail="")

    def run_until_done(self, timeout: float, quiet: float) -> float | None:
        """Poll until every article is COMPLETED (return that moment) or `timeout` passes (return None)."""
        deadline = self.started + timeout
        marker: tuple[int, int] | None = None
        moved = time.monotonic()
        while True:
            completed = self.runs.statuses(self.task.name, self.keys).get(RunStatus.COMPLETED, 0)
            counts = self._outcomes()
            now = time.monotonic()
            settled = self._settled(counts)
            if self.first_result is None and (completed > self.completed_before or settled > 0):
                self.first_result = now
            if (completed, settled) != marker:
                marker, moved = (completed, settled), now
            self._show(completed, counts, now)
            if completed >= len(self.keys):
                self._show(completed, counts, now, final=True)
                return now
            self._check_worker()
            if self.next_kill is not None and completed - self.completed_before >= self.next_kill:
                self._kill(completed)
                moved = time.monotonic()
            elif self._recover(republish=now - moved >= quiet and self._queue_empty()):
                moved = time.monotonic()
            if now > deadline:
                self._show(completed, counts, now, final=True)
                return None
            time.sleep(POLL_SECONDS)

    def settle(self, timeout: float, finished: float) -> float:
        """Wait until every delivery sent has an outcome, or none came for SETTLE_QUIET seconds (lost copies).

        Return when the last delivery was answered (at least `finished`, when the last article was scored).
        Stopping the worker earlier would put its waiting deliveries back in the queue for a later run.
        """
        sent = self.sent_first + self.sent_duplicates + self.sent_again
        deadline = self.started + timeout
        quiet = settle_quiet()
        answered_at, answered = finished, None
        last, changed = None, time.monotonic()
        while True:
            counts = self._outcomes()
            now = time.monotonic()
            settled = self._settled(counts)
            if answered is not None and settled != answered:
                answered_at = now
            answered = settled
            if counts != last:
                last, changed = counts, now
            if settled >= sent or now > deadline or now - changed > quiet:
                return answered_at
            time.sleep(POLL_SECONDS)

    def close(self) -> None:
        """Stop the progress bar and close the broker connection used for queue sizes."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._connection is not None:
            self._connection.release()
            self._connection = None

    # -- faults and the producer's half -----------------------------------------------------------------

    def _kill(self, completed: int) -> None:
        worker = self.worker
        if worker is None:
            return
        in_flight = self._aim()
        victims = worker.kill()
        self.dead.update(in_flight)
        self.kills += 1
        self.interrupted += len(in_flight)
        self.next_kill = (self.next_kill or 0) + (self.kill_every or 0)
        done = completed - self.completed_before
        pids = ", ".join(map(str, victims))
        self._say(
            f"kill {self.kills}: SIGKILLed the worker and its pool (pids {pids}) after {done} articles, "
            f"{len(in_flight)} job(s) mid-pipeline"
        )
        worker.start()
        self._say(f"restarted: started a worker: pid {worker.pid}")

    def _aim(self) -> list[tuple[str, int]]:
        """Wait (briefly) for a moment when exactly one job is mid-pipeline; return the live claims then."""
        deadline = time.monotonic() + KILL_AIM_SECONDS
        while True:
            live = [claim for claim in self._running() if claim not in self.dead]
            if len(live) == 1 or time.monotonic() > deadline:
                return live
            time.sleep(0.01)

    def _running(self) -> list[tuple[str, int]]:
        running = self.runs.list(task_name=self.task.name, status=RunStatus.RUNNING, keys=self.keys, limit=None)
        return [(run.key, run.token) for run in running]

    def _recover(self, republish: bool) -> bool:
        """One relay round: publish, sweep lost runs, and (when quiet) re-publish unstarted rows; True if it sent."""
        if self.relay is None:
            return False
        done = self.relay.run_once(republish=republish)
        again = done.republished + done.swept
        if again:
            self.sent_again += again
            self._say(
                f"the relay re-sent {again} job(s) lost with a killed worker ({done.swept} swept from their runs, "
                f"{done.republished} re-published from the outbox); the claim absorbs any extra copy"
            )
        return bool(again or done.published)

    def _queue_empty(self) -> bool:
        """Return whether the queue holds no message (True when the broker cannot tell)."""
        name = str(self.app.conf.task_default_queue)
        try:
            if self._connection is None:
                self._connection = self.app.connection_for_read()
            _, count, _ = self._connection.default_channel.queue_declare(queue=name, passive=True)
        except Exception as exc:  # e.g. Redis answers NOT_FOUND for an empty (deleted) list
            logger.debug("queue size of %s unknown: %s", name, exc)
            return True
        return int(count) == 0

    def _check_worker(self) -> None:
        worker = self.worker
        if worker is not None and worker.exited() is not None:
            raise click.ClickException(
                f"the worker exited with code {worker.exited()}; its log ends:\n{worker.log_tail()}"
            )

    # -- reading and showing -----------------------------------------------------------------------------

    def _completed_keys(self) -> set[str]:
        return self.runs.keys_in(self.task.name, RunStatus.COMPLETED, self.keys)

    def _outcomes(self) -> dict[str, int]:
        counts = self.runs.outcome_counts(self.task.name)
        return {o.value: counts.get(o.value, 0) - self.outcomes_before.get(o.value, 0) for o in Outcome}

    @staticmethod
    def _settled(counts: dict[str, int]) -> int:
        return sum(counts[name] for name in SETTLED_NAMES)

    def _show(self, completed: int, counts: dict[str, int], now: float, final: bool = False) -> None:
        detail = (
            f"executed {counts['executed']} · replayed {counts['replayed']} · resumed {counts['resumed']} · "
            f"waits {counts['in_progress']} · kills {self.kills} · re-sent {self.sent_again}"
            + (f" · failed {counts['failed']}" if counts["failed"] else "")
            + (f" · {self.status}" if self.status and not final else "")
        )
        if self._progress is not None:
            self._progress.update(self._bar, completed=completed, detail=detail)
            return
        if final or now - self._last_line >= LINE_EVERY:
            self._last_line = now
            self.console.print(f"scored {completed}/{len(self.keys)} · {detail} · {now - self.started:.1f} s")

    def _say(self, line: str) -> None:
        (self._progress.console if self._progress is not None else self.console).print(line)
