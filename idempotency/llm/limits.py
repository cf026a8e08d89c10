"""One limit for the whole fleet: requests and tokens per minute, admitted on the database clock.

Each limiter is one `llm_limiters` row holding a GCRA theoretical arrival time (`tat`, epoch seconds by the
database clock). Admitting a call of cost `c` is one conditional UPDATE per limiter, in the transaction that
commits the call's intent as `prepared`:

    UPDATE llm_limiters SET tat = max(tat, now) + c * seconds_per_unit / factor
    WHERE name = :name AND tat - now <= tau_s

A row that does not move refuses the call: the intent's transaction rolls back (no other limiter keeps its
admission) and the caller waits `tat - now - tau_s` seconds, inline when short, else parked WAITING. Every
worker of every host shares the row, so 32 workers with a 500 rpm limit send 500 a minute, not 16,000.

Why GCRA and not a token bucket: one float per row, advanced by one guarded UPDATE with no read first (a token
bucket needs its level and its last refill, both written per admission), and the wait is read off the same row.
`tau_s` is the burst the limiter lets through at once (default 0: smooth pacing, each call spaced by its cost);
over any window of W seconds it admits at most W / seconds_per_unit units plus one call's cost, so limits are set
a few percent below a provider's fixed-window limit (docs/limits.md states the margin).

Settlement returns what a call did not use (its output limit minus the tokens it produced) in the transaction
that ends its intent, and a provider's 429 halves the limiter's capacity (`factor`) and pushes `tat` past its
retry-after; each call that succeeds gives back 5 % of it (AIMD).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Float, bindparam, case, func, literal, select, update

from oncelery.errors import ConfigurationError
from oncelery.store.dialects import Dialect
from oncelery.store.tables import LIMITERS

__all__ = [
    "KINDS",
    "Admission",
    "LimitRule",
    "Throttled",
    "admit_txn",
    "backlog_s",
    "count_throttled",
    "hold",
    "limiters_for",
    "parse_limits",
    "penalize",
    "settle_txn",
    "used_by",
]

KINDS = ("rpm", "tpm", "itpm", "otpm")  # requests; input + output tokens; input tokens; output tokens
WINDOW_S = 60.0
MIN_FACTOR = 0.1  # a 429 storm never stops a limiter: it keeps a tenth of its rate
RECOVERY = 0.05  # capacity given back per successful call after a 429


class Throttled(Exception):
    """A limiter refused the call: try again after `wait_s` seconds (nothing was admitted or written)."""

    def __init__(self, limiter: str, wait_s: float) -> None:
        super().__init__(f"rate limit {limiter}: wait {wait_s:.2f}s")
        self.limiter = limiter
        self.wait_s = wait_s


@dataclass(frozen=True)
class LimitRule:
    """One configured limit: `scope` ("openai:gpt-4.1-mini", "tenant:*", "tenant:acme", "task:name"), a kind."""

    scope: str
    kind: str
    per_minute: int  # per window: a minute unless `window_s` compresses time (tests, benchmarks)
    burst: int = 0  # units let through at once beyond the pace (tau = burst x seconds per unit)
    window_s: float = WINDOW_S

    @property
    def seconds_per_unit(self) -> float:
        """Seconds one unit (a request, a token) occupies of the limiter."""
        return self.window_s / self.per_minute


@dataclass(frozen=True)
class Admission:
    """One limiter a call goes through: its row's name, the rule, and this call's cost in the rule's units."""

    name: str
    rule: LimitRule
    cost: int


def parse_limits(table: Any, setting: str = "oncelery_limits") -> tuple[LimitRule, ...]:
    """Validate `oncelery_limits` ({scope: {kind: per minute, "burst": units}}) or raise ConfigurationError."""
    if table is None:
        return ()
    if not isinstance(table, Mapping):
        raise ConfigurationError(f"{setting} must be a dict of scope -> {{'rpm': n, 'tpm': n}}, got {table!r}")
    rules = []
    for scope, entry in table.items():
        where = f"{setting}[{scope!r}]"
        if not isinstance(scope, str) or ":" not in scope or not scope.split(":", 1)[1]:
            raise ConfigurationError(f"{where}: name a scope as provider:model, tenant:*, tenant:<id> or task:<name>")
        if not isinstance(entry, Mapping) or not entry:
            raise ConfigurationError(f"{where} = {entry!r}: give {{'rpm': n, 'tpm': n}} (per minute)")
        burst = entry.get("burst", 0)
        if isinstance(burst, bool) or not isinstance(burst, int) or burst < 0:
            raise ConfigurationError(f"{where}['burst'] = {burst!r}: give a whole number of units >= 0")
        window = entry.get("window_s", WINDOW_S)
        if isinstance(window, bool) or not isinstance(window, int | float) or not 0 < window <= 86400:
            raise ConfigurationError(f"{where}['window_s'] = {window!r}: give seconds in (0, 86400] (default 60)")
        for kind, value in entry.items():
            if kind in ("burst", "window_s"):
                continue
            if kind not in KINDS:
                raise ConfigurationError(
                    f"{where}: unknown limit {kind!r}; use {', '.join(KINDS)} (and 'burst', 'window_s')"
                )
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigurationError(f"{where}[{kind!r}] = {value!r}: give a whole number per minute > 0")
            rules.append(LimitRule(scope, kind, value, burst, float(window)))
    return tuple(rules)


def limiters_for(
    rules: tuple[LimitRule, ...], provider: str, model: str, tenant: str, task: str, tokens: tuple[int, int]
) -> list[Admission]:
    """The limiters a call goes through, with its cost in each: `tokens` is (input estimate, output limit).

    "tenant:*" is one limiter per tenant (not one shared by all); a call without a tenant skips tenant rules.
    A scope of its own ("tenant:acme", "openai:gpt-x") replaces the wildcard's limit of the same kind.
    """
    chosen: dict[str, Admission] = {}
    for rule in rules:
        kind, _, which = rule.scope.partition(":")
        if kind == "tenant":
            if not tenant or which not in ("*", tenant):
                continue
            name = f"tenant:{tenant}"
        elif kind == "task":
            if which != task:
                continue
            name = rule.scope
        elif (kind, which) in ((provider, model), (provider, "*")):
            name = f"{provider}:{model}"
        else:
            continue
        admission = Admission(f"{name}/{rule.kind}", rule, cost_of(rule.kind, *tokens))
        # One admission per limiter row: "tenant:acme" wins over "tenant:*", "openai:gpt-x" over "openai:*".
        if admission.name not in chosen or not rule.scope.endswith(":*"):
            chosen[admission.name] = admission
    return list(chosen.values())


def cost_of(kind: str, input_tokens: int, output_limit: int) -> int:
    """A call's cost in a limiter of `kind`: 1 request, or its tokens (input estimate and output limit)."""
    return {"rpm": 1, "tpm": input_tokens + output_limit, "itpm": input_tokens, "otpm": output_limit}[kind]


def _ensure(conn: Connection, dialect: Dialect, admission: Admission) -> None:
    # Created on first use, at rest (tat 0): no migration or start-up step per configured limit.
    stmt = dialect.insert(LIMITERS).values(
        name=admission.name, tat=0.0, seconds_per_unit=admission.rule.seconds_per_unit, tau_s=0.0, factor=1.0
    )
    conn.execute(stmt.on_conflict_do_nothing(index_elements=["name"]))


def admit_txn(conn: Connection, dialect: Dialect, admissions: list[Admission]) -> dict[str, int]:
    """Admit the call through every limiter in the caller's transaction, or raise Throttled (roll it back).

    Returns {limiter name: cost} for the intent to keep (settlement returns the unused part of it).
    """
    c = LIMITERS.c
    now = dialect.epoch()
    admitted: dict[str, int] = {}
    for a in admissions:
        spu, tau = a.rule.seconds_per_unit, a.rule.burst * a.rule.seconds_per_unit
        start = case((c.tat > now, c.tat), else_=now)
        advance = (
            update(LIMITERS)
            .where(c.name == a.name, c.tat - now <= literal(tau, Float))
            .values(
                # An operator's cap (`oncelery limits set`, capped_spu) wins over the configuration's pace.
                tat=start
                + bindparam("p_cost", type_=Float) * func.coalesce(c.capped_spu, literal(spu, Float)) / c.factor,
                seconds_per_unit=spu,
                tau_s=tau,
                admitted=c.admitted + 1,
            )
            .returning(c.tat)
        )
        moved = conn.execute(advance, {"p_cost": float(a.cost)}).first()
        if moved is None:  # refused, or the limiter's first admission (its row is made on the spot)
            _ensure(conn, dialect, a)
            moved = conn.execute(advance, {"p_cost": float(a.cost)}).first()
        if moved is None:
            wait = conn.execute(select(c.tat - now - literal(tau, Float)).where(c.name == a.name)).scalar_one()
            raise Throttled(a.name, max(0.001, float(wait)))
        admitted[a.name] = a.cost
    return admitted


def settle_txn(conn: Connection, dialect: Dialect, admitted: Mapping[str, int], used: Mapping[str, int]) -> None:
    """Give back what a finished call did not use (`used`: {limiter name: actual cost}), and 5 % of capacity."""
    c = LIMITERS.c
    for name, cost in admitted.items():
        unused = max(0, int(cost) - int(used.get(name, cost)))
        conn.execute(
            update(LIMITERS)
            .where(c.name == name)
            .values(
                tat=c.tat - literal(float(unused), Float) * func.coalesce(c.capped_spu, c.seconds_per_unit) / c.factor,
                factor=case((c.factor + RECOVERY < 1.0, c.factor + RECOVERY), else_=1.0),
            )
        )


def penalize(conn: Connection, dialect: Dialect, names: list[str], retry_after_s: float | None) -> None:
    """A provider's 429: halve these limiters' capacity and hold them until its retry-after; count it."""
    c = LIMITERS.c
    now = dialect.epoch()
    hold = now + literal(float(retry_after_s or 0.0), Float)
    for name in names:
        conn.execute(
            update(LIMITERS)
            .where(c.name == name)
            .values(
                factor=case((c.factor * 0.5 > MIN_FACTOR, c.factor * 0.5), else_=MIN_FACTOR),
                tat=case((c.tat > hold, c.tat), else_=hold),
                throttled_provider=c.throttled_provider + 1,
            )
        )


def hold(conn: Connection, dialect: Dialect, names: list[str], seconds: float) -> None:
    """The provider's headers say its window is spent: admit nothing through these limiters for `seconds`."""
    c = LIMITERS.c
    until = dialect.epoch() + literal(float(seconds), Float)
    for name in names:
        conn.execute(update(LIMITERS).where(c.name == name).values(tat=case((c.tat > until, c.tat), else_=until)))


def count_throttled(conn: Connection, name: str) -> None:
    """Count one local refusal of limiter `name` (its own statement: the refused transaction rolled back)."""
    c = LIMITERS.c
    conn.execute(update(LIMITERS).where(c.name == name).values(throttled_local=c.throttled_local + 1))


def used_by(admitted: Mapping[str, int], input_tokens: int, output_tokens: int) -> dict[str, int]:
    """What a finished call used of each limiter it was admitted by (requests stay used)."""
    used = {}
    for name in admitted:
        kind = name.rsplit("/", 1)[-1]
        used[name] = admitted[name] if kind == "rpm" else cost_of(kind, input_tokens, output_tokens)
    return used


def backlog_s(tat: float, now: float) -> float:
    """Seconds of admitted work a limiter holds ahead of now (0 when idle)."""
    return max(0.0, tat - now) if math.isfinite(tat) else 0.0
