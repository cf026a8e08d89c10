"""Fork a past run from step N: a new run under its own key namespace, LLM-aware (docs/fork.md).

    fork_run(app, task, key, from_step="quality", overrides={"quality": {"model": "m2"}}, effects="dry")

1. the source run (task, tenant, key) must be COMPLETED; `from_step` names one of its checkpointed steps;
2. its arguments are the ones it kept (the task's `keep_arguments=`), else the caller's (`args=`, `kwargs=`);
3. one `oncelery_forks` row records the source, the from-step, the overrides and the effects mode; its id names
   the fork's run: key `fork:<id>:<source key>`, same task and tenant, so production's claim, concurrency key
   and entity version are never taken (runs/forks.py);
4. the job is sent as any other: the worker replays steps before N from the SOURCE's checkpoints, executes
   from N on (a new run has no checkpoint there, so no StepMismatch), applies the overrides in `self.llm`
   (a changed request: a new call in the ledger), and writes effects as the mode says (delivery/effects.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, select

from oncelery.errors import ConfigurationError
from oncelery.models import ForkEffects, RunStatus
from oncelery.ops.fork_preview import ForkPreview, price_steps
from oncelery.runs.forks import OVERRIDABLE, record_fork_txn
from oncelery.runs.kept import arguments_of
from oncelery.settings import HEADER_FORK, HEADER_KEY, HEADER_TENANT, require_database_url
from oncelery.store.database import Database
from oncelery.store.tables import RUNS, STEPS

__all__ = [
    "EFFECTS_MODES",
    "ForkHandle",
    "SourceRun",
    "find_source",
    "fork_run",
    "parse_overrides",
    "preview_fork",
]

EFFECTS_MODES = tuple(m.value for m in ForkEffects)


@dataclass(frozen=True)
class SourceRun:
    """The completed run a fork starts from: its row, its steps in order, and the arguments it kept."""

    run_id: int
    task_name: str
    tenant: str
    key: str
    steps: list[tuple[int, str]]  # (position, step name)
    message: Any
    finished_at: Any = None

    def position_of(self, step: str) -> int:
        """The position of `step` in the source run, or ConfigurationError naming the steps it has."""
        for position, name in self.steps:
            if name == step:
                return position
        names = ", ".join(name for _, name in self.steps) or "none"
        raise ConfigurationError(
            f"{self.task_name}[{self.key}] has no step {step!r}: fork from one of its steps ({names})"
        )


@dataclass(frozen=True)
class ForkHandle:
    """A fork just sent: its id (`oncelery fork diff ID`), its run's key, and the Celery result of its job."""

    id: int
    key: str
    result: Any
    cohort_id: int | None = None

    def get(self, timeout: float | None = None) -> Any:
        """Wait for the fork's run to finish and return its result (Celery's AsyncResult.get)."""
        return self.result.get(timeout=timeout)


def parse_overrides(pairs: Any) -> dict[str, dict[str, Any]]:
    """`["quality.model=m2", "quality.temperature=0.2"]` (or a {step: {name: value}} dict) as a checked dict.

    A value is JSON when it parses as JSON (0.2, 7, true), else the text itself; names are OVERRIDABLE only.
    """
    if isinstance(pairs, dict):
        items = [(f"{step}.{name}", value) for step, changes in pairs.items() for name, value in dict(changes).items()]
    else:
        items = []
        for pair in pairs or ():
            target, sep, text = str(pair).partition("=")
            if not sep:
                raise ConfigurationError(f"--set {pair!r}: give STEP.NAME=VALUE, e.g. quality.model=gpt-4.1-mini")
            try:
                value: Any = json.loads(text)
            except ValueError:
                value = text
            items.append((target, value))
    out: dict[str, dict[str, Any]] = {}
    for target, value in items:
        step, dot, name = target.rpartition(".")
        if not dot or not step or name not in OVERRIDABLE:
            raise ConfigurationError(
                f"--set {target}=...: give STEP.NAME with NAME one of {', '.join(OVERRIDABLE)} (e.g. quality.model)"
            )
        out.setdefault(step, {})[name] = value
    return out


def find_source(conn: Connection, task_name: str, key: str, tenant: str = "") -> SourceRun:
    """The COMPLETED run (task, tenant, key) with its steps, or ConfigurationError saying what to fork instead."""
    c = RUNS.c
    row = (
        conn.execute(
            select(c.id, c.status, c.message, c.finished_at).where(
                c.task_name == task_name, c.tenant == tenant, c.idempotency_key == key
            )
        )
        .mappings()
        .first()
    )
    if row is None:
        raise ConfigurationError(
            f"no run {task_name}[{key}] (tenant {tenant!r}): see `oncelery runs list --task {task_name}`"
        )
    if row["status"] is not RunStatus.COMPLETED:
        raise ConfigurationError(
            f"{task_name}[{key}] is {row['status'].value}: only a COMPLETED run can be forked; wait for it to finish"
        )
    s = STEPS.c
    steps = conn.execute(select(s.position, s.step_name).where(s.run_id == row["id"]).order_by(s.position)).all()
    return SourceRun(
        int(row["id"]), task_name, tenant, key, [(int(p), n) for p, n in steps], row["message"], row["finished_at"]
    )


def _arguments(source: SourceRun, args: Any, kwargs: Any) -> tuple[list[Any], dict[str, Any]]:
    if args is not None or kwargs is not None:
        return list(args or ()), dict(kwargs or {})
    kept = arguments_of(source.message)
    if kept is None:
        raise ConfigurationError(
            f"{source.task_name}[{source.key}] kept no arguments: give them (--args/--kwargs, or args=/kwargs=), "
            f"or set keep_arguments=True on the task so its next runs keep them"
        )
    return kept


def preview_fork(
    app: Any, task: Any, key: str, *, from_step: str, overrides: Any = None, tenant: str = ""
) -> ForkPreview:
    """What forking `key` from `from_step` with `overrides` would cost, from the source's ledger (nothing is sent)."""
    name = task if isinstance(task, str) else task.name
    db = Database(require_database_url(app.conf, "oncelery fork --dry-run"))
    with db.read() as conn:
        source = find_source(conn, name, key, tenant)
        return price_steps(conn, app.conf, source.run_id, source.steps, source.position_of(from_step),
                            parse_overrides(overrides))  # fmt: skip


def fork_run(
    app: Any,
    task: Any,
    key: str,
    *,
    from_step: str,
    overrides: Any = None,
    effects: str = "dry",
    shadow_url: str | None = None,
    tenant: str = "",
    args: Any = None,
    kwargs: Any = None,
    cohort_id: int | None = None,
    cohort_cap_micros: int | None = None,
) -> ForkHandle:
    """Fork the COMPLETED run `key` of `task` from step `from_step`: record the fork, send its run, return it.

    Steps before `from_step` are replayed from the source's checkpoints; it and every later step execute, with
    `overrides` ({step: {model, prompt, temperature, seed}} or ["step.model=..."]) applied by `self.llm`.
    `effects`: "dry" (rolled back, the default), "shadow" (written to `shadow_url`) or "live" (production).
    `task`: the task or its name (sent by name: a worker of the task runs it).
    """
    name = task if isinstance(task, str) else str(task.name)
    changes = parse_overrides(overrides)
    if effects not in EFFECTS_MODES:
        raise ConfigurationError(f"effects={effects!r}: use one of {', '.join(EFFECTS_MODES)} (dry is the default)")
    if effects == "shadow" and not shadow_url:
        raise ConfigurationError("effects='shadow' needs shadow_url= (--shadow-url): the database effects go to")
    db = Database(require_database_url(app.conf, "oncelery fork"))
    with db.begin() as conn:
        source = find_source(conn, name, key, tenant)
        position = source.position_of(from_step)
        for step in changes:
            if step in {name for p, name in source.steps if p < position}:
                raise ConfigurationError(
                    f"--set {step}.*: step {step!r} comes before {from_step!r} and is replayed; fork from it instead"
                )
        call_args, call_kwargs = _arguments(source, args, kwargs)
        row = {
            "source_run_id": source.run_id, "task_name": name, "tenant": tenant, "source_key": key,
            "from_step": from_step, "from_position": position, "overrides": changes,
            "effects": ForkEffects(effects), "shadow_url": shadow_url, "cohort_id": cohort_id,
            "cohort_cap_micros": cohort_cap_micros,
        }  # fmt: skip
        fork_id, new_key, cohort_id = record_fork_txn(conn, row)
    headers: dict[str, Any] = {HEADER_KEY: new_key, HEADER_FORK: fork_id}
    if tenant:
        headers[HEADER_TENANT] = tenant
    # Sent by name with the key headers a call's options become, so the CLI needs no import of the task's module.
    result = app.send_task(name, call_args, call_kwargs, headers=headers)
    return ForkHandle(fork_id, new_key, result, cohort_id)
