"""The batcher's poller: poll each submitted batch at its pace and, once it ended, apply each result line once.

4. **Poll** at the batch's pace; once it ended, **apply** each line once by `custom_id` (a conditional UPDATE of
   a `submitted` item): done with its response, or re-queued (an item error, up to its policy's attempts;
   expired or cancelled items are re-queued free), or failed. Each applied item wakes its run (its `not_before`
   becomes now; the relay's waker re-sends it, and the claim absorbs a duplicate wake). Reading the results
   again after a crash applies nothing twice. Gemini's responses carry no custom_id: they are matched by
   position to the batch's items in the order they were sent (by item id), so no item leaves a batch before
   the batch has ended (its re-queues commit with the batch's end, in one transaction).
5. A batch with **suspects** (Anthropic only) is polled with them (`suspects.SuspectWatch`).

Crash points (`oncelery.runs.faults`): batch_downloaded, batch_applying.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sqlalchemy import Connection, and_, select, update

from oncelery.models.batches import BatchState, ItemState
from oncelery.relay.batcher.stage import BatcherLease, BatchRound, Stage, wake_run
from oncelery.relay.batcher.suspects import Suspects, SuspectWatch
from oncelery.runs.faults import fault_point
from oncelery.store.database import Database, rowcount
from oncelery.store.tables import BATCH_ITEMS, BATCHES

__all__ = ["POLL_S", "Poller"]

POLL_S = 5.0  # between polls of a submitted batch when the provider gives no hint


class Poller(Stage):
    """Polls submitted batches and applies each ended batch's results once, waking each applied item's run."""

    def __init__(
        self, db: Database, adapters: dict[str, Any], lease: BatcherLease, suspects: SuspectWatch, *, poll_s: float
    ) -> None:
        super().__init__(db, adapters, lease)
        self.suspects = suspects
        self.poll_s = poll_s

    def due(self) -> list[Any]:
        """The submitted batches whose next poll is due."""
        b = BATCHES.c
        with self.db.read() as conn:
            now = float(conn.execute(select(self.db.dialect.epoch())).scalar_one())
            due = (b.next_poll_at.is_(None)) | (b.next_poll_at <= now)
            return list(conn.execute(select(BATCHES).where(b.state == BatchState.SUBMITTED, due)).all())

    def poll(self, batch: Any, done: BatchRound) -> None:
        """Poll the batch (and its suspects); once it ended, apply each of its lines once and end it."""
        adapter = self.adapters.get(batch.provider)
        if adapter is None:
            return
        watch = Suspects.read(batch.suspects)
        if watch is not None and watch.applied:  # the items have their answers: only the suspects are left
            self._polled(batch.id, None, self.poll_s)
            self.suspects.watch(adapter, batch, watch, done)
            return
        state = adapter.retrieve(batch.provider_batch_id)
        done.polled += 1
        self._polled(batch.id, state.status, getattr(state, "poll_after_s", None) or self.poll_s)
        lines: list[Any] | None = None
        if not state.ended and watch is not None:
            first = self.suspects.first(adapter, batch, watch, done)
            if first is None:
                return
            state, lines, watch = first
        if not state.ended:
            return
        ordered = bool(getattr(adapter, "results_in_input_order", False))
        if lines is None:
            # Matched by position (Gemini): the custom_ids in send order, complete while the batch is not ended.
            lines = list(adapter.results(state, self.custom_ids(batch.id)) if ordered else adapter.results(state))
        fault_point("batch_downloaded", batch=batch.id)
        later: list[Any] = []
        for n, line in enumerate(lines):
            if n:
                fault_point("batch_applying", batch=batch.id, line=n)
            if ordered and not line.ok:
                # Not now: a re-queued item leaves the batch, which would shift every position of a re-read
                # after a crash. Failed and re-queued lines apply with the batch's end, in one transaction.
                later.append(line)
                continue
            self._apply(batch.id, line, done)
        self._end(batch.id, later, done, watch)
        if batch.file_id:
            done.files_deleted += self.delete_files(adapter, [batch.file_id])

    def _polled(self, batch_id: str, status: str | None, after_s: float) -> None:
        """Count the poll and set the next one (fenced); keep the provider's status when given."""
        with self.db.begin() as conn:
            self.lease.fence(conn)
            now = float(conn.execute(select(self.db.dialect.epoch())).scalar_one())
            values: dict[str, Any] = {"polls": BATCHES.c.polls + 1, "next_poll_at": now + after_s}
            if status is not None:
                values["provider_status"] = status
            conn.execute(update(BATCHES).where(BATCHES.c.id == batch_id).values(**values))

    def _apply(self, batch_id: str, line: Any, done: BatchRound) -> None:
        """Apply one result line once (a conditional UPDATE of its submitted item), and wake its run."""
        with self.db.begin() as conn:
            self.lease.fence(conn)
            self._apply_txn(conn, batch_id, line, done)

    def _apply_txn(self, conn: Connection, batch_id: str, line: Any, done: BatchRound) -> None:
        i = BATCH_ITEMS.c
        mine = and_(i.custom_id == line.custom_id, i.batch_id == batch_id, i.state == ItemState.SUBMITTED)
        row = conn.execute(select(i.run_id, i.attempts, i.group_key).where(mine)).first()
        if row is None:
            return  # applied before (a re-read after a crash), or not ours
        if line.ok:
            values: dict[str, Any] = {"state": ItemState.DONE, "response": dict(line.response or {}),
                                      "done_at": self.db.dialect.now(), "request": None}  # fmt: skip
            done.applied += 1
        elif line.expired or int(row.attempts) + 1 < _attempts_of(str(row.group_key)):
            values = {"state": ItemState.QUEUED, "batch_id": None, "error": line.error,
                      "attempts": i.attempts + (0 if line.expired else 1)}  # fmt: skip
            done.requeued += 1
        else:
            values = {"state": ItemState.FAILED, "error": line.error or "failed in its batch", "request": None}
            done.failed += 1
        conn.execute(update(BATCH_ITEMS).where(mine).values(**values))
        if values["state"] is not ItemState.QUEUED:
            wake_run(conn, self.db, int(row.run_id))

    def _end(self, batch_id: str, later: list[Any], done: BatchRound, watch: Suspects | None = None) -> None:
        """In one fenced transaction: apply the lines left for the end, re-queue every item in no line (expired,
        cancelled, missing), and end the batch. Until it commits, every item of the batch is still in it. With
        suspects still watched, the batch stays submitted, its results marked applied, until they are resolved."""
        values: dict[str, Any] = {"state": BatchState.ENDED, "ended_at": self.db.dialect.now()}
        if watch is not None:
            values = {"suspects": replace(watch, applied=True).as_json(), **({} if watch.watched else values)}
        with self.db.begin() as conn:
            self.lease.fence(conn)
            for line in later:
                self._apply_txn(conn, batch_id, line, done)
            self._requeue_rest(conn, batch_id, done)
            conn.execute(
                update(BATCHES)
                .where(BATCHES.c.id == batch_id, BATCHES.c.state == BatchState.SUBMITTED)
                .values(**values)
            )

    @staticmethod
    def _requeue_rest(conn: Connection, batch_id: str, done: BatchRound) -> None:
        i = BATCH_ITEMS.c
        left = conn.execute(
            update(BATCH_ITEMS)
            .where(i.batch_id == batch_id, i.state == ItemState.SUBMITTED)
            .values(state=ItemState.QUEUED, batch_id=None, error="not in the batch's results")
        )
        done.requeued += rowcount(left)


def _attempts_of(group: str) -> int:
    """The policy's max_attempts, the group key's last field (oncelery.llm.batches.group_key)."""
    try:
        return int(group.rsplit("|", 1)[1])
    except (IndexError, ValueError):
        return 3
