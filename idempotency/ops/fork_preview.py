"""What a fork will cost, from the ledger, before it is sent; and what it changed, after (`oncelery fork diff`).

Preview: for each step the fork executes (the from-step and every later one), the source's ledger row for that
step gives the input tokens (exact: the same input, unless a prompt override changes it) and the output tokens
(an estimate: the new model may answer at another length); the step's model (its override, else the source's)
gives the price (`price_of`: `oncelery_prices`, else the price file). A step with no ledger row (not a model call)
costs nothing.

Diff: per step of the fork's run, the source's output beside the fork's (a unified diff of their text), the
token, cost and latency deltas from the ledger, and the user's scorer, `score(source_output, fork_output)`.
"""

from __future__ import annotations

import difflib
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, select

from oncelery.errors import ConfigurationError
from oncelery.ledger.prices import price_for
from oncelery.runs.forks import load_fork_txn
from oncelery.store.database import Database
from oncelery.store.tables import CALLS, RUNS, STEPS

__all__ = [
    "ForkPreview",
    "StepCall",
    "StepDiff",
    "fork_diff",
    "load_scorer",
    "price_steps",
    "step_calls",
]


@dataclass(frozen=True)
class StepCall:
    """A step's model calls in the ledger, added up: model, tokens, cost (micro-USD) and latency."""

    model: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    cost_micros: int = 0
    latency_ms: float = 0.0


@dataclass
class ForkPreview:
    """The estimated cost of a fork: one line per executed step, and the total in micro-USD."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    total_micros: int = 0
    unpriced: list[str] = field(default_factory=list)  # models with no price: their cost is unknown

    def as_json(self) -> dict[str, Any]:
        """The preview as JSON (micro-USD and USD)."""
        return {"steps": self.steps, "total_micros": self.total_micros, "total_usd": self.total_micros / 1e6,
                "unpriced": self.unpriced}  # fmt: skip


def step_calls(conn: Connection, run_id: int) -> dict[str, StepCall]:
    """The run's ledger rows added up per step (the ok ones: a failed call has no answer to compare)."""
    c = CALLS.c
    rows = conn.execute(
        select(c.step, c.model, c.input_tokens, c.output_tokens, c.cost_micros, c.latency_ms)
        .where(c.run_id == run_id, c.ok.is_(True))
        .order_by(c.id)
    ).all()
    out: dict[str, StepCall] = {}
    for step, model, tin, tout, cost, latency in rows:
        seen = out.get(step, StepCall())
        out[step] = StepCall(
            model, seen.input_tokens + int(tin or 0), seen.output_tokens + int(tout or 0),
            seen.cost_micros + int(cost or 0), seen.latency_ms + float(latency or 0.0),
        )  # fmt: skip
    return out


def price_steps(
    conn: Connection, conf: Any, run_id: int, steps: list[tuple[int, str]], position: int, overrides: dict[str, Any]
) -> ForkPreview:
    """The cost of re-running steps from `position` of run `run_id` with `overrides`, priced by `conf`."""
    calls = step_calls(conn, run_id)
    preview = ForkPreview()
    for pos, name in steps:
        if pos < position or name not in calls:
            continue
        source = calls[name]
        model = str((overrides.get(name) or {}).get("model") or source.model or "")
        price = price_for(model, conf)
        cost = None if price is None else price.cost_micros(source.input_tokens, source.output_tokens)
        if cost is None:
            preview.unpriced.append(model)
        preview.total_micros += cost or 0
        preview.steps.append(
            {"step": name, "model": model, "source_model": source.model, "input_tokens": source.input_tokens,
             "output_tokens": source.output_tokens, "cost_micros": cost, "source_cost_micros": source.cost_micros}
        )  # fmt: skip
    return preview


@dataclass(frozen=True)
class StepDiff:
    """One step of a fork beside its source: outputs, their diff, the ledger's deltas, the user's score."""

    step: str
    position: int
    replayed: bool
    diff: list[str]
    tokens_delta: int
    cost_delta_micros: int
    latency_delta_ms: float
    score: Any = None

    def as_json(self) -> dict[str, Any]:
        """The step's line of `oncelery fork diff --json`."""
        return dict(self.__dict__)


def load_scorer(spec: str) -> Callable[[Any, Any], Any]:
    """The user's scorer `module:function`, called as `function(source_output, fork_output)`."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ConfigurationError(f"--scorer {spec!r}: give module:function, e.g. myapp.scoring:similarity")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise ConfigurationError(f"--scorer {spec!r}: {module} has no function {name}")
    return fn  # type: ignore[no-any-return]


def _text(value: Any) -> list[str]:
    if isinstance(value, str):
        return value.splitlines()
    return json.dumps(value, indent=2, sort_keys=True, default=str).splitlines()


def _results(conn: Connection, run_id: int) -> dict[int, tuple[str, Any]]:
    s = STEPS.c
    rows = conn.execute(select(s.position, s.step_name, s.result).where(s.run_id == run_id)).all()
    return {int(p): (n, r) for p, n, r in rows}


def fork_diff(db: Database, fork_id: int, scorer: Callable[[Any, Any], Any] | None = None) -> list[StepDiff]:
    """Per step of fork `fork_id`: the source's output beside the fork's, and the ledger's deltas."""
    with db.read() as conn:
        spec = load_fork_txn(conn, fork_id)
        if spec is None:
            raise ConfigurationError(f"no fork {fork_id}: see `oncelery fork list`")
        c = RUNS.c
        run_id = conn.execute(
            select(c.id).where(c.task_name == spec.task_name, c.tenant == spec.tenant, c.idempotency_key == spec.key)
        ).scalar()
        if run_id is None:
            raise ConfigurationError(f"fork {fork_id}'s run {spec.key} has not started yet: run a worker, then diff")
        source, mine = _results(conn, spec.source_run_id), _results(conn, int(run_id))
        before, after = step_calls(conn, spec.source_run_id), step_calls(conn, int(run_id))
    out: list[StepDiff] = []
    for position in sorted(source):
        name, old = source[position]
        replayed = position < spec.from_position
        new = old if replayed else mine.get(position, (name, None))[1]
        a, b = before.get(name, StepCall()), after.get(name, StepCall()) if not replayed else StepCall()
        lines = list(difflib.unified_diff(_text(old), _text(new), "source", f"fork {fork_id}", lineterm=""))
        out.append(
            StepDiff(
                name, position, replayed, lines,
                0 if replayed else (b.input_tokens + b.output_tokens) - (a.input_tokens + a.output_tokens),
                0 if replayed else b.cost_micros - a.cost_micros,
                0.0 if replayed else b.latency_ms - a.latency_ms,
                None if scorer is None or replayed else scorer(old, new),
            )
        )  # fmt: skip
    return out
