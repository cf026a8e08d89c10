"""The batcher's first stages: claim queued items under a batch row, then upload and create its provider batch.

1. **Claim.** Queued items of one group (provider, model, endpoint, policy) are claimed under a batch row once
   there are `max_items` of them or the oldest waited `max_wait_s`. The batch's id is derived from its items'
   `custom_id`s (`batch_id_of`): the same items always make the same id, and it is the tag the provider's batch
   carries.
2. **Upload** (OpenAI): the input file is named after the batch (`oncelery-<id>.jsonl`); after a crash a file
   of that name is reused and its duplicates deleted, so no upload is left behind.
3. **Create**, tagged with the batch's id (OpenAI `metadata`, Gemini's `displayName`, whose requests go inline
   with no upload). Before creating, the provider's list is searched for that tag: a batch created in the window
   before a crash is found again, never created twice. Anthropic's batches carry no tag (`_submit_untagged`): a
   create repeated past the search bound keeps the batches running then as its suspects (`suspects`).

Crash points (`oncelery.runs.faults`): batch_claimed, batch_uploaded, batch_created, batch_created_again,
batch_saved.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any, Protocol

from sqlalchemy import func, select, update

from oncelery.llm.batches import batch_url
from oncelery.models.batches import BatchState, ItemState
from oncelery.relay.batcher.stage import BatcherLease, BatchRound, Stage, epoch_of, logger
from oncelery.relay.batcher.suspects import Suspects, items_digest
from oncelery.runs.faults import fault_point
from oncelery.store.database import Database, rowcount
from oncelery.store.tables import BATCH_ITEMS, BATCHES

__all__ = ["CLAIM_LIMIT", "UNTAGGED_SEARCH_S", "FileBatches", "InlineBatches", "Submitter", "batch_id_of"]

CLAIM_LIMIT = 50  # batches formed per round at most (each is one transaction)
# A provider whose batches carry no tag (Anthropic): after a crash in the create window, batches created from
# this long before the claim are examined, and a batch still running is waited for up to UNTAGGED_SEARCH_S (its
# requests can only be matched once it has ended; Anthropic ends every batch within 24 h).
UNTAGGED_SLACK_S = 60.0
UNTAGGED_SEARCH_S = 24 * 3600.0


class FileBatches(Protocol):
    """A provider's batch API with an input file and tagged batches (OpenAI's Files and Batches)."""

    provider: str

    def submit_file(self, lines: list[tuple[str, dict[str, Any]]], endpoint: str, filename: str) -> str: ...
    def create(self, file_id: str, endpoint: str, tag: str) -> Any: ...
    def retrieve(self, batch_id: str) -> Any: ...
    def find(self, tag: str, created_after: float | None = None) -> Any: ...
    def uploaded_files(self, prefix: str) -> list[tuple[str, str]]: ...
    def delete_file(self, file_id: str) -> None: ...
    def results(self, state: Any) -> Iterator[Any]: ...


class InlineBatches(Protocol):
    """A provider's batch API with inline requests and tagged batches whose results come back in input order,
    without their custom_ids (Gemini's batch mode: the tag is the batch's `displayName`)."""

    provider: str
    results_in_input_order: bool  # True: `results` is given the custom_ids in the order they were sent

    def create(self, lines: list[tuple[str, dict[str, Any]]], model: str, tag: str) -> Any: ...
    def retrieve(self, batch_id: str) -> Any: ...
    def find(self, tag: str, created_after: float | None = None) -> Any: ...
    def results(self, state: Any, custom_ids: list[str]) -> Iterator[Any]: ...


class _Changed(Exception):
    """The items changed under a claim: its transaction rolls back."""


class Submitter(Stage):
    """Claims due groups into batch rows and creates each one's provider batch once (found again after a crash)."""

    def __init__(
        self, db: Database, adapters: dict[str, Any], lease: BatcherLease, *, untagged_search_s: float
    ) -> None:
        super().__init__(db, adapters, lease)
        # How long a batch whose create may have been sent (untagged) waits for a running batch before it is
        # created again: Anthropic ends every batch within 24 h, so past that a running one was not ours.
        self.untagged_search_s = untagged_search_s

    # -- 1. claim ------------------------------------------------------------------------------------------
    def claim_due(self, done: BatchRound) -> None:
        """Claim every due group's oldest queued items into batches (at most CLAIM_LIMIT this round)."""
        i = BATCH_ITEMS.c
        with self.db.read() as conn:
            now = float(conn.execute(select(self.db.dialect.epoch())).scalar_one())
            groups = conn.execute(
                select(i.group_key, i.max_items, i.max_wait_s, func.count(), func.min(i.queued_at))
                .where(i.state == ItemState.QUEUED)
                .group_by(i.group_key, i.max_items, i.max_wait_s)
            ).all()
        for key, max_items, max_wait, count, oldest in groups:
            while count >= max_items or (count > 0 and now - float(oldest) >= float(max_wait)):
                if done.claimed >= CLAIM_LIMIT:
                    return
                taken = self._claim(str(key), int(max_items))
                if taken == 0:
                    break
                done.claimed += 1
                count -= taken

    def _claim(self, key: str, max_items: int) -> int:
        """Claim up to `max_items` of the group's oldest queued items under one batch row; return how many."""
        try:
            return self._claim_txn(key, max_items)
        except _Changed:  # rolled back: nothing claimed
            return 0

    def _claim_txn(self, key: str, max_items: int) -> int:
        i = BATCH_ITEMS.c
        with self.db.begin() as conn:
            self.lease.fence(conn)
            rows = conn.execute(
                select(i.id, i.custom_id, i.provider, i.model, i.endpoint)
                .where(i.state == ItemState.QUEUED, i.group_key == key)
                .order_by(i.id)
                .limit(max_items)
            ).all()
            if not rows:
                return 0
            # The group's batches so far make it unique: re-queued items (an error, an expiry) form a new batch.
            formed = conn.execute(select(func.count()).select_from(BATCHES).where(BATCHES.c.group_key == key)).scalar()
            batch_id = batch_id_of(f"{key}#{int(formed or 0)}", [r.custom_id for r in rows])
            conn.execute(
                BATCHES.insert().values(
                    id=batch_id, provider=rows[0].provider, model=rows[0].model, endpoint=rows[0].endpoint,
                    group_key=key, state=BatchState.CLAIMED, items=len(rows),
                )
            )  # fmt: skip
            moved = conn.execute(
                update(BATCH_ITEMS)
                .where(i.id.in_([r.id for r in rows]), i.state == ItemState.QUEUED)
                .values(state=ItemState.CLAIMED, batch_id=batch_id)
            )
            if rowcount(moved) != len(rows):  # an item fell back meanwhile: form the batch again next round
                raise _Changed(batch_id)
        fault_point("batch_claimed", batch=batch_id)
        return len(rows)

    def due(self) -> list[Any]:
        """The batches claimed or uploaded but not yet submitted, oldest first."""
        b = BATCHES.c
        with self.db.read() as conn:
            states = (BatchState.CLAIMED, BatchState.UPLOADED)
            return list(conn.execute(select(BATCHES).where(b.state.in_(states)).order_by(b.created_at)).all())

    # -- 2 and 3. upload, create -----------------------------------------------------------------------------
    def submit(self, batch: Any, done: BatchRound) -> None:
        """Create the batch's provider batch once (uploading its input first where the provider needs a file)."""
        adapter = self.adapters.get(batch.provider)
        if adapter is None:
            done.errors.append(f"no batch adapter for provider {batch.provider!r} (batch {batch.id})")
            return
        if not hasattr(adapter, "submit_file"):
            inline = self._submit_inline if hasattr(adapter, "find") else self._submit_untagged
            inline(adapter, batch, done)
            return
        url = batch_url(batch.endpoint)
        file_id = batch.file_id
        if batch.state is BatchState.CLAIMED:
            prefix = f"oncelery-{batch.id}"
            found = [f for f, name in adapter.uploaded_files(prefix) if name.startswith(prefix)]
            if found:  # uploaded before a crash: use the first, delete the others
                file_id = found[0]
            else:
                file_id = adapter.submit_file(self.lines(batch.id), url, f"{prefix}.jsonl")
                fault_point("batch_uploaded", batch=batch.id)
            done.files_deleted += self.delete_files(adapter, [f for f in found if f != file_id])
            self.save(batch.id, BatchState.CLAIMED, state=BatchState.UPLOADED, file_id=file_id)
        tagged = adapter.find(batch.id)  # created in the window before a crash: found by its tag, not created again
        if tagged is None:
            tagged = adapter.create(str(file_id), url, batch.id)
            fault_point("batch_created", batch=batch.id)
        self._submitted(batch, tagged, done)
        logger.info("batcher: batch %s submitted as %s (%d items)", batch.id, tagged.id, batch.items)

    def _submit_inline(self, adapter: Any, batch: Any, done: BatchRound) -> None:
        """A provider whose batches carry a tag and their requests inline (Gemini: `displayName`): nothing to upload.
        As for OpenAI, the provider's list is searched for the tag first: a batch created in the window before a
        crash is found again, never created twice. Its requests go in item order: its results are matched by it."""
        tagged = adapter.find(batch.id)
        if tagged is None:
            tagged = adapter.create(self.lines(batch.id), batch.model, batch.id)
            fault_point("batch_created", batch=batch.id)
        self._submitted(batch, tagged, done)
        logger.info("batcher: batch %s submitted as %s (%d items)", batch.id, tagged.id, batch.items)

    def _submit_untagged(self, adapter: Any, batch: Any, done: BatchRound) -> None:
        """A provider whose batches carry no tag (Anthropic): mark the create as maybe sent, then create. After a
        crash in that window, the batches created since are listed; once each has ended, one whose results are
        exactly this batch's custom_ids is adopted. Only past `untagged_search_s` with none found is it created
        again, once: the batches still running then are kept as its suspects (one of them may be ours), so the
        first to end is applied and the other labelled `duplicate_batch` in the ledger (`Poller.poll`)."""
        if batch.state is BatchState.CLAIMED:
            self.save(batch.id, BatchState.CLAIMED, state=BatchState.UPLOADED)  # from here a create may be sent
            created = adapter.create(self.lines(batch.id))
            fault_point("batch_created", batch=batch.id)
            self._submitted(batch, created, done)
            return
        items = items_digest(self.custom_ids(batch.id))
        again = Suspects.read(batch.suspects)  # set: the create was repeated once already (it may have been sent)
        since = epoch_of(batch.created_at) - UNTAGGED_SLACK_S
        running: list[str] = []
        found: list[Any] = []
        for listed in adapter.list_since(since):
            candidate = listed if listed.ended else adapter.retrieve(listed.id)
            if not candidate.ended:
                running.append(candidate.id)  # its requests cannot be read before it ends: wait for it
                continue
            if items_digest(line.custom_id for line in adapter.results(candidate)) == items:
                found.append(candidate)
                if again is None:
                    break  # created once at most: this is the one
        if found:
            # After a repeated create, every other batch that may be ours is watched (a duplicate is labelled).
            watch = None
            if again is not None:
                watched = (*running, *(f.id for f in found[1:]))
                gone = tuple(b for b in again.watched if b not in watched and b != found[0].id)
                watch = Suspects(watched, items, others=(*again.others, *gone))
            self._submitted(batch, found[0], done, watch)
            logger.warning("batcher: batch %s found again as %s (created before a crash)", batch.id, found[0].id)
            return
        if again is not None:
            if running:  # the repeated create may be among them: never a third create, wait for them to end
                return
            # Nothing runs, and nothing ended with these requests since the claim: neither create reached the
            # provider. The suspects (each ended with other requests) are forgotten; the saved mark stays until
            # this create is saved, so a crash after it waits for it instead of creating a third.
            created = adapter.create(self.lines(batch.id))
            fault_point("batch_created_again", batch=batch.id)
            self._submitted(batch, created, done, Suspects((), items, others=(*again.others, *again.watched)))
            return
        with self.db.read() as conn:
            waited = float(conn.execute(select(self.db.dialect.epoch())).scalar_one()) - epoch_of(batch.created_at)
        if running and waited < self.untagged_search_s:
            return
        watch = Suspects(tuple(running), items) if running else None
        if watch is not None:  # saved before the create: a crash after it never leads to a third create
            self.save(batch.id, BatchState.UPLOADED, suspects=watch.as_json())
        created = adapter.create(self.lines(batch.id))
        fault_point("batch_created_again", batch=batch.id)
        self._submitted(batch, created, done, watch)
        if watch is not None:
            logger.warning(
                "batcher: batch %s created again as %s after %.0f s; %d batches still running are watched: the first "
                "to end is applied, a duplicate is labelled in the ledger", batch.id, created.id, waited, len(running)
            )  # fmt: skip

    def _submitted(self, batch: Any, created: Any, done: BatchRound, watch: Suspects | None = None) -> None:
        """Save the provider's batch id (fenced), and its items as submitted; its suspects too, if any."""
        values: dict[str, Any] = {} if watch is None else {"suspects": watch.as_json()}
        with self.db.begin() as conn:
            self.lease.fence(conn)
            conn.execute(
                update(BATCHES)
                .where(BATCHES.c.id == batch.id, BATCHES.c.state.in_((BatchState.CLAIMED, BatchState.UPLOADED)))
                .values(state=BatchState.SUBMITTED, provider_batch_id=created.id, provider_status=created.status,
                        submitted_at=self.db.dialect.now(), **values)
            )  # fmt: skip
            conn.execute(
                update(BATCH_ITEMS)
                .where(BATCH_ITEMS.c.batch_id == batch.id, BATCH_ITEMS.c.state == ItemState.CLAIMED)
                .values(state=ItemState.SUBMITTED)
            )
        fault_point("batch_saved", batch=batch.id)
        done.submitted += 1


def batch_id_of(group: str, custom_ids: list[str]) -> str:
    """The batch's id, from its group (with the count of its batches so far) and items: known before anything is
    sent, saved with the claim, and carried by the provider's batch as its tag."""
    digest = hashlib.sha256("\n".join([group, *custom_ids]).encode()).hexdigest()
    return f"ob-{digest[:32]}"
