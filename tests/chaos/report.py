"""The run's report: one verdict line, the per-fault counts, the fence and LLM ledger summaries; the exit code.

    jobs=500 faults=15 lost=0 duplicated=0 unexpected=0

The exit code is 0 only if lost, duplicated, unexpected and inconsistent are all 0, every fault kind reached
its minimum count (the options), including >= 1 visibility-timeout redelivery when long jobs ran, and the
system settled (runner.Run.settle: no copy still delivered, nothing RUNNING or queued) before the timeout.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tests.chaos.checker import check, key_of
from tests.chaos.faults import KILLS, PHASES

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
    }


def report(run: Run, chaos: Chaos) -> int:
    """Check, print the report, and return the exit code."""
    verdict = check(run.ledger, run.sut)
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
        f"unexpected={len(verdict.unexpected)}",
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
    for line in verdict.summary:
        print(line)
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
        f"settled={'yes' if run.settled else 'NO'} wall={wall:.1f}s"
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
    if short:
        print(f"NOT reached: {', '.join(short)}")
    code = 0 if verdict.ok() and not short else 1
    run.failed = code != 0
    return code


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
