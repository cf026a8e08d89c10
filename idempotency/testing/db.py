"""The test kit's reads of a claims database (`OnceleryDb`), and the assertions a test makes with them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from unittest.mock import ANY

from sqlalchemy import inspect, text

from oncelery.errors import ConfigurationError
from oncelery.models import Outcome, RunStatus
from oncelery.runs.views import Runs, RunView
from oncelery.store.database import Database

__all__ = [
    "ANY",
    "OnceleryDb",
    "assert_ledger",
    "assert_outcomes",
    "assert_ran_once",
    "assert_steps",
]


@dataclass
class OnceleryDb:
    """A migrated claims database for one test: its URL, and reads of runs, outcomes, steps and the ledger.

    `cluster`: the throwaway PostgreSQL cluster it lives on (`oncelery_cluster_db`), which `database_down` stops.
    """

    url: str
    runs: Runs = field(init=False)
    cluster: Any = None

    def __post_init__(self) -> None:
        self.runs = Runs(self.url)

    def run(self, task: Any, key: str, tenant: str = "") -> RunView | None:
        """The run of (task, tenant, key), or None (`task` is a task or its name)."""
        return self.runs.get(_name(task), key, tenant)

    def outcome_counts(self, task: Any) -> dict[str, int]:
        """The task's delivery outcome counts (exact, across processes)."""
        return self.runs.outcome_counts(_name(task))

    def steps(self, task: Any, key: str, tenant: str = "") -> tuple[list[str], list[str]]:
        """(executed, replayed) step names of the run's last attempt: replayed ones were saved by earlier tokens."""
        run = self.run(task, key, tenant)
        if run is None:
            return [], []
        steps = self.runs.steps(run.run_id)
        return [x.name for x in steps if x.token == run.token], [x.name for x in steps if x.token < run.token]

    def ledger_rows(self, task: Any, key: str) -> list[Any]:
        """The cost ledger's rows (model_calls) of the key, oldest first: one per real model call."""
        db = Database(self.url)
        if "model_calls" not in inspect(db.engine).get_table_names():
            return []
        with db.read() as conn:
            query = "SELECT * FROM model_calls WHERE task_name = :t AND idempotency_key = :k ORDER BY id"
            return list(conn.execute(text(query), {"t": _name(task), "k": key}))

    def count(self, sql: str, **params: Any) -> int:
        """Run a counting query of your own (e.g. rows your task wrote through effects()) and return it."""
        with Database(self.url).read() as conn:
            return int(conn.execute(text(sql), params).scalar_one())


def _name(task: Any) -> str:
    return task if isinstance(task, str) else str(task.name)


# -- assertions ----------------------------------------------------------------------------------------------


def _expect(condition: bool, message: str) -> None:
    # An explicit raise, not `assert`: the kit's checks must hold under `python -O` too.
    if not condition:
        raise AssertionError(message)


def assert_ran_once(
    db: OnceleryDb, task: Any, key: str, tenant: str = "", effects: Callable[[], int] | str | None = None
) -> RunView:
    """Assert the key's run COMPLETED with its result stored, and (if given) that its effects exist once.

    `effects`: a callable returning how many effects the run left, or a counting SQL query over your own
    tables with a `:key` parameter.
    """
    run = db.run(task, key, tenant)
    if run is None:
        raise AssertionError(f"{_name(task)}[{key}] never ran")
    _expect(run.status is RunStatus.COMPLETED, f"{_name(task)}[{key}] is {run.status.value}: {run.error}")
    if effects is not None:
        seen = effects() if callable(effects) else db.count(effects, key=key)
        _expect(seen == 1, f"{_name(task)}[{key}] left {seen} effects, not 1")
    return run


def assert_outcomes(db: OnceleryDb, task: Any, ignore: Iterable[str] = (), **expected: Any) -> dict[str, int]:
    """Assert the task's outcome counts are exactly `expected` (e.g. executed=1, replayed=19).

    An outcome given as `ANY` (e.g. in_progress=ANY), or named in `ignore`, may have any count, none included:
    how often a duplicate re-checks a running key depends on timing.
    """
    free = _free_outcomes(expected, ignore)
    counts = db.outcome_counts(task)
    seen = {k: v for k, v in counts.items() if k not in free}
    wanted = {k: v for k, v in expected.items() if k not in free and v}
    any_of = f" (any count of {', '.join(sorted(free))})" if free else ""
    _expect(seen == wanted, f"{_name(task)} outcomes {counts}, expected {wanted}{any_of}")
    return counts


_OUTCOMES = frozenset(o.value for o in Outcome)


def _free_outcomes(expected: dict[str, Any], ignore: Iterable[str]) -> set[str]:
    """The outcomes whose count assert_outcomes does not check; refuses a name that is no outcome."""
    free = {ignore} if isinstance(ignore, str) else set(ignore)  # a lone name, not its letters
    free |= {k for k, v in expected.items() if v is ANY}
    unknown = (set(expected) | free) - _OUTCOMES
    if unknown:
        raise ConfigurationError(
            f"assert_outcomes: {', '.join(sorted(unknown))} is no outcome; use one of {', '.join(sorted(_OUTCOMES))}"
        )
    return free


def assert_steps(
    db: OnceleryDb, task: Any, key: str, executed: list[str], replayed: list[str], tenant: str = ""
) -> None:
    """Assert which steps the run's last attempt executed and which it replayed from checkpoints."""
    seen = db.steps(task, key, tenant)
    _expect(seen == (executed, replayed), f"{_name(task)}[{key}] steps (executed, replayed) = {seen}")


def assert_ledger(db: OnceleryDb, task: Any, key: str, calls: int) -> list[Any]:
    """Assert the cost ledger holds exactly `calls` model calls for the key (one per real call)."""
    rows = db.ledger_rows(task, key)
    _expect(len(rows) == calls, f"{_name(task)}[{key}] has {len(rows)} ledger rows, expected {calls}")
    return rows
