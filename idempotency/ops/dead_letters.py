"""The dead-letter queue: runs that will never succeed as they are, and messages that never had a run.

A run goes DEAD, with one `dead_letters` row, when it spends its last retry, fails with an error that can never
succeed (StepMismatch, ResultNotJSON, a ConfigurationError, a task's `dead_on`), or loses its worker on
`max_deliveries` deliveries (a poison message). No delivery runs a DEAD run. `replay` makes it FAILED again
(retry and lost-delivery counts reset) and re-enqueues its message with the same key through the outbox, so
its completed steps are replayed from their checkpoints and the job runs to completion once.

A replayed letter says where its message is (`LetterView.replay`): `queued` while its outbox row waits for a
relay to publish it (a PENDING row for its task, tenant and key), `unpublished` if that row was given up
(DEAD, never published), else `published`. Both are read through the outbox's status index.
"""

from __future__ import annotations

import builtins
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from celery import Celery
from sqlalchemy import Select, and_, case, delete, exists, select, update

from oncelery.models import OutboxStatus, RunStatus
from oncelery.relay.loop import Relay
from oncelery.relay.outbox import CONTINUATION, enqueue
from oncelery.runs.forks import stored_fork_headers
from oncelery.runs.letters import delete_dead_runs_txn, revive_dead_txn
from oncelery.settings import HEADER_FORK, HEADER_LEASE, HEADER_ON_IN_PROGRESS
from oncelery.store.database import Database
from oncelery.store.tables import LETTERS, OUTBOX, RUNS

__all__ = [
    "DeadLetters",
    "LetterView",
    "ReplayReport",
    "ReplayState",
]


class ReplayState(enum.StrEnum):
    """Where a replayed letter's message is (LetterView.replay; None: never replayed)."""

    QUEUED = "queued"  # in the outbox, not yet published: a relay publishes it
    PUBLISHED = "published"
    UNPUBLISHED = "unpublished"  # its outbox row was given up (DEAD) before any publish


# The per-call option headers a replay sends again (the key and tenant go as the outbox's own options).
# A fork's run is recognised by its header alone (runs/forks.py): its replay must carry it, or it is refused.
_REPLAYED_HEADERS = (HEADER_LEASE, HEADER_ON_IN_PROGRESS, HEADER_FORK)


@dataclass(frozen=True)
class LetterView:
    """One dead letter: the run (if any), why it died, its error and traceback, attempts, first/last failure."""

    letter_id: int
    run_id: int | None
    task_name: str
    tenant: str
    key: str | None
    reason: str
    error: str | None
    traceback: str | None
    attempts: int
    message: Any
    first_failed_at: datetime | None
    last_failed_at: datetime | None
    replayed_at: datetime | None
    replays: int
    run_status: RunStatus | None
    replay: ReplayState | None = None
    # Why the last publish of a queued replay failed (its outbox row's last_error), if one was tried.
    replay_error: str | None = None

    @property
    def replayable(self) -> bool:
        """Whether `replay` can send it again: it has a run, which is DEAD, and the message to send."""
        return self.run_id is not None and self.run_status is RunStatus.DEAD and isinstance(self.message, dict)


@dataclass
class ReplayReport:
    """What a replay did: the letters re-enqueued, and the ones skipped with why."""

    replayed: list[LetterView] = field(default_factory=list)
    skipped: list[tuple[LetterView, str]] = field(default_factory=list)
    # Why publishing the replayed messages failed after they were committed to the outbox (None: it did not).
    publish_error: str | None = None


def _letters_rows(status: OutboxStatus) -> Any:
    """The outbox rows in `status` of the letter's task, tenant and key (found through the index on status)."""
    d, o = LETTERS.c, OUTBOX.c
    return and_(
        o.status == status,
        o.task_name == d.task_name,
        o.tenant == d.tenant,
        o.idempotency_key == d.idempotency_key,
    )


def _query() -> Select[Any]:
    d, r = LETTERS.c, RUNS.c
    replay = case(
        (d.replayed_at.is_(None), None),
        (exists().where(_letters_rows(OutboxStatus.PENDING)), ReplayState.QUEUED.value),
        (exists().where(_letters_rows(OutboxStatus.DEAD), OUTBOX.c.publishes == 0), ReplayState.UNPUBLISHED.value),
        else_=ReplayState.PUBLISHED.value,
    )
    o = OUTBOX.c
    last_error = select(o.last_error).where(_letters_rows(OutboxStatus.PENDING)).order_by(o.id.desc()).limit(1)
    replay_error = case((d.replayed_at.is_(None), None), else_=last_error.scalar_subquery())
    columns = (r.status.label("run_status"), replay.label("replay"), replay_error.label("replay_error"))
    return select(LETTERS, *columns).select_from(LETTERS.outerjoin(RUNS, d.run_id == r.id))


def _view(row: Any) -> LetterView:
    return LetterView(
        letter_id=row.id,
        run_id=row.run_id,
        task_name=row.task_name,
        tenant=row.tenant,
        key=row.idempotency_key,
        reason=row.reason,
        error=row.error,
        traceback=row.traceback,
        attempts=row.attempts,
        message=row.message,
        first_failed_at=row.first_failed_at,
        last_failed_at=row.last_failed_at,
        replayed_at=row.replayed_at,
        replays=row.replays,
        run_status=row.run_status,
        replay=None if row.replay is None else ReplayState(row.replay),
        replay_error=row.replay_error,
    )


class DeadLetters:
    """Lists, replays and purges dead letters of one claims database."""

    def __init__(self, url: str) -> None:
        self.db = Database(url)

    def list(
        self,
        *,
        task_name: str | None = None,
        tenant: str | None = None,
        reason: str | None = None,
        keys: Sequence[str] | None = None,
        ids: Sequence[int] | None = None,
        include_replayed: bool = False,
        limit: int | None = 50,
    ) -> builtins.list[LetterView]:
        """Return letters, most recent failure first, filtered; replayed ones only with `include_replayed`."""
        d = LETTERS.c
        stmt = _query().order_by(d.last_failed_at.desc(), d.id.desc())
        if not include_replayed:
            stmt = stmt.where(d.replayed_at.is_(None))
        if task_name is not None:
            stmt = stmt.where(d.task_name == task_name)
        if tenant is not None:
            stmt = stmt.where(d.tenant == tenant)
        if reason is not None:
            stmt = stmt.where(d.reason == reason)
        if keys:
            stmt = stmt.where(d.idempotency_key.in_(list(keys)))
        if ids:
            stmt = stmt.where(d.id.in_(list(ids)))
        if limit is not None:
            stmt = stmt.limit(limit)
        with self.db.read() as conn:
            return [_view(row) for row in conn.execute(stmt)]

    def get(self, letter_id: int) -> LetterView | None:
        """Return one letter by id, or None."""
        found = self.list(ids=[letter_id], include_replayed=True, limit=1)
        return found[0] if found else None

    def replay(self, app: Celery, letters: Sequence[LetterView], queue: str | None = None) -> ReplayReport:
        """Make each letter's DEAD run FAILED again and re-enqueue its message with the same key.

        The reset and the outbox row commit together (a replay is never half done); the relay's publish
        follows at once, and a running `oncelery relay` publishes it if this process cannot (the letter's
        `replay` is then `queued`, and `publish_error` says why when the publish raised).
        """
        report = ReplayReport()
        d = LETTERS.c
        for letter in letters:
            if not letter.replayable or letter.run_id is None:
                report.skipped.append((letter, _why_not(letter)))
                continue
            message = dict(letter.message)
            # The stored tenant, "" included: a replay from the CLI has no caller to resolve one from.
            options: dict[str, Any] = {"idempotency_key": letter.key, "tenant": letter.tenant}
            if queue or message.get("queue"):
                options["queue"] = queue or message["queue"]
            for option in CONTINUATION:
                if message.get(option):
                    options[option] = message[option]
            # The call's own options travel as headers: a replay keeps its lease and on_in_progress too.
            headers = {name: v for name, v in (message.get("headers") or {}).items() if name in _REPLAYED_HEADERS}
            headers = stored_fork_headers(letter.key, headers)  # a fork's letter stored before its header
            if headers:
                options["headers"] = headers
            sig = app.signature(letter.task_name, list(message.get("args") or ()), dict(message.get("kwargs") or {}))
            sig = sig.set(**options)
            now = self.db.dialect.now()
            with self.db.begin() as conn:
                if not revive_dead_txn(conn, self.db.dialect, letter.run_id):
                    conn.rollback()
                    report.skipped.append((letter, "its run is no longer DEAD (replayed already?)"))
                    continue
                conn.execute(
                    update(LETTERS).where(d.id == letter.letter_id).values(replayed_at=now, replays=d.replays + 1)
                )
                enqueue(conn, sig)
            report.replayed.append(letter)
        if report.replayed:
            report.publish_error = self._publish(app, [x.letter_id for x in report.replayed])
        return report

    def _publish(self, app: Celery, letter_ids: Sequence[int]) -> str | None:
        """Publish the outbox until these letters' rows are out or a round publishes nothing; the error, if any."""
        relay = Relay(app, self.db.url, sweep_interval=None)
        try:
            # Rows of other writers may come first (the outbox is published in id order): go on while it moves.
            while relay.publish_pending().published and self._queued(letter_ids):
                pass
        except Exception as exc:  # the rows are committed: the relay publishes them once the cause is gone
            return f"{type(exc).__name__}: {exc}"
        return None

    def _queued(self, letter_ids: Sequence[int]) -> bool:
        return any(x.replay is ReplayState.QUEUED for x in self.list(ids=letter_ids, include_replayed=True, limit=None))

    def purge(self, letters: Sequence[LetterView]) -> int:
        """Delete these letters and their DEAD runs (the key may then be sent again); return how many letters."""
        ids = [letter.letter_id for letter in letters]
        runs = [letter.run_id for letter in letters if letter.run_id is not None]
        if not ids:
            return 0
        with self.db.begin() as conn:
            n = conn.execute(delete(LETTERS).where(LETTERS.c.id.in_(ids))).rowcount or 0
            if runs:
                delete_dead_runs_txn(conn, runs)
        return int(n)


def _why_not(letter: LetterView) -> str:
    if letter.run_id is None:
        return (
            f"a {letter.reason} message has no run to replay: fix the message, then send it again "
            f"(with a new key if it conflicted)"
        )
    if letter.run_status is not RunStatus.DEAD:
        return f"its run is {letter.run_status.value if letter.run_status else 'gone'}, not DEAD"
    return "no message was kept to send again"
