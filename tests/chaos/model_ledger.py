"""The model-call layer's checks: every create the provider counted has its ledger row, every repeat is labelled,
no budget is overspent, and nothing stays reserved.

The provider's side is the fake's own counters (`creates_by_intent`: creates per intent public id, read from the
request's `metadata.oncelery_intent`), read once at the end over its control API: a process the runner started,
which no fault touches. The system's side is the claims database's `model_calls` (a row's `call_id` is its
intent's public id), `llm_intents` (which budgets each call reserved in) and `llm_budgets`.

- calls_without_a_row: creates the provider counted for an intent that has no `model_calls` row with its public id
  (at most one row per call id), plus creates carrying no intent at all;
- unlabelled: rows with no reason (NULL) of a repeated create: of an intent after its step's first attempt, or a
  second NULL row of one step;
- over_budget: budget windows whose spent is over the limit, whose charged ledger rows (the rows of the calls that
  reserved in it) cost more than the limit, or whose spent plus overrun is not the sum of those rows;
- reservations_left: micro-USD still reserved in every budget, after the relay had `release_after` (and a margin)
  to release the reservations of prepared calls whose holder died.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from tests.chaos.checker import Sut, job_of
from tests.chaos.jobs import TASK_NAME


@dataclass
class ModelLedger:
    """The counts, and what is behind them (for the report)."""

    calls_without_a_row: list[str] = field(default_factory=list)  # intent public ids (a create each)
    unlabelled: list[str] = field(default_factory=list)  # call ids
    over_budget: list[str] = field(default_factory=list)  # budget rows, with why
    reservations_left: int = 0  # micro-USD
    lines: list[str] = field(default_factory=list)

    def counts(self) -> tuple[int, int, int, int]:
        """calls_without_a_row, unlabelled, over_budget, reservations_left."""
        return len(self.calls_without_a_row), len(self.unlabelled), len(self.over_budget), self.reservations_left

    def ok(self) -> bool:
        """Whether every count is 0."""
        return not any(self.counts())


@dataclass(frozen=True)
class IntentRow:
    public_id: str
    key: str
    run_status: str
    position: int
    attempt: int
    state: str
    repeat_reason: str | None
    budgets: tuple[str, ...]
    released: bool


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def read_intents(sut: Sut) -> dict[str, IntentRow]:
    """Every intent of the chaos task, by public id."""
    rows = sut.rows(
        "SELECT i.public_id, r.idempotency_key, r.status, i.position, i.attempt, i.state, i.repeat_reason, "
        "i.reserved, i.released_at IS NOT NULL FROM llm_intents i JOIN task_runs r ON r.id = i.run_id "
        "WHERE r.task_name = :t",
        t=TASK_NAME,
    )
    found = {}
    for pid, key, status, position, attempt, state, reason, reserved, released in rows:
        budgets = tuple(sorted(((_json(reserved) or {}).get("budgets") or {}).keys()))
        found[str(pid)] = IntentRow(
            str(pid), str(key), str(status), int(position), int(attempt), str(state), reason, budgets, bool(released)
        )
    return found


def check_model_ledger(sut: Sut, stats: dict[str, Any], jobs: int) -> ModelLedger:
    """Compare the provider's creates with the ledger, the ledger with the budgets; count what is left reserved."""
    m = ModelLedger()
    intents = read_intents(sut)
    rows = sut.rows(
        "SELECT call_id, reason, cost_micros, reattached FROM model_calls WHERE task_name = :t ORDER BY id", t=TASK_NAME
    )
    by_call = {str(c): (r, cost, bool(again)) for c, r, cost, again in rows if c is not None}
    creates: dict[str, int] = {str(k): int(n) for k, n in (stats.get("creates_by_intent") or {}).items()}
    for pid, n in sorted(creates.items()):
        m.calls_without_a_row += [pid] * max(0, n - (1 if pid in by_call else 0))
    m.calls_without_a_row += ["(no intent)"] * int(stats.get("creates_without_intent") or 0)

    # Repeats: per step (run, position), the rows with no reason beyond its first attempt's one.
    per_step: defaultdict[tuple[str, int], list[tuple[str, IntentRow]]] = defaultdict(list)
    orphans = 0
    for call_id, (reason, _cost, _again) in by_call.items():
        intent = intents.get(call_id)
        if intent is None:
            orphans += 1
            continue
        if reason is None:
            per_step[(intent.key, intent.position)].append((call_id, intent))
    for nulls in per_step.values():
        first = [c for c, i in nulls if i.attempt == 1][:1]
        m.unlabelled += [c for c, _ in nulls if c not in first]

    budgets = sut.rows("SELECT name, limit_micros, spent_micros, reserved_micros, overrun_micros FROM llm_budgets")
    charged: Counter[str] = Counter()
    for call_id, (_reason, cost, _again) in by_call.items():
        intent = intents.get(call_id)
        for name in intent.budgets if intent is not None else ():
            charged[name] += int(cost or 0)
    for name, limit, spent, _reserved, overrun in budgets:
        why = []
        if int(spent) > int(limit) or charged[name] > int(limit):
            why.append(f"spent {spent} (rows {charged[name]}) > limit {limit}")
        if int(spent) + int(overrun) != charged[name]:
            why.append(f"spent {spent} + overrun {overrun} != its rows {charged[name]}")
        if why:
            m.over_budget.append(f"{name}: {'; '.join(why)}")
    m.reservations_left = sum(int(b[3]) for b in budgets)

    reasons = Counter(str(r) for r, _c, _a in by_call.values() if r is not None)
    reattached = sum(1 for _r, _c, again in by_call.values() if again)
    states = Counter(i.state for i in intents.values())
    limiters = sut.rows(
        "SELECT coalesce(sum(admitted), 0), coalesce(sum(throttled_local), 0), coalesce(sum(throttled_provider), 0) "
        "FROM llm_limiters"
    )[0]
    errors = stats.get("errors_served") or {}
    global_rows = [b for b in budgets if str(b[0]).startswith("global/")]
    m.lines.append(
        f"model calls: provider creates={sum(creates.values())} for intents={len(creates)} jobs={jobs}; "
        f"ledger rows={len(by_call)} (labelled {dict(sorted(reasons.items()))}, reattached={reattached}, "
        f"without an intent={orphans}); intents {dict(sorted(states.items()))}"
    )
    m.lines.append(
        f"provider: polls={stats.get('polls', 0)} cancels={stats.get('cancels', 0)} "
        f"forgotten={stats.get('forgotten', 0)} errors_served={dict(sorted(errors.items()))} "
        f"rate_limited_by_its_window={stats.get('rate_limited', 0)} "
        f"max_in_flight={stats.get('max_in_flight', 0)}; limiter: admitted={limiters[0]} throttled={limiters[1]} "
        f"429s_learned={limiters[2]}"
    )
    m.lines.append(
        "budgets: "
        + " ".join(f"{n}: spent={s} reserved={r} of {lim}" for n, lim, s, r, _o in global_rows)
        + f"; {len(budgets)} windows (a job's own included), over or unmatched={len(m.over_budget)}"
    )
    return m


def describe_calls(sut: Sut, stats: dict[str, Any], public_ids: list[str], limit: int = 5) -> list[str]:
    """One line per call (up to `limit`): its provider creates, its intent, its run and dead letter, its rows."""
    intents = read_intents(sut)
    creates = stats.get("creates_by_intent") or {}
    lines = []
    for pid in list(dict.fromkeys(public_ids))[:limit]:
        intent = intents.get(pid)
        if intent is None:
            lines.append(f"    intent {pid}: creates={creates.get(pid, 0)}, no intent row")
            continue
        letters = sut.rows(
            "SELECT reason FROM dead_letters WHERE task_name = :t AND idempotency_key = :k", t=TASK_NAME, k=intent.key
        )
        rows = sut.rows("SELECT reason, ok FROM model_calls WHERE call_id = :c", c=pid)
        steps = [
            (i.attempt, i.state, i.repeat_reason, creates.get(i.public_id, 0))
            for i in sorted(intents.values(), key=lambda i: i.attempt)
            if i.key == intent.key
        ]
        lines.append(
            f"    intent {pid} job {job_of(intent.key)}: creates={creates.get(pid, 0)} rows={[tuple(r) for r in rows]} "
            f"attempt {intent.attempt} {intent.state} released={intent.released}; run {intent.run_status} "
            f"letters={[r[0] for r in letters]}; the step's intents (attempt, state, reason, creates)={steps}"
        )
    return lines
