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

Crash points (`oncelery.runs.faults`): batch_claimed, batch_uploaded, batch_created, batch_saved,
batch_downloaded, batch_applying.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC
from typing import Any, Protocol

from sqlalchemy import Connection, and_, func, select, update

from oncelery.llm.batches import batch_url
from oncelery.llm.errors import ProviderError, ProviderRejected
from oncelery.models import RunStatus
from oncelery.models.batches import BatchState, ItemState
from oncelery.runs.faults import fault_point
from oncelery.store.database import Database, rowcount
from oncelery.store.tables import BATCH_ITEMS, BATCHES, LEASES, RUNS

__all__ = ["BatchRound", "Batcher", "FileBatches", "InlineBatches"]

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
    errors: list[str] = field(default_factory=list)

    def busy(self) -> bool:
        """Whether the round moved anything."""
        return bool(self.claimed or self.submitted or self.applied or self.requeued or self.failed)


class _Changed(Exception):
    """The items changed under a claim: its transaction rolls back."""


class LeaseLost(Exception):
    """The batcher's lease passed to another: this one writes nothing more this round."""


class Batcher:
    """Pools queued batch items into provider batches and applies their results (see the module)."""

    def __init__(
        self, db: Database, adapters: Mapping[str, Any], *, poll_s: float = POLL_S, lease_s: float = LEASE_S
    ) -> None:
        self.db = db
        self.adapters = dict(adapters)
        self.poll_s = poll_s
        self.lease_s = lease_s  # a batcher that dies holds the lease this long: the next one waits it out
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
        """In the caller's transaction: raise LeaseLost unless this batcher still holds its lease."""
        c = LEASES.c
        held = conn.execute(
            select(c.name).where(c.name == LEASE_NAME, c.owner == self.owner, c.token == self.token)
        ).first()
        if held is None:
            raise LeaseLost(f"batcher {self.owner} lost its lease")

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
        except LeaseLost as exc:
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
        exactly this batch's custom_ids is adopted. Only past UNTAGGED_SEARCH_S with none found is it created
        again (a batch still running when that bound passes may then run it twice: the ledger would label it)."""
        if batch.state is BatchState.CLAIMED:
            self._save(batch.id, BatchState.CLAIMED, state=BatchState.UPLOADED)  # from here a create may be sent
            created = adapter.create(self._lines(batch.id))
            fault_point("batch_created", batch=batch.id)
            self._submitted(batch, created, done)
            return
        mine = set(self._custom_ids(batch.id))
        since = _epoch(batch.created_at) - UNTAGGED_SLACK_S
        running = False
        for listed in adapter.list_since(since):
            candidate = listed if listed.ended else adapter.retrieve(listed.id)
            if not candidate.ended:
                running = True  # its requests cannot be read before it ends: wait for it
                continue
            if {line.custom_id for line in adapter.results(candidate)} == mine:
                self._submitted(batch, candidate, done)
                logger.warning("batcher: batch %s found again as %s (created before a crash)", batch.id, candidate.id)
                return
        with self.db.read() as conn:
            waited = float(conn.execute(select(self.db.dialect.epoch())).scalar_one()) - _epoch(batch.created_at)
        if running and waited < UNTAGGED_SEARCH_S:
            return
        self._submitted(batch, adapter.create(self._lines(batch.id)), done)

    def _submitted(self, batch: Any, created: Any, done: BatchRound) -> None:
        """Save the provider's batch id (fenced), and its items as submitted."""
        with self.db.begin() as conn:
            self._fence(conn)
            conn.execute(
                update(BATCHES)
                .where(BATCHES.c.id == batch.id, BATCHES.c.state.in_((BatchState.CLAIMED, BatchState.UPLOADED)))
                .values(state=BatchState.SUBMITTED, provider_batch_id=created.id, provider_status=created.status,
                        submitted_at=self.db.dialect.now())
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
        state = adapter.retrieve(batch.provider_batch_id)
        done.polled += 1
        hint = getattr(state, "poll_after_s", None) or self.poll_s
        with self.db.begin() as conn:
            self._fence(conn)
            now = float(conn.execute(select(self.db.dialect.epoch())).scalar_one())
            conn.execute(
                update(BATCHES)
                .where(BATCHES.c.id == batch.id)
                .values(provider_status=state.status, polls=BATCHES.c.polls + 1, next_poll_at=now + hint)
            )
        if not state.ended:
            return
        ordered = bool(getattr(adapter, "results_in_input_order", False))
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
        self._end(batch.id, later, done)
        if batch.file_id:
            done.files_deleted += self._delete_files(adapter, [batch.file_id])

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

    def _end(self, batch_id: str, later: list[Any], done: BatchRound) -> None:
        """In one fenced transaction: apply the lines left for the end, re-queue every item in no line (expired,
        cancelled, missing), and end the batch. Until it commits, every item of the batch is still in it."""
        with self.db.begin() as conn:
            self._fence(conn)
            for line in later:
                self._apply_txn(conn, batch_id, line, done)
            self._requeue_rest(conn, batch_id, done)
            conn.execute(
                update(BATCHES)
                .where(BATCHES.c.id == batch_id, BATCHES.c.state == BatchState.SUBMITTED)
                .values(state=BatchState.ENDED, ended_at=self.db.dialect.now())
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
