"""The running totals' metrics: what completed runs did (steps, takeovers) and saved (replays), and the model
calls made (ledger_totals).

Each is written in the transaction of what it counts (a completion, a replay's count, a ledger row), so a scrape
reads a row per task, tenant (and model), never step_results or model_calls. Tenants past the cap are "other".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from sqlalchemy import Connection, select

from oncelery.ledger.unknown import UNKNOWN_OUTCOME
from oncelery.llm.limits import limiter_views
from oncelery.models.intents import IntentState
from oncelery.models.money import MICROS_PER_USD, usd
from oncelery.ops.histograms import PREFIX, TenantCap, age_seconds
from oncelery.store.tables import BUDGETS, INTENTS, LABEL_TOTALS, LIMITERS, OUTCOME_TOTALS, TOTALS

__all__ = [
    "REATTACHED",
    "UNKNOWN_OUTCOME",
    "budget_families",
    "ledger_families",
    "lifetime_families",
    "limiter_families",
    "open_call_families",
]

REATTACHED = "reattached"  # the ledger label of a call a later holder took the answer of

_LIFETIME = {
    "steps_executed": ("steps_executed", "Checkpointed steps of completed runs, executed by any of their holders."),
    "steps_replayed": ("steps_replayed", "Steps completing deliveries took from checkpoints instead of executing."),
    "takeovers": ("takeovers", "Takeovers (fencing_token - 1) of completed runs: retries and lost holders."),
    "saved_calls": ("llm_saved_calls", "Model calls replays did not make (each replay x the run's ok calls)."),
    "saved_cost_micros": ("llm_saved_cost_usd", "Estimated USD replays saved (priced calls)."),
    "at_producer": (
        "producer_answers",
        "Duplicate calls answered where they were made (.delay()), never published; also counted as replayed.",
    ),
}


def lifetime_families(totals: dict[tuple[str, str], list[int]]) -> Iterator[Metric]:
    """Counters kept with the outcome counts (steps, takeovers, what replays saved) per task and tenant."""
    index = {name: i for i, name in enumerate(OUTCOME_TOTALS)}
    families = {
        name: CounterMetricFamily(f"{PREFIX}_{metric}", help_text, labels=["name", "tenant"])
        for name, (metric, help_text) in _LIFETIME.items()
    }
    tokens = CounterMetricFamily(
        f"{PREFIX}_llm_saved_tokens", "Tokens replays did not spend.", labels=["name", "tenant", "direction"]
    )
    for (task, tenant), figures in sorted(totals.items()):
        for name, family in families.items():
            value = figures[index[name]]
            family.add_metric([task, tenant], _usd(value) if name == "saved_cost_micros" else value)
        tokens.add_metric([task, tenant, "input"], int(figures[index["saved_input_tokens"]]))
        tokens.add_metric([task, tenant, "output"], int(figures[index["saved_output_tokens"]]))
    yield from (*families.values(), tokens)


def ledger_families(conn: Connection, cap: TenantCap) -> Iterator[Metric]:
    """Model calls made, their tokens and estimated USD, per task, tenant and model (running totals)."""
    labels = ["name", "tenant", "model"]
    calls = CounterMetricFamily(f"{PREFIX}_llm_calls", "Model calls made (failed ones included).", labels=labels)
    failed = CounterMetricFamily(f"{PREFIX}_llm_failed_calls", "Model calls that raised.", labels=labels)
    tokens = CounterMetricFamily(
        f"{PREFIX}_llm_tokens", "Tokens of the model calls made.", labels=[*labels, "direction"]
    )
    cost = CounterMetricFamily(f"{PREFIX}_llm_cost_usd", "Estimated USD of the priced calls made.", labels=labels)
    t = TOTALS.c
    merged: dict[tuple[str, str, str], list[int]] = {}  # tenants past the cap summed as "other"
    figures = (t.calls, t.failed_calls, t.input_tokens, t.output_tokens, t.cost_micros)
    for row in conn.execute(select(t.task_name, t.tenant, t.model, *figures)):
        into = merged.setdefault((row.task_name, cap(row.tenant), row.model), [0] * 5)
        for i, figure in enumerate(row[3:]):
            into[i] += int(figure or 0)  # integers all (micro-USD for the cost): summed exactly
    for (task, tenant, model), (n, n_failed, tokens_in, tokens_out, micros) in sorted(merged.items()):
        key = [task, tenant, model]
        calls.add_metric(key, n)
        failed.add_metric(key, n_failed)
        tokens.add_metric([*key, "input"], tokens_in)
        tokens.add_metric([*key, "output"], tokens_out)
        cost.add_metric(key, _usd(micros))
    yield from (calls, failed, tokens, cost)
    yield from _label_families(conn, cap)


def _usd(micros: int) -> float:
    """An exact micro-USD sum as the float USD a Prometheus sample holds (int / int: correctly rounded)."""
    return micros / MICROS_PER_USD


def _label_families(conn: Connection, cap: TenantCap) -> Iterator[Metric]:
    """Calls made again (by reason), calls of unknown outcome, and calls re-attached (ledger_label_totals)."""
    labels = ["name", "tenant", "model"]
    repeated = CounterMetricFamily(
        f"{PREFIX}_llm_repeated_calls",
        "Model calls made again for the same step, by reason (create_window, sync_unknown, lost, failed...).",
        labels=[*labels, "reason"],
    )
    unknown = CounterMetricFamily(
        f"{PREFIX}_llm_unknown_outcome_calls",
        "Calls whose holder died before they were answered: ledger rows of estimated usage, maybe never made.",
        labels=labels,
    )
    reattached = CounterMetricFamily(
        f"{PREFIX}_llm_reattached_calls",
        "Calls whose answer a later holder took from the provider instead of paying again.",
        labels=labels,
    )
    merged: Counter[tuple[str, str, str, str]] = Counter()
    t = LABEL_TOTALS.c
    for row in conn.execute(select(t.task_name, t.tenant, t.model, t.label, t.calls)):
        merged[(row.task_name, cap(row.tenant), row.model, row.label)] += int(row.calls)
    for (task, tenant, model, label), n in sorted(merged.items()):
        if label == UNKNOWN_OUTCOME:
            unknown.add_metric([task, tenant, model], n)
        elif label == REATTACHED:
            reattached.add_metric([task, tenant, model], n)
        else:
            repeated.add_metric([task, tenant, model, label], n)
    yield from (repeated, unknown, reattached)


def open_call_families(conn: Connection, clock: datetime) -> Iterator[Metric]:
    """Model calls still open (intents prepared or sent) and those at risk: sent longer ago than the provider
    keeps a response, so it may be gone when the run is next delivered (one read of the few open intents)."""
    c = INTENTS.c
    open_calls = GaugeMetricFamily(
        f"{PREFIX}_llm_open_calls", "Model calls not yet ended (intents prepared or sent).", labels=["state"]
    )
    at_risk = GaugeMetricFamily(
        f"{PREFIX}_llm_calls_at_risk",
        "Sent calls older than the provider's retention: their response may be gone (then re-called or dead-lettered).",
    )
    states = {IntentState.PREPARED: 0, IntentState.SENT: 0}
    risky = 0
    rows = conn.execute(select(c.state, c.sent_at, c.retention_s).where(c.state.in_(list(states))))
    for state, sent_at, retention in rows:
        states[state] += 1
        if state is IntentState.SENT and retention is not None and age_seconds(clock, sent_at) > retention:
            risky += 1
    for state, n in states.items():
        open_calls.add_metric([state.value], n)
    at_risk.add_metric([], risky)
    yield from (open_calls, at_risk)


def limiter_families(conn: Connection, clock: datetime) -> Iterator[Metric]:
    """The shared limiters (one row each in llm_limiters): admissions, waits by source, backlog and capacity."""
    labels = ["limiter"]
    throttled = CounterMetricFamily(
        f"{PREFIX}_llm_throttled",
        "Calls a limiter made wait: source=local (our limiter refused the admission), provider (a 429 served).",
        labels=[*labels, "source"],
    )
    admitted = CounterMetricFamily(f"{PREFIX}_llm_limiter_admitted", "Calls a limiter admitted.", labels=labels)
    backlog = GaugeMetricFamily(
        f"{PREFIX}_llm_limiter_backlog_seconds",
        "Seconds of admitted work the limiter holds ahead of now (its pace; 0: idle).",
        labels=labels,
    )
    capacity = GaugeMetricFamily(
        f"{PREFIX}_llm_limiter_capacity_ratio",
        "The limiter's share of its configured rate after the provider's 429s (1: full; halved per 429).",
        labels=labels,
    )
    now = (clock if clock.tzinfo is not None else clock.replace(tzinfo=UTC)).timestamp()
    rows = conn.execute(select(LIMITERS))
    for view in limiter_views(rows, now):  # one series per limiter, its shards summed
        throttled.add_metric([view.name, "local"], view.throttled_local)
        throttled.add_metric([view.name, "provider"], view.throttled_provider)
        admitted.add_metric([view.name], view.admitted)
        backlog.add_metric([view.name], view.backlog_s)
        capacity.add_metric([view.name], view.capacity)
    yield from (throttled, admitted, backlog, capacity)


BUDGET_SERIES = 200  # current windows exported at most (largest spend first): tenants are unbounded


def budget_families(conn: Connection, clock: datetime) -> Iterator[Metric]:
    """The current window of each fleet and tenant budget (llm_budgets): limit, spent, reserved, overrun, refusals.

    Labelled by the budget's scope ("tenant:acme/day"), not its window: a new day continues the same series.
    A job's own budget (max_cost_usd, one row per run) is not exported: it would be one series per run.
    """
    labels = ["budget"]
    gauges = {
        "limit": GaugeMetricFamily(f"{PREFIX}_llm_budget_limit_usd", "The window's cap in USD.", labels=labels),
        "spent": GaugeMetricFamily(
            f"{PREFIX}_llm_budget_spent_usd", "USD spent in the window (its calls' ledger rows).", labels=labels
        ),
        "reserved": GaugeMetricFamily(
            f"{PREFIX}_llm_budget_reserved_usd", "USD reserved by calls in flight (their estimates).", labels=labels
        ),
        "overrun": GaugeMetricFamily(
            f"{PREFIX}_llm_budget_overrun_usd",
            "USD calls cost above their reservation that the cap could not hold (an estimate's error; 0 expected).",
            labels=labels,
        ),
        "refused": GaugeMetricFamily(
            f"{PREFIX}_llm_budget_refused_calls",
            "Calls refused in the window (BudgetExceeded or deferred).",
            labels=labels,
        ),
    }
    now = (clock if clock.tzinfo is not None else clock.replace(tzinfo=UTC)).timestamp()
    b = BUDGETS.c
    rows = conn.execute(
        select(b.scope, b.limit_micros, b.spent_micros, b.reserved_micros, b.overrun_micros, b.refused)
        .where(b.resets_at.is_not(None), b.resets_at > now)
        .order_by(b.spent_micros.desc())
        .limit(BUDGET_SERIES)
    )
    for scope, limit, spent, reserved, overrun, refused in rows:
        for name, value in (("limit", limit), ("spent", spent), ("reserved", reserved), ("overrun", overrun)):
            gauges[name].add_metric([scope], float(usd(int(value)) or 0))
        gauges["refused"].add_metric([scope], int(refused))
    yield from gauges.values()
