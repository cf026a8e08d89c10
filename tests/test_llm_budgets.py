"""Budgets that are never overspent (`max_cost_usd`, `oncelery_budgets`): a call reserves its estimate in the
intent's prepared transaction, its ledger row charges the actual cost, its end releases the reservation, and the
database's CHECK (`spent + reserved <= limit`) refuses any overspend. Real workers, both stores, the fake
provider (its creates per intent are the oracle), and SIGKILL between reservation and settlement."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from sqlalchemy import func, select, text, update
from sqlalchemy.exc import IntegrityError

from oncelery import BudgetExceeded, DeadLetters, IdempotentTask, output_text
from oncelery.basetask.startup import check_spending_settings
from oncelery.cli import oncelery as oncelery_cli
from oncelery.errors import ConfigurationError
from oncelery.fake_provider import FakeProvider, Knobs, count_tokens
from oncelery.llm.adapters.openai_responses import OpenAIResponses
from oncelery.llm.budgets import BudgetPlan, BudgetRule, parse_budgets, reserve_txn, window_of
from oncelery.llm.tokens import estimate_tokens
from oncelery.models import IntentState, RunStatus
from oncelery.relay.loop import Relay
from oncelery.runs.views import Runs
from oncelery.store.database import Database, get_engine
from oncelery.store.tables import BUDGETS, CALLS, INTENTS
from oncelery.testing import relay_running
from tests.conftest import ON_POSTGRESQL, ON_SQLITE
from tests.services import proc_state, wait_for
from tests.test_crash import JOB_TIMEOUT, cluster
from tests.test_metrics import scrape

TEXT = "The council approved the new library budget on Tuesday."
JOB = 60.0
PRICE = {"gpt-test": {"input": 1000, "output": 1000}}  # USD per 1M tokens: 1,000 micro-USD per token
OUT = 8  # every call's output limit: the fake's answers are longer, so each call produces exactly 8 tokens
ESTIMATE = (estimate_tokens(TEXT) + OUT) * 1000  # micro-USD reserved per call
ACTUAL = (count_tokens(TEXT) + OUT) * 1000  # micro-USD a call costs (the fake counts one token per word and mark)


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """A fake provider answering at once."""
    with FakeProvider(Knobs(poll_after_ms=5, generation_s=0.0)) as provider:
        yield provider


def budget_rows(db_url: str) -> dict[str, dict[str, Any]]:
    with get_engine(db_url).connect() as conn:
        return {r.name: dict(r._mapping) for r in conn.execute(select(BUDGETS))}


def ledger_micros(db_url: str, **where: Any) -> int:
    with get_engine(db_url).connect() as conn:
        stmt = select(func.coalesce(func.sum(CALLS.c.cost_micros), 0)).filter_by(**where)
        return int(conn.execute(stmt).scalar_one())


def cli(db_url: str, *args: str) -> Any:
    done = CliRunner().invoke(oncelery_cli, ["--database-url", db_url, *args])
    assert done.exit_code == 0, done.output
    return done.output


@ON_SQLITE
def test_budgets_are_validated_with_one_line_each(app: Celery) -> None:
    rules = parse_budgets(
        {"global": {"usd_per_month": 1000}, "tenant:*": {"usd_per_day": "2.50"}, "tenant:acme": {"day": 20}}
    )
    assert [(r.scope, r.period, r.limit_micros) for r in rules] == [
        ("global", "month", 1_000_000_000),
        ("tenant:*", "day", 2_500_000),
        ("tenant:acme", "day", 20_000_000),
    ]
    for bad, says in [
        ({"team:x": {"day": 1}}, "'global', 'tenant:\\*' or 'tenant:<id>'"),
        ({"global": {"week": 1}}, "unknown period 'week'"),
        ({"global": {"day": -1}}, "give an amount in USD > 0"),
        ({"global": {"day": True}}, "give an amount in USD > 0"),
        ({"global": 5}, "give {'usd_per_day': usd}"),
        ([1], "must be a dict"),
    ]:
        with pytest.raises(ConfigurationError, match=says):
            parse_budgets(bad)
    # Windows are UTC days and months; each ends where the next begins.
    assert window_of("day", 1_796_083_199.5) == ("2026-11-30", 1_796_083_200.0)  # 2026-12-01T00:00Z
    assert window_of("month", 1_796_083_200.0) == ("2026-12", 1_798_761_600.0)  # 2027-01-01T00:00Z
    # A task's cap and its policy are checked where the task is made.
    with pytest.raises(ConfigurationError, match="max_cost_usd = 'lots'"):

        @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_bad_cap", max_cost_usd="lots")
        def bad_cap(self: IdempotentTask) -> None: ...

        app.tasks["oncelery.t_bad_cap"]  # Celery makes the task when it is first used

    with pytest.raises(ConfigurationError, match="on_budget='later'"):

        @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_bad_policy", on_budget="later")
        def bad_policy(self: IdempotentTask) -> None: ...

        app.tasks["oncelery.t_bad_policy"]


@ON_SQLITE
def test_a_model_without_a_price_is_refused_at_worker_start(app: Celery) -> None:
    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_priced", llm_models=("gpt-new",))
    def priced(self: IdempotentTask) -> None: ...

    check_spending_settings(app, IdempotentTask)  # no budget: a price is not needed
    app.conf.oncelery_budgets = {"global": {"day": 10}}
    app.conf.oncelery_limits = {"openai:gpt-limited": {"rpm": 10}}
    app.conf.oncelery_prices = {"gpt-limited": {"input": 1, "output": 2}}
    with pytest.raises(ConfigurationError, match="no price in oncelery_prices: gpt-new"):
        check_spending_settings(app, IdempotentTask)
    app.conf.oncelery_prices = {**app.conf.oncelery_prices, "gpt-new": {"input": 1, "output": 1}}
    check_spending_settings(app, IdempotentTask)
    app.conf.oncelery_budgets = {"global": {"fortnight": 10}}
    with pytest.raises(ConfigurationError, match="unknown period 'fortnight'"):
        check_spending_settings(app, IdempotentTask)


# -- the invariant, from several processes ---------------------------------------------------------------------

RACER = r"""
import json, random, sys, uuid
from sqlalchemy import select
from oncelery.ledger.settle import Reservation, charge_txn, release_txn
from oncelery.llm.budgets import BudgetPlan, BudgetRule, reserve_txn
from oncelery.errors import OnceleryError
from oncelery.store.database import Database
from oncelery.store.tables import BUDGETS, INTENTS

url, seed, rounds, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
db = Database(url)
plan = BudgetPlan((BudgetRule("global", "day", limit),), None, (1, 1))
charged = refused = 0
violations = []
for n in range(rounds):
    estimate = rng.randint(1, limit // 4)
    public_id = uuid.uuid4().hex
    try:
        with db.begin() as conn:
            held = reserve_txn(conn, db.dialect, plan, "", 0, estimate)
            conn.execute(INTENTS.insert().values(
                public_id=public_id, run_id=seed, position=n, step_name="s", attempt=1, token=1, provider="p",
                endpoint="e", model="m", mode="sync", request_digest="d", state="prepared", reserved=held.as_json()))
            row = conn.execute(select(BUDGETS)).one()
            if row.spent_micros + row.reserved_micros > row.limit_micros:
                violations.append(dict(row._mapping))
    except OnceleryError:
        refused += 1
        continue
    cost = rng.randint(0, estimate) if rng.random() < 0.9 else 0  # some calls fail and cost nothing
    with db.begin() as conn:
        release_txn(conn, db.dialect, public_id, held)
        charge_txn(conn, held, cost)
        row = conn.execute(select(BUDGETS)).one()
        if row.spent_micros + row.reserved_micros > row.limit_micros:
            violations.append(dict(row._mapping))
    charged += cost
print(json.dumps({"charged": charged, "refused": refused, "violations": len(violations)}))
"""


def test_spent_plus_reserved_never_exceeds_the_limit_under_racing_processes(db_url: str) -> None:
    """Four processes, random reservations and settlements against one budget: at every commit (each checks
    its own view before committing) spent + reserved <= limit; at the end nothing is reserved and spent is the
    sum of what was charged. And the database itself refuses a write that would break it."""
    limit = 2_000
    plan = BudgetPlan((BudgetRule("global", "day", limit),), None, (Decimal(1), Decimal(1)))
    db = Database(db_url)
    with db.begin() as conn:  # the row, made by a first reservation of 0 cost's worth... of 1 micro
        reserve_txn(conn, db.dialect, plan, "", 0, 1)
        conn.execute(update(BUDGETS).values(reserved_micros=0))
    seeds = [random.randrange(10**6) for _ in range(4)]
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, db_url, str(seed), "60", str(limit)], stdout=subprocess.PIPE, text=True
        )
        for seed in seeds
    ]
    try:
        outs = [json.loads(p.communicate(timeout=JOB)[0]) for p in racers]
    finally:
        for p in racers:
            p.kill() if p.poll() is None else None
    assert all(p.returncode == 0 for p in racers), seeds
    assert sum(o["violations"] for o in outs) == 0, (outs, seeds)
    assert sum(o["refused"] for o in outs) > 0, "the budget was really contended"
    [row] = budget_rows(db_url).values()
    assert row["reserved_micros"] == 0 and row["overrun_micros"] == 0, row
    assert row["spent_micros"] == sum(o["charged"] for o in outs) <= limit, (row, outs)
    # The invariant is the database's: a direct write that breaks it is refused on both stores.
    with pytest.raises(IntegrityError, match=r"(?i)check"), db.begin() as conn:
        conn.execute(update(BUDGETS).values(spent_micros=BUDGETS.c.limit_micros + 1))
    with pytest.raises(IntegrityError, match=r"(?i)check"), db.begin() as conn:
        conn.execute(text("UPDATE llm_budgets SET reserved_micros = -1"))


# -- a job's cap -----------------------------------------------------------------------------------------------


def three_steps(app: Celery, adapter: Any, **options: Any) -> Any:
    calls: list[str] = []

    @app.task(
        shared=False, base=IdempotentTask, bind=True, name="oncelery.t_three_calls", idempotency_key="doc:{doc}",
        **options,
    )  # fmt: skip
    def pipeline(self: IdempotentTask, doc: str) -> list[str]:
        out = []
        for step in ("draft", "critique", "final"):
            calls.append(step)
            answer = self.llm(step, adapter=adapter, model="gpt-test", input=TEXT, max_output_tokens=OUT)
            out.append(output_text(answer))
        return out

    pipeline.calls = calls  # type: ignore[attr-defined]
    return pipeline


@ON_SQLITE
def test_a_job_cap_reached_after_step_two_dead_letters_the_run_and_step_three_is_never_called(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    app.conf.oncelery_prices = PRICE
    # Two calls fit (each reserves ESTIMATE, then costs ACTUAL); the third's estimate does not.
    cap = Decimal(2 * ACTUAL + ESTIMATE - 1) / 1_000_000
    job = three_steps(app, responses, max_cost_usd=cap)
    with worker_factory(app), pytest.raises(BudgetExceeded, match=r"budget run:\d+: this call's estimate"):
        job.delay("d1").get(timeout=JOB)
    assert job.calls == ["draft", "critique", "final"]
    stats = fake.stats()
    assert sum(stats["creates_by_intent"].values()) == 2, "step 3 was never sent"
    run = Runs(db_url).get("oncelery.t_three_calls", "doc:d1")
    assert run is not None and run.status is RunStatus.DEAD and run.retries == 0
    [letter] = DeadLetters(db_url).list(task_name="oncelery.t_three_calls")
    assert letter.reason == "budget_exceeded" and "max_cost_usd" in (letter.error or "")
    row = budget_rows(db_url)[f"run:{run.run_id}"]
    assert row["spent_micros"] == 2 * ACTUAL == ledger_micros(db_url, run_id=run.run_id)
    assert row["reserved_micros"] == 0 and row["refused"] == 1, row

    # Raise the cap, replay: steps 1 and 2 replay from their checkpoints, step 3 is the one new call.
    job.max_cost_usd = Decimal(3 * ESTIMATE) / 1_000_000
    with worker_factory(app), relay_running(app, db_url):
        report = DeadLetters(db_url).replay(app, [letter])
        assert len(report.replayed) == 1
        wait_for(lambda: Runs(db_url).get("oncelery.t_three_calls", "doc:d1").status is RunStatus.COMPLETED,
                 timeout=JOB, what="the replayed run to complete")  # fmt: skip
    assert sum(fake.stats()["creates_by_intent"].values()) == 3
    row = budget_rows(db_url)[f"run:{run.run_id}"]
    assert row["spent_micros"] == 3 * ACTUAL == ledger_micros(db_url, run_id=run.run_id)
    assert row["reserved_micros"] == 0


@ON_POSTGRESQL
def test_a_retry_first_checks_the_job_budget_covers_the_next_call(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    """A 500 on the create leaves the call's outcome unknown (it stays reserved, charged at its estimate by
    the next holder): with less than one more estimate left, the run is dead-lettered at once, not retried."""
    app.conf.oncelery_prices = PRICE
    fake.set_knobs(fail_next=1, fail_status=500)
    job = three_steps(
        app, responses, max_cost_usd=Decimal(ESTIMATE * 3 // 2) / 1_000_000,
        autoretry_for=(Exception,), max_retries=3, retry_kwargs={"countdown": 0.1},
    )  # fmt: skip
    with worker_factory(app), pytest.raises(BudgetExceeded, match="run:"):
        job.delay("d2").get(timeout=JOB)
    run = Runs(db_url).get("oncelery.t_three_calls", "doc:d2")
    assert run is not None and run.status is RunStatus.DEAD and run.retries == 0, run
    assert fake.stats()["creates_by_intent"] == {}, "the failed create made nothing, and no call followed"


# -- a tenant's day, deferred; an operator's cap --------------------------------------------------------------


@ON_POSTGRESQL
def test_a_tenant_day_cap_defers_and_an_operators_cap_wins_with_its_history(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    app.conf.oncelery_prices = PRICE
    app.conf.oncelery_budgets = {"tenant:*": {"day": Decimal(ESTIMATE + ACTUAL - 1) / 1_000_000}}

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_tenant_call",
              idempotency_key="doc:{doc}", on_budget="defer")  # fmt: skip
    def one_call(self: IdempotentTask, doc: str) -> str:
        return output_text(self.llm("s", adapter=responses, model="gpt-test", input=TEXT, max_output_tokens=OUT))

    with worker_factory(app):
        assert one_call.apply_async(("a",), tenant="acme").get(timeout=JOB)
        assert one_call.apply_async(("b",), tenant="globex").get(timeout=JOB)  # one budget per tenant
        one_call.apply_async(("c",), tenant="acme")  # acme's second call does not fit its day
        wait_for(lambda: one_call.outcome_counts().get("waiting", 0) == 1, timeout=JOB, what="c to be deferred")
    run = Runs(db_url).get("oncelery.t_tenant_call", "doc:c", "acme")
    assert run is not None and run.status is RunStatus.WAITING, run
    day, resets = window_of("day", run.updated_at.timestamp())
    assert run.not_before is not None and abs(run.not_before.timestamp() - resets) < 5, (run.not_before, resets)
    rows = budget_rows(db_url)
    acme = rows[f"tenant:acme/day/{day}"]
    assert (acme["spent_micros"], acme["reserved_micros"], acme["refused"]) == (ACTUAL, 0, 1), acme
    assert rows[f"tenant:globex/day/{day}"]["spent_micros"] == ACTUAL
    assert sum(fake.stats()["creates_by_intent"].values()) == 2

    # An operator raises acme's cap: it wins over the configuration at once, and the change is recorded.
    said = cli(db_url, "budgets", "set", "tenant:acme", "--day", "--usd", "1", "--by", "alice")
    assert "tenant:acme per day: cap (configuration) -> $1.000000" in said
    shown = json.loads(cli(db_url, "budgets", "--json"))
    listed = {b["budget"]: b for b in shown["budgets"]}
    assert Decimal(str(listed[f"tenant:acme/day/{day}"]["limit_usd"])) == Decimal(1)
    assert {k: Decimal(str(v)) for k, v in shown["caps"].items()} == {"budget:tenant:acme/day": Decimal(1)}
    with worker_factory(app):
        assert one_call.apply_async(("d",), tenant="acme").get(timeout=JOB)
    [change] = json.loads(cli(db_url, "budgets", "history", "--json"))["changes"]
    assert (change["cap"], change["from"], change["by"]) == ("budget:tenant:acme/day", None, "alice")
    assert Decimal(str(change["to"])) == Decimal(1)
    assert budget_rows(db_url)[f"tenant:acme/day/{day}"]["spent_micros"] == 2 * ACTUAL
    samples = scrape(db_url)  # the exporter: per scope, the current window
    acme_series = (("budget", "tenant:acme/day"),)
    assert samples[("oncelery_llm_budget_spent_usd", acme_series)] == pytest.approx(2 * ACTUAL / 1_000_000)
    assert samples[("oncelery_llm_budget_limit_usd", acme_series)] == 1.0
    assert samples[("oncelery_llm_budget_refused_calls", acme_series)] == 1
    assert samples[("oncelery_llm_budget_reserved_usd", acme_series)] == 0
    # Lowering it below what is held never breaks the CHECK: the window's limit stops at what it holds.
    cli(db_url, "budgets", "set", "tenant:acme", "--day", "--usd", "0.000001", "--by", "bob")
    assert budget_rows(db_url)[f"tenant:acme/day/{day}"]["limit_micros"] == 2 * ACTUAL


# -- SIGKILL between reservation and settlement -----------------------------------------------------------------


@pytest.mark.crash
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_sigkill_between_reservation_and_settlement_releases_after_one_relay_period(
    tmp_path: Path, db_url: str, redis_url: str
) -> None:
    """The whole worker is SIGKILLed after its call's reservation committed and before the create: the relay
    releases the reservation once the intent is stale with no live holder (the budget's view equals the
    ledger's: 0). The run, re-sent by the sweeper, records the unknown call at its estimate and makes the call:
    the budget's spent equals the ledger's sum again, with nothing reserved."""
    marks = tmp_path / "marks"
    marks.mkdir()
    with FakeProvider(Knobs(poll_after_ms=20)) as fake, cluster(tmp_path, db_url, redis_url, lease=2) as c:
        c.env.update(
            ONCELERY_FAKE_PROVIDER_URL=fake.url, ONCELERY_CRASH_MARKS=str(marks), ONCELERY_CRASH_BUDGET_USD="5"
        )
        first = c.start("first")
        c.wait_ready(first)
        key = f"budget-{uuid.uuid4().hex[:6]}"
        text_ = "Rain is expected over the coast on Friday, the weather service said."
        result = c.sender.send_task(
            "oncelery.crash_llm", args=[key, text_], kwargs={"at": "llm_create", "sig": "SIGSTOP"}
        )
        child = c.wait_executing(key)
        wait_for(lambda: proc_state(child) == "T", timeout=JOB_TIMEOUT, what="the holder to stop before its create")
        os.killpg(first.pid, signal.SIGKILL)  # host loss: parent and child, with the reservation committed
        first.proc.wait(timeout=30)
        [row] = budget_rows(db_url).values()
        assert row["reserved_micros"] > 0 and row["spent_micros"] == 0, row

        c.sender.conf.oncelery_budget_release_s = 1.0
        relay = Relay(c.sender, db_url, sweep_interval=None)
        wait_for(lambda: relay.run_once().released == 1, timeout=JOB_TIMEOUT, what="the relay to release it")
        [row] = budget_rows(db_url).values()
        assert row["reserved_micros"] == 0 and row["spent_micros"] == ledger_micros(db_url) == 0, row
        assert relay.run_once().released == 0, "released once"

        # The run comes back (its stored message re-sent by the sweeper) and ends once.
        c.wait_ready(c.start("second"))
        sweeper = Relay(c.sender, db_url, sweep_interval=1.0)
        wait_for(lambda: bool(sweeper.run_once().swept) or result.ready(), timeout=JOB_TIMEOUT, what="a re-send")
        assert result.get(timeout=JOB_TIMEOUT)["key"] == key
        [row] = budget_rows(db_url).values()
        with get_engine(db_url).connect() as conn:
            states = [r.state for r in conn.execute(select(INTENTS).order_by(INTENTS.c.attempt))]
        assert states == [IntentState.LOST, IntentState.DONE]
        ledger = ledger_micros(db_url)
        assert row["reserved_micros"] == 0 and row["spent_micros"] == ledger > 0, (row, ledger)
        assert sum(fake.stats()["creates_by_intent"].values()) == 1, "never sent before the kill"
