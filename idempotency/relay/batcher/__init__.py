"""The batcher: pool parked batch items into provider batches, poll them, and apply each result once.

One batcher works at a time (the `batcher` lease in `oncelery_leases`, on the database clock); every write it
makes is fenced by that lease's token, so a batcher that lost its lease (paused, partitioned) writes nothing.
It runs inside `oncelery relay` (`Relay.run_once`). A round takes the lease, then runs its stages, each in a
module of its own that documents its protocol and its crash points (`oncelery.runs.faults`):

- `stage`: what the stages share: the round's tally (`BatchRound`), the lease (`BatcherLease`), the reads.
- `submit` (`Submitter`): 1. **claim** due groups under batch rows, 2. **upload** (OpenAI), 3. **create**
  each provider batch once, found again by its tag after a crash (Anthropic's untagged batches by their items).
- `poll` (`Poller`): 4. **poll** each submitted batch at its pace; once it ended, **apply** each line once
  by `custom_id` and wake its run.
- `suspects` (`SuspectWatch`): 5. **suspects** (Anthropic only): the batches that may run a batch's
  requests a second time; the first to end is applied, a duplicate is labelled `duplicate_batch` in the ledger.

This module keeps the round (`Batcher.run_once`) and what happens to a batch the provider refuses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import select, update

from oncelery.ledger.recording import CallLedger
from oncelery.llm.errors import ProviderError, ProviderRejected
from oncelery.models.batches import BatchState, ItemState
from oncelery.relay.batcher.poll import POLL_S as POLL_S
from oncelery.relay.batcher.poll import Poller
from oncelery.relay.batcher.stage import LEASE_S as LEASE_S
from oncelery.relay.batcher.stage import BatcherLease, BatcherLeaseLost, BatchRound, logger, wake_run
from oncelery.relay.batcher.submit import UNTAGGED_SEARCH_S as UNTAGGED_SEARCH_S
from oncelery.relay.batcher.submit import FileBatches, InlineBatches, Submitter
from oncelery.relay.batcher.suspects import DUPLICATE_BATCH, Suspects, SuspectWatch
from oncelery.store.database import Database
from oncelery.store.tables import BATCH_ITEMS, BATCHES

__all__ = [
    "DUPLICATE_BATCH",
    "BatchRound",
    "Batcher",
    "FileBatches",
    "InlineBatches",
    "Suspects",
]


class Batcher:
    """Pools queued batch items into provider batches and applies their results (see the module)."""

    def __init__(
        self,
        db: Database,
        adapters: Mapping[str, Any],
        *,
        poll_s: float = POLL_S,
        lease_s: float = LEASE_S,
        untagged_search_s: float = UNTAGGED_SEARCH_S,
        ledger: CallLedger | None = None,
    ) -> None:
        self.db = db
        self.adapters = dict(adapters)  # one dict for every stage: an adapter set here is the one they use
        self.lease = BatcherLease(db, lease_s)
        self.submitter = Submitter(db, self.adapters, self.lease, untagged_search_s=untagged_search_s)
        self.suspects = SuspectWatch(db, self.adapters, self.lease, ledger=ledger)
        self.poller = Poller(db, self.adapters, self.lease, self.suspects, poll_s=poll_s)

    # -- a round -------------------------------------------------------------------------------------------
    def run_once(self) -> BatchRound:
        """One round: claim due groups, submit claimed batches, poll submitted ones and apply their results."""
        done = BatchRound()
        if not self._has_work() or not self.lease.acquire():
            return done
        try:
            self.submitter.claim_due(done)
            for batch in self.submitter.due():
                self._guarded(self.submitter.submit, batch, done)
            for batch in self.poller.due():
                self._guarded(self.poller.poll, batch, done)
        except BatcherLeaseLost as exc:
            done.errors.append(str(exc))
        return done

    def _guarded(self, step: Any, batch: Any, done: BatchRound) -> None:
        """One batch's step: a provider that refuses the batch (4xx) fails its items (their steps fail through
        the normal retry path, instead of the batch being retried for ever); an outage leaves it to a later round,
        and never stops the other batches of the round."""
        try:
            step(batch, done)
        except ProviderRejected as exc:
            done.errors.append(f"batch {batch.id}: {exc}")
            self._fail_batch(batch.id, str(exc), done)
        except ProviderError as exc:
            done.errors.append(f"batch {batch.id}: {exc}")
            logger.warning("batcher: batch %s: %s (tried again next round)", batch.id, exc)

    def _fail_batch(self, batch_id: str, error: str, done: BatchRound) -> None:
        i = BATCH_ITEMS.c
        with self.db.begin() as conn:
            self.lease.fence(conn)
            runs = (
                conn.execute(
                    select(i.run_id).where(
                        i.batch_id == batch_id, i.state.in_((ItemState.CLAIMED, ItemState.SUBMITTED))
                    )
                )
                .scalars()
                .all()
            )
            conn.execute(
                update(BATCH_ITEMS)
                .where(i.batch_id == batch_id, i.state.in_((ItemState.CLAIMED, ItemState.SUBMITTED)))
                .values(state=ItemState.FAILED, error=error[:1000], request=None)
            )
            conn.execute(
                update(BATCHES).where(BATCHES.c.id == batch_id).values(state=BatchState.FAILED, error=error[:1000])
            )
            for run_id in runs:
                wake_run(conn, self.db, int(run_id))
        done.failed += len(runs)
        logger.error("batcher: the provider refused batch %s; its %d items failed: %s", batch_id, len(runs), error)

    def _has_work(self) -> bool:
        """A cheap read first: an idle relay round never takes the lease or SQLite's writer lock."""
        i, b = BATCH_ITEMS.c, BATCHES.c
        with self.db.read() as conn:
            queued = conn.execute(select(i.id).where(i.state == ItemState.QUEUED).limit(1)).first()
            open_ = conn.execute(
                select(b.id)
                .where(b.state.in_((BatchState.CLAIMED, BatchState.UPLOADED, BatchState.SUBMITTED)))
                .limit(1)
            ).first()
        return queued is not None or open_ is not None
