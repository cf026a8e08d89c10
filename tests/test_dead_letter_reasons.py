"""Every reason a dead letter is written with is one `oncelery dlq list/replay --reason` accepts: the CLI's choices
are the one tuple of stored reasons. Letters of reason `budget_exceeded` (a real budget refusal in a worker) and
`revoked` (a parked run cancelled by the function a worker calls when Celery's revoke reaches it) are listed and
replayed by reason through the CLI, on both stores; the replayed runs then complete."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import click
import pytest
from celery import Celery
from click.testing import CliRunner

from oncelery import BudgetExceeded, IdempotentTask, Runs, RunStatus, output_text
from oncelery.basetask.revoke import cancel_on_revoke
from oncelery.cli import oncelery as oncelery_cli
from oncelery.cli.dlq import dlq
from oncelery.errors import StoreUnavailable
from oncelery.fake_provider import FakeProvider, Knobs
from oncelery.llm.adapters.openai_responses import OpenAIResponses
from oncelery.runs import decisions
from oncelery.runs.decisions import LETTER_REASONS
from oncelery.runs.faults import fault_injected
from oncelery.testing import wait_until

TEXT = "The council approved the new library budget on Tuesday."
JOB = 60.0
OUT = 8
PRICE = {"gpt-test": {"input": 1000, "output": 1000}}  # 1,000 micro-USD per token: over the day's budget below
REFUSED, DEFERRED = "oncelery.t_reason_refused", "oncelery.t_reason_deferred"


@pytest.fixture
def responses() -> Iterator[OpenAIResponses]:
    """An OpenAI Responses adapter on a fake provider answering at once."""
    with (
        FakeProvider(Knobs(poll_after_ms=5, generation_s=0.0)) as fake,
        OpenAIResponses(fake.openai_base_url, "sk") as adapter,
    ):
        yield adapter


def letters(invoke: Any, reason: str) -> list[tuple[str, str]]:
    """`oncelery dlq list --json --reason REASON`: its letters' (task, key)."""
    done = invoke("list", "--json", "--reason", reason)
    assert done.exit_code == 0, done.output
    return sorted((x["task"], x["key"]) for x in json.loads(done.output)["letters"])


def test_letters_of_budget_exceeded_and_revoked_are_listed_and_replayed_by_reason(
    app: Celery, worker_factory: Any, db_url: str, responses: OpenAIResponses
) -> None:
    app.conf.oncelery_prices = PRICE
    app.conf.oncelery_budgets = {"global": {"day": "0.000001"}}  # no call fits

    def one_call(self: IdempotentTask, doc: str) -> str:
        return output_text(self.llm("s", adapter=responses, model="gpt-test", input=TEXT, max_output_tokens=OUT))

    options = {"shared": False, "base": IdempotentTask, "bind": True, "idempotency_key": "doc:{doc}"}
    refused = app.task(name=REFUSED, **options)(one_call)  # over budget: dead-lettered (on_budget="dead_letter")
    deferred = app.task(name=DEFERRED, on_budget="defer", **options)(one_call)  # over budget: parked WAITING
    runs = Runs(db_url)

    def invoke(*args: str) -> Any:
        return CliRunner().invoke(oncelery_cli, ["--database-url", db_url, "dlq", *args], obj=SimpleNamespace(app=app))

    with worker_factory(app):
        with pytest.raises(BudgetExceeded):
            refused.delay("a").get(timeout=JOB)
        parked = deferred.delay("b")
        wait_until(lambda: getattr(runs.get(DEFERRED, "doc:b"), "status", None) is RunStatus.WAITING, JOB)
        assert cancel_on_revoke(deferred, parked.id)  # what the worker does when the revoke of its message arrives

        assert letters(invoke, "budget_exceeded") == [(REFUSED, "doc:a")]
        assert letters(invoke, "revoked") == [(DEFERRED, "doc:b")]
        app.conf.oncelery_budgets = None  # the fix each letter waits for: the budget is raised
        for reason in ("budget_exceeded", "revoked"):
            done = invoke("replay", "--reason", reason)
            assert done.exit_code == 0 and "1 replayed, 0 skipped" in done.output, done.output
        for name, key in ((REFUSED, "doc:a"), (DEFERRED, "doc:b")):
            wait_until(lambda n=name, k=key: runs.get(n, k).status is RunStatus.COMPLETED, JOB, what=f"{name} replayed")
    assert letters(invoke, "budget_exceeded") == letters(invoke, "revoked") == []  # replayed: listed with --all


def test_a_revoke_that_meets_a_store_fault_tries_again_and_cancels_the_parked_run(
    app: Celery, worker_factory: Any, db_url: str, responses: OpenAIResponses
) -> None:
    """A revoke is heard once, in the memory of the workers up at that moment: a cancel given up on a store fault
    (a pooled connection a database restart closed) would be lost if the worker restarted before the run's next
    wake. It is tried again, and the parked run is cancelled now."""
    app.conf.oncelery_prices = PRICE
    app.conf.oncelery_budgets = {"global": {"day": "0.000001"}}  # no call fits: the run parks WAITING

    @app.task(shared=False, base=IdempotentTask, bind=True, name=DEFERRED, idempotency_key="doc:{doc}",
              on_budget="defer")  # fmt: skip
    def deferred(self: IdempotentTask, doc: str) -> str:
        return output_text(self.llm("s", adapter=responses, model="gpt-test", input=TEXT, max_output_tokens=OUT))

    def connection_closed(_point: str, _context: dict[str, Any]) -> None:
        if not failed:
            failed.append(True)
            raise StoreUnavailable("the pooled connection was closed by a database restart")

    failed: list[bool] = []
    runs = Runs(db_url)
    with worker_factory(app):
        parked = deferred.delay("c")
        wait_until(lambda: getattr(runs.get(DEFERRED, "doc:c"), "status", None) is RunStatus.WAITING, JOB)
        with fault_injected("dead_letter", connection_closed):
            assert cancel_on_revoke(deferred, parked.id), "the cancel was given up after one store fault"
    assert failed == [True], "the fault was met"
    run = runs.get(DEFERRED, "doc:c")
    assert run is not None and run.status is RunStatus.DEAD


def test_the_cli_accepts_every_reason_a_letter_is_written_with() -> None:
    # Every REASON_* value is a stored reason, in the one tuple; the CLI's --reason choices are that tuple.
    constants = {value for name, value in vars(decisions).items() if name.startswith("REASON_")}
    assert constants == set(LETTER_REASONS) and len(LETTER_REASONS) == len(constants)
    assert {"budget_exceeded", "revoked", "republish_cap"} <= set(LETTER_REASONS)
    for command in ("list", "replay", "purge"):
        [option] = [p for p in dlq.commands[command].params if p.name == "reason"]
        assert isinstance(option.type, click.Choice) and tuple(option.type.choices) == LETTER_REASONS
