"""Budgets that are never overspent: a call reserves its estimated cost before it is sent.

Scopes: one job (`max_cost_usd`, a run's whole life across retries), one tenant per UTC day or month
("tenant:*" is one budget per tenant; "tenant:acme" a tenant of its own), and the whole fleet ("global"). Each
window of each budget is one `llm_budgets` row in integer micro-USD, and three writes keep it:

1. **Reserve**, in the transaction that commits the call's intent as `prepared` (with the limiters'
   admission): one conditional UPDATE per budget,
   `reserved += estimate WHERE spent + reserved + estimate <= limit`. A row that does not move refuses the call
   (`BudgetExceeded`); the transaction rolls back, so no other budget or limiter keeps anything.
2. **Charge**, in the transaction that writes the call's ledger row (once per call id): its actual cost moves to
   `spent`. So a budget's `spent` is the sum of its calls' ledger rows, exactly.
3. **Release**, once (`llm_intents.released_at`): when the intent reaches a terminal state, or when it is still
   `prepared` with no provider reference past a timeout and no live holder (the sweeper). A `sent` call keeps
   its reservation however long it runs: a dead holder's background call still runs at the provider, and the
   next holder re-attaches and settles it, so releasing it early would let others spend the same money.

The invariant is the database's: `CHECK (spent + reserved <= limit)` on both SQLite and PostgreSQL. The
estimate (input estimated conservatively + the call's output limit, at the model's price) is never below the
actual cost unless the tokenizer estimate undercounts; an actual cost above the reservation is charged up to the
limit and the excess counted in `overrun_micros`, in sight, never hidden and never breaking the CHECK.

Windows are UTC days and months on the database clock. A cap set by an operator (`oncelery budgets set`,
stored in `oncelery_caps`) wins over the configuration and is read in the reservation's transaction.
"""

from __future__ import annotations

import calendar
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import BigInteger, Connection, and_, bindparam, case, literal, or_, select, update

from oncelery.errors import ConfigurationError
from oncelery.ledger.settle import Reservation, release_txn
from oncelery.llm.errors import BudgetExceeded
from oncelery.models import IntentState, RunStatus
from oncelery.models.money import as_decimal, micros_up, usd
from oncelery.store.clock import lease_live
from oncelery.store.database import Database
from oncelery.store.dialects import Dialect
from oncelery.store.tables import BUDGETS, CAP_CHANGES, CAPS, INTENTS, RUNS

__all__ = [
    "DEFAULT_RELEASE_S",
    "ON_BUDGET",
    "PERIODS",
    "BudgetPlan",
    "BudgetRule",
    "cap_name",
    "count_refused",
    "estimate_micros",
    "parse_budgets",
    "parse_usd",
    "release_stale",
    "reserve_txn",
    "set_cap",
    "window_of",
]

PERIODS = ("day", "month")
# As the public API names them (docs/limits.md) ({"tenant:*": {"usd_per_day": 50}}), and their short forms.
PERIOD_NAMES = {"usd_per_day": "day", "usd_per_month": "month", "day": "day", "month": "month"}
ON_BUDGET = ("dead_letter", "defer")  # over budget: dead-letter the run (BudgetExceeded), or park it WAITING


@dataclass(frozen=True)
class BudgetRule:
    """One configured budget: `scope` ("global", "tenant:*", "tenant:acme"), a UTC period, a limit."""

    scope: str
    period: str
    limit_micros: int


@dataclass(frozen=True)
class BudgetPlan:
    """What a call's budgets need: the rules, the job's cap (micro-USD, None: none), the model's price."""

    rules: tuple[BudgetRule, ...]
    job_limit_micros: int | None
    price: tuple[Decimal, Decimal]  # USD per 1M tokens, input and output: micro-USD per token
    on_budget: str = "dead_letter"
    call_limit_micros: int | None = None  # this one call's cap (`self.llm(..., max_cost_usd=)`)
    # Named caps shared by many runs, (row name, micro-USD): a fork cohort's `cohort:<id>` (ops/fork_cohort.py).
    shared: tuple[tuple[str, int], ...] = ()

    @property
    def active(self) -> bool:
        """Whether any budget applies (else nothing is reserved, and no statement is run)."""
        return (
            bool(self.rules) or self.job_limit_micros is not None or self.call_limit_micros is not None
            or bool(self.shared)
        )  # fmt: skip


def parse_usd(value: Any, where: str) -> int:
    """A USD amount (number, Decimal or numeric string) > 0 as micro-USD, or ConfigurationError naming `where`."""
    try:
        ok = not isinstance(value, bool) and isinstance(value, int | float | Decimal | str)
        amount = as_decimal(value) if ok else None
    except (TypeError, ValueError, ArithmeticError):
        amount = None
    if amount is None or not amount.is_finite() or amount <= 0:
        raise ConfigurationError(f"{where} = {value!r}: give an amount in USD > 0 (e.g. 10 or '2.50')")
    return micros_up(amount)


def parse_budgets(table: Any, setting: str = "oncelery_budgets") -> tuple[BudgetRule, ...]:
    """Validate `oncelery_budgets` ({"global"|"tenant:*"|"tenant:<id>": {"usd_per_day"|"usd_per_month": usd}})
    or raise ConfigurationError naming the entry ("day" and "month" are accepted for the periods too)."""
    if table is None:
        return ()
    if not isinstance(table, Mapping):
        raise ConfigurationError(f"{setting} must be a dict like {{'tenant:*': {{'day': 10}}}} (USD), got {table!r}")
    rules = []
    for scope, entry in table.items():
        where = f"{setting}[{scope!r}]"
        if not isinstance(scope, str) or not (scope == "global" or (scope.startswith("tenant:") and scope[7:])):
            raise ConfigurationError(f"{where}: name a scope as 'global', 'tenant:*' or 'tenant:<id>'")
        if not isinstance(entry, Mapping) or not entry:
            raise ConfigurationError(
                f"{where} = {entry!r}: give {{'usd_per_day': usd}} and/or {{'usd_per_month': usd}}"
            )
        for period, amount in entry.items():
            if period not in PERIOD_NAMES:
                raise ConfigurationError(
                    f"{where}: unknown period {period!r}; use 'usd_per_day' or 'usd_per_month' (UTC; or 'day', 'month')"
                )
            rules.append(BudgetRule(scope, PERIOD_NAMES[period], parse_usd(amount, f"{where}[{period!r}]")))
    return tuple(rules)


def cap_name(scope: str, period: str | None = None) -> str:
    """The `oncelery_caps` name of a budget's operator cap ("budget:tenant:acme/day", "budget:global/month")."""
    return f"budget:{scope}" if period is None else f"budget:{scope}/{period}"


def estimate_micros(price: tuple[Decimal, Decimal], input_tokens: int, output_tokens: int) -> int:
    """A call's cost in micro-USD at `price` (USD per 1M tokens is micro-USD per token), rounded up."""
    return micros_up((input_tokens * price[0] + output_tokens * price[1]) / 1_000_000)


def window_of(period: str, now_epoch: float) -> tuple[str, float]:
    """The UTC window holding `now_epoch` ("2026-12-02" or "2026-12") and when it ends (epoch seconds)."""
    at = datetime.fromtimestamp(now_epoch, UTC)
    if period == "day":
        start = datetime(at.year, at.month, at.day, tzinfo=UTC)
        return at.strftime("%Y-%m-%d"), start.timestamp() + 86400.0
    days = calendar.monthrange(at.year, at.month)[1]
    start = datetime(at.year, at.month, 1, tzinfo=UTC)
    return at.strftime("%Y-%m"), start.timestamp() + days * 86400.0


@dataclass(frozen=True)
class _Budget:
    name: str  # the row: "<scope>/<period>/<window>" or "run:<id>"
    scope: str  # what a cap names: "<scope>/<period>" or "run:<id>"
    caps: tuple[str, ...]  # the operator caps that may override it, most specific first
    limit_micros: int
    resets_at: float | None


def _budgets(plan: BudgetPlan, tenant: str, run_id: int, now_epoch: float) -> list[_Budget]:
    """The budget rows a call reserves in: the job's, its tenant's (its own rule over "tenant:*"), global."""
    chosen: list[_Budget] = []
    if plan.job_limit_micros is not None:
        chosen.append(_Budget(f"run:{run_id}", f"run:{run_id}", (), plan.job_limit_micros, None))
    chosen.extend(_Budget(name, name, (), limit, None) for name, limit in plan.shared)
    picked: dict[tuple[str, str], BudgetRule] = {}
    for rule in plan.rules:
        if rule.scope.startswith("tenant:"):
            if not tenant or rule.scope not in ("tenant:*", f"tenant:{tenant}"):
                continue
            key = (f"tenant:{tenant}", rule.period)
            if key in picked and rule.scope == "tenant:*":
                continue  # a tenant's own rule wins over the one for every tenant
        else:
            key = (rule.scope, rule.period)
        picked[key] = rule
    for (scope, period), rule in picked.items():
        window, resets = window_of(period, now_epoch)
        caps = (cap_name(scope, period),) + ((cap_name("tenant:*", period),) if scope.startswith("tenant:") else ())
        chosen.append(_Budget(f"{scope}/{period}/{window}", f"{scope}/{period}", caps, rule.limit_micros, resets))
    return chosen


def reserve_txn(
    conn: Connection, dialect: Dialect, plan: BudgetPlan, tenant: str, run_id: int, estimate: int
) -> Reservation:
    """Reserve `estimate` micro-USD in every budget of the call, in the caller's transaction, or raise
    BudgetExceeded (the caller's transaction must roll back: nothing is kept by the budgets that did admit)."""
    if plan.call_limit_micros is not None and estimate > plan.call_limit_micros:
        raise BudgetExceeded.of("call", estimate, 0, 0, plan.call_limit_micros)
    now = float(conn.execute(select(dialect.epoch())).scalar_one())
    budgets = _budgets(plan, tenant, run_id, now)
    wanted = {name for b in budgets for name in b.caps}
    caps = dict(conn.execute(select(CAPS.c.name, CAPS.c.value).where(CAPS.c.name.in_(wanted))).all()) if wanted else {}
    c = BUDGETS.c
    reserved: dict[str, int] = {}
    for b in budgets:
        limit = next((int(caps[name]) for name in b.caps if name in caps), b.limit_micros)
        params = {"p_est": estimate, "p_limit": limit}
        take = (
            update(BUDGETS)
            .where(
                c.name == b.name,
                c.spent_micros + c.reserved_micros + bindparam("p_est", type_=BigInteger)
                <= bindparam("p_limit", type_=BigInteger),
            )
            .values(reserved_micros=c.reserved_micros + bindparam("p_est"), limit_micros=bindparam("p_limit"))
        )
        if conn.execute(take, params).rowcount != 1:
            row = dict(name=b.name, scope=b.scope, limit_micros=limit, resets_at=b.resets_at)
            conn.execute(dialect.insert(BUDGETS).values(**row).on_conflict_do_nothing(index_elements=["name"]))
            if conn.execute(take, params).rowcount != 1:
                spent, held, kept = conn.execute(
                    select(c.spent_micros, c.reserved_micros, c.limit_micros).where(c.name == b.name)
                ).one()
                waits = None if b.resets_at is None else max(1.0, b.resets_at - now)
                raise BudgetExceeded.of(b.name, estimate, int(spent), int(held), max(limit, int(kept)), waits)
        reserved[b.name] = estimate
    return Reservation(reserved, (str(plan.price[0]), str(plan.price[1])))


def set_cap(conn: Connection, dialect: Dialect, name: str, value: int | None, by: str) -> int | None:
    """Set (None: remove) the operator cap `name` in the caller's transaction, recording who changed it from
    what to what; return the value it replaces. A budget's rows in force take the new limit at once, but never
    below what they already hold (spent + reserved), so the CHECK holds and nothing in flight is cancelled."""
    old = conn.execute(select(CAPS.c.value).where(CAPS.c.name == name)).scalar_one_or_none()
    if value is None:
        conn.execute(CAPS.delete().where(CAPS.c.name == name))
    else:
        fields = {"value": value, "set_by": by, "set_at": dialect.now()}
        stmt = dialect.insert(CAPS).values(name=name, **fields)
        conn.execute(stmt.on_conflict_do_update(index_elements=["name"], set_=fields))
    conn.execute(
        CAP_CHANGES.insert().values(name=name, old_value=old, new_value=value, set_by=by, set_at=dialect.now())
    )
    if value is not None and name.startswith("budget:"):
        c = BUDGETS.c
        scope = name[len("budget:") :]
        held = c.spent_micros + c.reserved_micros
        target = literal(int(value), BigInteger)
        rows = c.scope == scope if "tenant:*" not in scope else c.scope.like(scope.replace("*", "%"))
        conn.execute(update(BUDGETS).where(rows).values(limit_micros=case((held > target, held), else_=target)))
    return None if old is None else int(old)


def count_refused(conn: Connection, name: str) -> None:
    """Count one refusal of budget `name` (its own statement: the refused transaction rolled back)."""
    c = BUDGETS.c
    conn.execute(update(BUDGETS).where(c.name == name).values(refused=c.refused + 1))


DEFAULT_RELEASE_S = 900.0  # past the longest synchronous call and a lease: its holder is surely gone


def release_stale(db: Database, older_than_s: float = DEFAULT_RELEASE_S, batch: int = 100) -> int:
    """Release the reservations of up to `batch` intents still `prepared` past `older_than_s` with no provider
    reference and no live holder (its worker died before the create was answered); return how many.

    A `sent` intent is never released here: its call may still run at the provider, and the next holder
    re-attaches and settles it. A call released here that later turns out made (the next holder records it
    `unknown_outcome` at its estimate) is still charged, by that ledger row.
    """
    i, r = INTENTS.c, RUNS.c
    now = db.dialect.now()
    held = and_(r.status == RunStatus.RUNNING, lease_live(now))
    stale = (
        select(i.public_id, i.reserved)
        .select_from(INTENTS.outerjoin(RUNS, r.id == i.run_id))
        .where(
            i.state == IntentState.PREPARED,
            i.reference.is_(None),
            i.released_at.is_(None),
            i.reserved.is_not(None),
            i.prepared_at < db.dialect.lease_until("p_age"),
            or_(r.id.is_(None), ~held),
        )
        .limit(batch)
    )
    with db.read() as conn:
        rows = conn.execute(stale, {"p_age": db.dialect.lease_param(-older_than_s)}).all()
    released = 0
    for public_id, reserved in rows:
        with db.begin() as conn:
            released += release_txn(conn, db.dialect, public_id, Reservation.of(reserved))
    return released


def remaining_micros(conn: Connection, name: str) -> int | None:
    """What is left in budget row `name` (None: no such row yet)."""
    c = BUDGETS.c
    row = conn.execute(select(c.limit_micros - c.spent_micros - c.reserved_micros).where(c.name == name)).first()
    return None if row is None else int(row[0])


def describe(micros: int | None) -> str:
    """Micro-USD as `$1.234567` for messages."""
    amount = usd(micros)
    return "-" if amount is None else f"${amount}"
