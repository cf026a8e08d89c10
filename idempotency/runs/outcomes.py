"""Delivery outcomes (G7): every delivery records exactly one, counted in the database, exact across hosts.

Counters are sharded rows summed on read, so concurrent workers rarely queue on one counter row.

Replays answered from the replay cache are counted here too, in this process's memory first: a flusher thread
writes them every FLUSH_INTERVAL (and at exit), so a cache hit costs no database round trip.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import threading
import time
from typing import Any

from sqlalchemy import Connection, bindparam, func, select, update
from sqlalchemy.orm import Session

from oncelery.errors import StoreError
from oncelery.models import Outcome
from oncelery.runs.faults import fault_point
from oncelery.settings import ENV_REPLAY_FLUSH_INTERVAL, env_seconds
from oncelery.store.database import Database, get_engine, translated
from oncelery.store.driver import driver_transaction
from oncelery.store.statements import statements
from oncelery.store.tables import OUTCOME_SHARDS, OUTCOME_TOTALS, OUTCOMES, RUNS, SAVED_FROM

__all__ = [
    "FLUSH_CHUNK",
    "FLUSH_INTERVAL",
    "MAX_PENDING_RUNS",
    "PendingReplays",
    "counter_shard",
    "flush_at_exit",
    "flush_replays",
    "outcome_counts",
    "outcome_params",
    "pending_replays",
    "record_outcome",
    "record_outcome_txn",
    "record_producer_replay",
]

logger = logging.getLogger("oncelery.replay_cache")  # the cached replays' counts keep the cache's logger name

# How often a process writes the replays it answered from the cache to the database (seconds); the most a
# SIGKILL can lose of them. $ONCELERY_REPLAY_FLUSH_INTERVAL overrides it.
FLUSH_INTERVAL = 1.0
# Runs with unwritten replay counts beyond which the cache answers nothing more (the database does) until a
# flush succeeds: a database that is down for long costs no memory, and loses no count.
MAX_PENDING_RUNS = 10_000
FLUSH_CHUNK = 500  # runs per flush transaction (SQLite's bound parameters are limited)


def outcome_params(task_name: str, outcome: Outcome, tenant: str = "", **totals: int) -> dict[str, Any]:
    """The parameters of one counter increment (a random shard), adding `totals` (OUTCOME_TOTALS, default 0)."""
    params: dict[str, Any] = {f"p_{name}": totals.pop(name, 0) for name in OUTCOME_TOTALS}
    if totals:
        raise TypeError(f"not an outcome total: {sorted(totals)}")
    return {"p_task": task_name, "p_tenant": tenant, "p_outcome": outcome, "p_shard": counter_shard(), **params}


def counter_shard() -> int:
    """A random shard of an outcome counter (concurrent workers rarely queue on one counter row)."""
    return random.randrange(OUTCOME_SHARDS)


def record_outcome_txn(
    conn: Connection | Session, dialect: str, task_name: str, outcome: Outcome, tenant: str = ""
) -> None:
    """Count one delivery outcome inside the caller's transaction (it commits or rolls back with it)."""
    conn.execute(statements(dialect).count_outcome, outcome_params(task_name, outcome, tenant))


def record_outcome(
    db: Database, task_name: str, outcome: Outcome, tenant: str = "", replayed_run: int | None = None
) -> None:
    """Count one delivery outcome in its own durable transaction.

    `replayed_run`: the COMPLETED run whose stored result answered this delivery; its `replays` grows by one in
    the same transaction (one statement on PostgreSQL).
    """
    sql = statements(db.dialect.name)
    params = outcome_params(task_name, outcome, tenant)
    if replayed_run is None:
        db.one(sql.count_outcome, params)
        return
    params["p_run_id"] = replayed_run
    if sql.count_replay is not None:
        db.one(sql.count_replay, params)
        return
    with db.begin() as conn:
        run = conn.execute(sql.count_replay_on_run, params).first()
        if run is not None:  # purged meanwhile: the replay is counted, saving nothing known
            calls, input_tokens, output_tokens, cost = run
            params.update(
                p_saved_calls=calls,
                p_saved_input_tokens=input_tokens,
                p_saved_output_tokens=output_tokens,
                p_saved_cost_micros=cost,
            )
        conn.execute(sql.count_outcome, params)


def record_producer_replay(db: Database, mode: str, task_name: str, tenant: str, run_id: int) -> None:
    """Count a replay answered at the producer (`replayed`, at_producer = 1, with what it saved) and bump its run's
    replays, in one durable transaction on the engine of `mode` (bounded: a busy database raises StoreError).

    For databases without data-modifying CTEs (SQLite); PostgreSQL counts it in the producer's one statement.
    """
    sql = statements(db.dialect.name)
    params = {**outcome_params(task_name, Outcome.REPLAYED, tenant, at_producer=1), "p_run_id": run_id}
    with translated(db.url), driver_transaction(get_engine(db.url, mode)) as tx:
        run = tx.execute(sql.count_replay_on_run, params).first()
        if run is not None:  # purged meanwhile: the replay is counted, saving nothing known
            params.update(zip((f"p_{name}" for name in SAVED_FROM), run, strict=True))
        tx.execute(sql.count_outcome, params)


def outcome_counts(db: Database, task_name: str | None = None, tenant: str | None = None) -> dict[str, int]:
    """Return {outcome: count} summed over all tasks (and tenants), or one task's, or one tenant's."""
    c = OUTCOMES.c
    stmt = select(c.outcome, func.sum(c.count)).group_by(c.outcome)
    if task_name is not None:
        stmt = stmt.where(c.task_name == task_name)
    if tenant is not None:
        stmt = stmt.where(c.tenant == tenant)
    with db.read() as conn:
        return {o.value: int(n) for o, n in conn.execute(stmt)}


class PendingReplays:
    """Replays answered from the cache and not yet in the database: {run id: [task, tenant, count]}."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.lock = threading.Lock()
        self.flushing = threading.Lock()
        self.runs: dict[int, list[Any]] = {}

    def add(self, run_id: int, task_name: str, tenant: str) -> None:
        """Count one replay of `run_id` (the flusher thread writes it)."""
        with self.lock:
            seen = self.runs.get(run_id)
            if seen is None:
                self.runs[run_id] = [task_name, tenant, 1]
            else:
                seen[2] += 1
        _flusher().wake()

    def full(self) -> bool:
        """Whether so many counts wait for the database that the cache should stop answering."""
        return len(self.runs) >= MAX_PENDING_RUNS

    def flush(self) -> int:
        """Write every pending count in transactions of FLUSH_CHUNK runs; return replays written.

        Raises StoreError if the database refuses; the counts not written stay pending (none is lost or doubled:
        a chunk is taken out only once its transaction committed).
        """
        written = 0
        with self.flushing:  # one flush at a time (the flusher thread, outcome_counts, exit): none writes twice
            while True:
                with self.lock:  # a snapshot: counts added during the write stay for the next chunk
                    chunk = {run_id: (t, te, n) for run_id, (t, te, n) in list(self.runs.items())[:FLUSH_CHUNK]}
                if not chunk:
                    return written
                _write(self.db, chunk)
                with self.lock:
                    for run_id, (_task, _tenant, n) in chunk.items():
                        left = self.runs[run_id][2] - n
                        if left:
                            self.runs[run_id][2] = left
                        else:
                            del self.runs[run_id]
                written += sum(n for _task, _tenant, n in chunk.values())


_BUMP = update(RUNS).where(RUNS.c.id == bindparam("b_id")).values(replays=RUNS.c.replays + bindparam("b_n"))
_SAVED = select(RUNS.c.id, *(RUNS.c[column] for column in SAVED_FROM.values())).where(
    RUNS.c.id.in_(bindparam("b_ids", expanding=True))
)


def _write(db: Database, chunk: dict[int, tuple[str, str, int]]) -> None:
    """One transaction: each run's replays, and the `replayed` outcome counts with what they saved."""
    counts: dict[tuple[str, str], dict[str, int]] = {}
    with db.begin() as conn:
        fault_point("flush_replays", runs=len(chunk))
        conn.execute(_BUMP, [{"b_id": run_id, "b_n": n} for run_id, (_t, _te, n) in chunk.items()])
        saved = {row[0]: row[1:] for row in conn.execute(_SAVED, {"b_ids": list(chunk)})}
        for run_id, (task_name, tenant, n) in chunk.items():
            totals = counts.setdefault((task_name, tenant), {"count": 0, **dict.fromkeys(SAVED_FROM, 0)})
            totals["count"] += n
            for name, value in zip(SAVED_FROM, saved.get(run_id, ()), strict=False):  # purged: saved nothing
                totals[name] += n * (value or 0)
        params = []
        for (task_name, tenant), totals in counts.items():
            n = int(totals.pop("count"))
            params.append({**outcome_params(task_name, Outcome.REPLAYED, tenant, **totals), "p_count": n})
        conn.execute(statements(db.dialect.name).count_outcomes, params)


_pendings: dict[str, PendingReplays] = {}


def pending_replays(db: Database) -> PendingReplays:
    """This process's pending cached-replay counts for `db` (made on first use, anew after a fork)."""
    pending = _pendings.get(db.url)
    if pending is None:
        pending = _pendings[db.url] = PendingReplays(db)
    return pending


def flush_replays() -> int:
    """Write this process's pending cached-replay counts to the database now; return how many. Raises StoreError."""
    return sum(pending.flush() for pending in list(_pendings.values()))


class _Flusher:
    """One daemon thread per process: writes pending counts every FLUSH_INTERVAL, retrying after a failure."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.interval = env_seconds(ENV_REPLAY_FLUSH_INTERVAL, FLUSH_INTERVAL)
        self.event = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="oncelery-replay-counts", daemon=True)
        self.thread.start()

    def wake(self) -> None:
        """Make sure a flush is due (at most FLUSH_INTERVAL from now)."""
        if not self.event.is_set():
            self.event.set()

    def _loop(self) -> None:
        while True:
            self.event.wait()
            time.sleep(self.interval)  # gather an interval's replays into one transaction
            self.event.clear()
            try:
                flush_replays()
            except StoreError as exc:
                logger.warning("could not write cached replay counts (kept, retried): %s", exc)
                self.event.set()


_flusher_of: list[_Flusher] = []


def _flusher() -> _Flusher:
    if not _flusher_of or _flusher_of[0].pid != os.getpid():
        _flusher_of[:] = [_Flusher()]
    return _flusher_of[0]


def _forget_parent_state() -> None:
    # A forked child (a prefork pool process) must not write the counts its parent will write.
    _pendings.clear()
    _flusher_of.clear()


def flush_at_exit() -> None:
    """Write the pending counts now, logging (not raising) a failure: the last word of an ending process."""
    try:
        flush_replays()
    except StoreError as exc:
        logger.error("cached replay counts lost at exit: %s", exc)


os.register_at_fork(after_in_child=_forget_parent_state)
atexit.register(flush_at_exit)
