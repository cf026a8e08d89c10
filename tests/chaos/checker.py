"""Reads of the system under test, and the verdict: lost, duplicated and unexpected effects (Jepsen's queue checker).

- lost: a submitted job (the ledger's `submissions`) with no committed effect row, unless the runner revoked its
  parked run and the run is DEAD with a dead letter of reason `revoked` (an expected non-completion);
- duplicated: a job with more than one committed effect row (an effect applied more than once);
- unexpected: a committed effect row for a job never submitted, or written by an attempt the ledger never
  staged (an effect nobody's code made);
- inconsistent (checked too, reported on its own line): a job whose one effect does not match its COMPLETED
  run's stored result (other attempt, or a draft the fake model would not have given).

The committed effect rows are read once, at the end, through the runner's own connection (a final read). The
model-call counts (calls without a ledger row, unlabelled repeats, budgets, reservations left) are
tests/chaos/model_ledger.py's.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sqlalchemy import create_engine, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from oncelery import StoreError, cost_report
from tests.chaos.jobs import TASK_NAME, tenant_for
from tests.chaos.ledger import Ledger
from tests.chaos.model import expected_draft

T = TypeVar("T")


def key_of(job: int) -> str:
    """The idempotency key the chaos task derives for `job`."""
    return f"chaos:{job}"


def job_of(key: object) -> int:
    """The job of the chaos task's idempotency key."""
    return int(str(key).split(":")[1])


@dataclass(frozen=True)
class Intent:
    """A model call's intent as the claims database has it."""

    public_id: str
    state: str  # prepared, sent, done, failed, lost, cancelled
    reference: str | None
    attempt: int
    token: int


class Sut:
    """The runner's reads of the claims database: plain connections (NullPool), retried through restarts."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = create_engine(url, poolclass=NullPool, connect_args={"connect_timeout": 5})

    def retrying(self, fn: Callable[[Any], T], timeout: float = 90.0) -> T:
        """Run `fn(connection)`, again after a database fault, for at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with self.engine.connect() as conn:
                    return fn(conn)
            except (DBAPIError, StoreError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def rows(self, sql: str, **params: Any) -> list[Any]:
        """Return the rows of `sql` (retried)."""
        return self.retrying(lambda conn: list(conn.execute(text(sql), params)))

    def run_of(self, job: int) -> tuple[str, int] | None:
        """Return (status, fencing token) of the job's run, or None before its first claim."""
        rows = self.rows(
            "SELECT status, fencing_token FROM task_runs WHERE task_name = :t AND idempotency_key = :k",
            t=TASK_NAME,
            k=key_of(job),
        )
        return (str(rows[0][0]), int(rows[0][1])) if rows else None

    def holds(self, job: int, token: int) -> bool:
        """Whether the job's run is RUNNING under `token` (that attempt holds it)."""
        run = self.run_of(job)
        return run is not None and run[0].endswith("RUNNING") and run[1] == token

    def effect_attempts(self, job: int) -> list[str]:
        """Return the attempts whose effect for `job` committed."""
        return [str(a) for (a,) in self.rows("SELECT attempt FROM chaos_effects WHERE job = :j", j=job)]

    def jobs_done(self) -> int:
        """Return how many distinct jobs have a committed effect."""
        return int(self.rows("SELECT count(DISTINCT job) FROM chaos_effects")[0][0])

    def unsettled(self) -> int:
        """Return runs still RUNNING or WAITING plus outbox rows not yet published (work the system still owes)."""
        running = self.rows("SELECT count(*) FROM task_runs WHERE status IN ('RUNNING', 'WAITING')")[0][0]
        pending = self.rows("SELECT count(*) FROM outbox WHERE status = 'PENDING'")[0][0]
        return int(running) + int(pending)

    def dead_runs(self) -> int:
        """Return how many of the task's runs are DEAD (never run again: revoked, or lost for the checker)."""
        return int(
            self.rows("SELECT count(*) FROM task_runs WHERE task_name = :t AND status = 'DEAD'", t=TASK_NAME)[0][0]
        )

    def reserved_micros(self) -> int:
        """Return what every budget still holds reserved (micro-USD)."""
        return int(self.rows("SELECT coalesce(sum(reserved_micros), 0) FROM llm_budgets")[0][0])

    def latest_intent(self, job: int) -> Intent | None:
        """Return the job's model call's latest intent (its step's highest attempt), or None before the first."""
        rows = self.rows(
            "SELECT i.public_id, i.state, i.reference, i.attempt, i.token FROM llm_intents i "
            "JOIN task_runs r ON r.id = i.run_id WHERE r.task_name = :t AND r.idempotency_key = :k "
            "ORDER BY i.attempt DESC LIMIT 1",
            t=TASK_NAME,
            k=key_of(job),
        )
        return Intent(*rows[0]) if rows else None

    def intent_state(self, public_id: str) -> str | None:
        """Return the state of the intent `public_id` (None: no such intent)."""
        rows = self.rows("SELECT state FROM llm_intents WHERE public_id = :p", p=public_id)
        return str(rows[0][0]) if rows else None

    def parked(self, ahead_s: float = 0.0, limit: int = 20) -> list[tuple[int, str, Intent | None]]:
        """Return up to `limit` runs parked WAITING whose wake is at least `ahead_s` away: (job, task id, its
        latest intent), in a random order."""
        rows = self.rows(
            "SELECT r.idempotency_key, r.celery_task_id FROM task_runs r WHERE r.task_name = :t "
            "AND r.status = 'WAITING' AND r.celery_task_id IS NOT NULL "
            "AND r.not_before > clock_timestamp() + make_interval(secs => :ahead) ORDER BY random() LIMIT :n",
            t=TASK_NAME,
            ahead=ahead_s,
            n=limit,
        )
        return [(job_of(k), str(tid), self.latest_intent(job_of(k))) for k, tid in rows]

    def status_of(self, job: int) -> tuple[str, bool] | None:
        """Return (status, whether its wake was marked sent: swept_at set) of the job's run, or None."""
        rows = self.rows(
            "SELECT status, swept_at IS NOT NULL FROM task_runs WHERE task_name = :t AND idempotency_key = :k",
            t=TASK_NAME,
            k=key_of(job),
        )
        return (str(rows[0][0]), bool(rows[0][1])) if rows else None

    def outcomes(self) -> dict[str, int]:
        """Return the task's delivery outcome counts (the framework's G7 counters)."""
        rows = self.rows(
            "SELECT outcome, sum(count) FROM delivery_outcomes WHERE task_name = :t GROUP BY outcome", t=TASK_NAME
        )
        return {str(o).lower().rsplit(".", 1)[-1]: int(n) for o, n in rows}

    def producer_answers(self) -> int:
        """How many copies the runner's `.delay()` answered from the database without publishing (producer dedupe)."""
        rows = self.rows(
            "SELECT coalesce(sum(at_producer), 0) FROM delivery_outcomes WHERE task_name = :t", t=TASK_NAME
        )
        return int(rows[0][0]) if rows else 0

    def close(self) -> None:
        """Close the engine."""
        self.engine.dispose()


@dataclass
class Verdict:
    """The checker's counts, and the job ids behind them (for the report)."""

    jobs: int = 0
    lost: list[int] = field(default_factory=list)
    duplicated: list[int] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    inconsistent: list[int] = field(default_factory=list)
    revoked: list[int] = field(default_factory=list)  # revoked jobs that ended DEAD (reason revoked), no effect
    refused: int = 0  # staged effects that never committed: completions the fence refused
    fenced: int = 0  # attempts that raised LeaseLost in the body
    completions_refused: int = 0  # bodies that returned, whose fenced completion was refused
    summary: list[str] = field(default_factory=list)

    def ok(self) -> bool:
        """Whether nothing was lost, duplicated, unexpected or inconsistent."""
        return not (self.lost or self.duplicated or self.unexpected or self.inconsistent)


def check(ledger: Ledger, sut: Sut) -> Verdict:
    """Compare the ledger's history with the system's committed effects and stored results.

    A job the runner revoked (its run parked WAITING, its message revoked) is expected to end without its effect:
    it is not lost if its run is DEAD with a dead letter of reason `revoked` and it has no effect (a revoke that
    lost the race to the wake leaves a job that completed, with its one effect, like any other).
    """
    v = Verdict()
    submitted = {int(j) for (j,) in ledger.rows("SELECT DISTINCT job FROM submissions")}
    staged = {str(a) for (a,) in ledger.rows("SELECT attempt FROM staged")}
    v.jobs = len(submitted)
    effects = sut.rows("SELECT job, attempt FROM chaos_effects")
    per_job = Counter(int(job) for job, _ in effects)
    revoked = {int(j) for (j,) in ledger.rows("SELECT DISTINCT job FROM revokes")}
    letters = sut.rows(
        "SELECT r.idempotency_key FROM task_runs r JOIN dead_letters d ON d.run_id = r.id "
        "WHERE r.task_name = :t AND r.status = 'DEAD' AND d.reason = 'revoked'",
        t=TASK_NAME,
    )
    v.revoked = sorted(j for j in (job_of(k) for (k,) in letters) if j in revoked and per_job[j] == 0)
    v.lost = sorted(j for j in submitted if per_job[j] == 0 and j not in v.revoked)
    v.duplicated = sorted(j for j, n in per_job.items() if n > 1)
    v.unexpected = [f"job {job} attempt {a}" for job, a in effects if int(job) not in submitted or a not in staged]
    committed = {str(a) for _, a in effects}
    v.refused = len(staged - committed)
    v.fenced = ledger.scalar("SELECT count(*) FROM attempts WHERE how = 'fenced'")
    returned = {str(a) for (a,) in ledger.rows("SELECT attempt FROM attempts WHERE how = 'returned'")}
    v.completions_refused = len((returned & staged) - committed)
    rows = sut.rows("SELECT idempotency_key, status, result, tenant FROM task_runs WHERE task_name = :t", t=TASK_NAME)
    runs = {str(k): (str(s), r) for k, s, r, _tenant in rows}
    # A run in another tenant than its job's: the tenant was lost (or resolved again) on the way.
    v.unexpected += [f"run {k} in tenant {t!r}" for k, _s, _r, t in rows if t != tenant_for(job_of(k))]
    only = {int(job): str(a) for job, a in effects if per_job[int(job)] == 1}
    for job, attempt in sorted(only.items()):
        status, result = runs.get(key_of(job), ("", None))
        result = json.loads(result) if isinstance(result, str) else result
        want = {"job": job, "attempt": attempt, "draft": expected_draft(job)}
        if not status.endswith("COMPLETED") or not result or any(result.get(k) != w for k, w in want.items()):
            v.inconsistent.append(job)
    v.summary.append(replay_summary(sut, ledger))
    return v


def replay_summary(sut: Sut, ledger: Ledger) -> str:
    """One line: the calls replays saved (cost_report), and how the bodies ended (parked, errors)."""
    try:
        saved: object = sut.retrying(lambda _conn: cost_report(sut.url, task_name=TASK_NAME).saved.calls)
    except Exception as exc:  # the summary is informative; the verdict does not depend on it
        saved = f"? ({type(exc).__name__})"
    ends = ledger.rows("SELECT how, count(*) FROM attempts GROUP BY how ORDER BY how")
    return f"replays: calls_saved_by_replays={saved}; attempts ended {dict((str(h), int(str(n))) for h, n in ends)}"
