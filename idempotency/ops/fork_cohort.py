"""`oncelery fork cohort`: one change applied to many past runs of a task, previewed first, under a cost cap.

It makes real, paid calls, so: the preview of every fork is added up first (from the ledger, as for one fork);
a total over `max_cost_usd` refuses the cohort before anything is sent; nothing is sent without `confirm=True`
(`--yes`). Every fork of the cohort shares one job cap, the budget row `cohort:<id>`, in the budgets' reservations
(llm/budgets.py): each model call reserves its estimate there before it is sent, so the cohort never spends past
its cap even where the preview under-estimated. `batch=True` sends the overridden steps' calls as batch items
(`self.llm(mode="batch")`, at about half the price; the relay's batcher submits them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select

from oncelery.errors import ConfigurationError
from oncelery.llm.budgets import parse_usd
from oncelery.models import RunStatus
from oncelery.ops.fork import find_source, fork_run, parse_overrides
from oncelery.ops.fork_preview import price_steps
from oncelery.relay.retention import parse_age
from oncelery.settings import FORK_KEY_PREFIX, require_database_url
from oncelery.store.database import Database
from oncelery.store.tables import RUNS

__all__ = [
    "CohortPlan",
    "fork_cohort",
]


@dataclass
class CohortPlan:
    """The cohort's runs, each one's preview (micro-USD), the total, and the forks sent (once confirmed)."""

    keys: list[tuple[str, str]] = field(default_factory=list)  # (tenant, key)
    costs: list[int] = field(default_factory=list)
    total_micros: int = 0
    cap_micros: int | None = None
    forks: list[Any] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        """The plan as `--json` prints it."""
        runs = zip(self.keys, self.costs, strict=True)
        return {
            "runs": [{"tenant": t, "key": k, "cost_micros": c} for (t, k), c in runs],
            "total_micros": self.total_micros, "cap_micros": self.cap_micros,
            "forks": [{"id": f.id, "key": f.key} for f in self.forks], "count": len(self.keys),
        }  # fmt: skip


def fork_cohort(
    app: Any,
    task_name: str,
    *,
    since: str,
    limit: int,
    from_step: str,
    overrides: Any,
    max_cost_usd: Any = None,
    confirm: bool = False,
    batch: bool = False,
    effects: str = "dry",
    shadow_url: str | None = None,
) -> CohortPlan:
    """Preview forking the task's runs that completed within `since` (at most `limit`); send them if `confirm`."""
    changes = parse_overrides(overrides)
    if not changes:
        raise ConfigurationError("fork cohort: give the change with --set STEP.NAME=VALUE (e.g. quality.model=...)")
    if batch:
        changes = {step: {**values, "mode": "batch"} for step, values in changes.items()}
    plan = CohortPlan(cap_micros=None if max_cost_usd is None else parse_usd(max_cost_usd, "--max-cost-usd"))
    db = Database(require_database_url(app.conf, "oncelery fork cohort"))
    c = RUNS.c
    with db.read() as conn:
        # The database clock: runs finished after now - since (the same expression retention's cut-off uses).
        since_at = db.dialect.lease_until("p_age")
        found = conn.execute(
            select(c.tenant, c.idempotency_key)
            .where(c.task_name == task_name, c.status == RunStatus.COMPLETED, c.finished_at >= since_at)
            .where(c.idempotency_key.not_like(f"{FORK_KEY_PREFIX}%"))
            .order_by(c.finished_at.desc(), c.id.desc())
            .limit(limit),
            {"p_age": db.dialect.lease_param(-parse_age(since))},
        ).all()
        for tenant, key in found:
            source = find_source(conn, task_name, key, tenant)
            cost = price_steps(conn, app.conf, source.run_id, source.steps, source.position_of(from_step), changes)
            plan.keys.append((tenant, key))
            plan.costs.append(cost.total_micros)
    plan.total_micros = sum(plan.costs)
    if plan.cap_micros is not None and plan.total_micros > plan.cap_micros:
        raise ConfigurationError(
            f"fork cohort: the preview is {plan.total_micros / 1e6:.6f} USD, over --max-cost-usd "
            f"{plan.cap_micros / 1e6:.6f}: raise the cap or lower --limit"
        )
    if not confirm:
        return plan
    cohort_id: int | None = None
    for tenant, key in plan.keys:
        handle = fork_run(
            app, task_name, key, from_step=from_step, overrides=changes, effects=effects, shadow_url=shadow_url,
            tenant=tenant, cohort_id=cohort_id, cohort_cap_micros=plan.cap_micros,
        )  # fmt: skip
        cohort_id = handle.cohort_id if cohort_id is None else cohort_id
        plan.forks.append(handle)
    return plan
