"""The run's report: one verdict line, the per-fault counts, the fence and model-call summaries; the exit code.

    jobs=170 faults=22 lost=0 duplicated=0 unexpected=0 calls_without_a_row=0 unlabelled=0 over_budget=0 \
        reservations_left=0   (one line)

The exit code is 0 only if every count of the verdict line is 0 (tests/chaos/checker.py, tests/chaos/model_ledger.py)
and inconsistent too, every fault kind reached its minimum count (the options), including >= 1
visibility-timeout redelivery when long jobs ran, and the system settled (runner.Run.settle: no copy still
delivered, nothing RUNNING, WAITING or queued) before the timeout.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tests.chaos.checker import check, key_of
from tests.chaos.faults import KILLS, PHASES
from tests.chaos.model_ledger import check_model_ledger, describe_calls

if TYPE_CHECKING:
    from tests.chaos.faults import Chaos
    from tests.chaos.runner import Run


def minimums(run: Run) -> dict[str, int]:
    """The fault counts the options require, by kind (kills and backend kills in total)."""
    o = run.opts
    return {
        "kills": o.kills,
        "backend_kills": o.backend_kills,
        "flush": o.flushes,
        "restart": o.restarts,
        "broker_restart": o.broker_restarts,
        "cut": o.cuts,
        "zombie": o.zombies,
        "kill_create": o.create_kills,
        "kill_poll": o.poll_kills,
        "kill_relay": o.relay_kills,
        "revoke": o.revokes,
        "provider_errors": o.provider_errors,
        "forget": o.forgets,
    }


def achieved(chaos: Chaos) -> dict[str, int]:
    """The fault counts that hit, grouped as minimums() names them."""
    c = chaos.counts
    return {
        "kills": sum(c[k] for k in KILLS),
        "backend_kills": sum(c[f"backend_{p}"] for p in PHASES),
        "flush": c["flush"],
        "restart": c["restart"],
        "broker_restart": c["broker_restart"],
        "cut": c["cut"],
        "zombie": c["zombie"],
        "kill_create": c["kill_create"],
        "kill_poll": c["kill_poll"],
        "kill_relay": c["kill_relay"],
        "revoke": c["revoke"],
        "provider_errors": c["provider_5xx"] + c["provider_429"],
        "forget": c["forget"],
    }


def report(run: Run, chaos: Chaos) -> int:
    """Check, print the report, and return the exit code."""
    verdict = check(run.ledger, run.sut)
    stats = run.fake.stats() if run.fake is not None else {}
    model = check_model_ledger(run.sut, stats, verdict.jobs)
    without, unlabelled, over, left = model.counts()
    got, need = achieved(chaos), minimums(run)
    faults = sum(got.values())
    redeliveries = run.ledger.scalar("SELECT count(*) FROM deliveries WHERE redelivered = 1")
    long_jobs = sum(1 for s in run.seconds.values() if s is not None)
    short = [f"{k} {got[k]}<{n}" for k, n in need.items() if got[k] < n]
    if long_jobs and redeliveries < 1:
        short.append("visibility-timeout redeliveries 0<1")
    if not run.settled:
        short.append("the system did not settle (copies still delivered, or work RUNNING or queued)")
    wall = time.monotonic() - run.t0

    print(
        f"jobs={verdict.jobs} faults={faults} lost={len(verdict.lost)} duplicated={len(verdict.duplicated)} "
        f"unexpected={len(verdict.unexpected)} calls_without_a_row={without} unlabelled={unlabelled} "
        f"over_budget={over} reservations_left={left}",
        flush=True,
    )
    per_kind = " ".join(f"{k}={n}" for k, n in sorted(chaos.counts.items()))
    missed = " ".join(f"{k}={n}" for k, n in sorted(chaos.missed.items())) or "none"
    print(f"faults: {per_kind} (missed: {missed})")
    restarted = sum(w.restarts for w in run.workers.values())
    if run.opts.broker == "rabbitmq":  # no visibility timeout: a message comes back when its channel closes
        print(
            f"broker: rabbitmq {run.opts.queue_type} queue, redeliveries={redeliveries}; restarted workers={restarted}"
        )
    else:
        print(
            f"visibility: timeout={run.opts.visibility_timeout:g}s long_jobs={long_jobs} "
            f"redeliveries={redeliveries}; restarted workers={restarted}"
        )
    outcomes = run.sut.outcomes()
    print(f"fence: staged_effects_refused={verdict.refused} completions_refused={verdict.completions_refused} "
          f"attempts_fenced_in_body={verdict.fenced} lease_lost={outcomes.get('lease_lost', 0)}")  # fmt: skip
    print("outcomes: " + " ".join(f"{k}={n}" for k, n in sorted(outcomes.items())))
    for line in model.lines + verdict.summary:
        print(line)
    if chaos.revoked:
        ended, logs = len(verdict.revoked), "".join(_text(w) for w in run.workdir.glob("worker-*.log"))
        failed = len(re.findall(r"could not cancel the run of revoked message", logs))
        print(
            f"revoked: {len(chaos.revoked)} parked runs, {ended} ended DEAD (reason revoked, no effect); not applied "
            f"in time: {chaos.revokes_not_applied} (workers' cancels that could not reach the database: {failed})"
        )
    relay_log = _text(run.relay.log if run.relay else None)
    republished = sum(int(n) for n in re.findall(r"re-published (\d+) jobs", relay_log))
    print(f"relay: re-published {republished} jobs whose runs had not finished (lost by a flush, a killed worker...)")
    sent = run.sent
    if run.opts.producer_dedupe:
        # Direct copies and fault resends go through .delay(): those the database answered were never published.
        print(f"producer dedupe: answered_at_producer={run.sut.producer_answers()} (counted replayed)")
    print(
        f"sent: outbox={sent['outbox']} direct={sent['direct']} fault_resends={sent['fault']} "
        f"deliveries={run.ledger.scalar('SELECT count(*) FROM deliveries')} "
        f"attempts={run.ledger.scalar('SELECT count(*) FROM attempts')} inconsistent={len(verdict.inconsistent)} "
        f"settled={'yes' if run.settled else 'NO'} relay_restarts={run.relay.restarts if run.relay else 0} "
        f"wall={wall:.1f}s"
    )
    if run.errors:
        print(f"client errors (retried): {len(run.errors)}, e.g. {run.errors[:3]}")
    for name, jobs in (
        ("lost", verdict.lost),
        ("duplicated", verdict.duplicated),
        ("inconsistent", verdict.inconsistent),
    ):
        if jobs:
            print(f"{name} jobs: {jobs[:20]}")
            for job in jobs[:5]:
                describe(run, job, job in chaos.victims)
    storms = run.ledger.rows(
        "SELECT job, count(*) FROM deliveries GROUP BY job HAVING count(*) > 50 ORDER BY count(*) DESC LIMIT 3"
    )
    if storms:  # a job delivered this often kept being answered "in progress": show what held it
        print(f"most delivered jobs: {storms}")
        for job, _ in storms:
            describe(run, int(str(job)), int(str(job)) in chaos.victims)
    if verdict.unexpected:
        print(f"unexpected effects: {verdict.unexpected[:20]}")
    if model.calls_without_a_row:
        print(f"calls without a row (provider creates, no model_calls row): {len(model.calls_without_a_row)}")
        for line in describe_calls(run.sut, stats, model.calls_without_a_row):
            print(line)
    if model.unlabelled:
        print(f"unlabelled repeated creates (reason NULL): {model.unlabelled[:10]}")
        for line in describe_calls(run.sut, stats, model.unlabelled):
            print(line)
    if model.over_budget:
        print(f"budgets over or unmatched: {model.over_budget[:10]}")
    if model.reservations_left:
        print(f"reservations left: {model.reservations_left} micro-USD")
        for line in describe_calls(run.sut, stats, held_reservations(run)):
            print(line)
    if short:
        print(f"NOT reached: {', '.join(short)}")
    code = 0 if verdict.ok() and model.ok() and not short else 1
    run.failed = code != 0
    return code


def held_reservations(run: Run) -> list[str]:
    """The intents still holding a reservation (not released)."""
    rows = run.sut.rows("SELECT public_id FROM llm_intents WHERE reserved IS NOT NULL AND released_at IS NULL")
    return [str(p) for (p,) in rows]


def describe(run: Run, job: int, victim: bool) -> None:
    """Print what the ledger and the database know of one job (for a failure's root cause)."""
    ledger = run.ledger
    subs = ledger.rows("SELECT copy, via, at FROM submissions WHERE job = ? ORDER BY id", (job,))
    dels = ledger.rows("SELECT host, pid, redelivered, at FROM deliveries WHERE job = ? ORDER BY id LIMIT 8", (job,))
    atts = ledger.rows("SELECT attempt, host, pid, token, how FROM attempts WHERE job = ? ORDER BY started", (job,))
    run_row = run.sut.rows(
        "SELECT status, fencing_token, attempts, lost, replays, lease_expires_at, clock_timestamp(), error "
        "FROM task_runs WHERE idempotency_key = :k",
        k=key_of(job),
    )
    effects = run.sut.rows("SELECT attempt, host, pid, token FROM chaos_effects WHERE job = :j", j=job)
    outbox = run.sut.rows("SELECT status, publishes, attempts FROM outbox WHERE idempotency_key = :k", k=key_of(job))
    print(f"--- job {job}: run={[tuple(r) for r in run_row]} effects={[tuple(e) for e in effects]}")
    print(f"    submissions={subs} outbox={[tuple(o) for o in outbox]}")
    print(f"    deliveries={dels}")
    print(f"    attempts={atts} fault_victim={victim}")


def _text(path: Path | None) -> str:
    try:
        return path.read_text(errors="replace") if path is not None else ""
    except OSError:
        return ""
