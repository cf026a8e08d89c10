"""The claim protocol on a SQL database: each transition is one atomic, token-guarded statement.

Lease timeline (all times are the database clock's, never a worker's):

    claim: INSERT (token=1) or takeover UPDATE (token=t+1), owner=o, lease_expires_at = now + L
    |<------------- L ------------->|
    holder renews every L/3:  UPDATE ... SET lease_expires_at = now + L WHERE id AND token=t AND owner=o
    completion:               UPDATE ... SET status=COMPLETED WHERE id AND token=t AND owner=o AND RUNNING

    If the holder stops renewing (SIGKILL, SIGSTOP, GC pause, partition):
    |<------------- L ------------->| expired: the next delivery takes over in ONE statement:
        UPDATE ... SET token=t+1, owner=o2 WHERE key AND fingerprint AND
                  (status=FAILED OR (status=RUNNING AND lease_expires_at < now))
    The old holder (a zombie) wakes: every write it makes says `token=t AND owner=o` -> 0 rows ->
    LeaseLost, and its transaction (result, effects, step) rolls back.

`owner` is a random id per claim: with the token it stays unique even if a database crash loses a claim
row and a counter is handed out again.

The claim's rounds (insert, read, decide, take over) are `ClaimRounds` (`claim_rounds.py`), which `RunStore`
inherits; this module holds the store, the holder's fenced writes, and the reads and counters.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from oncelery.errors import StaleVersion
from oncelery.ledger.unknown import UNKNOWN_OUTCOME, abandon_run_intents_txn
from oncelery.models import Outcome, RunStatus
from oncelery.runs.claim_rounds import ClaimRounds
from oncelery.runs.decisions import (
    Claim,
    Death,
    EntityVersionOf,
    ProducerFind,
    clean_error,
    completion_counts,
    lease_lost,
)
from oncelery.runs.faults import fault_point
from oncelery.runs.keys import Identity
from oncelery.runs.legacy import LegacyRuns
from oncelery.runs.letters import letter_conflict, letter_without_run, write_letter
from oncelery.runs.outcomes import (
    counter_shard,
    flush_replays,
    outcome_counts,
    record_outcome,
    record_outcome_txn,
    record_producer_replay,
)
from oncelery.runs.secrets import Secrets
from oncelery.runs.views import Runs, RunView
from oncelery.store.database import rowcount, translated
from oncelery.store.driver import DriverTransaction
from oncelery.store.statements import Statements, statements
from oncelery.store.tables import RUNS, VERSIONS

__all__ = ["RunStore"]


class RunStore(ClaimRounds):
    """Claims, leases, fencing and completion of runs in one SQL database (PostgreSQL or SQLite).

    Round trips per executed job on PostgreSQL: the claim is one autocommit statement on a connection
    with `synchronous_commit = off` (a claim need not be durable: a lost claim only makes its holder's
    fenced completion fail, and the random owner id keeps tokens unique), and the completion plus its
    outcome counter is one durable autocommit statement (or joins the effects transaction).
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.runs = Runs(url)
        self.db = self.runs.db  # one handle: the reads and the claims share its dialect and engines
        self.secrets = Secrets(self.db)
        # Runs stored before keyed digests and injective keys: found by a lookup only while they may remain.
        self.legacy = LegacyRuns(self.db, self.secrets)

    @property
    def engine(self) -> Engine:
        """This process's engine for the store's database."""
        return self.db.engine

    @property
    def read_engine(self) -> Engine:
        """This process's engine for reads (never takes SQLite's writer lock)."""
        return self.db.read_engine

    @property
    def dialect(self) -> str:
        """The database's dialect name: "postgresql" or "sqlite"."""
        return self.db.dialect.name

    @property
    def sql(self) -> Statements:
        """The prebuilt statements of this store's dialect."""
        return statements(self.dialect)

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """A transaction on the store's database; driver errors become typed store errors."""
        with self.db.begin() as conn:
            yield conn

    def fence_params(self, claim: Claim) -> dict[str, Any]:
        """The parameters of the fence every holder write carries (run id, token, owner)."""
        return {"p_run_id": claim.run_id, "p_token": claim.token, "p_owner": claim.owner}

    def lease_params(self, seconds: float) -> dict[str, Any]:
        """The parameter that sets a lease of `seconds` from the database clock's now."""
        return {"p_lease": self.db.dialect.lease_param(seconds)}

    # -- claim (`claim` and its rounds: ClaimRounds, claim_rounds.py) ---------------------------------

    def producer_find(self, task_name: str, ident: Identity, mode: str) -> ProducerFind | None:
        """The run of a call as a producer sees it before publishing, or None (no run); never claims.

        A COMPLETED run of the same payload is answered: its replay is counted (`replayed`, at_producer) and its
        run's replays bumped before this returns (`counted`), in the read's own statement on PostgreSQL. `mode`: the
        bounded engine to use (store.dialects.producer_mode); a timeout or any driver error raises StoreError.
        """
        params = {
            "p_task": task_name,
            "p_tenant": ident.tenant,
            "p_key": ident.key,
            "p_fingerprint": ident.fingerprint,
            "p_shard": counter_shard(),
        }
        sql = self.sql
        fault_point("producer_find", task=task_name, key=ident.key)
        if sql.producer_answer is not None:
            row, _ = self.db.one_bounded(mode, sql.producer_answer, params)
            return None if row.id is None else _producer_find(row, counted=bool(row.replayed))
        with self.db.read() as conn:  # SQLite: reads take no lock; only an answer writes (its count)
            row = conn.execute(sql.producer_view, params).first()
        if row is None:
            return None
        found = _producer_find(row, counted=False)
        if found.status is RunStatus.COMPLETED and found.fingerprint == ident.fingerprint:
            fault_point("producer_count", task=task_name, key=ident.key)
            record_producer_replay(self.db, mode, task_name, ident.tenant, found.run_id)
            return _producer_find(row, counted=True)
        return found

    def letter_without_run(
        self, task_name: str, tenant: str, reason: str, error: str, message: Any, key: str | None = None
    ) -> None:
        """Dead-letter a message that has no run of its own (a bad message, a conflict), and count its outcome."""
        letter_without_run(self.db, task_name, tenant, reason, error, message, key)

    def letter_conflict(self, task_name: str, ident: Identity, error: str, fields: list[str], message: Any) -> None:
        """Count a conflicting delivery, with one redacted letter per (task, tenant, key, fingerprint)."""
        letter_conflict(self.db, task_name, ident, error, fields, message)

    def applied_version(self, task_name: str, tenant: str, entity: str) -> int | None:
        """The last applied version of `entity` for this task and tenant, or None before the first."""
        v = VERSIONS.c
        stmt = select(v.version).where(v.task_name == task_name, v.tenant == tenant, v.entity == entity)
        with self.db.read() as conn:
            value = conn.execute(stmt).scalar_one_or_none()
        return None if value is None else int(value)

    def settle_stale(self, task_name: str, ident: Identity) -> int | None:
        """Complete with no result the run of a stale delivery that waits to be run again (a retry due, or an
        expired holder, or parked), so nothing re-sends it for ever; its calls still open end with their ledger
        rows in the same transaction (oncelery.ledger.unknown). Return the settled run's id (None: none was)."""
        params = {"p_task": task_name, "p_tenant": ident.tenant, "p_key": ident.key}
        r = RUNS.c
        find = select(r.id).where(r.task_name == task_name, r.tenant == ident.tenant, r.idempotency_key == ident.key)
        with self.db.begin() as conn:
            if rowcount(conn.execute(self.sql.settle_stale, params)) != 1:
                return None
            run_id = int(conn.execute(find).scalar_one())
            why = "its run was settled stale (a newer version of its entity was applied)"
            abandon_run_intents_txn(conn, self.db.dialect, run_id, UNKNOWN_OUTCOME, why)
        return run_id

    def close_outbox_row(self, celery_task_id: str | None, outcome: Outcome) -> None:
        """Close the outbox row that published this delivery (if any) with the outcome that settled it without
        a run, so the relay never re-publishes it; idempotent (only a PENDING or SENT row changes)."""
        if celery_task_id:
            self.db.one(self.sql.close_outbox_row, {"p_task_id": celery_task_id, "p_outcome": outcome.value})

    # -- holder's writes (all fenced) ----------------------------------------------------------------

    def heartbeat(self, claim: Claim) -> bool:
        """Extend the lease by `claim.lease` from now (database clock) iff the claim is still ours."""
        params = {**self.fence_params(claim), **self.lease_params(claim.lease)}
        return self.db.one(self.sql.heartbeat, params, durable=False)[1] == 1

    def heartbeat_txn(self, conn: Connection, claim: Claim) -> bool:
        """`heartbeat` in the caller's transaction, whose writes it fences (the UPDATE row-locks the run)."""
        params = {**self.fence_params(claim), **self.lease_params(claim.lease)}
        return rowcount(conn.execute(self.sql.heartbeat, params)) == 1

    def complete_txn(
        self,
        conn: Connection | Session | DriverTransaction,
        claim: Claim,
        result: Any,
        outcome: Outcome = Outcome.EXECUTED,
        version: EntityVersionOf | None = None,
        steps: tuple[int, int] = (0, 0),
        keep_arguments: bool = False,
    ) -> None:
        """Mark the run COMPLETED with `result` in the caller's transaction, or raise LeaseLost (no write).

        With `version`, the entity's applied version moves to it in the same transaction, or StaleVersion
        is raised (nothing written) if a newer version was applied first. `steps`: the run's checkpointed steps
        and those this delivery replayed, added with its takeovers to the outcome's running totals.
        `keep_arguments`: the run keeps its message (the task's keep_arguments) until retention clears it.
        """
        if version is not None:
            vparams = {"p_task": claim.task_name, "p_tenant": claim.tenant, **version.params()}
            if conn.execute(self.sql.advance_version, vparams).first() is None:
                raise StaleVersion.of(version.entity, version.version)
        params = {**self.fence_params(claim), "p_result": result, **completion_counts(claim, outcome, steps)}
        sql = self.sql
        if keep_arguments:
            if rowcount(conn.execute(sql.complete_keeping, params)) != 1:
                raise lease_lost(claim)
            conn.execute(sql.count_outcome, params)
            return
        if sql.complete_and_count is not None:
            if conn.execute(sql.complete_and_count, params).first() is None:
                raise lease_lost(claim)
            return
        if rowcount(conn.execute(sql.complete, params)) != 1:
            raise lease_lost(claim)
        conn.execute(sql.count_outcome, params)

    def complete(
        self,
        claim: Claim,
        result: Any,
        effects: Connection | Session | None = None,
        outcome: Outcome = Outcome.EXECUTED,
        version: EntityVersionOf | None = None,
        steps: tuple[int, int] = (0, 0),
        keep_arguments: bool = False,
    ) -> None:
        """Commit the run's completion (and the open `effects` transaction) atomically, fenced by the token."""
        if effects is None and outcome is Outcome.STALE:
            with self.db.begin() as conn:  # rare: a stale completion ends its calls still open (the ledger rule)
                self.complete_txn(conn, claim, result, outcome, version, steps, keep_arguments)
                why = "its run completed stale (a newer version of its entity was applied)"
                abandon_run_intents_txn(conn, self.db.dialect, claim.run_id, UNKNOWN_OUTCOME, why)
            return
        if effects is None:
            sql = self.sql
            if sql.complete_and_count is not None and version is None and not keep_arguments:
                # One statement: its own durable transaction in autocommit mode (no BEGIN/COMMIT trips).
                params = {**self.fence_params(claim), "p_result": result, **completion_counts(claim, outcome, steps)}
                if self.db.one(sql.complete_and_count, params)[0] is None:
                    raise lease_lost(claim)
                return
            with self.db.begin_statements() as conn:
                self.complete_txn(conn, claim, result, outcome, version, steps, keep_arguments)
            return
        with translated(self.url):
            try:
                self.complete_txn(effects, claim, result, outcome, version, steps, keep_arguments)
                effects.commit()
            except BaseException:
                effects.rollback()
                raise

    def park(self, claim: Claim, wake_in: float, reason: str, message: Any) -> bool:
        """Park the run WAITING for `wake_in` seconds (database clock) iff the claim is still ours; count `waiting`.

        The run keeps `message` for the waker (`oncelery relay` re-sends it when due), holds no lease, and its
        retries are untouched: waiting is not a failure. Returns False (nothing written but a `lease_lost`
        count) if the claim was lost.
        """
        params = {
            **self.fence_params(claim),
            "p_error": clean_error(reason),
            "p_delay": self.db.dialect.lease_param(max(0.0, wake_in)),
            "p_message": message,
        }
        with self.db.begin() as conn:
            ok = rowcount(conn.execute(self.sql.park, params)) == 1
            counted = Outcome.WAITING if ok else Outcome.LEASE_LOST
            record_outcome_txn(conn, self.dialect, claim.task_name, counted, claim.tenant)
        return ok

    def fail(
        self,
        claim: Claim,
        error: str,
        outcome: Outcome = Outcome.FAILED,
        retry_in: float | None = None,
        death: Death | None = None,
    ) -> bool:
        """Record the run FAILED with `error` iff the claim is still ours; return whether it was.

        `retry_in`: Celery retries the run after that many seconds; until then (database clock) no duplicate
        may take it over, and the retry is counted on the run. `death`: the run goes DEAD instead, with its
        dead letter in the same transaction, and the outcome counted is `dead`.
        """
        error = clean_error(error)
        params = {**self.fence_params(claim), "p_error": error}
        stmt = self.sql.fail
        if death is not None:
            stmt, outcome = self.sql.fail_dead, Outcome.DEAD
        elif retry_in is not None:
            stmt = self.sql.fail_for_retry
            params["p_delay"] = self.db.dialect.lease_param(max(0.0, retry_in))
        with self.db.begin() as conn:
            ok = rowcount(conn.execute(stmt, params)) == 1
            if ok and death is not None:
                write_letter(conn, self.sql, claim.run_id, error, death)
                # A dead run is held by nobody: its calls still open go on the books now (the ledger rule).
                why = f"its run went dead ({death.reason})"
                abandon_run_intents_txn(conn, self.db.dialect, claim.run_id, UNKNOWN_OUTCOME, why)
            elif ok and retry_in is None:
                # Failed for good (no retry is coming: Celery acks it as failed): held by nobody unless the job is
                # sent again, so its calls still open go on the books now too. A later send calls again, on the
                # books as well, rather than leave a create that may have happened unrecorded and its money held.
                why = "its run failed with no retry coming"
                abandon_run_intents_txn(conn, self.db.dialect, claim.run_id, UNKNOWN_OUTCOME, why)
            counted = outcome if ok else Outcome.LEASE_LOST
            record_outcome_txn(conn, self.dialect, claim.task_name, counted, claim.tenant)
        return ok

    # -- reads and counters --------------------------------------------------------------------------

    def digest_key(self) -> bytes | None:
        """The secret this database generated for per-field digests (read once), or None if it has none."""
        return self.secrets.digest_key()

    def identity_key(self) -> bytes:
        """The key of every fingerprint and content-addressed key: this database's, generated once, never rotated."""
        return self.secrets.identity().key

    def get(self, task_name: str, key: str, tenant: str = "") -> RunView | None:
        """Return the run for (task, tenant, key), with whether its lease is live by the database clock."""
        return self.runs.get(task_name, key, tenant)

    def record_outcome(
        self, task_name: str, outcome: Outcome, tenant: str = "", replayed_run: int | None = None
    ) -> None:
        """Count one delivery outcome in its own (durable) transaction.

        `replayed_run`: the id of the COMPLETED run whose result answered it; one more replay on that run, in
        the same transaction.
        """
        record_outcome(self.db, task_name, outcome, tenant, replayed_run)

    def outcome_counts(self, task_name: str | None = None, tenant: str | None = None) -> dict[str, int]:
        """Return {outcome: count} summed over all tasks, or for one task (or tenant).

        This process's replays answered by the replay cache are written first, so its own counts are exact.
        """
        flush_replays()
        return outcome_counts(self.db, task_name, tenant)


def _producer_find(row: Any, counted: bool) -> ProducerFind:
    return ProducerFind(
        run_id=int(row.id),
        status=RunStatus(row.status) if not isinstance(row.status, RunStatus) else row.status,
        fingerprint=row.fingerprint,
        token=int(row.fencing_token),
        result=row.result,
        celery_task_id=row.celery_task_id,
        lease_live=bool(row.lease_live),
        recoverable=bool(row.kept) or bool(row.queued),
        counted=counted,
    )
