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
`tau_s` is the burst the limiter lets through at once (burst 0: smooth pacing, each call spaced by its cost);
over any window of W seconds it admits at most W / seconds_per_unit units plus the burst plus one call's cost,
so limits are set a few percent below a provider's fixed-window limit (docs/limits.md states the margin).

`burst` defaults to 2 % of the rate, rounded down (none below 50 a window): a worker that wakes for its slot a
few milliseconds late (a CPU-bound host) takes the slot it missed instead of losing it; without it a saturated
fleet reached 81 % of the limit, with it 97 % (docs/benchmarks.md).

One row takes about 190 durable admissions a second on PostgreSQL (each holds the row's lock until its commit
is flushed). A faster limiter is split into `shards` rows (default: one per 6,000 requests a minute), each
at 1/N of the rate: a call admits through one shard chosen at random, and through the least-loaded shard when
that one is full. Over any window the N shards admit at most the rate plus the burst plus N calls' cost.

Settlement returns what a call did not use in the transaction that ends its intent: the input tokens our
estimate counted beyond the provider's count, and the unused output tokens only where the provider gives them
back (Anthropic's output-token limit; OpenAI counts `max_output_tokens` in full). A provider's 429 halves the
limiter's capacity (`factor`, every shard) and pushes `tat` past its retry-after; each call that succeeds gives
back 5 % of it (AIMD).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Connection, Float, bindparam, case, func, literal, or_, select, update

from oncelery.errors import ConfigurationError
from oncelery.store.dialects import Dialect
from oncelery.store.tables import LIMITERS

__all__ = [
    "KINDS",
    "OUTPUT_KEY",
    "OUTPUT_RETURNED_ENDPOINTS",
    "Admission",
    "LimitRule",
    "LimiterView",
    "Throttled",
    "admit_txn",
    "backlog_s",
    "base_name",
    "count_throttled",
    "hold",
    "limiter_views",
    "limiters_for",
    "parse_limits",
    "penalize",
    "rows_of",
    "settle_txn",
    "shard_names",
    "used_by",
]

KINDS = ("rpm", "tpm", "itpm", "otpm")  # requests; input + output tokens; input tokens; output tokens
WINDOW_S = 60.0
MIN_FACTOR = 0.1  # a 429 storm never stops a limiter: it keeps a tenth of its rate
RECOVERY = 0.05  # capacity given back per successful call after a 429
DEFAULT_BURST_SHARE = 0.02  # the default burst: 2 % of the rate (rounded down: none below 50 a window)
SHARD_RPM = 6000  # requests a minute per shard by default (one row takes about 190 admissions a second)
MAX_SHARDS = 64
# Endpoints whose provider gives back unused output tokens when a call ends: Anthropic's output-token limit is
# estimated from max_tokens and adjusted to the tokens produced; OpenAI counts max_output_tokens and keeps it.
OUTPUT_RETURNED_ENDPOINTS = frozenset({"messages"})
OUTPUT_KEY = "*output"  # in an intent's `admitted`: the output limit its token admissions counted (not a row)
SHARD_MARK = "#"  # "openai:m/rpm#3": shard 3 of limiter "openai:m/rpm" (shard 0 is the limiter's own name)


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
    shards: int = 1  # rows the limiter is split into, each at 1/shards of the rate

    @property
    def seconds_per_unit(self) -> float:
        """Seconds one unit (a request, a token) occupies of the whole limiter."""
        return self.window_s / self.per_minute

    @property
    def tau_s(self) -> float:
        """The burst as time: how far ahead of now a row's theoretical arrival time may be and still admit."""
        return self.burst * self.seconds_per_unit


@dataclass(frozen=True)
class Admission:
    """One limiter a call goes through: its row's name, the rule, and this call's cost in the rule's units."""

    name: str
    rule: LimitRule
    cost: int
    output: int = 0  # the part of `cost` that is the call's output limit (token kinds)


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
        burst = entry.get("burst")
        if burst is not None and (isinstance(burst, bool) or not isinstance(burst, int) or burst < 0):
            raise ConfigurationError(f"{where}['burst'] = {burst!r}: give a whole number of units >= 0")
        shards = entry.get("shards")
        if shards is not None and (isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= 64):
            raise ConfigurationError(f"{where}['shards'] = {shards!r}: give a whole number of rows in [1, 64]")
        window = entry.get("window_s", WINDOW_S)
        if isinstance(window, bool) or not isinstance(window, int | float) or not 0 < window <= 86400:
            raise ConfigurationError(f"{where}['window_s'] = {window!r}: give seconds in (0, 86400] (default 60)")
        kinds = {k: v for k, v in entry.items() if k not in ("burst", "window_s", "shards")}
        for kind, value in kinds.items():
            if kind not in KINDS:
                raise ConfigurationError(
                    f"{where}: unknown limit {kind!r}; use {', '.join(KINDS)} (and 'burst', 'window_s', 'shards')"
                )
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigurationError(f"{where}[{kind!r}] = {value!r}: give a whole number per minute > 0")
        if shards is None:  # every kind of a scope is admitted as often as its requests: one count for all
            requests_per_minute = kinds.get("rpm", 0) * WINDOW_S / float(window)
            shards = min(MAX_SHARDS, max(1, math.ceil(requests_per_minute / SHARD_RPM)))
        for kind, value in kinds.items():
            units = burst if burst is not None else math.floor(value * DEFAULT_BURST_SHARE)
            rules.append(LimitRule(scope, kind, value, units, float(window), shards))
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
        output = tokens[1] if rule.kind in ("tpm", "otpm") else 0
        admission = Admission(f"{name}/{rule.kind}", rule, cost_of(rule.kind, *tokens), output)
        # One admission per limiter row: "tenant:acme" wins over "tenant:*", "openai:gpt-x" over "openai:*".
        if admission.name not in chosen or not rule.scope.endswith(":*"):
            chosen[admission.name] = admission
    return list(chosen.values())


def cost_of(kind: str, input_tokens: int, output_limit: int) -> int:
    """A call's cost in a limiter of `kind`: 1 request, or its tokens (input estimate and output limit)."""
    return {"rpm": 1, "tpm": input_tokens + output_limit, "itpm": input_tokens, "otpm": output_limit}[kind]


def shard_names(name: str, shards: int) -> list[str]:
    """The rows of limiter `name` split into `shards`: its own name first, then "name#1" .. "name#N-1"."""
    return [name] + [f"{name}{SHARD_MARK}{i}" for i in range(1, shards)]


def base_name(row_name: str) -> str:
    """The limiter a row belongs to ("openai:m/rpm#3" -> "openai:m/rpm")."""
    return row_name.split(SHARD_MARK, 1)[0]


def rows_of(names: Iterable[str]) -> ColumnElement[bool]:
    """A WHERE clause matching every shard row of these limiters, however many the configuration made."""
    c = LIMITERS.c
    return or_(*(or_(c.name == n, c.name.startswith(n + SHARD_MARK, autoescape=True)) for n in names))


def _ensure(conn: Connection, dialect: Dialect, admission: Admission) -> None:
    # Created on first use, at rest (tat 0), all shards at once: no migration or start-up step per configured
    # limit. A shard made later than its limiter's first row carries the cap an operator set on that row.
    rule, c = admission.rule, LIMITERS.c
    spu = rule.seconds_per_unit * rule.shards
    first, *others = shard_names(admission.name, rule.shards)
    row = {"tat": 0.0, "seconds_per_unit": spu, "tau_s": rule.tau_s, "factor": 1.0}
    conn.execute(dialect.insert(LIMITERS).values(name=first, **row).on_conflict_do_nothing(index_elements=["name"]))
    if others:
        cap = select(c.capped_spu).where(c.name == first).scalar_subquery()
        stmt = dialect.insert(LIMITERS).values([{"name": n, **row, "capped_spu": cap} for n in others])
        conn.execute(stmt.on_conflict_do_nothing(index_elements=["name"]))


def admit_txn(conn: Connection, dialect: Dialect, admissions: list[Admission]) -> dict[str, int]:
    """Admit the call through every limiter in the caller's transaction, or raise Throttled (roll it back).

    Returns {limiter row name: cost} for the intent to keep (settlement returns the unused part of it).
    A refusal takes no lock: the conditional UPDATE that does not match leaves the row alone.
    """
    c = LIMITERS.c
    now = dialect.epoch()
    admitted: dict[str, int] = {}
    for a in admissions:
        rule = a.rule
        spu = rule.seconds_per_unit * rule.shards  # one shard's pace
        tau = literal(rule.tau_s, Float)
        # An operator's cap (`oncelery limits set`, capped_spu: the whole limiter's pace) wins over the rule's.
        pace = func.coalesce(c.capped_spu * rule.shards, literal(spu, Float))
        start = case((c.tat > now, c.tat), else_=now)
        advance = (
            update(LIMITERS)
            .where(c.name == bindparam("p_name"), c.tat - now <= tau)
            .values(
                tat=start + bindparam("p_cost", type_=Float) * pace / c.factor,
                seconds_per_unit=spu,
                tau_s=rule.tau_s,
                admitted=c.admitted + 1,
            )
            .returning(c.name)
        )
        names = shard_names(a.name, rule.shards)
        first = names[random.randrange(rule.shards)]  # spreads the fleet's row locks over the shards
        moved = conn.execute(advance, {"p_name": first, "p_cost": float(a.cost)}).first()
        if moved is None:
            # Full (or not made yet): the shard with the least admitted work ahead, read without a lock.
            least = conn.execute(
                select(c.name, c.tat - now - tau).where(c.name.in_(names)).order_by(c.tat).limit(1)
            ).first()
            shard, wait = (first, 0.0) if least is None else (str(least[0]), float(least[1]))
            if least is None:
                _ensure(conn, dialect, a)
            if shard != first or wait <= 0:
                moved = conn.execute(advance, {"p_name": shard, "p_cost": float(a.cost)}).first()
            if moved is None:
                raise Throttled(a.name, max(0.001, wait))
        admitted[moved[0]] = a.cost
        if a.output:
            admitted[OUTPUT_KEY] = a.output
    return admitted


def settle_txn(conn: Connection, dialect: Dialect, admitted: Mapping[str, int], used: Mapping[str, int]) -> None:
    """Give back what a finished call did not use (`used`: {limiter row name: actual cost}), and 5 % of capacity.

    A row with nothing to give back and its full capacity is not written (a request limiter's, mostly): the
    hot row's lock is taken only when something changes.
    """
    c = LIMITERS.c
    for name, cost in admitted.items():
        if name == OUTPUT_KEY:
            continue
        unused = max(0, int(cost) - int(used.get(name, cost)))
        stmt = update(LIMITERS).where(c.name == name)
        if unused == 0:  # only capacity to give back: no write (no lock) on a row at full capacity
            stmt = stmt.where(c.factor < 1.0)
        conn.execute(
            stmt.values(
                tat=c.tat - literal(float(unused), Float) * func.coalesce(c.capped_spu, c.seconds_per_unit) / c.factor,
                factor=case((c.factor + RECOVERY < 1.0, c.factor + RECOVERY), else_=1.0),
            )
        )


def penalize(conn: Connection, dialect: Dialect, names: list[str], retry_after_s: float | None) -> None:
    """A provider's 429: halve these limiters' capacity (every shard) and hold them until its retry-after."""
    if not names:
        return
    c = LIMITERS.c
    now = dialect.epoch()
    # Past the burst too: a row admits while tat - now <= tau_s, and nothing may be admitted before retry-after.
    hold = now + literal(float(retry_after_s or 0.0), Float) + c.tau_s
    conn.execute(
        update(LIMITERS)
        .where(rows_of(names))
        .values(
            factor=case((c.factor * 0.5 > MIN_FACTOR, c.factor * 0.5), else_=MIN_FACTOR),
            tat=case((c.tat > hold, c.tat), else_=hold),
            throttled_provider=case((c.name.in_(names), c.throttled_provider + 1), else_=c.throttled_provider),
        )
    )


def hold(conn: Connection, dialect: Dialect, names: list[str], seconds: float) -> None:
    """The provider's headers say its window is spent: admit nothing through these limiters for `seconds`."""
    if not names:
        return
    c = LIMITERS.c
    until = dialect.epoch() + literal(float(seconds), Float) + c.tau_s  # past the burst too (see penalize)
    conn.execute(update(LIMITERS).where(rows_of(names)).values(tat=case((c.tat > until, c.tat), else_=until)))


def count_throttled(conn: Connection, name: str) -> None:
    """Count one call that had to wait for limiter `name` (its own statement: the refused transaction rolled
    back). Counted on a random shard's row, so that the count spreads as the admissions do."""
    c = LIMITERS.c
    rows = conn.execute(select(c.name).where(rows_of([name]))).scalars().all()
    if rows:
        row = random.choice(rows)
        conn.execute(update(LIMITERS).where(c.name == row).values(throttled_local=c.throttled_local + 1))


def used_by(
    admitted: Mapping[str, int], input_tokens: int, output_tokens: int, output_returned: bool = False
) -> dict[str, int]:
    """What a finished call used of each limiter row it was admitted by, as its provider counts it.

    Requests stay used. Input tokens: the provider's count (our estimate errs high). The output limit stays
    used where the provider counts it up front and keeps it (OpenAI); only what the call produced is used where
    the provider gives the rest back (`output_returned`: Anthropic's output-token limit).
    """
    limit = int(admitted.get(OUTPUT_KEY, 0))
    produced = min(limit, output_tokens) if output_returned else limit
    used = {}
    for name, cost in admitted.items():
        kind = base_name(name).rsplit("/", 1)[-1]
        if name == OUTPUT_KEY:
            continue
        if kind == "itpm":
            used[name] = min(cost, input_tokens)
        elif kind == "otpm":
            used[name] = produced
        elif kind == "tpm":
            used[name] = min(cost - limit, input_tokens) + produced
        else:  # requests stay used
            used[name] = cost
    return used


@dataclass(frozen=True)
class LimiterView:
    """One limiter as an operator reads it, its shard rows summed: rate, backlog, capacity and counts."""

    name: str
    per_minute: float  # per 60 s, whatever window the rule was written with (the operator's cap when set)
    backlog_s: float  # admitted work ahead of now on its least-loaded shard: what a new call waits for
    capacity: float  # its share of the configured rate after the provider's 429s (1: full)
    admitted: int
    throttled_local: int
    throttled_provider: int
    cap: float | None  # the operator's cap per minute (`oncelery limits set`), None: the configuration's
    shards: int


def limiter_views(rows: Iterable[Any], now: float) -> list[LimiterView]:
    """Fold `llm_limiters` rows (name, tat, seconds_per_unit, capped_spu, factor, admitted, throttled_local,
    throttled_provider) into one view per limiter, in name order."""
    groups: dict[str, list[Any]] = {}
    for row in rows:
        groups.setdefault(base_name(row.name), []).append(row)
    views = []
    for name in sorted(groups):
        shards = groups[name]
        capped = shards[0].capped_spu
        configured = sum(60.0 / r.seconds_per_unit for r in shards if r.seconds_per_unit)
        views.append(
            LimiterView(
                name=name,
                per_minute=round(60.0 / capped if capped else configured, 3),
                backlog_s=round(min(backlog_s(float(r.tat), now) for r in shards), 3),
                capacity=round(min(float(r.factor) for r in shards), 3),
                admitted=sum(int(r.admitted) for r in shards),
                throttled_local=sum(int(r.throttled_local) for r in shards),
                throttled_provider=sum(int(r.throttled_provider) for r in shards),
                cap=None if capped is None else round(60.0 / capped, 3),
                shards=len(shards),
            )
        )
    return views


def backlog_s(tat: float, now: float) -> float:
    """Seconds of admitted work a limiter holds ahead of now (0 when idle)."""
    return max(0.0, tat - now) if math.isfinite(tat) else 0.0
