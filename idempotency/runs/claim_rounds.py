"""How a claim is settled: in rounds of guarded statements, each a decision on what the run's row holds.

A new key is inserted (token 1); a finished run answers a duplicate; a live holder is waited for; a FAILED or
expired run is taken over by one guarded UPDATE (token t+1); a poison run goes DEAD. The lease timeline these
statements follow is drawn at the top of `claims.py`; `RunStore` (there) inherits `ClaimRounds`.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import IntegrityError

from oncelery.errors import StoreError
from oncelery.models import RunStatus
from oncelery.runs.decisions import Claim, ClaimRequest, ClaimResult, Decision
from oncelery.runs.faults import fault_point
from oncelery.runs.keys import Identity
from oncelery.runs.letters import kill_lost
from oncelery.runs.views import RunView, run_view
from oncelery.store.database import Database

if TYPE_CHECKING:
    from oncelery.store.statements import Statements

__all__ = ["ClaimRounds"]

# A claim loops at most this often when the row changes between its statements (e.g. FAILED under us).
_MAX_CLAIM_ROUNDS = 8


class ClaimRounds:
    """The claim of `RunStore`: each round one or two guarded statements, settled in at most `_MAX_CLAIM_ROUNDS`."""

    db: Database  # set by `RunStore.__init__` (claims.py)

    if TYPE_CHECKING:  # defined by `RunStore` (claims.py), whose claims these rounds settle

        @property
        def sql(self) -> Statements: ...

        def lease_params(self, seconds: float) -> dict[str, Any]: ...

        def get(self, task_name: str, key: str, tenant: str = "") -> RunView | None: ...

    def claim(
        self,
        task_name: str,
        ident: Identity,
        lease: float,
        concurrency_key: str | None = None,
        celery_task_id: str | None = None,
        message: Any = None,
        max_deliveries: int | None = None,
        letter: Any = None,
        owner: str | None = None,
        abandoned: str | None = None,
    ) -> ClaimResult:
        """Take the run for (task, key) if it is new, FAILED, or its lease expired; else say who has it.

        A RUNNING run whose holder vanished for the `max_deliveries`-th time (a poison message) goes DEAD,
        with `letter` (the message) in its dead letter, instead of being run again. `owner` names this
        claimant (one per delivery); `abandoned` is the owner of an earlier delivery of this message that a
        database fault made send it again: its run is not a lost delivery.
        """
        request = ClaimRequest(
            task_name=task_name,
            ident=ident,
            lease=lease,
            owner=owner or uuid.uuid4().hex,
            concurrency_key=concurrency_key,
            celery_task_id=celery_task_id,
            message=message,
            max_deliveries=max_deliveries,
            letter=letter,
            abandoned=abandoned,
        )
        for _ in range(_MAX_CLAIM_ROUNDS):
            params = request.params(self.lease_params(lease))
            try:
                settled = self._claim_round(request, params)
            except IntegrityError as exc:
                settled = self._claim_refused(request, params, exc)
            if settled is not None:
                return settled
            # The row changed between our statements (purged, inserted after our snapshot, taken over, killed,
            # or an expired entity holder demoted): look again.
        raise StoreError(f"Could not settle a claim for {task_name}[{ident.key}] in {_MAX_CLAIM_ROUNDS} rounds")

    def _claim_round(self, request: ClaimRequest, params: dict[str, Any]) -> ClaimResult | None:
        """One round of a claim: a new key claimed, else the run found decided; None: look again."""
        if self.sql.claim_or_replay is not None:
            found = self._claim_or_replay(request, params)
        else:
            found = self._insert_or_read(request, params)
        if found is None or isinstance(found, ClaimResult):
            return found
        return self._decide_on(request, params, found)

    def _claim_or_replay(self, request: ClaimRequest, params: dict[str, Any]) -> ClaimResult | RunView | None:
        """PostgreSQL, one round trip: a new key claimed or a finished duplicate answered, else the run found."""
        # One round trip: a new key is claimed, a duplicate of a finished run answered and counted, anything
        # else read for the decision (_decide_on). Asynchronous commit, as every claim: see docs/benchmarks.md (a
        # server crash may forget the last moments' replay counts).
        row, _ = self.db.one(self.sql.claim_or_replay, params, durable=False)
        run = run_view(row) if row.id is not None else None
        if row.replayed and run is not None:
            return ClaimResult(Decision.COMPLETED, run=run, counted=True)
        if row.new_id is not None:
            return ClaimResult(Decision.CLAIMED, claim=Claim.inserted(row.new_id, request))
        if run is not None and not request.ident.same_payload(run.fingerprint):
            # Its answer holds no field digests (one_trip.NOT_DECIDING): read them for the error.
            ident = request.ident
            fault_point("conflict_read", task=request.task_name, key=ident.key)
            return ClaimResult(Decision.CONFLICT, run=self.get(request.task_name, ident.key, ident.tenant) or run)
        return run

    def _insert_or_read(self, request: ClaimRequest, params: dict[str, Any]) -> ClaimResult | RunView | None:
        """Any database: INSERT ... ON CONFLICT DO NOTHING claims a new key, else the run holding it is read."""
        row, _ = self.db.one(self.sql.insert_claim, params, durable=False)
        if row is not None:
            return ClaimResult(Decision.CLAIMED, claim=Claim.inserted(row.id, request))
        # The key exists. Read it first: a duplicate of a finished or live run (the common case) is then
        # decided by this one read, and only a FAILED or expired run needs a takeover.
        ident = request.ident
        return self.get(request.task_name, ident.key, ident.tenant)

    def _decide_on(self, request: ClaimRequest, params: dict[str, Any], run: RunView) -> ClaimResult | None:
        """What an existing run means for this claim: answered, waited for, killed, or taken over."""
        if run.fingerprint != request.ident.fingerprint:
            if not request.ident.same_payload(run.fingerprint):
                return ClaimResult(Decision.CONFLICT, run=run)
            # The same payload, fingerprinted before digests were keyed: the takeover's guard compares that form.
            params = {**params, "p_fingerprint": run.fingerprint}
        if run.status is RunStatus.COMPLETED:
            return ClaimResult(Decision.COMPLETED, run=run)
        if run.status is RunStatus.DEAD:
            return ClaimResult(Decision.DEAD, run=run)
        # This message's own earlier delivery, which gave the run up on a database fault: nothing runs it any
        # more (its body ended or never began), so it is taken over now, and not lost.
        given_up = request.abandoned is not None and run.owner == request.abandoned
        if run.status is RunStatus.RUNNING and run.lease_live and not given_up:
            return ClaimResult(Decision.IN_PROGRESS, run=run)
        lost = run.status is RunStatus.RUNNING and not given_up
        max_deliveries = request.max_deliveries
        if lost and max_deliveries and run.lost + 1 >= max_deliveries:
            if self._kill_lost(run, max_deliveries, request.letter):
                return ClaimResult(Decision.DEAD, run=run, killed=True)
            return None  # taken over (or killed) by someone else between our statements: look again
        if run.status is RunStatus.WAITING:
            own = run.celery_task_id == request.celery_task_id
            if run.retry_wait or not own:
                # Parked until its wake (the waker re-sends its message then): a duplicate waits for the run as for
                # a holder, before the wake and after it. Only the run's own message (its task id) takes it over:
                # a duplicate that did would complete it under its own id, and the first caller's AsyncResult,
                # whose message was acked when the run parked, would never get the result. A copy of the run's own
                # message before the wake (a wake sent twice, a redelivery) is dropped, not circulated.
                return ClaimResult(Decision.IN_PROGRESS, run=run, parked_copy=own)
        if run.status is RunStatus.FAILED and run.retry_wait and run.celery_task_id != request.celery_task_id:
            # Celery will retry it after a countdown: a duplicate waits for that, as for a holder.
            # (The retry itself carries the run's task id: it may go, even a moment early.)
            return ClaimResult(Decision.IN_PROGRESS, run=run)
        return self._take_over(request, params)

    def _take_over(self, request: ClaimRequest, params: dict[str, Any]) -> ClaimResult | None:
        """The guarded takeover UPDATE of a FAILED or expired run; None if another claimant took it first."""
        row, _ = self.db.one(self.sql.takeover, params, durable=False)
        if row is None:
            return None  # another claimant took it between our read and our takeover: look again
        return ClaimResult(Decision.CLAIMED, claim=Claim.from_row(row, request))

    def _claim_refused(self, request: ClaimRequest, params: dict[str, Any], exc: IntegrityError) -> ClaimResult | None:
        """A claim the database refused: ENTITY_BUSY, None once an expired entity holder is demoted, or StoreError.

        Only the entity lock (the partial unique index on RUNNING runs of one concurrency_key) is a decision;
        any other refusal is a schema that does not match the code.
        """
        if request.concurrency_key is None or not self.db.dialect.is_entity_lock_violation(exc):
            # Not the entity lock: a schema that does not match the code (NOT NULL, CHECK). Taking it for a busy
            # entity would re-send the job "in progress" forever; a store error re-sends it too, but says what is
            # wrong, every time.
            raise StoreError(
                f"{request.task_name}[{request.ident.key}]: the claims database refused the claim: {exc.orig}; is "
                f"its schema at the code's revision? Run `oncelery db upgrade`"
            ) from exc
        # The partial unique index refused a second RUNNING run for this entity. If its holder's lease expired
        # (database clock), demote that run and claim again; a live holder keeps the entity.
        if self.db.one(self.sql.demote_expired_entity, params)[1] > 0:
            return None
        return ClaimResult(Decision.ENTITY_BUSY)

    def _kill_lost(self, run: RunView, max_deliveries: int, letter: Any) -> bool:
        """Make a poison run DEAD (guarded by the token seen and its expiry), with its dead letter."""
        return kill_lost(self.db, self.sql, run, max_deliveries, letter)
