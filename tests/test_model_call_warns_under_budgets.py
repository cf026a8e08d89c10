"""`model_call` is record-only: budgets and shared limits admit and reserve `self.llm()` calls, never the calls it
records. Where one applies to a task, the task's first recorded call in a process warns `ModelCallNotBudgeted` (and
logs it on `oncelery.ledger`), once however many jobs follow; without any, nothing warns. Real workers, both stores,
a real SDK call (the OpenAI client) to the fake provider served over HTTP."""

from __future__ import annotations

import logging
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from celery import Celery

from oncelery import IdempotentTask, ModelCallNotBudgeted, model_call
from oncelery.basetask.unbudgeted import governing
from oncelery.fake_provider import FakeProvider, Knobs
from oncelery.store.database import get_engine
from oncelery.store.tables import BUDGETS, CALLS
from tests.services import count_rows

MODEL = "gpt-test"
OUT = 8
JOB = 60.0
PRICES = {MODEL: {"input": 1000, "output": 1000}}  # 1,000 micro-USD per token: any call is over a tiny budget
TEXTS = ["The council approved the new library budget.", "The harbour reopened on Tuesday after repairs."]


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """A fake provider answering at once."""
    with FakeProvider(Knobs(generation_s=0.0)) as provider:
        yield provider


def summarize(base_url: str, text: str) -> str:
    """A task's own SDK call, recorded in the ledger by `model_call` (what issue 36 found paying past a budget)."""
    with openai.OpenAI(base_url=base_url, api_key="sk", max_retries=0) as client, model_call(MODEL) as call:
        resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=OUT)
        call.usage(resp.usage)
    return str(resp.choices[0].message.content)


def metered(app: Celery, fake: FakeProvider) -> Any:
    """A task that makes its model call with its own SDK in a step; a new name per test (warned once per name)."""

    @app.task(shared=False, base=IdempotentTask, bind=True, name=f"oncelery.t_metered_{uuid.uuid4().hex[:8]}",
              idempotency_key="doc:{doc}")  # fmt: skip
    def job(self: IdempotentTask, doc: str, text: str) -> str:
        return self.step("summarize", summarize, fake.openai_base_url, text)

    return job


def ours(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, ModelCallNotBudgeted)]


def test_a_recorded_call_under_a_budget_warns_once_across_jobs(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, caplog: pytest.LogCaptureFixture
) -> None:
    app.conf.oncelery_prices = PRICES
    app.conf.oncelery_budgets = {"global": {"usd_per_day": "0.000001"}}
    task = metered(app, fake)
    with (
        worker_factory(app, concurrency=2),
        caplog.at_level(logging.WARNING, logger="oncelery.ledger"),
        pytest.warns(ModelCallNotBudgeted, match=r"self\.llm\(\)") as caught,
    ):
        pending = [task.delay(f"d{n}", text) for n, text in enumerate(TEXTS)]
        assert all(p.get(timeout=JOB) for p in pending)
        assert task.delay("d2", TEXTS[0] + " Again.").get(timeout=JOB)
    [said] = ours(caught.list)
    assert f"{task.name}: model_call('{MODEL}')" in said and "oncelery_budgets" in said, said
    assert "neither admitted by a shared limit nor reserved in a budget" in said, said
    logged = [r.getMessage() for r in caplog.records if r.name == "oncelery.ledger" and "self.llm()" in r.getMessage()]
    assert logged == [said]
    # What the warning says, as it stands: the ledger has every call; the budget saw none of them.
    assert fake.stats()["creates"] == {"chat": 3}
    assert count_rows(get_engine(db_url), CALLS) == 3 and count_rows(get_engine(db_url), BUDGETS) == 0


def test_a_recorded_call_without_budgets_or_limits_does_not_warn(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider
) -> None:
    app.conf.oncelery_prices = PRICES
    task = metered(app, fake)
    with worker_factory(app, concurrency=2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pending = [task.delay(f"d{n}", text) for n, text in enumerate(TEXTS)]
        assert all(p.get(timeout=JOB) for p in pending)
    assert ours(caught) == []
    assert count_rows(get_engine(db_url), CALLS) == 2


@pytest.mark.parametrize(
    ("setting", "value", "tenant", "found"),
    [
        ("oncelery_budgets", {"global": {"day": 1}}, "", ["oncelery_budgets"]),
        ("oncelery_budgets", {"tenant:*": {"day": 1}}, "acme", ["oncelery_budgets"]),
        ("oncelery_budgets", {"tenant:*": {"day": 1}}, "", []),  # a call without a tenant skips tenant budgets
        ("oncelery_budgets", {"tenant:globex": {"day": 1}}, "acme", []),
        ("oncelery_limits", {f"openai:{MODEL}": {"rpm": 5}}, "", ["oncelery_limits"]),
        ("oncelery_limits", {"anthropic:*": {"rpm": 5}}, "", ["oncelery_limits"]),  # the call names no provider
        ("oncelery_limits", {"openai:other-model": {"rpm": 5}}, "", []),
        ("oncelery_limits", {"task:oncelery.t_scoped": {"rpm": 5}}, "", ["oncelery_limits"]),
        ("oncelery_limits", {"task:oncelery.t_other": {"rpm": 5}}, "", []),
        ("oncelery_limits", {"tenant:acme": {"rpm": 5}}, "acme", ["oncelery_limits"]),
    ],
)
def test_the_budgets_and_limits_a_recorded_call_is_warned_about_are_those_self_llm_would_apply(
    setting: str, value: Any, tenant: str, found: list[str]
) -> None:
    app = Celery("scopes", set_as_current=False)
    app.conf[setting] = value
    assert governing(app.conf, None, "oncelery.t_scoped", tenant, MODEL) == found

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_capped", max_cost_usd=1)
    def capped(self: IdempotentTask) -> None: ...

    assert "oncelery.t_capped's max_cost_usd" in governing(app.conf, capped, "oncelery.t_capped", tenant, MODEL)
