"""The batcher and its poller: pool parked batch items into provider batches, and apply each result once.

One batcher works at a time (the `batcher` lease in `oncelery_leases`, on the database clock); every write it
makes is fenced by that lease's token, so a batcher that lost its lease (paused, partitioned) writes nothing.
It runs inside `oncelery relay` (`Relay.run_once`). A round:

1. **Claim.** Queued items of one group (provider, model, endpoint, policy) are claimed under a batch row once
   there are `max_items` of them or the oldest waited `max_wait_s`. The batch's id is derived from its items'
   `custom_id`s: the same items always make the same id, and it is the tag the provider's batch carries.
2. **Upload** (OpenAI): the input file is named after the batch (`oncelery-<id>.jsonl`); after a crash a file
   of that name is reused and its duplicates deleted, so no upload is left behind.
3. **Create**, tagged with the batch's id (OpenAI `metadata`, Gemini's `displayName`, whose requests go inline
   with no upload). Before creating, the provider's list is searched for that tag: a batch created in the window
   before a crash is found again, never created twice. Anthropic's batches carry no tag (`_submit_untagged`).
4. **Poll** at the batch's pace; once it ended, **apply** each line once by `custom_id` (a conditional UPDATE of
   a `submitted` item): done with its response, or re-queued (an item error, up to its policy's attempts;
   expired or cancelled items are re-queued free), or failed. Each applied item wakes its run (its `not_before`
   becomes now; the relay's waker re-sends it, and the claim absorbs a duplicate wake). Reading the results
   again after a crash applies nothing twice. Gemini's responses carry no custom_id: they are matched by
   position to the batch's items in the order they were sent (by item id), so no item leaves a batch before
   the batch has ended (its re-queues commit with the batch's end, in one transaction).
5. **Suspects** (Anthropic only): a batch whose create may have been sent before a crash, and which is created
   again past the search bound (`untagged_search_s`) because a batch was still running, keeps the batches running
   then as its suspects (`llm_batches.suspects`). The poller polls them with its own batch: the first of them to
   end with exactly this batch's custom_ids (or its own batch) is applied; each other one that ends with them is
   the duplicate, and each of its lines is written to the ledger once, labelled `duplicate_batch`, at the batch
   price, without touching the items. A suspect with other custom_ids, or gone, is forgotten. The batch ends once
   every suspect is resolved.

Crash points (`oncelery.runs.faults`): batch_claimed, batch_uploaded, batch_created, batch_created_again,
batch_saved, batch_downloaded, batch_applying.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC
from typing import Any, Protocol

from sqlalchemy import Connection, and_, func, select, update

from oncelery.llm.adapters.base import Usage
from oncelery.llm.batches import batch_micros, batch_url
from oncelery.llm.errors import ProviderError, ProviderRejected, ResponseGone
from oncelery.models import RunStatus
from oncelery.models.batches import BatchState, ItemState
from oncelery.runs.faults import fault_point
from oncelery.store.database import Database, rowcount
from oncelery.store.tables import BATCH_ITEMS, BATCHES, INTENTS, LEASES, RUNS

__all__ = [
    "DUPLICATE_BATCH",
    "BatchRound",
    "Batcher",
    "FileBatches",
    "InlineBatches",
    "LedgerWriter",
    "Suspects",
    "SyncPrice",
]

logger = logging.getLogger("oncelery.batcher")  # a stable name (users filter on it)

LEASE_NAME = "batcher"
LEASE_S = 30.0
POLL_S = 5.0  # between polls of a submitted batch when the provider gives no hint
CLAIM_LIMIT = 50  # batches formed per round at most (each is one transaction)
# A provider whose batches carry no tag (Anthropic): after a crash in the create window, batches created from
# this long before the claim are examined, and a batch still running is waited for up to UNTAGGED_SEARCH_S (its
# requests can only be matched once it has ended; Anthropic ends every batch within 24 h).
UNTAGGED_SLACK_S = 60.0
UNTAGGED_SEARCH_S = 24 * 3600.0
#: The ledger label (`model_calls.reason`) of each call of a duplicate batch: the same requests run a second time.
DUPLICATE_BATCH = "duplicate_batch"
_LOOKUP_CHUNK = 500  # custom_ids per IN (...) when a duplicate's items are looked up

#: A call's cost at the synchronous price in micro-USD (model, input tokens, output tokens); None: no price.
SyncPrice = Callable[[str, int, int], int | None]
#: Adds one ledger row (`model_calls`) in the caller's transaction, once per `call_id`; returns whether it was new.
LedgerWriter = Callable[[Connection, Mapping[str, Any]], bool]


class Line(Protocol):
    """One result line of a provider batch."""

    custom_id: str
    ok: bool
    response: Mapping[str, Any] | None
    error: str | None
    expired: bool


class ProviderBatch(Protocol):
    """What the batcher reads of a provider batch."""

    id: str
    status: str
    ended: bool


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


@dataclass
class BatchRound:
    """What one batcher round did."""

    claimed: int = 0  # batches formed
    submitted: int = 0  # provider batches created (or found again by their tag)
    polled: int = 0
    applied: int = 0  # items done (their runs woken)
    requeued: int = 0
    failed: int = 0
    files_deleted: int = 0
    duplicates: int = 0  # calls of a duplicate batch labelled in the ledger
    errors: list[str] = field(default_factory=list)

    def busy(self) -> bool:
        """Whether the round moved anything."""
        return bool(self.claimed or self.submitted or self.applied or self.requeued or self.failed)


@dataclass(frozen=True)
class Suspects:
    """The provider batches that may run a batch's requests a second time (its create was repeated past the search
    bound while they ran), as `llm_batches.suspects` keeps them until each is resolved."""

    watched: tuple[str, ...]  # provider batch ids not yet resolved
    items: str  # the digest of the batch's custom_ids when the create was repeated (`items_digest`)
    applied: bool = False  # the results of the batch's `provider_batch_id` are applied: only `watched` is left
    duplicates: tuple[str, ...] = ()  # ended with these custom_ids: each line labelled `duplicate_batch`
    others: tuple[str, ...] = ()  # ended with other custom_ids, or gone: forgotten

    @classmethod
    def read(cls, value: Any) -> Suspects | None:
        """The column's value as Suspects (None: the batch's create was never repeated)."""
        if not isinstance(value, Mapping):
            return None
        return cls(
            tuple(value.get("watched") or ()), str(value.get("items") or ""), bool(value.get("applied")),
            tuple(value.get("duplicates") or ()), tuple(value.get("others") or ()),
        )  # fmt: skip

    def as_json(self) -> dict[str, Any]:
        """The column's value."""
        return {"watched": list(self.watched), "items": self.items, "applied": self.applied,
                "duplicates": list(self.duplicates), "others": list(self.others)}  # fmt: skip

    def resolved(self, batch_id: str, duplicate: bool) -> Suspects:
        """These suspects with `batch_id` resolved: a duplicate (labelled), or another's batch (forgotten)."""
        watched = tuple(b for b in self.watched if b != batch_id)
        if duplicate:
            return replace(self, watched=watched, duplicates=(*self.duplicates, batch_id))
        return replace(self, watched=watched, others=(*self.others, batch_id))

    def swapped(self, winner: str, own: str) -> Suspects:
        """These suspects once `winner` ended first: it is the batch applied, and `own` (the batch created again)
        is watched in its place."""
        return replace(self, watched=(own, *(b for b in self.watched if b != winner)))


class _Changed(Exception):
    """The items changed under a claim: its transaction rolls back."""


class BatcherLeaseLost(Exception):
    """The batcher's lease passed to another: this one writes nothing more this round (a batcher's own lease, not a
    run's: the public `oncelery.errors.LeaseLost` is a run holder's fencing token gone stale)."""


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
        price: SyncPrice | None = None,
        ledger: LedgerWriter | None = None,
    ) -> None:
        self.db = db
        self.adapters = dict(adapters)
        self.poll_s = poll_s
        self.lease_s = lease_s  # a batcher that dies holds the lease this long: the next one waits it out
        # How long a batch whose create may have been sent (untagged) waits for a running batch before it is
        # created again: Anthropic ends every batch within 24 h, so past that a running one was not ours.
        self.untagged_search_s = untagged_search_s
        # A duplicate batch's calls go to the ledger: priced (the task room's price table, given by the relay)
        # and written by its writer (`add_call`), since this room does not import the task room.
        self.price = price
        self.ledger = ledger
        self.owner = uuid.uuid4().hex
        self.token = 0

    # -- the lease -----------------------------------------------------------------------------------------
    def _acquire(self) -> bool:
        """Take or renew the `batcher` lease (database clock); return whether this batcher holds it."""
        dialect, c = self.db.dialect, LEASES.c
        with self.db.begin() as conn:
            now = float(conn.execute(select(dialect.epoch())).scalar_one())
            row = conn.execute(select(c.owner, c.token, c.expires_at).where(c.name == LEASE_NAME)).first()
            if row is None:
                stmt = dialect.insert(LEASES).values(
                    name=LEASE_NAME, owner=self.owner, token=1, expires_at=now + self.lease_s
                )
                if rowcount(conn.execute(stmt.on_conflict_do_nothing(index_elements=["name"]))) != 1:
                    return False
                self.token = 1
                return True
            owner, token, expires = row
            if owner != self.owner and expires >= now:
                return False
            token = int(token) if owner == self.owner else int(token) + 1
            taken = conn.execute(
                update(LEASES)
                .where(c.name == LEASE_NAME, c.owner == owner, c.token == row.token)
                .values(owner=self.owner, token=token, expires_at=now + self.lease_s)
            )
            if rowcount(taken) != 1:
                return False
            self.token = token
            return True

    def _fence(self, conn: Connection) -> None:
        """In the caller's transaction: raise BatcherLeaseLost unless this batcher still holds its lease."""
        c = LEASES.c
        held = conn.execute(
            select(c.name).where(c.name == LEASE_NAME, c.owner == self.owner, c.token == self.token)
        ).first()
        if held is None:
            raise BatcherLeaseLost(f"batcher {self.owner} lost its lease")

    # -- a round -------------------------------------------------------------------------------------------
    def run_once(self) -> BatchRound:
        """One round: claim due groups, submit claimed batches, poll submitted ones and apply their results."""
        done = BatchRound()
        if not self._has_work() or not self._acquire():
            return done
        try:
            self._claim_due(done)
            for batch in self._batches(BatchState.CLAIMED, BatchState.UPLOADED):
                self._guarded(self._submit, batch, done)
            for batch in self._due_polls():
                self._guarded(self._poll, batch, done)
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
            self._fence(conn)
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

    # -- 1. claim ------------------------------------------------------------------------------------------
    def _claim_due(self, done: BatchRound) -> None:
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
            self._fence(conn)
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

    def _batches(self, *states: BatchState) -> list[Any]:
        b = BATCHES.c
        with self.db.read() as conn:
            return list(conn.execute(select(BATCHES).where(b.state.in_(states)).order_by(b.created_at)).all())

    # -- 2 and 3. upload, create -----------------------------------------------------------------------------
    def _submit(self, batch: Any, done: BatchRound) -> None:
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
                file_id = adapter.submit_file(self._lines(batch.id), url, f"{prefix}.jsonl")
                fault_point("batch_uploaded", batch=batch.id)
            done.files_deleted += self._delete_files(adapter, [f for f in found if f != file_id])
            self._save(batch.id, BatchState.CLAIMED, state=BatchState.UPLOADED, file_id=file_id)
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
            tagged = adapter.create(self._lines(batch.id), batch.model, batch.id)
            fault_point("batch_created", batch=batch.id)
        self._submitted(batch, tagged, done)
        logger.info("batcher: batch %s submitted as %s (%d items)", batch.id, tagged.id, batch.items)

    def _submit_untagged(self, adapter: Any, batch: Any, done: BatchRound) -> None:
        """A provider whose batches carry no tag (Anthropic): mark the create as maybe sent, then create. After a
        crash in that window, the batches created since are listed; once each has ended, one whose results are
        exactly this batch's custom_ids is adopted. Only past `untagged_search_s` with none found is it created
        again, once: the batches still running then are kept as its suspects (one of them may be ours), so the
        first to end is applied and the other labelled `duplicate_batch` in the ledger (`_poll`)."""
        if batch.state is BatchState.CLAIMED:
            self._save(batch.id, BatchState.CLAIMED, state=BatchState.UPLOADED)  # from here a create may be sent
            created = adapter.create(self._lines(batch.id))
            fault_point("batch_created", batch=batch.id)
            self._submitted(batch, created, done)
            return
        items = items_digest(self._custom_ids(batch.id))
        again = Suspects.read(batch.suspects)  # set: the create was repeated once already (it may have been sent)
        since = _epoch(batch.created_at) - UNTAGGED_SLACK_S
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
            created = adapter.create(self._lines(batch.id))
            fault_point("batch_created_again", batch=batch.id)
            self._submitted(batch, created, done, Suspects((), items, others=(*again.others, *again.watched)))
            return
        with self.db.read() as conn:
            waited = float(conn.execute(select(self.db.dialect.epoch())).scalar_one()) - _epoch(batch.created_at)
        if running and waited < self.untagged_search_s:
            return
        watch = Suspects(tuple(running), items) if running else None
        if watch is not None:  # saved before the create: a crash after it never leads to a third create
            self._save(batch.id, BatchState.UPLOADED, suspects=watch.as_json())
        created = adapter.create(self._lines(batch.id))
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
            self._fence(conn)
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

    def _custom_ids(self, batch_id: str) -> list[str]:
        """The batch's custom_ids in the order its requests were sent (`_lines`' order: by item id)."""
        i = BATCH_ITEMS.c
        with self.db.read() as conn:
            return list(conn.execute(select(i.custom_id).where(i.batch_id == batch_id).order_by(i.id)).scalars())

    def _lines(self, batch_id: str) -> list[tuple[str, dict[str, Any]]]:
        """The batch's (custom_id, request) in the order they are sent: by item id, the order `_custom_ids` gives."""
        i = BATCH_ITEMS.c
        with self.db.read() as conn:
            rows = conn.execute(select(i.custom_id, i.request).where(i.batch_id == batch_id).order_by(i.id)).all()
        return [(r.custom_id, dict(r.request or {})) for r in rows]

    def _save(self, batch_id: str, was: BatchState, **values: Any) -> None:
        with self.db.begin() as conn:
            self._fence(conn)
            conn.execute(update(BATCHES).where(BATCHES.c.id == batch_id, BATCHES.c.state == was).values(**values))

    @staticmethod
    def _delete_files(adapter: Any, file_ids: Iterable[str]) -> int:
        deleted = 0
        for file_id in file_ids:
            adapter.delete_file(file_id)
            deleted += 1
        return deleted

    # -- 4. poll and apply -----------------------------------------------------------------------------------
    def _due_polls(self) -> list[Any]:
        b = BATCHES.c
        with self.db.read() as conn:
            now = float(conn.execute(select(self.db.dialect.epoch())).scalar_one())
            due = (b.next_poll_at.is_(None)) | (b.next_poll_at <= now)
            return list(conn.execute(select(BATCHES).where(b.state == BatchState.SUBMITTED, due)).all())

    def _poll(self, batch: Any, done: BatchRound) -> None:
        adapter = self.adapters.get(batch.provider)
        if adapter is None:
            return
        watch = Suspects.read(batch.suspects)
        if watch is not None and watch.applied:  # the items have their answers: only the suspects are left
            self._polled(batch.id, None, self.poll_s)
            self._watch(adapter, batch, watch, done)
            return
        state = adapter.retrieve(batch.provider_batch_id)
        done.polled += 1
        self._polled(batch.id, state.status, getattr(state, "poll_after_s", None) or self.poll_s)
        lines: list[Any] | None = None
        if not state.ended and watch is not None:
            first = self._first_suspect(adapter, batch, watch, done)
            if first is None:
                return
            state, lines, watch = first
        if not state.ended:
            return
        ordered = bool(getattr(adapter, "results_in_input_order", False))
        if lines is None:
            # Matched by position (Gemini): the custom_ids in send order, complete while the batch is not ended.
            lines = list(adapter.results(state, self._custom_ids(batch.id)) if ordered else adapter.results(state))
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
            done.files_deleted += self._delete_files(adapter, [batch.file_id])

    def _polled(self, batch_id: str, status: str | None, after_s: float) -> None:
        """Count the poll and set the next one (fenced); keep the provider's status when given."""
        with self.db.begin() as conn:
            self._fence(conn)
            now = float(conn.execute(select(self.db.dialect.epoch())).scalar_one())
            values: dict[str, Any] = {"polls": BATCHES.c.polls + 1, "next_poll_at": now + after_s}
            if status is not None:
                values["provider_status"] = status
            conn.execute(update(BATCHES).where(BATCHES.c.id == batch_id).values(**values))

    # -- 5. suspects -----------------------------------------------------------------------------------------
    def _look(self, adapter: Any, batch_id: str, suspect: str, done: BatchRound) -> tuple[Any, list[Any]] | None:
        """A suspect as it is now, and its result lines once it has ended (none before); None: the provider no
        longer has it, or refuses to show it (nothing to apply or label: it is forgotten)."""
        try:
            state = adapter.retrieve(suspect)
            done.polled += 1
            return state, list(adapter.results(state)) if state.ended else []
        except (ResponseGone, ProviderRejected) as exc:
            logger.warning("batcher: batch %s: suspect %s cannot be read (%s): forgotten", batch_id, suspect, exc)
            return None

    def _first_suspect(
        self, adapter: Any, batch: Any, watch: Suspects, done: BatchRound
    ) -> tuple[Any, list[Any], Suspects] | None:
        """A suspect that ended before the batch's own provider batch: with exactly its custom_ids, it is the one
        applied (saved first, fenced, so a re-read after a crash applies the same one) and the batch's own is
        watched in its place; with others (or gone) it is forgotten. Returns the winner's state and lines."""
        for suspect in watch.watched:
            looked = self._look(adapter, batch.id, suspect, done)
            if looked is not None and not looked[0].ended:
                continue
            if looked is not None and items_digest(line.custom_id for line in looked[1]) == watch.items:
                won = watch.swapped(suspect, str(batch.provider_batch_id))
                with self.db.begin() as conn:
                    self._fence(conn)
                    swapped = conn.execute(
                        update(BATCHES)
                        .where(BATCHES.c.id == batch.id, BATCHES.c.state == BatchState.SUBMITTED,
                               BATCHES.c.provider_batch_id == batch.provider_batch_id)
                        .values(provider_batch_id=suspect, provider_status=looked[0].status, suspects=won.as_json())
                    )  # fmt: skip
                if rowcount(swapped) != 1:
                    return None  # changed meanwhile: the next poll reads the row again
                logger.warning(
                    "batcher: batch %s: %s (created before a crash) ended before %s, created again: it is applied, "
                    "the other will be labelled", batch.id, suspect, batch.provider_batch_id,
                )  # fmt: skip
                return looked[0], looked[1], won
            watch = watch.resolved(suspect, duplicate=False)
            self._resolve(batch, watch, suspect, [], done)
        return None

    def _watch(self, adapter: Any, batch: Any, watch: Suspects, done: BatchRound) -> None:
        """Resolve each suspect that has ended since: with the batch's custom_ids, the duplicate, labelled in the
        ledger; with others (or gone), forgotten. The batch ends with the last."""
        for suspect in watch.watched:
            looked = self._look(adapter, batch.id, suspect, done)
            if looked is not None and not looked[0].ended:
                continue
            lines = [] if looked is None else looked[1]
            duplicate = looked is not None and items_digest(line.custom_id for line in lines) == watch.items
            watch = watch.resolved(suspect, duplicate)
            self._resolve(batch, watch, suspect, lines if duplicate else [], done)

    def _resolve(self, batch: Any, watch: Suspects, suspect: str, duplicate: list[Any], done: BatchRound) -> None:
        """In one fenced transaction: a duplicate's ledger rows (none for a forgotten suspect), the suspects as
        resolved now, and the batch's end once its results are applied and no suspect is left. A re-read after a
        crash finds the suspect resolved, or writes the same rows again (each once: by its call_id)."""
        values: dict[str, Any] = {"suspects": watch.as_json()}
        if watch.applied and not watch.watched:
            values.update(state=BatchState.ENDED, ended_at=self.db.dialect.now())
        with self.db.begin() as conn:
            self._fence(conn)
            labelled = self._label(conn, batch, suspect, duplicate) if duplicate else 0
            conn.execute(
                update(BATCHES)
                .where(BATCHES.c.id == batch.id, BATCHES.c.state == BatchState.SUBMITTED)
                .values(**values)
            )
        done.duplicates += labelled
        if duplicate:
            logger.warning(
                "batcher: batch %s ran twice: %s is the duplicate; %d calls labelled %s in the ledger",
                batch.id, suspect, labelled, DUPLICATE_BATCH,
            )  # fmt: skip

    def _label(self, conn: Connection, batch: Any, suspect: str, lines: list[Any]) -> int:
        """Write one ledger row per line of the duplicate that ran (expired or cancelled lines never ran): its
        usage, its cost at the batch price, labelled `duplicate_batch`, with its item's run, task, tenant, key
        and step where they are still known. Nothing is applied to the items. Returns the rows new now."""
        if self.ledger is None:
            logger.error("batcher: batch %s: duplicate %s not labelled (no ledger writer)", batch.id, suspect)
            return 0
        ran = [line for line in lines if not line.expired]
        known = _origins(conn, [line.custom_id for line in ran])
        usage_of = getattr(self.adapters.get(batch.provider), "usage", None)
        written = 0
        for line in ran:
            usage = usage_of(line.response) if line.ok and usage_of is not None and line.response else Usage()
            sync = None if self.price is None else self.price(batch.model, usage.input_tokens, usage.output_tokens)
            origin = known.get(line.custom_id, {})
            row = {
                "call_id": duplicate_call_id(line.custom_id, suspect),
                "task_name": origin.get("task_name"),
                "tenant": origin.get("tenant") or "",
                "idempotency_key": origin.get("idempotency_key"),
                "step": origin.get("step"),
                "run_id": origin.get("run_id"),
                "fencing_token": None,  # written by the batcher, not by a holder of the run
                "model": batch.model,
                "prompt": None,
                "input_tokens": usage.input_tokens,
                "output_tokens": usage.output_tokens,
                "latency_ms": 0.0,
                "ok": bool(line.ok),
                "error": None if line.ok else (line.error or "failed in its batch")[:2000],
                "cost_micros": None if sync is None else batch_micros(sync),
                # It saved nothing: the same requests were paid for in the batch that was applied.
                "batch_saved_micros": None,
                "meta": {
                    "mode": "batch",
                    "custom_id": line.custom_id,
                    "provider_batch": suspect,
                    "duplicate_of": batch.id,
                },
                "reason": DUPLICATE_BATCH,
                "reattached": False,
            }
            written += int(self.ledger(conn, row))
        return written

    def _apply(self, batch_id: str, line: Any, done: BatchRound) -> None:
        """Apply one result line once (a conditional UPDATE of its submitted item), and wake its run."""
        with self.db.begin() as conn:
            self._fence(conn)
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
            self._fence(conn)
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


def wake_run(conn: Connection, db: Database, run_id: int) -> None:
    """Make a WAITING run due now (the relay's waker re-sends it); nothing if it is not waiting, or if its wake
    is already due (the waker sends it, or sent it: clearing its mark would send a second copy)."""
    r = RUNS.c
    now = db.dialect.now()
    conn.execute(
        update(RUNS)
        .where(r.id == run_id, r.status == RunStatus.WAITING, r.not_before > now)
        .values(not_before=now, swept_at=None)
    )


def batch_id_of(group: str, custom_ids: list[str]) -> str:
    """The batch's id, from its group (with the count of its batches so far) and items: known before anything is
    sent, saved with the claim, and carried by the provider's batch as its tag."""
    digest = hashlib.sha256("\n".join([group, *custom_ids]).encode()).hexdigest()
    return f"ob-{digest[:32]}"


def items_digest(custom_ids: Iterable[str]) -> str:
    """A digest of a set of custom_ids (order and repeats aside): how a batch's results are matched to its items."""
    return hashlib.sha256("\n".join(sorted(set(custom_ids))).encode()).hexdigest()


def duplicate_call_id(custom_id: str, provider_batch_id: str) -> str:
    """The ledger `call_id` of a custom_id's call in a duplicate batch: the same for every re-read (so its row
    is written once), 64 characters (the column's size; the parts are in the row's `meta`)."""
    return "dup-" + hashlib.sha256(f"{custom_id}\n{provider_batch_id}".encode()).hexdigest()[:60]


def _origins(conn: Connection, custom_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Where each custom_id's call was made, as far as the database still knows: its item's run, the run's task,
    tenant and key, and its intent's step."""
    i, n, r = BATCH_ITEMS.c, INTENTS.c, RUNS.c
    found: dict[str, dict[str, Any]] = {}
    for start in range(0, len(custom_ids), _LOOKUP_CHUNK):
        chunk = custom_ids[start : start + _LOOKUP_CHUNK]
        rows = conn.execute(
            select(i.custom_id, i.run_id, n.step_name.label("step"), r.task_name, r.tenant, r.idempotency_key)
            .select_from(BATCH_ITEMS.outerjoin(INTENTS, n.public_id == i.custom_id).outerjoin(RUNS, r.id == i.run_id))
            .where(i.custom_id.in_(chunk))
        )
        found.update({row.custom_id: dict(row._mapping) for row in rows})
    return found


def _epoch(value: Any) -> float:
    """A database timestamp (aware, or naive UTC as SQLite returns it) as epoch seconds."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return float(value.timestamp())


def _attempts_of(group: str) -> int:
    """The policy's max_attempts, the group key's last field (oncelery.llm.batches.group_key)."""
    try:
        return int(group.rsplit("|", 1)[1])
    except (IndexError, ValueError):
        return 3
