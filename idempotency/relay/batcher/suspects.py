"""The batcher's suspects (Anthropic only): the batches that may run a batch's requests a second time.

A batch whose create may have been sent before a crash, and which is created again past the search bound
(`untagged_search_s`) because a batch was still running, keeps the batches running then as its suspects
(`llm_batches.suspects`). The poller (`poll`) polls them with its own batch: the first of them to end with
exactly this batch's custom_ids (or its own batch) is applied; each other one that ends with them is the
duplicate, and each of its lines is written to the ledger once, labelled `duplicate_batch`, at the batch price,
without touching the items. A suspect with other custom_ids, or gone, is forgotten. The batch ends once every
suspect is resolved.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import Connection, select, update

from oncelery.ledger.recording import CallLedger
from oncelery.llm.adapters.base import Usage
from oncelery.llm.errors import ProviderRejected, ResponseGone
from oncelery.models.batches import BatchState
from oncelery.relay.batcher.stage import BatcherLease, BatchRound, Stage, logger
from oncelery.store.database import Database, rowcount
from oncelery.store.tables import BATCH_ITEMS, BATCHES, INTENTS, RUNS

__all__ = [
    "DUPLICATE_BATCH",
    "SuspectWatch",
    "Suspects",
    "duplicate_call_id",
    "items_digest",
]

#: The ledger label (`model_calls.reason`) of each call of a duplicate batch: the same requests run a second time.
DUPLICATE_BATCH = "duplicate_batch"
_LOOKUP_CHUNK = 500  # custom_ids per IN (...) when a duplicate's items are looked up


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


class SuspectWatch(Stage):
    """Resolves a batch's suspects, each once: the first to end with its custom_ids applied, a duplicate labelled."""

    def __init__(
        self,
        db: Database,
        adapters: dict[str, Any],
        lease: BatcherLease,
        *,
        ledger: CallLedger | None = None,
    ) -> None:
        super().__init__(db, adapters, lease)
        # A duplicate batch's calls go to the ledger the relay made for its app: priced at the app's prices and
        # written once per call id.
        self.ledger = ledger

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

    def first(
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
                    self.lease.fence(conn)
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

    def watch(self, adapter: Any, batch: Any, watch: Suspects, done: BatchRound) -> None:
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
            self.lease.fence(conn)
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
            cost = self.ledger.cost_micros(batch.model, usage.input_tokens, usage.output_tokens, "batch")
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
                "cost_micros": cost,
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
            written += int(self.ledger.record(conn, row))
        return written


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
