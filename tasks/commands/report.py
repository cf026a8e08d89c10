"""What `oncelery process` measured, read from the database: outcomes, the LLM cost ledger, checkpoints, scores.

Everything is a difference between a snapshot taken before the first message is sent and one taken at the
end, over this file's articles only, so re-running on the same database reports this run, not history.

Calls saved, precisely: a worker without the claim runs every delivery it receives from its first step.
So each delivery answered from a stored result (replayed) would have made one call per step, and each step
a resumed run replayed from its checkpoint would have been called again. `calls saved = steps per article x
replayed deliveries + replayed checkpoints`, and `calls without Oncelery = calls made + calls saved`. A run
that parked (WAITING on a model call or a batch) replays its checkpoints when woken: that is not a saving, so a
run with parks counts its replayed deliveries only.
Wasted calls are ledger rows beyond one per step of an article: a call that returned but whose step never
checkpointed (its worker was killed in between), so a later attempt had to call the model again.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, cast

from rich import box
from rich.console import Console
from rich.table import Table
from sqlalchemy import Table as SqlTable
from sqlalchemy import case, func, select

from oncelery import BatchSavings, Database, Outcome, Runs
from oncelery.models import ModelCall
from oncelery.models.jobs import ArticleScore

_CALLS = cast(SqlTable, ModelCall.__table__)
UNKNOWN_OUTCOME = "unknown_outcome"  # the ledger's reason for a call whose holder died before it was answered
_SCORES = cast(SqlTable, ArticleScore.__table__)


@dataclass(frozen=True)
class LedgerTotals:
    """One article's rows in the LLM cost ledger: calls and tokens."""

    calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    reattached: int = 0  # calls whose answer a later holder took instead of paying again
    repeated: tuple[tuple[str, int], ...] = ()  # calls made again for the same step, by reason (the ledger's)


@dataclass(frozen=True)
class Snapshot:
    """The task's delivery outcome counts and each article key's ledger totals at one moment."""

    outcomes: dict[str, int]
    ledger: dict[str, LedgerTotals]


def take_snapshot(runs: Runs, task_name: str, keys: Iterable[str]) -> Snapshot:
    """Return the outcome counts of `task_name` and the ledger totals of each of `keys`."""
    wanted = set(keys)
    c = _CALLS.c
    stmt = (
        select(
            c.idempotency_key,
            c.reason,
            func.count(),
            func.coalesce(func.sum(c.input_tokens), 0),
            func.coalesce(func.sum(c.output_tokens), 0),
            func.coalesce(func.sum(case((c.reattached, 1), else_=0)), 0),
        )
        .where(c.task_name == task_name)
        .group_by(c.idempotency_key, c.reason)
    )
    ledger: dict[str, LedgerTotals] = {}
    with runs.db.read() as conn:
        for key, reason, n, i, o, r in conn.execute(stmt):
            if key not in wanted:
                continue
            t = ledger.get(key, LedgerTotals())
            repeated = t.repeated + (((reason, int(n)),) if reason else ())
            ledger[key] = LedgerTotals(t.calls + n, t.input_tokens + i, t.output_tokens + o, t.reattached + r, repeated)
    return Snapshot(runs.outcome_counts(task_name), ledger)


def scored(url: str, articles: Iterable[tuple[str, int]]) -> tuple[int, list[tuple[str, int]]]:
    """Return (ArticleScore rows of these (id, version) pairs, the pairs that have none)."""
    wanted = set(articles)
    c = _SCORES.c
    with Database(url).read() as conn:
        rows = [(a, int(v)) for a, v in conn.execute(select(c.article_id, c.version)) if (a, int(v)) in wanted]
    found = set(rows)
    return len(rows), sorted(wanted - found)


@dataclass
class Summary:
    """The end-of-run table of `oncelery process` (also written as JSON with --summary-json)."""

    articles: int
    completed_before: int
    sent_first: int
    sent_duplicates: int
    sent_again: int
    executed: int
    replayed: int
    resumed: int
    in_progress_waits: int
    failed: int
    lease_lost: int
    worker_kills: int
    jobs_interrupted: int
    llm_calls: int
    llm_calls_saved: int
    wasted_calls: int
    calls_reattached: int
    repeated_calls: dict[str, int]
    input_tokens: int
    output_tokens: int
    wall_seconds: float
    steady_seconds: float | None
    score_rows: int
    missing: list[tuple[str, int]] = field(default_factory=list)
    parked: int = 0  # deliveries that parked their run WAITING on a model call still running (woken by the relay)
    batch: BatchSavings | None = None  # with --batch: the provider batches, the calls, the cost saved

    @property
    def deliveries_sent(self) -> int:
        """Every message this command sent: first copies, duplicates and re-sends."""
        return self.sent_first + self.sent_duplicates + self.sent_again

    @property
    def repeated(self) -> int:
        """Calls made again for a step (every reason but the unknown predecessor's own estimated row)."""
        return sum(n for reason, n in self.repeated_calls.items() if reason != UNKNOWN_OUTCOME)

    @property
    def articles_per_second(self) -> float:
        """Articles over the wall time."""
        return self.articles / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Return every field and derived figure as JSON-ready values."""
        data = asdict(self)
        data["missing"] = [list(pair) for pair in self.missing]
        data["deliveries_sent"] = self.deliveries_sent
        data["articles_per_second"] = round(self.articles_per_second, 3)
        data["llm_calls_without_oncelery"] = self.llm_calls + self.llm_calls_saved
        data["repeated"] = self.repeated
        if self.batch is not None:  # money as exact strings, never floats
            data["batch"] = {k: str(v) if isinstance(v, Decimal) else v for k, v in asdict(self.batch).items()}
        return data


def summarize(
    runs: Runs,
    task_name: str,
    keys: Sequence[str],
    fresh_keys: Sequence[str],
    before: Snapshot,
    steps_per_article: int,
    **figures: Any,
) -> Summary:
    """Build the Summary of a run from the `before` snapshot, the database now, and the producer's `figures`.

    `fresh_keys` are the articles that were not COMPLETED when the run started (their checkpoints count).
    """
    after = take_snapshot(runs, task_name, keys)
    delta = {o.value: after.outcomes.get(o.value, 0) - before.outcomes.get(o.value, 0) for o in Outcome}
    empty = LedgerTotals()

    def beyond(ledger: dict[str, LedgerTotals]) -> int:
        return sum(max(0, ledger.get(k, empty).calls - steps_per_article) for k in keys)

    def total(ledger: dict[str, LedgerTotals], name: str) -> int:
        return sum(getattr(t, name) for t in ledger.values())

    def by_reason(ledger: dict[str, LedgerTotals]) -> Counter[str]:
        counts: Counter[str] = Counter()
        for t in ledger.values():
            counts.update(dict(t.repeated))
        return counts

    repeated = by_reason(after.ledger)
    repeated.subtract(by_reason(before.ledger))
    checkpoints = runs.resumed_steps(task_name, fresh_keys)
    calls = total(after.ledger, "calls") - total(before.ledger, "calls")
    return Summary(
        executed=delta["executed"],
        replayed=delta["replayed"],
        resumed=delta["resumed"],
        in_progress_waits=delta["in_progress"],
        failed=delta["failed"] + delta["dead"] + delta["conflict"],
        lease_lost=delta["lease_lost"],
        parked=delta["waiting"],
        llm_calls=calls,
        # A parked run's wake replays the checkpoints it made before parking: that is how it continues, not a
        # call saved (a worker without the claim could not park at all). With parks, checkpoints are not counted.
        llm_calls_saved=steps_per_article * delta["replayed"] + (0 if delta["waiting"] else checkpoints),
        wasted_calls=beyond(after.ledger) - beyond(before.ledger),
        calls_reattached=total(after.ledger, "reattached") - total(before.ledger, "reattached"),
        repeated_calls={reason: n for reason, n in sorted(repeated.items()) if n > 0},
        input_tokens=total(after.ledger, "input_tokens") - total(before.ledger, "input_tokens"),
        output_tokens=total(after.ledger, "output_tokens") - total(before.ledger, "output_tokens"),
        **figures,
    )


def render(console: Console, s: Summary) -> None:
    """Print the summary table (plain box lines and no colour when the output is not a terminal)."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("", style="dim")
    for label, value, note in _rows(s):
        table.add_row(label, value, note)
    console.print(table)


def _rows(s: Summary) -> list[tuple[str, str, str]]:
    rows = [("articles", f"{s.articles}", "")]
    if s.completed_before:
        rows.append(("  completed before this run", f"{s.completed_before}", "replayed from stored results"))
    rows += [
        (
            "deliveries sent",
            f"{s.deliveries_sent}",
            f"{s.sent_first} + {s.sent_duplicates} duplicates + {s.sent_again} re-sent",
        ),
        ("executed", f"{s.executed}", "claimed and run from the first step"),
        ("replayed (duplicates absorbed)", f"{s.replayed}", "stored result, no model call"),
        ("resumed runs", f"{s.resumed}", "taken over, finished steps replayed"),
        ("in-progress waits", f"{s.in_progress_waits}", "held by another worker; re-checked"),
    ]
    if s.parked:
        rows.append(("parked on a model call", f"{s.parked}", "WAITING, slot freed; the relay woke each one"))
    if s.failed or s.lease_lost:
        rows.append(("failed / lease lost", f"{s.failed} / {s.lease_lost}", "see `oncelery runs list`"))
    rows += [
        ("worker kills", f"{s.worker_kills}", f"{s.jobs_interrupted} jobs interrupted mid-pipeline"),
        ("LLM calls made (ledger rows)", f"{s.llm_calls}", ""),
        (
            "LLM calls saved",
            f"{s.llm_calls_saved}",
            f"of {s.llm_calls + s.llm_calls_saved} without Oncelery"
            + ("; duplicates only: woken runs' checkpoint replays are not savings" if s.parked else ""),
        ),
        ("wasted calls", f"{s.wasted_calls}", "ledger rows beyond one per step"),
        ("calls re-attached", f"{s.calls_reattached}", "answered to a later delivery (after a kill or a park)"),
        ("repeated calls", f"{s.repeated}", _reasons(s.repeated_calls)),
        ("tokens in / out", f"{s.input_tokens:,} / {s.output_tokens:,}", ""),
        *_batch_rows(s),
        ("wall time", f"{s.wall_seconds:.1f} s", _wall_note(s)),
        ("articles/s", f"{s.articles_per_second:.1f}", _steady(s)),
    ]
    return rows


def _batch_rows(s: Summary) -> list[tuple[str, str, str]]:
    if s.batch is None:
        return []
    b = s.batch
    rows = [("provider batches", f"{b.batches}", f"{b.calls} batch calls, each step pooled across articles")]
    if b.cost is not None and b.synchronous is not None:
        rows.append(("cost at the batch price", f"${b.cost}", f"${b.synchronous} as synchronous calls"))
        rows.append(("saved by batching", f"${b.saved}", "exact: integer micro-USD, oncelery_prices"))
    return rows


def _reasons(repeated: dict[str, int]) -> str:
    known = {reason: n for reason, n in repeated.items() if reason != UNKNOWN_OUTCOME}
    text = ", ".join(f"{n} {reason}" for reason, n in known.items()) or "no call made twice"
    unknown = repeated.get(UNKNOWN_OUTCOME, 0)
    # The call a holder died in the create window of: estimated in the ledger, maybe never sent.
    return text + (f"; {unknown} earlier call(s) of unknown outcome (estimated)" if unknown else "")


def _wall_note(s: Summary) -> str:
    if s.completed_before == s.articles:
        return "first message sent to last delivery answered"
    return "first message sent to last article scored"


def _steady(s: Summary) -> str:
    if not s.steady_seconds:
        return ""
    return f"{s.articles / s.steady_seconds:.1f} after the first result"


def write_json(path: Path, s: Summary) -> None:
    """Write the summary as JSON to `path`."""
    path.write_text(json.dumps(s.as_dict(), indent=2) + "\n", encoding="utf-8")
