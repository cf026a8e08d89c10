"""A fork's row as the delivery reads it: which run it forks, from which step, with which overrides and effects.

The fork's run has its own key, `fork:<id>:<source key>` (FORK_KEY_PREFIX), under the source's task and tenant:
it never takes production's claim, its concurrency key or its entity version (a fork re-runs the past: it is
neither blocked by production's running entity nor stale against it). Steps before `from_position` are replayed
from the SOURCE's checkpoints; from there on every step executes in the fork's own run.

A delivery is a fork only by the header the fork command sends (HEADER_FORK, its id), never by its key's shape,
and only if the fork row names this very task, tenant and key (`fork_mismatch`): a step result never crosses
tenants, and a producer cannot make its call a fork by naming one.

The fork row is written here too (`record_fork_txn`, in the fork command's transaction): inserted under a pending
key, then named after its id.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, select, update

from oncelery.errors import ConfigurationError
from oncelery.settings import FORK_KEY_PREFIX, HEADER_FORK, MAX_KEY_LENGTH
from oncelery.store.database import Database
from oncelery.store.tables import FORKS

__all__ = [
    "OVERRIDABLE",
    "ForkSpec",
    "apply_overrides",
    "fork_id_of",
    "fork_key",
    "fork_mismatch",
    "load_fork",
    "load_fork_txn",
    "record_fork_txn",
    "stored_fork_headers",
]

#: What `--set STEP.NAME=VALUE` may change in a step's model call (`mode`: "batch" makes it a batch item).
OVERRIDABLE = ("model", "prompt", "temperature", "seed", "mode")

_FORK_KEY = re.compile(re.escape(FORK_KEY_PREFIX) + r"(\d+):")


@dataclass(frozen=True)
class ForkSpec:
    """One fork: its source run, the step it re-runs from, the per-step overrides and where effects go."""

    id: int
    source_run_id: int
    task_name: str
    tenant: str
    source_key: str
    from_step: str
    from_position: int
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    effects: str = "dry"
    shadow_url: str | None = None
    key: str = ""
    cohort_id: int | None = None
    cohort_cap_micros: int | None = None

    def shared_budgets(self) -> tuple[tuple[str, int], ...]:
        """The budget rows every call of this fork reserves in besides its own: its cohort's cap, if any."""
        if self.cohort_id is None or self.cohort_cap_micros is None:
            return ()
        return ((f"cohort:{self.cohort_id}", int(self.cohort_cap_micros)),)

    def overrides_for(self, step: str) -> dict[str, Any]:
        """The overrides `self.llm(step, ...)` applies in this fork (empty: the call as the code makes it)."""
        return dict(self.overrides.get(step) or {})


def apply_overrides(request: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """The model request with a fork's overrides: model, temperature and seed replace the request's; `prompt`
    replaces its input (a `{input}` in the prompt stands for the original input, when that is text).

    The request changes, so its digest does: the ledger and the intent protocol see a new call, never a replay.
    """
    changed = dict(request)
    for name in ("model", "temperature", "seed"):
        if name in overrides:
            changed[name] = overrides[name]
    if "prompt" in overrides:
        prompt = str(overrides["prompt"])
        original = request.get("input")
        text = prompt.replace("{input}", original) if isinstance(original, str) else prompt
        if "messages" in request and "input" not in request:  # a chat request: its last message is the prompt
            messages = [dict(m) for m in request["messages"]]
            if messages:
                last = messages[-1].get("content")
                messages[-1]["content"] = prompt.replace("{input}", last) if isinstance(last, str) else prompt
            changed["messages"] = messages
        else:
            changed["input"] = text
    return changed


def fork_key(fork_id: int, source_key: str) -> str:
    """The key of fork `fork_id`'s run: production's key can never be it (production keys never name a fork id)."""
    return f"{FORK_KEY_PREFIX}{fork_id}:{source_key}"


def fork_id_of(key: str | None) -> int | None:
    """The fork id a run's key names, or None for a production key (no query: most keys are not forks)."""
    if not key or not key.startswith(FORK_KEY_PREFIX):
        return None
    m = _FORK_KEY.match(key)
    return int(m.group(1)) if m else None


def stored_fork_headers(key: str | None, headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """A stored run's or letter's headers, with the fork command's header put back when its key names a fork and
    it has none: a message stored before forks were recognised by that header alone (a legacy lookup). It restores
    a fork's own message and never makes one: the delivery still checks the fork row's task, tenant and key."""
    found = dict(headers or {})
    fork_id = fork_id_of(key)
    if fork_id is not None and HEADER_FORK not in found:
        found[HEADER_FORK] = fork_id
    return found


def record_fork_txn(conn: Connection, row: Mapping[str, Any]) -> tuple[int, str, int | None]:
    """Insert the fork row `row` (source run and key, from-step, overrides, effects, cohort) and give it its run's
    key, named after its id, in the caller's transaction; return (fork id, its run's key, its cohort id).

    A cohort's first fork (a cap, no cohort id yet) names the cohort. ConfigurationError if the key would be longer
    than a key may be: raised inside the caller's transaction, so the row is rolled back with it.
    """
    pending = {**row, "fork_key": f"pending:{uuid.uuid4().hex}"}  # unique until the row has its id
    fork_id = int(conn.execute(FORKS.insert().values(**pending).returning(FORKS.c.id)).scalar_one())
    new_key = fork_key(fork_id, row["source_key"])
    if len(new_key) > MAX_KEY_LENGTH:
        raise ConfigurationError(
            f"the fork's key {new_key[:40]}... is over {MAX_KEY_LENGTH} characters: fork a run with a shorter key"
        )
    cohort_id = row.get("cohort_id")
    if row.get("cohort_cap_micros") is not None and cohort_id is None:  # a cohort's first fork names the cohort
        cohort_id = fork_id
    conn.execute(update(FORKS).where(FORKS.c.id == fork_id).values(fork_key=new_key, cohort_id=cohort_id))
    return fork_id, new_key, cohort_id


def load_fork_txn(conn: Connection, fork_id: int) -> ForkSpec | None:
    """The fork row `fork_id`, in the caller's transaction (None: no such fork)."""
    row = conn.execute(select(FORKS).where(FORKS.c.id == fork_id)).mappings().first()
    if row is None:
        return None
    return ForkSpec(
        id=int(row["id"]),
        source_run_id=int(row["source_run_id"]),
        task_name=row["task_name"],
        tenant=row["tenant"],
        source_key=row["source_key"],
        from_step=row["from_step"],
        from_position=int(row["from_position"]),
        overrides=dict(row["overrides"] or {}),
        effects=getattr(row["effects"], "value", row["effects"]),
        shadow_url=row["shadow_url"],
        key=row["fork_key"],
        cohort_id=row["cohort_id"],
        cohort_cap_micros=row["cohort_cap_micros"],
    )


def load_fork(db: Database, fork_id: int) -> ForkSpec | None:
    """The fork row `fork_id` (None: no such fork), read on its own."""
    with db.read() as conn:
        return load_fork_txn(conn, fork_id)


def fork_mismatch(spec: ForkSpec | None, fork_id: int, task_name: str, tenant: str, key: str) -> str | None:
    """Why a delivery of (task, tenant, key) that says it is fork `fork_id` is not that fork, or None if it is."""
    if spec is None:
        return f"it names fork {fork_id}, which does not exist"
    if spec.tenant != tenant:
        return f"its tenant {tenant!r} is not the tenant of fork {fork_id}"
    if spec.task_name != task_name or spec.key != key:
        return f"fork {fork_id} is another run than this call's task and key"
    return None
