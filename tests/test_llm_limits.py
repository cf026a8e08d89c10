"""Shared limits (`oncelery_limits`): one GCRA row per limiter on the database clock, admitted in the intent's
prepared transaction, shared by every worker; real workers and the fake provider, whose 429 counters are the
oracle. Time is compressed (`window_s`) on both sides: the fake's fixed window and the limiter's."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from sqlalchemy import select

from oncelery import IdempotentTask, output_text
from oncelery.cli import oncelery as oncelery_cli
from oncelery.errors import ConfigurationError
from oncelery.llm.adapters.openai_responses import OpenAIResponses
from oncelery.llm.fake import FakeProvider, Knobs, generate_text
from oncelery.llm.limits import LimitRule, Throttled, admit_txn, limiters_for, parse_limits
from oncelery.models import IntentState, RunStatus
from oncelery.store.database import Database, get_engine
from oncelery.store.tables import INTENTS, LIMITERS, RUNS
from oncelery.testing import relay_running
from tests.conftest import ON_POSTGRESQL, ON_SQLITE
from tests.test_metrics import scrape

TEXT = "The council approved the new library budget on Tuesday."
JOB = 60.0


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """A fake provider answering at once."""
    with FakeProvider(Knobs(poll_after_ms=5, generation_s=0.0)) as provider:
        yield provider


@pytest.fixture
def responses(fake: FakeProvider) -> Iterator[OpenAIResponses]:
    """An OpenAI Responses adapter on the fake."""
    with OpenAIResponses(fake.openai_base_url, "sk") as adapter:
        yield adapter


def summarizer(app: Celery, adapter: Any, **options: Any) -> Any:
    """A one-call task with an output limit (token limits need one)."""

    @app.task(
        shared=False, base=IdempotentTask, bind=True, name="oncelery.t_limited", idempotency_key="doc:{doc}",
        **options,
    )  # fmt: skip
    def summarize(self: IdempotentTask, doc: str, text: str) -> str:
        return output_text(self.llm("summary", adapter=adapter, model="gpt-test", input=text, max_output_tokens=400))

    return summarize


def limiter(db_url: str, name: str) -> dict[str, Any]:
    with get_engine(db_url).connect() as conn:
        return dict(conn.execute(select(LIMITERS).where(LIMITERS.c.name == name)).one()._mapping)


def test_limits_are_validated_with_one_line_each() -> None:
    assert parse_limits(None) == ()
    rules = parse_limits({"openai:gpt-test": {"rpm": 500, "tpm": 200_000, "burst": 5}, "tenant:*": {"tpm": 50}})
    assert [(r.scope, r.kind, r.per_minute, r.burst) for r in rules] == [
        ("openai:gpt-test", "rpm", 500, 5),
        ("openai:gpt-test", "tpm", 200_000, 5),
        ("tenant:*", "tpm", 50, 0),
    ]
    for bad, says in [
        ({"gpt-test": {"rpm": 5}}, "name a scope"),
        ({"openai:m": {"rpm": 0}}, "> 0"),
        ({"openai:m": {"rps": 5}}, "unknown limit 'rps'"),
        ({"openai:m": {"rpm": 5, "burst": -1}}, "'burst'"),
        ({"openai:m": {"rpm": 5, "window_s": 0}}, "'window_s'"),
        ([1], "must be a dict"),
    ]:
        with pytest.raises(ConfigurationError, match=says):
            parse_limits(bad)
    # "tenant:*" is one limiter per tenant; a call without a tenant passes no tenant limiter.
    chosen = limiters_for(rules, "openai", "gpt-test", "acme", "t", (30, 20))
    assert [(a.name, a.cost) for a in chosen] == [
        ("openai:gpt-test/rpm", 1),
        ("openai:gpt-test/tpm", 50),
        ("tenant:acme/tpm", 50),
    ]
    assert [a.name for a in limiters_for(rules, "openai", "other", "", "t", (1, 1))] == []


@ON_SQLITE
def test_an_operators_cap_wins_over_the_configuration_and_is_recorded(db_url: str) -> None:
    """`oncelery limits set` stores a cap in the database: every admission paces by it, whatever the
    configuration says, until it is unset; each change is in the history."""
    [fast] = limiters_for((LimitRule("openai:m", "rpm", 6000),), "openai", "m", "", "t", (1, 1))  # 0.01 s apart
    db = Database(db_url)

    def wait_after_two() -> float:
        try:
            with db.begin() as conn:
                admit_txn(conn, db.dialect, [fast])
                admit_txn(conn, db.dialect, [fast])
        except Throttled as refused:
            return refused.wait_s
        return 0.0

    runner = CliRunner()
    said = runner.invoke(oncelery_cli, ["--database-url", db_url, "limits", "set", "openai:m/rpm", "--per-minute", "6",
                                        "--by", "carol"])  # fmt: skip
    assert said.exit_code == 0 and "openai:m/rpm: cap (configuration) -> 6" in said.output, said.output
    assert 9.0 < wait_after_two() <= 10.0  # paced 10 s apart by the cap, not 0.01 s by the configuration
    [listed] = json.loads(runner.invoke(oncelery_cli, ["--database-url", db_url, "limits", "--json"]).output)[
        "limiters"
    ]
    assert (listed["per_minute"], listed["cap"]) == (6.0, 6.0)
    unset = runner.invoke(oncelery_cli, ["--database-url", db_url, "limits", "set", "openai:m/rpm", "--unset"])
    assert unset.exit_code == 0, unset.output
    with db.begin() as conn:  # the backlog the cap left is the configuration's to pay off from here
        conn.execute(LIMITERS.update().values(tat=0.0))
    assert wait_after_two() < 0.02  # the configuration's pace again: 0.01 s apart
    history = json.loads(runner.invoke(oncelery_cli, ["--database-url", db_url, "budgets", "history", "--json"]).output)
    assert [(c["cap"], c["from"], c["to"]) for c in history["changes"]] == [
        ("limit:openai:m/rpm", None, 6),
        ("limit:openai:m/rpm", 6, None),
    ]
    assert history["changes"][0]["by"] == "carol"
    bad = runner.invoke(oncelery_cli, ["--database-url", db_url, "limits", "set", "openai:m/rph", "--per-minute", "6"])
    assert bad.exit_code == 2 and "<scope>/<rpm|tpm|itpm|otpm>" in bad.output


def test_racing_admissions_never_share_a_slot_of_the_limiter(db_url: str) -> None:
    """8 threads, each with its own connections, race one limiter of 600 a minute (one every 0.1 s): every
    admission moves the theoretical arrival time by exactly its cost, so no two ever took the same slot."""
    rule = LimitRule("openai:m", "rpm", 600)
    [admission] = limiters_for((rule,), "openai", "m", "", "t", (1, 1))
    db = Database(db_url)
    tats: list[float] = []
    refused = [0]
    lock = threading.Lock()

    def racer() -> None:
        for _ in range(25):
            try:
                with db.begin() as conn:
                    admit_txn(conn, db.dialect, [admission])
                    tat = conn.execute(select(LIMITERS.c.tat).where(LIMITERS.c.name == admission.name)).scalar_one()
                with lock:
                    tats.append(float(tat))
            except Throttled:
                with lock:
                    refused[0] += 1

    threads = [threading.Thread(target=racer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=JOB)
    assert tats and refused[0] > 0, (len(tats), refused)  # the race was real: most were refused
    tats.sort()
    gaps = [b - a for a, b in itertools.pairwise(tats)]
    assert min(gaps) >= 0.1 * (1 - 1e-6), gaps  # each admission its own 0.1 s slot: none admitted twice
    row = limiter(db_url, admission.name)
    assert row["admitted"] == len(tats)


@ON_POSTGRESQL
def test_a_fleet_behind_one_limit_gets_no_429_from_a_provider_with_that_limit(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    # The provider takes 10 requests per 2 s window (fixed); the fleet's limit is 9 per 2 s, paced.
    fake.set_knobs(rpm_limit=10, rate_window_s=2.0)
    app.conf.oncelery_limits = {"openai:gpt-test": {"rpm": 9, "window_s": 2.0}}
    task = summarizer(app, responses)
    texts = [f"{TEXT} Item {i}." for i in range(24)]
    # One worker of 8 threads: 8 connections race the limiter row (the racing test above races 8 more).
    with worker_factory(app, concurrency=8), relay_running(app, db_url):
        pending = [task.delay(f"l{i}", t) for i, t in enumerate(texts)]
        assert [p.get(timeout=JOB) for p in pending] == [generate_text("gpt-test", t) for t in texts]
    stats = fake.stats()
    assert stats["errors_served"].get("429", 0) == 0, stats  # no call the provider refused
    assert sum(stats["creates_by_intent"].values()) == 24 == len(stats["creates_by_intent"])
    row = limiter(db_url, "openai:gpt-test/rpm")
    assert row["admitted"] == 24 and row["throttled_local"] > 0, row  # the fleet waited for its turn
    # What an operator sees: `oncelery limits` and the exporter.
    shown = CliRunner().invoke(oncelery_cli, ["--database-url", db_url, "limits", "--json"])
    assert shown.exit_code == 0, shown.output
    [listed] = json.loads(shown.output)["limiters"]
    assert (listed["limiter"], listed["per_minute"], listed["admitted"]) == ("openai:gpt-test/rpm", 270.0, 24)
    samples = scrape(db_url)
    assert samples[("oncelery_llm_limiter_admitted_total", (("limiter", "openai:gpt-test/rpm"),))] == 24
    local = samples[("oncelery_llm_throttled_total", (("limiter", "openai:gpt-test/rpm"), ("source", "local")))]
    assert local == row["throttled_local"]


@ON_SQLITE
def test_a_429_storm_is_retried_through_the_limiter_and_no_call_is_made_twice(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    fake.set_knobs(fail_next=2, fail_status=429, retry_after_s=0.2)
    app.conf.oncelery_limits = {"openai:gpt-test": {"rpm": 600}}
    task = summarizer(app, responses)
    with worker_factory(app):
        assert task.delay("s", TEXT).get(timeout=JOB) == generate_text("gpt-test", TEXT)
    stats = fake.stats()
    assert stats["errors_served"]["429"] == 2 and list(stats["creates_by_intent"].values()) == [1]
    with get_engine(db_url).connect() as conn:
        states = [r.state for r in conn.execute(select(INTENTS).order_by(INTENTS.c.attempt))]
    assert states == [IntentState.FAILED, IntentState.FAILED, IntentState.DONE]  # each 429 its own intent
    row = limiter(db_url, "openai:gpt-test/rpm")
    assert row["throttled_provider"] == 2 and 0.1 <= row["factor"] < 1.0, row  # capacity lowered, recovering


@ON_SQLITE
def test_a_long_limiter_wait_parks_the_run_instead_of_holding_a_slot(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    # One call per 2 s, and an inline wait of 0.2 s: the second and third calls wait longer than a delivery may
    # sleep (unless a job took over 1.8 s), so each parks at least once.
    app.conf.oncelery_limits = {"openai:gpt-test": {"rpm": 1, "window_s": 2.0}}
    task = summarizer(app, responses, llm_inline_wait=0.2)
    with worker_factory(app), relay_running(app, db_url):
        pending = [task.delay(f"p{i}", f"{TEXT} {i}") for i in range(3)]
        assert [p.get(timeout=JOB) for p in pending] == [generate_text("gpt-test", f"{TEXT} {i}") for i in range(3)]
    counts = task.outcome_counts()
    assert counts["executed"] == 3 and counts["waiting"] >= 2, counts
    with get_engine(db_url).connect() as conn:
        assert {r.status for r in conn.execute(select(RUNS))} == {RunStatus.COMPLETED}
        assert all(r.retries == 0 for r in conn.execute(select(RUNS)))
    assert fake.stats()["errors_served"] == {}
    assert limiter(db_url, "openai:gpt-test/rpm")["throttled_local"] >= 2


@ON_SQLITE
def test_the_providers_rate_headers_hold_the_limiter_before_a_429(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    """The provider allows 3 requests per 1.5 s window; our limiter is configured far above it (a stale table).
    Its `x-ratelimit-remaining-requests: 0` after the third call holds the limiter until the window resets, so
    the fourth waits for it instead of being refused: 0 429s."""
    fake.set_knobs(rpm_limit=3, rate_window_s=1.5)
    app.conf.oncelery_limits = {"openai:gpt-test": {"rpm": 600}}
    task = summarizer(app, responses, llm_inline_wait=0.2)
    with worker_factory(app), relay_running(app, db_url):
        for i in range(4):  # one after another: each sees the headers of the one before
            assert task.delay(f"h{i}", f"{TEXT} {i}").get(timeout=JOB) == generate_text("gpt-test", f"{TEXT} {i}")
    stats = fake.stats()
    assert stats["errors_served"] == {}, stats
    assert sum(stats["creates_by_intent"].values()) == 4
    assert limiter(db_url, "openai:gpt-test/rpm")["throttled_local"] >= 1  # held after the third call


@ON_SQLITE
def test_a_token_limit_needs_an_output_limit(app: Celery, db_url: str, responses: OpenAIResponses) -> None:
    app.conf.oncelery_limits = {"openai:gpt-test": {"tpm": 1000}}

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_unbounded", idempotency_key="d:{doc}")
    def unbounded(self: IdempotentTask, doc: str) -> Any:
        return self.llm("s", adapter=responses, model="gpt-test", input=doc)

    with pytest.raises(ConfigurationError, match="max_output_tokens"):
        unbounded.apply(("x",)).get()
