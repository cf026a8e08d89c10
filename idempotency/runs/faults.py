"""Named fault points on a delivery's path, for tests that make the database fail right there.

Each stage that touches the database calls `fault_point(name)` just before it does. Nothing is registered in
production, so a point costs one dict lookup. A test registers a callback (`oncelery.testing`-style:
`with fault_injected("complete", kill_backends): ...`) that kills the worker's connections, restarts the
server or holds a lock, and then asserts the job still ends exactly once.

`expire_run_lease` is the one fault a test makes to a run row itself: its lease moved into the past by the database
clock, as if its holder froze (oncelery.testing's `expire_lease`, `kill_holder`, `frozen_past_lease`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import update

from oncelery.store.database import Database
from oncelery.store.tables import RUNS

__all__ = [
    "POINTS",
    "expire_run_lease",
    "fault_injected",
    "fault_point",
]

#: Every point, in delivery order.
POINTS = (
    "producer_find",  # before a producer's check reads the call's run (and answers a duplicate) at .delay()
    "producer_count",  # SQLite: before a producer counts the duplicate it answers (its own write transaction)
    "debounce_check",  # before a debounced burst's message reads its key's latest edit
    "version_check",  # before a versioned event reads its entity's applied version
    "claim",  # before the claim statement
    "conflict_read",  # before a conflicting payload's claim reads the run's field digests (PostgreSQL)
    "load_checkpoints",  # before a taken-over run loads its steps
    "fork_load",  # before a fork's run reads its fork row (then the source's checkpoints)
    "heartbeat",  # before a holder's lease renewal (on the heartbeat thread, while the body runs)
    "step_call",  # before a step's function is called (oncelery.testing.fail_step_once)
    "ledger_write",  # before a model call's ledger row (and running totals) is written
    "ledger_committed",  # after a model call's ledger row committed, before its writer learns so (a lost answer)
    "llm_prepare",  # before a model call's intent is prepared (its limiters admit it, its budgets reserve)
    "llm_create",  # a model call's intent is committed `prepared`; before its create request is sent
    "llm_created",  # the provider answered the create; before the intent is marked `sent` (the create window)
    "llm_poll",  # before a sent call is polled (its reference is saved)
    "park",  # before a run whose model call outlasts the inline wait is parked WAITING
    "step_save",  # before a step's checkpoint is written
    "effects_begin",  # before a run's first effects() block begins its transaction (SQLite: the write lock)
    "effects_flush",  # before an effects() block is flushed
    "complete",  # before the completion (and the effects commit)
    "record_failure",  # before a failed run is recorded
    "count_outcome",  # before a replay, conflict, in-progress wait or lost lease is counted
    "dead_letter",  # before a poison run is made DEAD, or a run-less message (conflict, bad) is dead-lettered
    "flush_replays",  # inside the transaction that writes the replay cache's counted replays, before its writes
    "publish",  # before a stored job is sent to the broker (relay, sweeper, dead-letter replay): a broker refusal
    "relay_published",  # after the relay published a batch, before it marks the rows sent
    "debounce_dispatched",  # after the dispatcher wrote due bursts' outbox rows, before its transaction commits
    "supersede_check",  # before a debounced run's renewal asks whether a newer edit supersedes it
    "purge_batch",  # inside a purge batch's transaction, after its deletes, before it commits
    # The batcher (oncelery.relay.batcher, in the relay): each crash point of a provider batch's life.
    "batch_claimed",  # its items are claimed under the batch row; nothing uploaded
    "batch_uploaded",  # its input file is at the provider; the file id is not saved
    "batch_created",  # the provider's batch exists (the create window); its id is not saved
    "batch_created_again",  # an untagged batch created again past the search bound; its id is not saved
    "batch_saved",  # the provider's batch id is saved
    "batch_downloaded",  # its results are read, none applied yet
    "batch_applying",  # between two result lines applied (mid fan-out)
)

_hooks: dict[str, Callable[[str, dict[str, Any]], None]] = {}
_lock = threading.Lock()


def fault_point(name: str, **context: Any) -> None:
    """Call the callback registered for `name`, if any (tests only); `context` says what is happening."""
    hook = _hooks.get(name)
    if hook is not None:
        hook(name, context)


@contextmanager
def fault_injected(name: str, hook: Callable[[str, dict[str, Any]], None]) -> Iterator[None]:
    """Within the block, call `hook(name, context)` each time a delivery reaches the point `name`."""
    if name not in POINTS:
        raise ValueError(f"unknown fault point {name!r}; known: {', '.join(POINTS)}")
    with _lock:
        _hooks[name] = hook
    try:
        yield
    finally:
        with _lock:
            _hooks.pop(name, None)


def expire_run_lease(db: Database, task_name: str, tenant: str, key: str) -> None:
    """Move the lease of run (task, tenant, key) an hour into the past by the database clock: as if its holder froze
    (no sleeping); its status and token are left as they are, so a takeover decides as for any expired lease."""
    r = RUNS.c
    stmt = (
        update(RUNS)
        .where(r.task_name == task_name, r.tenant == tenant, r.idempotency_key == key)
        .values(lease_expires_at=db.dialect.lease_until("p_lease"))  # the database clock's now - 1 h
    )
    with db.begin() as conn:
        conn.execute(stmt, {"p_lease": db.dialect.lease_param(-3600.0)})
