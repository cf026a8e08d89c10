"""What the batcher's stages share: a round's tally, the lease that fences each write, and the batch reads.

One batcher works at a time (the `batcher` lease in `oncelery_leases`, on the database clock); every write a
stage makes is fenced by that lease's token (`BatcherLease.fence`), so a batcher that lost its lease (paused,
partitioned) writes nothing. The stages (`submit`, `poll`, `suspects`) each hold the one lease
of their `Batcher` (`oncelery.relay.batcher`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC
from typing import Any, Protocol

from sqlalchemy import Connection, select, update

from oncelery.models.batches import BatchState
from oncelery.runs.sweeps import make_waiting_run_due_txn
from oncelery.store.database import Database, rowcount
from oncelery.store.tables import BATCH_ITEMS, BATCHES, LEASES

__all__ = [
    "LEASE_S",
    "BatchRound",
    "BatcherLease",
    "BatcherLeaseLost",
    "Line",
    "ProviderBatch",
    "Stage",
    "epoch_of",
    "wake_run",
]

logger = logging.getLogger("oncelery.batcher")  # a stable name (users filter on it), shared by every stage

LEASE_NAME = "batcher"
LEASE_S = 30.0


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


class BatcherLeaseLost(Exception):
    """The batcher's lease passed to another: this one writes nothing more this round (a batcher's own lease, not a
    run's: the public `oncelery.errors.LeaseLost` is a run holder's fencing token gone stale)."""


class BatcherLease:
    """The `batcher` lease one batcher holds at a time; `fence` lets a transaction commit only while it is held."""

    def __init__(self, db: Database, lease_s: float = LEASE_S) -> None:
        self.db = db
        self.lease_s = lease_s  # a batcher that dies holds the lease this long: the next one waits it out
        self.owner = uuid.uuid4().hex
        self.token = 0

    def acquire(self) -> bool:
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

    def fence(self, conn: Connection) -> None:
        """In the caller's transaction: raise BatcherLeaseLost unless this batcher still holds its lease."""
        c = LEASES.c
        held = conn.execute(
            select(c.name).where(c.name == LEASE_NAME, c.owner == self.owner, c.token == self.token)
        ).first()
        if held is None:
            raise BatcherLeaseLost(f"batcher {self.owner} lost its lease")


class Stage:
    """A stage of the batcher: its database, its provider batch APIs and its lease, shared with the other stages."""

    def __init__(self, db: Database, adapters: dict[str, Any], lease: BatcherLease) -> None:
        self.db = db
        self.adapters = adapters  # the Batcher's own dict (one for every stage)
        self.lease = lease

    def save(self, batch_id: str, was: BatchState, **values: Any) -> None:
        """Set these columns of the batch (fenced), only if it is still in state `was`."""
        with self.db.begin() as conn:
            self.lease.fence(conn)
            conn.execute(update(BATCHES).where(BATCHES.c.id == batch_id, BATCHES.c.state == was).values(**values))

    def custom_ids(self, batch_id: str) -> list[str]:
        """The batch's custom_ids in the order its requests were sent (`lines`' order: by item id)."""
        i = BATCH_ITEMS.c
        with self.db.read() as conn:
            return list(conn.execute(select(i.custom_id).where(i.batch_id == batch_id).order_by(i.id)).scalars())

    def lines(self, batch_id: str) -> list[tuple[str, dict[str, Any]]]:
        """The batch's (custom_id, request) in the order they are sent: by item id, the order `custom_ids` gives."""
        i = BATCH_ITEMS.c
        with self.db.read() as conn:
            rows = conn.execute(select(i.custom_id, i.request).where(i.batch_id == batch_id).order_by(i.id)).all()
        return [(r.custom_id, dict(r.request or {})) for r in rows]

    @staticmethod
    def delete_files(adapter: Any, file_ids: Iterable[str]) -> int:
        """Delete these uploaded input files at the provider; return how many."""
        deleted = 0
        for file_id in file_ids:
            adapter.delete_file(file_id)
            deleted += 1
        return deleted


def wake_run(conn: Connection, db: Database, run_id: int) -> None:
    """Make a WAITING run due now (the relay's waker re-sends it); nothing if it is not waiting, or if its wake
    is already due. The transition is the runs room's (runs/sweeps.py), in the caller's transaction."""
    make_waiting_run_due_txn(conn, db, run_id)


def epoch_of(value: Any) -> float:
    """A database timestamp (aware, or naive UTC as SQLite returns it) as epoch seconds."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return float(value.timestamp())
