"""The LLM cost ledger: one `llm_calls` row per real model call, committed as soon as the call ends.

The row is written in its own transaction right after the call returns (or fails), before the step that
made it checkpoints: a call whose worker died before the checkpoint still has its row (spend is never hidden),
and a replayed step never calls the model, so it writes no row.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, cast

from sqlalchemy import Table, case, func, insert, select

from oncelery import ENV_DATABASE_URL, Database, current_step
from oncelery.models.jobs import LLMCall
from oncelery.tasks.llm.base import LLMClient, LLMResult

logger = logging.getLogger(__name__)

_CALLS = cast(Table, LLMCall.__table__)
_ERROR_LIMIT = 2000  # characters of an error message kept in the ledger


def call_llm(
    client: LLMClient,
    task: str,
    text: str,
    *,
    temperature: float = 0.0,
    seed: int | None = None,
    max_tokens: int = 256,
) -> LLMResult:
    """Make one model call and commit exactly one ledger row for it (ok or failed), then return or re-raise.

    Inside `self.step(...)` the row carries the step's task, key, name, run id and fencing token, the seed
    defaults to the step's deterministic seed, and it goes to the run's database. Outside a step it goes to
    ONCELERY_DATABASE_URL when that is set; with neither, the call is made and nothing is recorded (a call
    from a script or REPL never creates a database file as a side effect).
    """
    step = current_step()
    if seed is None and step is not None:
        seed = step.seed
    url = step.database_url if step is not None else os.environ.get(ENV_DATABASE_URL) or None
    prompt_hash = client.prompt_hash(task, text)  # raises UnsupportedTask before any call is made
    row: dict[str, Any] = {
        "task_name": step.task_name if step else None,
        "idempotency_key": step.key if step else None,
        "step": step.name if step else task,
        "run_id": step.run_id if step else None,
        "fencing_token": step.token if step else None,
        "model": client.model,
        "model_version": client.model_version,
        "seed": seed,
        "temperature": temperature,
        "prompt_hash": prompt_hash,
    }
    started = time.perf_counter()
    try:
        result = client.complete(task, text, temperature=temperature, seed=seed, max_tokens=max_tokens)
    except Exception as exc:
        failed = {
            **row,
            "input_tokens": 0,
            "output_tokens": 0,
            "latency_ms": (time.perf_counter() - started) * 1000.0,
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}"[:_ERROR_LIMIT],
        }
        try:
            _record(url, failed)
        except Exception:
            # The call's own error is what the caller must see; the ledger failure is logged, not swapped in.
            logger.exception("could not record failed LLM call (%s) in the ledger", task)
        raise
    _record(
        url,
        {
            **row,
            "model": result.model,
            "model_version": result.model_version,
            "input_tokens": result.input_tokens,
            "output_tokens": result.output_tokens,
            "latency_ms": result.latency_ms,
            "ok": True,
            "error": None,
        },
    )
    return result


def _record(url: str | None, row: dict[str, Any]) -> None:
    """Commit one ledger row in its own transaction (never the caller's: it must survive a rollback)."""
    if url is None:
        logger.debug("LLM call %s not recorded: no step and no %s", row["step"], ENV_DATABASE_URL)
        return
    with Database(url).begin() as conn:
        conn.execute(insert(_CALLS).values(**row))
    logger.debug(
        "ledger: %s %s[%s] step=%s ok=%s tokens=%d/%d",
        row["model"],
        row["task_name"],
        row["idempotency_key"],
        row["step"],
        row["ok"],
        row["input_tokens"],
        row["output_tokens"],
    )


def ledger_summary(database_url: str, task_name: str | None = None) -> dict[str, Any]:
    """Return totals over the ledger (optionally one task): calls, ok/failed calls, tokens in/out, latency ms."""
    c = _CALLS.c
    stmt = select(
        func.count(),
        func.coalesce(func.sum(case((c.ok.is_(True), 1), else_=0)), 0),
        func.coalesce(func.sum(c.input_tokens), 0),
        func.coalesce(func.sum(c.output_tokens), 0),
        func.coalesce(func.sum(c.latency_ms), 0.0),
    )
    if task_name is not None:
        stmt = stmt.where(c.task_name == task_name)
    with Database(database_url).read() as conn:
        calls, ok_calls, input_tokens, output_tokens, latency_ms = conn.execute(stmt).one()
    return {
        "calls": int(calls),
        "ok_calls": int(ok_calls),
        "failed_calls": int(calls) - int(ok_calls),
        "input_tokens": int(input_tokens),
        "output_tokens": int(output_tokens),
        "latency_ms": float(latency_ms),
    }
