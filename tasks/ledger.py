"""The article pipeline's model calls, each recorded in the framework's cost ledger (`oncelery.model_call`).

One `model_calls` row per real call, committed as soon as the call ends, before the step that made it
checkpoints: a call whose worker died before the checkpoint still has its row (spend is never hidden), and a
replayed step never calls the model, so it writes no row.
"""

from __future__ import annotations

from oncelery import current_step, model_call
from oncelery.tasks.llm.base import LLMClient, LLMResult


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

    The row is named after the prompt (`task`: summarize, keywords, quality) and keeps what fixes the answer
    (model version, seed, temperature, prompt hash) in its meta. Inside `self.step(...)` the seed defaults to
    the step's deterministic seed and the row carries the run; outside any task it goes to
    ONCELERY_DATABASE_URL when that is set, else nowhere (a script never creates a database file).
    """
    step = current_step()
    if seed is None and step is not None:
        seed = step.seed
    meta = {
        "model_version": client.model_version,
        "seed": seed,
        "temperature": temperature,
        "prompt_hash": client.prompt_hash(task, text),  # raises UnsupportedTask before any call is made
    }
    with model_call(client.model, prompt=task, meta=meta) as call:
        result = client.complete(task, text, temperature=temperature, seed=seed, max_tokens=max_tokens)
        call.tokens(result.input_tokens, result.output_tokens)
        call.meta["model_version"] = result.model_version
    return result
