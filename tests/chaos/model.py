"""The chaos job's model call, without the Celery app: its model, price, prompt, output limit and what it costs.

Imported by the job (tests/chaos/jobs.py), by the runner (the shared limit and the day budget it configures) and
by the checker (the answer a correct result holds), none of which may import the app before its environment is set.
"""

from __future__ import annotations

from decimal import Decimal

from oncelery.fake_provider import generate_text
from oncelery.llm.tokens import estimate_tokens

MODEL = "chaos-llm"
PROVIDER = "openai"  # OpenAIResponses' provider: the shared limit's scope is "openai:<model>"
PRICE = {"input": Decimal("2.00"), "output": Decimal("8.00")}  # USD per 1M tokens
MAX_OUTPUT_TOKENS = 64  # every answer of the fake for these prompts is shorter (12 to 43 words): never truncated
LARGEST_JOB = 10**6  # the estimates below are taken at this job number: at least any run's


def prompt_of(job: int) -> str:
    """The model call's input for `job`."""
    return f"summarize document {job}"


def admission_tokens(job: int = LARGEST_JOB) -> int:
    """What one call of `job` costs in a token limiter: its input's estimate plus its output limit."""
    return estimate_tokens(prompt_of(job)) + MAX_OUTPUT_TOKENS


def estimate_usd(job: int = LARGEST_JOB) -> Decimal:
    """The call's reservation in its budgets (input estimate + output limit at the price), before rounding up."""
    return (estimate_tokens(prompt_of(job)) * PRICE["input"] + MAX_OUTPUT_TOKENS * PRICE["output"]) / 1_000_000


def expected_draft(job: int) -> str:
    """The fake model's answer for `job` (what a correct stored result must hold)."""
    return generate_text(MODEL, prompt_of(job), MAX_OUTPUT_TOKENS)
