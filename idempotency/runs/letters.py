"""Dead letters the claim protocol writes: a poison run made DEAD, a failure's letter, a run-less message; and
the dead-letter queue's own changes to a DEAD run: replayed (FAILED again) or purged.

Each letter is written in the same transaction as the state change it records (and its outcome count), so a
fault in between can neither leave a DEAD run without its letter nor write a letter twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, delete, select, update

from oncelery.ledger.unknown import REVOKED_LABEL, UNKNOWN_OUTCOME, abandon_run_intents_txn
from oncelery.models import Outcome, RunStatus
from oncelery.runs.decisions import REASON_CONFLICT, REASON_MAX_DELIVERIES, REASON_REVOKED, Death, clean_error
from oncelery.runs.faults import fault_point
from oncelery.runs.keys import Identity
from oncelery.runs.outcomes import record_outcome_txn
from oncelery.runs.views import RunView
from oncelery.store.database import Database, rowcount
from oncelery.store.dialects import Dialect
from oncelery.store.statements import Statements, statements
from oncelery.store.tables import LETTERS, RUNS

__all__ = [
    "REDACTED_CONFLICT",
    "cancel_revoked",
    "delete_dead_runs_txn",
    "kill_lost",
    "letter_conflict",
    "letter_without_run",
    "revive_dead_txn",
    "write_letter",
]

# What a conflict letter keeps instead of the payload (not needed: a conflict is never replayed).
REDACTED_CONFLICT = "the conflicting payload is not kept; fields_that_differ names what differs"


def write_letter(conn: Connection, sql: Statements, run_id: int, error: str, death: Death) -> None:
    """Insert the dead letter of run `run_id` in the caller's transaction (its DEAD state commits with it)."""
    params = {
        "p_run_id": run_id,
        "p_reason": death.reason,
        "p_error": clean_error(death.error or error),
        "p_traceback": clean_error(death.traceback) if death.traceback else None,
        "p_letter": death.message,
    }
    conn.execute(sql.letter, params)


def kill_lost(db: Database, sql: Statements, run: RunView, max_deliveries: int, letter: Any) -> bool:
    """Make a poison run DEAD (guarded by the token seen and its expiry) with its dead letter; False if not ours."""
    error = (
        f"the worker running {run.task_name}[{run.key}] was lost on {run.lost + 1} deliveries "
        f"(max_deliveries={max_deliveries}): killed by the OS (OOM, segfault, SIGKILL) or cut off; "
        f"fix the cause, then `oncelery dlq replay`"
    )
    params = {"p_run_id": run.run_id, "p_token": run.token, "p_error": error}
    fault_point("dead_letter", task=run.task_name, key=run.key)
    with db.begin() as conn:
        if rowcount(conn.execute(sql.kill_lost, params)) != 1:
            return False
        write_letter(conn, sql, run.run_id, error, Death(REASON_MAX_DELIVERIES, None, letter))
        why = "its run went dead (its worker was lost too often)"
        abandon_run_intents_txn(conn, db.dialect, run.run_id, UNKNOWN_OUTCOME, why)
    return True


def letter_without_run(
    db: Database, task_name: str, tenant: str, reason: str, error: str, message: Any, key: str | None = None
) -> None:
    """Dead-letter a message that has no run of its own (a bad message, a conflict), and count its outcome."""
    row = {
        "task_name": task_name,
        "tenant": tenant,
        "idempotency_key": key,
        "reason": reason,
        "error": clean_error(error),
        "attempts": 1,
        "message": message,
    }
    with db.begin() as conn:
        conn.execute(LETTERS.insert().values(**row))
        # Counted with its letter, in one transaction: a fault between the two can neither leave a letter
        # uncounted nor, once the copy is re-sent, write the letter twice. A conflict is counted as such
        # (the first payload's run stands); any other reason as `dead`.
        outcome = Outcome.CONFLICT if reason == REASON_CONFLICT else Outcome.DEAD
        record_outcome_txn(conn, db.dialect.name, task_name, outcome, tenant)


def letter_conflict(db: Database, task_name: str, ident: Identity, error: str, fields: list[str], message: Any) -> None:
    """Count a conflicting delivery and keep one letter per (task, tenant, key, payload fingerprint), its
    arguments redacted (a conflict is never replayed: its letter names the fields that differ, not their values).
    """
    headers = dict((message or {}).get("headers") or {}) if isinstance(message, dict) else {}
    kept = {"redacted": REDACTED_CONFLICT, "fields_that_differ": fields, "headers": headers}
    params = {
        "p_task": task_name,
        "p_tenant": ident.tenant,
        "p_key": ident.key,
        "p_fingerprint": ident.fingerprint,
        "p_error": clean_error(error),
        "p_letter": kept,
    }
    with db.begin() as conn:
        conn.execute(statements(db.dialect.name).conflict_letter, params)
        # Counted with its letter, in one transaction: a fault between the two re-sends the copy, counted once.
        record_outcome_txn(conn, db.dialect.name, task_name, Outcome.CONFLICT, ident.tenant)


def cancel_revoked(db: Database, task_name: str, celery_task_id: str, terminated: bool) -> tuple[int, int] | None:
    """Make the run whose message Celery revoked DEAD (reason `revoked`, replayable), counted `dead`; return its
    (id, token), or None if no run of that message may be cancelled.

    A WAITING run is cancelled (nothing holds it: its wake was the revoked message). A RUNNING one only when the
    revoke terminated its holder: a revoke without terminate never stops a running body (Celery's rule), and
    losing a lease never cancels anything. Guarded by the status and token read, so a run taken over in between is
    left alone.
    """
    r = RUNS.c
    statuses = [RunStatus.WAITING, RunStatus.RUNNING] if terminated else [RunStatus.WAITING]
    with db.read() as conn:
        row = conn.execute(
            select(r.id, r.fencing_token, r.message, r.tenant).where(
                r.task_name == task_name, r.celery_task_id == celery_task_id, r.status.in_(statuses)
            )
        ).first()
    if row is None:
        return None
    how = "terminated and revoked" if terminated else "revoked while it waited"
    error = (
        f"{task_name}: its message {celery_task_id} was {how} (Celery's revoke): cancelled, not run again; "
        "`oncelery dlq replay` runs it again"
    )
    now = db.dialect.now()
    fault_point("dead_letter", task=task_name, key=None)
    with db.begin() as conn:
        done = conn.execute(
            update(RUNS)
            .where(r.id == row.id, r.fencing_token == row.fencing_token, r.status.in_(statuses))
            .values(
                status=RunStatus.DEAD, error=error, updated_at=now, finished_at=now, lease_expires_at=None,
                not_before=None, first_failed_at=now,
            )
        )  # fmt: skip
        if rowcount(done) != 1:
            return None
        write_letter(conn, statements(db.dialect.name), row.id, error, Death(REASON_REVOKED, None, row.message))
        # Its calls still open go on the books now, labelled; the canceller then stops them at the provider.
        abandon_run_intents_txn(conn, db.dialect, row.id, REVOKED_LABEL, "cancelled: its run was revoked")
        record_outcome_txn(conn, db.dialect.name, task_name, Outcome.DEAD, row.tenant)
    return int(row.id), int(row.fencing_token)


# -- the dead-letter queue's changes (oncelery dlq replay / purge) ------------------------------------------------


def revive_dead_txn(conn: Connection, dialect: Dialect, run_id: int) -> bool:
    """Make run `run_id` FAILED again iff it is still DEAD (retry and lost-delivery counts reset, no retry pending),
    in the caller's transaction; return whether it did (False: it is no longer DEAD, e.g. replayed already)."""
    r = RUNS.c
    now = dialect.now()
    revived = conn.execute(
        update(RUNS)
        .where(r.id == run_id, r.status == RunStatus.DEAD)
        .values(
            status=RunStatus.FAILED,
            lost=0,
            retries=0,
            not_before=None,
            error="replayed from the dead-letter queue",
            updated_at=now,
        )
    )
    return rowcount(revived) == 1


def delete_dead_runs_txn(conn: Connection, run_ids: Sequence[int]) -> int:
    """Delete those of `run_ids` that are DEAD, in the caller's transaction (a run replayed meanwhile stays); return
    how many."""
    r = RUNS.c
    return rowcount(conn.execute(delete(RUNS).where(r.id.in_(list(run_ids)), r.status == RunStatus.DEAD)))
