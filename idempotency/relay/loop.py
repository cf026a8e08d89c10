"""The outbox relay: puts committed outbox rows on the broker, and publishes again those whose run never finished.

Run it as `oncelery relay`, or as the beat task `install_relay_task` registers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from celery import Celery
from kombu.exceptions import OperationalError as BrokerUnreachable
from sqlalchemy import and_, case, or_, select, update

from oncelery.basetask.heartbeat import heartbeat_file
from oncelery.delivery.replay_cache import purge_forgetter
from oncelery.ledger.recording import CallLedger
from oncelery.ledger.unknown import abandon_finished
from oncelery.llm.budgets import DEFAULT_RELEASE_S, release_stale
from oncelery.models import OutboxStatus, RunStatus
from oncelery.relay.batcher import LEASE_S, POLL_S, UNTAGGED_SEARCH_S, Batcher, BatchRound
from oncelery.relay.debounce import dispatch_due
from oncelery.relay.outbox import send_keyed
from oncelery.relay.retention import kept_arguments_age, purge
from oncelery.relay.rows import back_off, give_up, mark_republished, mark_sent, sent_params
from oncelery.relay.sweeper import sweep_lost_runs
from oncelery.relay.waker import wake_waiting_runs
from oncelery.runs.faults import fault_point
from oncelery.settings import CONF_BUDGET_RELEASE, require_database_url
from oncelery.store.database import Database
from oncelery.store.tables import OUTBOX, RUNS

__all__ = [
    "DEFAULT_MAX_PUBLISHES",
    "Relay",
    "RelayRound",
    "install_relay_task",
]

# Re-publishes of one outbox row whose run never finishes, before the row is given up (DEAD, with a letter).
DEFAULT_MAX_PUBLISHES = 20

# The outbox's logger, as before the relay had a module of its own.
logger = logging.getLogger("oncelery.outbox")


# A wake no delivery took is sent again after this: long, because a wake waits its turn in the queue behind the
# backlog (first deliveries), and every early copy is one more delivery (dropped or replayed, never run twice).
DEFAULT_REWAKE_S = 300.0


@dataclass
class RelayRound:
    """What one relay round did: rows published, re-published, marked done or dead, runs swept."""

    published: int = 0
    republished: int = 0
    done: int = 0
    failed: int = 0
    dead: int = 0
    swept: int = 0
    woken: int = 0  # WAITING runs whose wake came: their messages re-sent
    released: int = 0  # budget reservations of calls left prepared by a dead holder, released
    abandoned: int = 0  # calls left open by finished runs, ended with their estimated ledger rows
    batches_submitted: int = 0  # provider batches the batcher created (batch steps)
    batch_items_applied: int = 0  # batch items whose results were applied (done or failed): their runs woken
    purged: int = 0
    debounced: int = 0  # due debounce bursts moved into the outbox (relay/debounce.py)

    def busy(self) -> bool:
        """Whether the round moved anything (the loop then goes again without sleeping)."""
        batched = self.batches_submitted or self.batch_items_applied
        moved = self.published or self.republished or self.swept or self.woken or self.done or self.debounced
        return bool(moved or batched)


class Relay:
    """Publishes committed outbox rows, re-publishes unfinished ones, and re-sends lost runs' stored messages.

    Several relays may run at once: on PostgreSQL each round locks its rows with FOR UPDATE SKIP LOCKED
    (no double publish), on SQLite a round holds the database's single writer lock. A relay killed between
    publishing and marking a row sent publishes it again; the claim absorbs the copy. No row is ever lost.
    """

    def __init__(
        self,
        app: Celery,
        url: str,
        *,
        batch: int = 100,
        republish_after: float = 300.0,
        max_attempts: int = 10,
        sweep_interval: float | None = 60.0,
        max_publishes: int = DEFAULT_MAX_PUBLISHES,
        rewake_after: float = DEFAULT_REWAKE_S,
        release_after: float | None = None,
        batch_adapters: Mapping[str, Any] | None = None,
        batch_poll_s: float = POLL_S,
        batch_lease_s: float = LEASE_S,
        batch_untagged_search_s: float = UNTAGGED_SEARCH_S,
    ) -> None:
        self.app = app
        self.db = Database(url)
        self.batch = batch
        self.republish_after = republish_after
        self.max_attempts = max_attempts
        self.max_publishes = max_publishes
        self.sweep_interval = sweep_interval
        # A wake sent but not taken (the message is queued behind busy workers, or was lost) is sent again only
        # after this long: long enough that a busy queue does not fill with copies (each is dropped anyway).
        self.rewake_after = rewake_after
        # A call prepared but never answered, whose holder died: its budget reservation is released this long
        # after it was prepared (the app's oncelery_budget_release_s, default 900 s).
        configured = app.conf.get(CONF_BUDGET_RELEASE)
        self.release_after = float(release_after or configured or DEFAULT_RELEASE_S)
        # Batch steps: the provider batch APIs, by provider (given, else the app's tasks' llm_batch_adapter).
        adapters = batch_adapters if batch_adapters is not None else batch_adapters_of(app)
        # Anthropic: how long a batch whose create may have been sent waits for a running one before it is created
        # again (its calls then labelled `duplicate_batch` if both ran).
        self.batch_untagged_search_s = batch_untagged_search_s
        self.batcher: Batcher | None = None
        self.use_batch_adapters(adapters, batch_poll_s, batch_lease_s)
        self.last_batch_round: BatchRound | None = None  # what the batcher did in the latest round
        dia = self.db.dialect
        self._now = dia.now()

    def use_batch_adapters(self, adapters: Mapping[str, Any], poll_s: float = POLL_S, lease_s: float = LEASE_S) -> None:
        """Run the batcher on these provider batch APIs (by provider name), e.g. once a provider has started."""
        if not adapters:
            self.batcher = None
            return
        self.batcher = Batcher(
            self.db, adapters, poll_s=poll_s, lease_s=lease_s, untagged_search_s=self.batch_untagged_search_s,
            ledger=CallLedger(self.db.dialect, self.app.conf),  # a duplicate batch's calls, at the app's prices
        )  # fmt: skip

    def _forget(self) -> Callable[[list[tuple[str, str, str]]], object] | None:
        return purge_forgetter(self.app.conf, self.db.url)

    def run_once(self, republish: bool = True) -> RelayRound:
        """One round: publish pending rows, re-publish unfinished sent rows (if `republish`), sweep lost runs."""
        done = RelayRound()
        try:
            done.debounced = dispatch_due(self.app, self.db, self.batch)  # due bursts: published just below
        except Exception as exc:  # a burst that cannot be sent must not stop the outbox: it stays pending
            logger.error("debounce dispatch failed (the bursts stay pending): %s", exc)
        self.publish_pending(done)
        if republish:
            self.republish_unfinished(done)
        if self.sweep_interval is not None:
            done.swept = sweep_lost_runs(self.app, self.db, self.sweep_interval, self.batch)
        # Always on: a parked run has no other way back (its delivery was acked).
        done.woken = wake_waiting_runs(self.app, self.db, self.rewake_after, self.batch)
        done.released = release_stale(self.db, self.release_after, self.batch)
        # Calls finished runs left open (a body that caught its call's error, a crash): on the books, at estimate.
        done.abandoned = abandon_finished(self.db, self.batch)
        if self.batcher is not None:
            batched = self.last_batch_round = self.batcher.run_once()
            done.batches_submitted = batched.submitted
            done.batch_items_applied = batched.applied + batched.failed
            if done.batch_items_applied:  # their runs are due now: wake them in this round, not the next
                done.woken += wake_waiting_runs(self.app, self.db, self.rewake_after, self.batch)
        return done

    def serve(
        self,
        stop: threading.Event,
        interval: float = 0.5,
        retention: float | None = None,
        purge_every: float = 3600.0,
    ) -> RelayRound:
        """Run rounds until `stop` is set (SIGTERM in `oncelery relay`); purge past `retention` every hour.

        A round that fails (database or broker down) is logged and tried again after a backoff: the relay
        outlives any outage. Each round that succeeds touches $ONCELERY_HEARTBEAT_FILE (its health check: an
        outage makes it stale). Returns the totals.
        """
        total = RelayRound()
        failures = 0
        heartbeat = heartbeat_file()
        next_purge = time.monotonic()
        while not stop.is_set():
            try:
                done = self.run_once()
                if retention is not None and time.monotonic() >= next_purge:
                    kept = kept_arguments_age(self.app.conf)
                    done.purged = purge(self.db, retention, forget=self._forget(), kept_older_than=kept).runs
                    next_purge = time.monotonic() + purge_every
                failures = 0
                if heartbeat is not None:
                    heartbeat.beat()
            except Exception as exc:  # keep relaying through outages; the rows wait in the database
                failures += 1
                logger.error("relay round failed (%d in a row): %s", failures, exc)
                stop.wait(min(30.0, interval * 2**failures))
                continue
            for name, value in vars(done).items():
                setattr(total, name, getattr(total, name) + value)
            if not done.busy():
                stop.wait(interval)
        return total

    # -- pending rows ------------------------------------------------------------------------------

    def publish_pending(self, done: RelayRound | None = None) -> RelayRound:
        """Publish up to `batch` PENDING rows that are due; mark each SENT, or back it off (DEAD after N)."""
        done = done or RelayRound()
        o = OUTBOX.c
        query = (
            select(OUTBOX)
            .where(o.status == OutboxStatus.PENDING, o.next_attempt_at <= self._now)
            .order_by(o.id)
            .limit(self.batch)
        )
        if not self._any(query):
            return done
        with self.db.begin() as conn:
            rows = conn.execute(self._locked(query)).all()
            sent: list[int] = []
            for row in rows:
                error = self._publish(row)
                if error is None:
                    sent.append(row.id)
                    continue
                dead = back_off(conn, self.db.dialect, row, f"{type(error).__name__}: {error}", self.max_attempts)
                done.dead += dead
                done.failed += 1 - dead
                if isinstance(error, BrokerUnreachable):
                    # The broker, not this row, failed: the other rows wait for the next round untouched,
                    # instead of each waiting out broker_connection_timeout (and a back-off) in turn.
                    break
            fault_point("relay_published", rows=len(sent))
            if sent:
                marks = [sent_params(self.db.dialect, row) for row in rows if row.id in sent]
                conn.execute(mark_sent(self.db.dialect, self._now), marks)
        done.published += len(sent)
        return done

    def _any(self, query: Any, params: dict[str, Any] | None = None) -> bool:
        """Whether `query` finds a row, read without a lock: an idle round never takes SQLite's writer lock."""
        with self.db.read() as conn:
            return conn.execute(query.limit(1), params or {}).first() is not None

    def _locked(self, query: Any) -> Any:
        # PostgreSQL: rows another relay holds are skipped, not waited for (no double publish).
        return self.db.dialect.locked_rows(query, of=OUTBOX)

    def _publish(self, row: Any) -> Exception | None:
        """Send one row's job; return the error if the broker refused it (the row stays, backed off)."""
        options = dict(row.options or {})
        # retry=False: a broker that is down fails this row now; the relay backs off and tries again.
        job = (row.task_name, row.args, row.kwargs, row.celery_task_id)
        return send_keyed(self.app, *job, row.idempotency_key, row.tenant, options, retry=False)

    # -- sent rows whose run has not finished --------------------------------------------------------

    def republish_unfinished(self, done: RelayRound | None = None) -> RelayRound:
        """Publish again each SENT row older than `republish_after` whose run has not finished; close the rest.

        Finished: COMPLETED, DEAD, or FAILED for good (no retry pending). A run that never started (the broker
        lost the message), whose holder vanished, or whose retry was lost, is published again.
        """
        done = done or RelayRound()
        o, r = OUTBOX.c, RUNS.c
        dia = self.db.dialect
        cutoff = dia.lease_until("p_age")
        query = (
            select(OUTBOX, r.status.label("run_status"), r.not_before.label("run_not_before"), r.lease_expires_at)
            .select_from(
                OUTBOX.outerjoin(
                    RUNS,
                    and_(r.task_name == o.task_name, r.tenant == o.tenant, r.idempotency_key == o.idempotency_key),
                )
            )
            # Published over `republish_after` ago, and due on the broker (its countdown) over that long ago too.
            .where(o.status == OutboxStatus.SENT, o.sent_at < cutoff, o.next_attempt_at < cutoff)
            .order_by(o.id)
            .limit(self.batch)
        )
        params = {"p_age": dia.lease_param(-self.republish_after)}
        finished = case(
            (r.status.in_([RunStatus.COMPLETED, RunStatus.DEAD]), True),
            (and_(r.status == RunStatus.FAILED, r.not_before.is_(None)), True),
            else_=False,
        )
        live = and_(r.status == RunStatus.RUNNING, r.lease_expires_at >= self._now)
        # A retry pending, or a run parked WAITING (the waker re-sends it when due, not the outbox).
        waiting = or_(and_(r.status == RunStatus.FAILED, r.not_before >= cutoff), r.status == RunStatus.WAITING)
        query = query.add_columns(finished.label("finished"), live.label("live"), waiting.label("waiting"))
        if not self._any(query, params):
            return done
        with self.db.begin() as conn:
            rows = conn.execute(self._locked(query), params).all()
            closed = [row.id for row in rows if row.idempotency_key is None or row.finished]
            open_rows = [row for row in rows if not (row.idempotency_key is None or row.finished)]
            later = [row.id for row in open_rows if row.live or row.waiting]
            lost = [row for row in open_rows if not (row.live or row.waiting)]
            capped = [row for row in lost if row.publishes >= self.max_publishes]
            sent = [row for row in lost if row not in capped and self._publish(row) is None]
            if closed:
                conn.execute(update(OUTBOX).where(o.id.in_(closed)).values(status=OutboxStatus.DONE))
            if capped:
                done.dead += give_up(conn, capped, self.max_publishes)
            if sent:
                conn.execute(mark_republished(dia, self._now), [sent_params(dia, row) for row in sent])
            if later:  # a live holder or a pending retry: look again after another interval
                conn.execute(update(OUTBOX).where(o.id.in_(later)).values(sent_at=self._now))
        if sent:
            logger.warning("outbox: re-published %d jobs whose runs had not finished (lost by the broker?)", len(sent))
        done.done += len(closed)
        done.republished += len(sent)
        return done


def batch_adapters_of(app: Celery) -> dict[str, Any]:
    """The provider batch APIs the app's tasks name (`llm_batch_adapter`: an adapter or a factory), by provider."""
    found: dict[str, Any] = {}
    for task in list(app.tasks.values()):
        chosen = getattr(task, "llm_batch_adapter", None)
        if chosen is None:
            continue
        if not hasattr(chosen, "retrieve") and callable(chosen):
            chosen = chosen()
        found.setdefault(str(chosen.provider), chosen)
    return found


def install_relay_task(app: Celery, every: float = 1.0, url: str | None = None, **relay_options: Any) -> Any:
    """Register the task `oncelery.relay_outbox` on `app` and schedule it with beat every `every` seconds.

    Runs one relay round per beat tick (rounds may overlap: their rows never do). Returns the task.
    """

    def relay_outbox() -> dict[str, int]:
        db_url = url or require_database_url(app.conf, "The outbox relay task")
        return vars(Relay(app, db_url, **relay_options).run_once())

    task = app.task(name="oncelery.relay_outbox", ignore_result=True, shared=False)(relay_outbox)
    schedule = dict(app.conf.beat_schedule or {})
    schedule["oncelery-relay-outbox"] = {"task": "oncelery.relay_outbox", "schedule": every}
    app.conf.beat_schedule = schedule
    return task
