"""The read side of the cost ledger: what model calls cost per task, tenant and model, and what replays saved.

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

from oncelery.models.money import usd
from oncelery.store.database import Database
from oncelery.store.tables import CALLS, LABEL_TOTALS, RUNS

__all__ = ["CostLine", "CostReport", "Spend", "cost_report"]


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
                }
                for line in self.lines
            ],
            "total": {"made": self.made.as_dict(), "saved": self.saved.as_dict()},
            "labelled_calls": dict(sorted(self.labels.items())),
        }


def cost_report(url: str, task_name: str | None = None, tenant: str | None = None) -> CostReport:
    """Return what the ledger of `url` holds (one task's or tenant's if given): two grouped queries, no scans."""
    made = {key: Spend(*figures) for key, figures in _grouped(url, _made_query(), task_name, tenant)}
    # A replay skips whole runs of returned calls: none of what it saved failed.
    saved = {key: Spend(n, 0, *rest) for key, (n, *rest) in _grouped(url, _saved_query(), task_name, tenant)}
    keys = sorted(made.keys() | saved.keys(), key=lambda k: (k[0] or "", k[1], k[2]))
    lines = [CostLine(*key, made.get(key, Spend()), saved.get(key, Spend())) for key in keys]
    return CostReport(lines, _labels(url, task_name, tenant))


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


def _grouped(
    url: str, stmt: Select[Any], task_name: str | None, tenant: str | None
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
        ((row[0], row[1], row[2]), [_figure(value, i == len(row) - 2) for i, value in enumerate(row[3:], start=3)])
        for row in rows
    ]


def _figure(value: Any, is_usd: bool) -> Any:
    if is_usd:
        return None if value is None else usd(int(value))
    return int(value)
