"""The model-call layer's faults, each injected when an observable condition says it will hit a call in flight.

Mixed into `Chaos` (tests/chaos/faults.py), whose victims, ledger and reads they share. The provider is the fake
(`python -m oncelery.fake_provider`, a process of the runner): its counters say which creates reached it.

- kill_create: SIGKILL in the create window. The fake holds the answer of the next create (`hold_creates`); the
  victim is a running attempt that holds its run, whose latest intent the database shows `prepared` and whose
  public id the fake counted a create for. Killed, its call was paid and never answered: the next holder sends it
  again labelled `create_window`, with an `unknown_outcome` row for the killed one.
- kill_poll: SIGKILL of a holder whose call is `sent` (its reference saved): it polls. The next holder re-attaches.
- kill_relay: the relay stopped between a wake's mark (committed) and its send: armed through a file, the relay's
  publish hook records where it stands and waits there (tests/chaos/jobs.py); the runner checks that the run is
  WAITING with its wake marked, and SIGKILLs the relay's process group. The keeper restarts it, and the run is
  woken again after `rewake_after`.
- revoke: `app.control.revoke` of the message of a run parked WAITING whose wake is at least half a second away:
  every worker discards the wake when it arrives and Oncelery makes the run DEAD (reason `revoked`), cancelling
  its call at the provider with a ledger row labelled `run_revoked`. Every second revoke aims at a run whose
  call the provider forgot first, so that the cancel fails (404): its call was made, and must still reach the
  ledger (and release its reservation). A hit needs the run DEAD; a revoke that did not take (the wake outran
  the broadcast, reached a worker restarted since, or the worker could not reach the database) is noted and
  another parked run is revoked.
- provider_5xx / provider_429: the next creates are refused with 503 (the client cannot know whether the
  provider has it: the intent stays `prepared`, the task retries, the retry re-sends labelled `create_window`) or
  429 (nothing made: the intent ends `failed`, the limiter is halved, a new intent waits its turn).
- forget: the response of a parked run's sent call is dropped by the provider (past its retention): the wake's
  poll gets a 404, the intent ends `lost` with an `unknown_outcome` row, and the call is made again, labelled `lost`.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.chaos.checker import Intent, Sut
from tests.chaos.ledger import Attempt, Ledger
from tests.chaos.procs import FakeProvider, Relay, Worker, wait_for
from tests.services import alive

if TYPE_CHECKING:
    from collections.abc import Callable

MODEL_FAULTS = ("kill_create", "kill_poll", "kill_relay", "revoke", "provider_5xx", "provider_429", "forget")
BURST_ERRORS = 3  # creates refused per provider error burst
REVOKE_AHEAD_S = 0.5  # a revoked run's wake is at least this far: the broadcast reaches the workers before it
REVOKE_TAKES_S = 20.0  # a revoke applied makes its run DEAD by then: its wake is due, queued and discarded before


class ModelFaults:
    """The model-call faults; `Chaos` provides the fields below."""

    workers: dict[str, Worker]
    ledger: Ledger
    sut: Sut
    log: Callable[[str], None]
    victims: list[int]
    fake: FakeProvider | None
    relay: Relay | None
    app: Any
    arm: Path | None
    revoked: list[int]
    revokes_not_applied: list[int]
    killed: set[int]
    counts: Counter[str]
    missed: Counter[str]

    def _fake(self) -> FakeProvider:
        if self.fake is None:
            raise RuntimeError("the model-call faults need the fake provider")
        return self.fake

    def _holders(self) -> Iterator[tuple[Worker, Attempt]]:
        """The running attempts of ready workers that hold their run (RUNNING under their token), newest first."""
        ready = {n: w for n, w in self.workers.items() if w.ready()}
        for att in self.ledger.open_attempts(tuple(ready)) if ready else []:
            worker = ready[att.host]
            if att.pid in self.killed or att.pid == worker.pid or not worker.owns(att.pid):
                continue
            if self.sut.holds(att.job, att.token):
                yield worker, att

    def _kill_child(self, how: str, worker: Worker, att: Attempt, intent: Intent) -> None:
        self.killed.add(att.pid)
        os.kill(att.pid, signal.SIGKILL)
        self.victims.append(att.job)
        self.log(
            f"  {how}: {worker.name} pid {att.pid}, job {att.job} token {att.token}, intent {intent.public_id} "
            f"attempt {intent.attempt} {intent.state}"
        )

    def kill_create(self, timeout: float) -> bool:
        """SIGKILL a holder whose create reached the provider (held there) while its intent is still `prepared`."""
        fake = self._fake()
        fake.knobs(hold_creates=1)

        def in_window() -> tuple[Worker, Attempt, Intent] | None:
            stats: dict[str, Any] | None = None
            for worker, att in self._holders():
                intent = self.sut.latest_intent(att.job)
                if intent is None or intent.state != "prepared":
                    continue
                stats = stats or fake.stats()
                if (
                    stats["held"]
                    and intent.public_id in stats["creates_by_intent"]
                    and self.sut.holds(att.job, att.token)
                ):
                    return worker, att, intent
            if stats is not None and not stats["held"] and not fake.knobs()["hold_creates"]:
                fake.knobs(hold_creates=1)  # the held create was answered (its hold timed out): hold the next one
            return None

        try:
            found = wait_for(in_window, timeout, 0.05)
            if found is None:
                return False
            self._kill_child("kill_create", *found)
            return True
        finally:
            fake.knobs(hold_creates=0)
            fake.release()

    def kill_poll(self, timeout: float) -> bool:
        """SIGKILL a holder whose call is `sent` (its reference saved): it is polling the provider."""

        def polling() -> tuple[Worker, Attempt, Intent] | None:
            for worker, att in self._holders():
                intent = self.sut.latest_intent(att.job)
                if intent is not None and intent.state == "sent" and self.sut.holds(att.job, att.token):
                    return worker, att, intent
            return None

        found = wait_for(polling, timeout, 0.02)
        if found is None:
            return False
        self._kill_child("kill_poll", *found)
        return True

    def kill_relay(self, timeout: float) -> bool:
        """SIGKILL the relay standing between a wake's mark (committed) and its send."""
        relay, arm = self.relay, self.arm
        if relay is None or arm is None:
            raise RuntimeError("kill_relay needs the relay and its arming folder")
        since = time.time()
        (arm / "wake").touch()

        def marked() -> tuple[int, int] | None:
            rows = self.ledger.rows(
                "SELECT job, pid FROM marks WHERE kind = 'wake_marked' AND at >= ? ORDER BY id DESC LIMIT 1", (since,)
            )
            if not rows:
                return None
            job, pid = int(str(rows[0][0])), int(str(rows[0][1]))
            run = self.sut.status_of(job)
            if pid == relay.pid and alive(pid) and run is not None and run == ("WAITING", True):
                return job, pid
            return None

        try:
            found = wait_for(marked, timeout, 0.02)
        finally:
            (arm / "wake").unlink(missing_ok=True)
        if found is None:
            return False
        job, pid = found
        os.killpg(pid, signal.SIGKILL)
        self.victims.append(job)
        back = wait_for(lambda: relay.pid != pid and relay.ready(), 30.0, 0.1)
        self.log(
            f"  kill_relay: relay pid {pid} between the wake's mark and its send, job {job}; restarted={bool(back)}"
        )
        return True

    def revoke(self, timeout: float) -> bool:
        """Revoke a parked run's message: it must end DEAD (reason revoked), its call cancelled and on the books.

        A revoke that does not make its run DEAD within REVOKE_TAKES_S (a worker's cancel could not reach the
        database, or the wake outran the broadcast) is noted in `revokes_not_applied` and another parked run is
        revoked, within `timeout`. Its job is still one the runner revoked: the checker accepts it DEAD (revoked)
        or completed with its one effect.
        """
        deadline = time.monotonic() + timeout
        gone = (self.counts["revoke"] + self.missed["revoke"]) % 2 == 1  # every second revoke: its cancel fails
        while time.monotonic() < deadline:
            # Every worker up: a revoke is a broadcast to the workers consuming now (a worker restarted later
            # never hears of it, and would run the wake).
            found = wait_for(
                lambda: all(w.ready() for w in self.workers.values()) and next(iter(self._revocable(gone)), None),
                deadline - time.monotonic(),
                0.1,
            )
            if found is None:
                return False
            job, task_id, reference = found
            if gone and self._fake().forget(reference or "") != 1:
                continue
            self.ledger.revoked(job, task_id)
            self.revoked.append(job)
            self.victims.append(job)
            self.app.control.revoke(task_id)
            dead = wait_for(lambda: (self.sut.status_of(job) or ("", False))[0] == "DEAD", REVOKE_TAKES_S, 0.1)  # noqa: B023
            status = (self.sut.status_of(job) or ("?", False))[0]
            how = f" (its response {reference} forgotten first: the cancel gets a 404)" if gone else ""
            self.log(f"  revoke: job {job} message {task_id}{how}: run {status}")
            if dead:
                # The worker cancels the call after the run is DEAD, in a second transaction: the next fault must
                # not land in between by chance (a kill there is another fault: the relay's sweep of the issue).
                cancelled = gone or wait_for(lambda: self._call_ended(job), REVOKE_TAKES_S, 0.1)  # noqa: B023
                if not cancelled:
                    self.log(f"  revoke: job {job}: its call is still `sent` {REVOKE_TAKES_S:g}s after the run died")
                return True
            self.revokes_not_applied.append(job)
        return False

    def _call_ended(self, job: int) -> bool:
        """Whether the job's latest call is no longer in flight (not `prepared` or `sent`)."""
        intent = self.sut.latest_intent(job)
        return intent is None or intent.state not in ("prepared", "sent")

    def _revocable(self, sent: bool = False) -> list[tuple[int, str, str | None]]:
        """Parked runs never revoked, whose wake is at least REVOKE_AHEAD_S away (`sent`: with a call in flight):
        (job, task id, the call's reference)."""
        return [
            (job, tid, intent.reference if intent is not None else None)
            for job, tid, intent in self.sut.parked(REVOKE_AHEAD_S)
            if job not in self.revoked and (not sent or (intent is not None and intent.state == "sent"))
        ]

    def provider_errors(self, status: int, timeout: float) -> bool:
        """Refuse the next BURST_ERRORS creates with `status` (503 or 429); a hit once they were all served."""
        fake = self._fake()

        def served() -> int:
            return int(fake.stats()["errors_served"].get(str(status), 0))

        before = served()
        fake.knobs(fail_next=BURST_ERRORS, fail_status=status, retry_after_s=1.0)
        try:
            hit = wait_for(lambda: served() >= before + BURST_ERRORS, timeout, 0.1)
        finally:
            fake.knobs(fail_next=0)
        self.log(f"  provider_{status}: {served() - before} creates refused with {status}")
        return bool(hit)

    def provider_5xx(self, timeout: float) -> bool:
        """A burst of 503s on creates."""
        return self.provider_errors(503, timeout)

    def provider_429(self, timeout: float) -> bool:
        """A burst of 429s on creates."""
        return self.provider_errors(429, timeout)

    def forget(self, timeout: float) -> bool:
        """Drop a parked run's sent call at the provider; a hit once its intent ended `lost` (the wake's 404)."""
        fake = self._fake()

        def parked_call() -> tuple[int, Intent] | None:
            for job, _tid, intent in self.sut.parked():
                if intent is not None and intent.state == "sent" and intent.reference:
                    return job, intent
            return None

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = wait_for(parked_call, deadline - time.monotonic(), 0.1)
            if found is None:
                return False
            job, intent = found
            if fake.forget(intent.reference or "") != 1:
                continue  # already gone (retention): pick again
            self.victims.append(job)
            ended = wait_for(lambda: self.sut.intent_state(intent.public_id) == "lost", 60.0, 0.1)  # noqa: B023
            self.log(f"  forget: job {job} intent {intent.public_id} ({intent.reference}): lost={bool(ended)}")
            return bool(ended)
        return False
