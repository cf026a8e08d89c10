"""The read side of the cost ledger: what model calls cost per task, tenant and model, what replays saved, and
what batch steps saved (each batch row keeps the difference to its synchronous price, `batch_saved_micros`).

Saved, exactly: a duplicate delivery answered from a COMPLETED run's stored result (`task_runs.replays`)
made none of the calls the run made, so each run saved `replays x` its ok calls, tokens and cost. Both figure
sets are one grouped query each; nothing is summed row by row in Python.

Money is exact: the database sums integer micro-USD (oncelery.models.money) and a `Spend` holds the sum as
`Decimal` USD, so a report of a thousand 0.1-dollar calls says 100.000000, not 99.99999999999986.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from decimal import Decimal
from typing import Any

from sqlalchemy import BigInteger, Select, case, cast, func, select

from oncelery.ledger.prices import price_for
from oncelery.models.money import usd
from oncelery.store.database import Database
from oncelery.store.tables import BATCH_ITEMS, CALLS, INTENTS, LABEL_TOTALS, RUNS

__all__ = ["BatchSavings", "CostLine", "CostReport", "Spend", "batch_savings", "cost_report"]


@dataclass(frozen=True)
class Spend:
    """Model calls and their cost: calls (failed among them), tokens in and out, exact Decimal USD (None: no
    price known)."""

    calls: int = 0
    failed_calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost: Decimal | None = None
    unpriced_calls: int = 0  # calls whose model had no price: `cost` leaves them out

    @property
    def ok_calls(self) -> int:
        """Calls that returned."""
        return self.calls - self.failed_calls

    def __add__(self, other: Spend) -> Spend:
        costs = [c for c in (self.cost, other.cost) if c is not None]
        return Spend(
            self.calls + other.calls,
            self.failed_calls + other.failed_calls,
            self.input_tokens + other.input_tokens,
            self.output_tokens + other.output_tokens,
            sum(costs, Decimal(0)) if costs else None,
            self.unpriced_calls + other.unpriced_calls,
        )

    def as_dict(self) -> dict[str, Any]:
        """Every figure, ok_calls included, as JSON-ready values: USD as a number of at most 6 decimals (the
        float whose shortest repr is the exact Decimal, for amounts under 10^9 USD)."""
        cost = None if self.cost is None else float(self.cost)
        return {**asdict(self), "cost": cost, "ok_calls": self.ok_calls}


@dataclass(frozen=True)
class CostLine:
    """One (task, tenant, model): the calls made, and those its runs' replays did not have to make."""

    task_name: str | None  # None: calls made outside any task
    tenant: str
    model: str
    made: Spend = field(default_factory=Spend)
    saved: Spend = field(default_factory=Spend)
    batched: Spend = field(default_factory=Spend)  # the calls among `made` that went through a provider batch
    batch_saved: Decimal | None = None  # what their batch price saved against the synchronous price (exact)


@dataclass(frozen=True)
class CostReport:
    """The ledger's lines (ordered by task, tenant, model) and their totals, and its labelled calls by label."""

    lines: list[CostLine]
    #: Calls made again by reason (create_window, sync_unknown, lost...), `unknown_outcome` (estimated rows of
    #: calls that may never have been made) and `reattached` (answers taken instead of paid again).
    labels: dict[str, int] = field(default_factory=dict)

    @property
    def made(self) -> Spend:
        """Every call made."""
        return sum((line.made for line in self.lines), Spend())

    @property
    def saved(self) -> Spend:
        """Every call replays avoided."""
        return sum((line.saved for line in self.lines), Spend())

    @property
    def batched(self) -> Spend:
        """Every call made through a provider batch."""
        return sum((line.batched for line in self.lines), Spend())

    @property
    def batch_saved(self) -> Decimal | None:
        """What batching saved in all (None: no priced batch call)."""
        amounts = [line.batch_saved for line in self.lines if line.batch_saved is not None]
        return sum(amounts, Decimal(0)) if amounts else None

    def as_dict(self) -> dict[str, Any]:
        """The report as a JSON document (costs in USD)."""
        return {
            "currency": "USD",
            "lines": [
                {
                    "task": line.task_name,
                    "tenant": line.tenant,
                    "model": line.model,
                    "made": line.made.as_dict(),
                    "saved": line.saved.as_dict(),
                    "batched": line.batched.as_dict(),
                    "batch_saved": _number(line.batch_saved),
                }
                for line in self.lines
            ],
            "total": {
                "made": self.made.as_dict(),
                "saved": self.saved.as_dict(),
                "batched": self.batched.as_dict(),
                "batch_saved": _number(self.batch_saved),
            },
            "labelled_calls": dict(sorted(self.labels.items())),
        }


def cost_report(url: str, task_name: str | None = None, tenant: str | None = None) -> CostReport:
    """Return what the ledger of `url` holds (one task's or tenant's if given): three grouped queries, no scans."""
    made = {key: Spend(*figures) for key, figures in _grouped(url, _made_query(), task_name, tenant)}
    # A replay skips whole runs of returned calls: none of what it saved failed.
    saved = {key: Spend(n, 0, *rest) for key, (n, *rest) in _grouped(url, _saved_query(), task_name, tenant)}
    batched = {
        key: (Spend(*figures[:-1]), None if figures[-1] is None else usd(int(figures[-1])))
        for key, figures in _grouped(url, _batch_query(), task_name, tenant, usd_at=-3)
    }
    keys = sorted(made.keys() | saved.keys(), key=lambda k: (k[0] or "", k[1], k[2]))
    lines = [
        CostLine(*key, made.get(key, Spend()), saved.get(key, Spend()), *batched.get(key, (Spend(), None)))
        for key in keys
    ]
    return CostReport(lines, _labels(url, task_name, tenant))


def _number(amount: Decimal | None) -> float | None:
    # As Spend.as_dict: a JSON number of at most 6 decimals (exact for amounts under 10^9 USD).
    return None if amount is None else float(amount)


def _labels(url: str, task_name: str | None, tenant: str | None) -> dict[str, int]:
    """Labelled calls summed by label, from the running totals (a few rows; never model_calls)."""
    t = LABEL_TOTALS.c
    stmt = select(t.label, func.sum(t.calls)).group_by(t.label)
    if task_name is not None:
        stmt = stmt.where(t.task_name == task_name)
    if tenant is not None:
        stmt = stmt.where(t.tenant == tenant)
    with Database(url).read() as conn:
        return {label: int(n) for label, n in conn.execute(stmt)}


_GROUP = (CALLS.c.task_name, CALLS.c.tenant, CALLS.c.model)


def _made_query() -> Select[Any]:
    c = CALLS.c
    return select(
        *_GROUP,
        func.count(),
        func.coalesce(func.sum(case((c.ok.is_(False), 1), else_=0)), 0),
        func.coalesce(func.sum(c.input_tokens), 0),
        func.coalesce(func.sum(c.output_tokens), 0),
        func.sum(c.cost_micros),
        func.coalesce(func.sum(case((c.cost_micros.is_(None), 1), else_=0)), 0),
    ).group_by(*_GROUP)


def _saved_query() -> Select[Any]:
    # Each ok call of a run, times that run's replays. BIGINT: replays x tokens can pass 2^31 on PostgreSQL.
    c, replays = CALLS.c, cast(RUNS.c.replays, BigInteger)
    return (
        select(
            *_GROUP,
            func.coalesce(func.sum(replays), 0),
            func.coalesce(func.sum(replays * c.input_tokens), 0),
            func.coalesce(func.sum(replays * c.output_tokens), 0),
            func.sum(replays * c.cost_micros),
            func.coalesce(func.sum(case((c.cost_micros.is_(None), replays), else_=0)), 0),
        )
        .select_from(CALLS.join(RUNS, c.run_id == RUNS.c.id))
        .where(c.ok.is_(True), RUNS.c.replays > 0)
        .group_by(*_GROUP)
    )


def _batch_query() -> Select[Any]:
    # The calls whose intent went through a provider batch: made figures, then what batching saved (raw micros).
    c, i = CALLS.c, INTENTS.c
    return (
        _made_query()
        .add_columns(func.sum(c.batch_saved_micros))
        .select_from(CALLS.join(INTENTS, i.public_id == c.call_id))
        .where(i.mode == "batch")
    )


def _grouped(
    url: str, stmt: Select[Any], task_name: str | None, tenant: str | None, usd_at: int = -2
) -> list[tuple[tuple[str | None, str, str], list[Any]]]:
    c = CALLS.c
    if task_name is not None:
        stmt = stmt.where(c.task_name == task_name)
    if tenant is not None:
        stmt = stmt.where(c.tenant == tenant)
    with Database(url).read() as conn:
        rows = conn.execute(stmt).all()
    # Counts as int (PostgreSQL sums BIGINTs as NUMERIC, i.e. Decimal); the cost, last but one, summed in
    # micro-USD, as Decimal USD or None.
    return [
        ((row[0], row[1], row[2]), [_figure(value, i == len(row) + usd_at) for i, value in enumerate(row[3:], start=3)])
        for row in rows
    ]


def _figure(value: Any, is_usd: bool) -> Any:
    if value is None:  # a SUM over no priced row
        return None
    return usd(int(value)) if is_usd else int(value)


@dataclass(frozen=True)
class BatchSavings:
    """What batch steps cost against the same calls made synchronously (exact: sums of micro-USD)."""

    batches: int  # provider batches their items went through
    calls: int  # batch items applied (ledger rows of mode batch)
    cost: Decimal | None  # at the batch price, as the ledger recorded it (None: no call had a price)
    synchronous: Decimal | None  # the same calls at the synchronous price (price_of)
    saved: Decimal | None


def batch_savings(url: str, conf: Any, task_name: str, keys: list[str] | None = None) -> BatchSavings:
    """The batch calls of `task_name` (of these idempotency `keys`, or all): count, cost, and what they saved."""
    c, i, b = CALLS.c, INTENTS.c, BATCH_ITEMS.c
    where = [i.mode == "batch", c.task_name == task_name]
    if keys is not None:
        where.append(c.idempotency_key.in_(keys))
    joined = CALLS.join(INTENTS, i.public_id == c.call_id)
    with Database(url).read() as conn:
        rows = conn.execute(
            select(c.model, c.input_tokens, c.output_tokens, c.cost_micros).select_from(joined).where(*where)
        ).all()
        batches = conn.execute(
            select(func.count(func.distinct(b.batch_id)))
            .select_from(joined.join(BATCH_ITEMS, b.custom_id == c.call_id))
            .where(*where)
        ).scalar_one()
    priced = [r for r in rows if r.cost_micros is not None]
    if not priced:
        return BatchSavings(int(batches), len(rows), None, None, None)
    cost = sum(int(r.cost_micros) for r in priced)
    prices = {r.model: price_for(r.model, conf) for r in priced}
    sync = sum(p.cost_micros(r.input_tokens, r.output_tokens) for r in priced if (p := prices[r.model]) is not None)
    return BatchSavings(int(batches), len(rows), usd(cost), usd(sync), usd(sync - cost))
