"""Per-step checkpoints (G4): a step's JSON result is stored once, fenced by the token, and replayed after.

A run's steps are identified by position *and* name: replaying changed pipeline code (a different name
at a position) raises StepMismatch instead of returning another step's cached result.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, delete, select

from oncelery.errors import ConfigurationError, StepMismatch
from oncelery.runs.claims import RunStore
from oncelery.runs.decisions import Claim, encode_result, lease_lost
from oncelery.runs.faults import fault_point
from oncelery.store.tables import STEPS

__all__ = [
    "MAX_STEP_NAME",
    "SEED_BITS",
    "Checkpoint",
    "StepInfo",
    "StepRunner",
    "WithWrites",
    "args_digest",
    "current_step",
    "load_checkpoints",
    "save_checkpoint_txn",
    "step_seed",
    "validate_step_name",
]

MAX_STEP_NAME = 255  # the width of step_results.step_name
SEED_BITS = 31  # fits every LLM API's seed parameter (OpenAI, vLLM, Ollama take int32 or wider)


def step_seed(task_name: str, key: str, step: str) -> int:
    """Return the step's deterministic seed: sha256(task, key, step) — equal in every process and retry."""
    digest = hashlib.sha256(f"{task_name}\x00{key}\x00{step}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % (1 << SEED_BITS)


@dataclass(frozen=True)
class Checkpoint:
    """A stored step: its position, name, JSON result and what produced it (meta)."""

    position: int
    name: str
    result: Any
    meta: Any = None
    args_digest: str | None = None


@dataclass(frozen=True)
class StepInfo:
    """The step executing on this thread: what an LLM client needs to write its cost ledger."""

    task_name: str
    key: str
    run_id: int
    token: int
    name: str
    position: int
    seed: int
    database_url: str


_current: ContextVar[StepInfo | None] = ContextVar("oncelery_current_step", default=None)


def current_step() -> StepInfo | None:
    """Return the step executing in this context (None outside a step)."""
    return _current.get()


@contextmanager
def _in_step(info: StepInfo) -> Iterator[None]:
    token = _current.set(info)
    try:
        yield
    finally:
        _current.reset(token)


def load_checkpoints(store: RunStore, run_id: int) -> list[Checkpoint]:
    """Return the run's stored steps in position order (a step that raised leaves its position empty)."""
    c = STEPS.c
    stmt = (
        select(c.position, c.step_name, c.result, c.meta, c.args_digest).where(c.run_id == run_id).order_by(c.position)
    )
    with store.db.read() as conn:
        return [Checkpoint(int(p), n, r, m, d) for p, n, r, m, d in conn.execute(stmt)]


def args_digest(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """Return a stable digest of a step's arguments; a value that is not JSON counts by its type only."""
    encoded = json.dumps(
        [list(args), kwargs],
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        default=lambda value: f"<{type(value).__module__}.{type(value).__qualname__}>",
    )
    return hashlib.sha256(encoded.encode("utf-8")).hexdigest()


def validate_step_name(name: Any) -> str:
    """Return `name` if it can be stored (a non-empty str within the column), else raise before any call."""
    if not isinstance(name, str) or not name or len(name) > MAX_STEP_NAME:
        raise ConfigurationError(
            f"Step name {name!r} must be a non-empty string of at most {MAX_STEP_NAME} characters "
            f"(it is checked before the step runs, so a paid call is never made for a step that cannot be saved)"
        )
    return name


def save_checkpoint_txn(
    conn: Connection,
    store: RunStore,
    claim: Claim,
    position: int,
    name: str,
    result: Any,
    meta: Any = None,
    supersede: bool = False,
    digest: str | None = None,
    seconds: float | None = None,
) -> None:
    """Store a step in the caller's transaction iff `claim` still holds the run, renewing its lease.

    `seconds`: what the step's function took; a trigger adds it to the step_duration histogram in this
    transaction (models/totals.py), so the histogram counts exactly the checkpoints written.

    The fenced UPDATE both proves the claim and row-locks the run (PostgreSQL; SQLite's writer lock
    serialises it), so a takeover waits for this checkpoint to commit instead of racing it.
    """
    if not store.heartbeat_txn(conn, claim):
        raise lease_lost(claim, f"step {name!r} was not saved")
    if supersede:
        # A re-run step (its inputs changed) supersedes its checkpoint and every later one, which used it.
        conn.execute(delete(STEPS).where(STEPS.c.run_id == claim.run_id, STEPS.c.position >= position))
    # The fence above proved this holder live, so a row already at this position is an earlier holder's
    # (never a concurrent one: the fenced UPDATE serialises holders): the live holder's result replaces it.
    values = {
        "step_name": name,
        "result": result,
        "meta": meta,
        "args_digest": digest,
        "token": claim.token,
        "seconds": seconds,
        # The database clock, to the run's own precision (SQLite's column default has whole seconds only).
        "created_at": store.db.dialect.now(),
    }
    stmt = store.db.dialect.insert(STEPS).values(run_id=claim.run_id, position=position, **values)
    conn.execute(stmt.on_conflict_do_update(index_elements=["run_id", "position"], set_=values))


@dataclass(frozen=True)
class WithWrites:
    """A step's value with writes that must commit in its checkpoint's transaction (a model call's intent and
    ledger row: the answer, its bill and its end are recorded together or not at all)."""

    value: Any
    writes: Callable[[Connection], None]


class StepRunner:
    """Executes or replays the named steps of one run, in order."""

    def __init__(self, store: RunStore, claim: Claim, checkpoints: list[Checkpoint]) -> None:
        self.store = store
        self.claim = claim
        # By their STORED position, never their index: a step that raised leaves a gap that must stay one.
        self.checkpoints = {c.position: c for c in checkpoints}
        self.loaded = len(checkpoints)  # steps executed (and checkpointed) by earlier holders of the run
        self.position = 0
        self.occurrences: dict[str, int] = {}
        self.replayed: list[str] = []
        self.executed: list[str] = []
        self.superseded = False

    def counts(self) -> tuple[int, int]:
        """(checkpointed steps of the run: earlier holders' and this one's, replayed steps of this delivery)."""
        return self.loaded + len(self.executed), len(self.replayed)

    def seed(self, name: str, occurrence: int = 0) -> int:
        """The deterministic seed of the `occurrence`-th step called `name` in this run (0: the first)."""
        return step_seed(self.claim.task_name, self.claim.key, name if occurrence == 0 else f"{name}#{occurrence}")

    def run(
        self,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        meta: Any = None,
        rerun_on_change: bool = False,
        digest: str | None = None,
    ) -> Any:
        """Return the step's stored result if checkpointed, else execute `fn` and checkpoint its result.

        `meta` (JSON) describes what produces the result (model, prompt hash...): a checkpoint whose meta
        differs raises StepMismatch, or is re-executed (with later steps) when `rerun_on_change`. `digest`
        replaces the arguments' digest (a model call's is its request's, `oncelery.llm.request`). `fn` may
        return `WithWrites`: its value is the result, and its writes commit with the checkpoint.
        """
        validate_step_name(name)
        if meta is not None and not isinstance(meta, dict):
            raise ConfigurationError(f"step_meta of step {name!r} must be a dict, got {type(meta).__name__}")
        meta = encode_result(meta, f"The meta of step {name!r}") if meta is not None else None
        # The arguments are part of what produced a result: a replay with other arguments at this position
        # (a loop over items in another order) must never return another item's checkpoint.
        digest = digest or args_digest(args, kwargs)
        # The position is taken before the step runs: a step that raises (and is caught by the body) keeps
        # its slot, so the positions of later steps are the same on every attempt.
        position = self.position
        self.position += 1
        occurrence = self.occurrences.get(name, 0)
        self.occurrences[name] = occurrence + 1
        stored = self.checkpoints.get(position)
        if stored is not None:
            if self._replayable(stored, position, name, meta, digest, rerun_on_change):
                self.replayed.append(name)
                return stored.result
            # Everything from here on was computed from the stale result: forget it.
            for later in [p for p in self.checkpoints if p >= position]:
                del self.checkpoints[later]
            self.superseded = True
        return self._execute(position, name, occurrence, fn, args, kwargs, meta, digest)

    def _replayable(
        self, stored: Checkpoint, position: int, name: str, meta: Any, digest: str, rerun_on_change: bool
    ) -> bool:
        """Whether the checkpoint answers this step; False means re-run it; raise if it may not be used."""
        if stored.name != name:
            raise StepMismatch(
                f"{self.claim.task_name}[{self.claim.key}]: step {position} is {name!r} in this code but "
                f"{stored.name!r} in the checkpoint — the pipeline changed between attempts; use a new "
                f"key (bump the version) to run the new code",
                position=position,
                expected=stored.name,
                found=name,
            )
        old, new = stored.meta or {}, meta or {}
        changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        if stored.args_digest is not None and stored.args_digest != digest:
            changed.append("arguments")
        if not changed:
            return True
        if rerun_on_change:
            return False
        raise StepMismatch(
            f"{self.claim.task_name}[{self.claim.key}]: step {name!r} was checkpointed with different "
            f"inputs ({', '.join(changed)} changed); refusing to replay another model's or prompt's "
            f"answer — use a new key, or declare the step rerun_on_change=True",
            position=position,
            expected=name,
            found=name,
            changed=changed,
        )

    def _execute(
        self,
        position: int,
        name: str,
        occurrence: int,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        meta: Any,
        digest: str,
    ) -> Any:
        """Call the step's function in its context and checkpoint the result, fenced by the claim."""
        seed = self.seed(name, occurrence)
        if _accepts_seed(fn) and "seed" not in kwargs:
            kwargs = {**kwargs, "seed": seed}
        info = StepInfo(
            self.claim.task_name,
            self.claim.key,
            self.claim.run_id,
            self.claim.token,
            name,
            position,
            seed,
            self.store.url,
        )
        with _in_step(info):
            fault_point("step_call", task=self.claim.task_name, key=self.claim.key, step=name)
            started = time.perf_counter()
            value = fn(*args, **kwargs)
            seconds = time.perf_counter() - started
        writes = None
        if isinstance(value, WithWrites):
            value, writes = value.value, value.writes
        result = encode_result(value, f"Step {name!r} of {self.claim.task_name}[{self.claim.key}]")
        fault_point("step_save", task=self.claim.task_name, key=self.claim.key, step=name)
        with self.store.transaction() as conn:
            save_checkpoint_txn(
                conn, self.store, self.claim, position, name, result, meta, self.superseded, digest, seconds
            )
            if writes is not None:
                writes(conn)  # after the fence: a holder that lost the run writes none of them
        self.superseded = False
        self.executed.append(name)
        return result


def _accepts_seed(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "seed" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
