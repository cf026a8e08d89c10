"""Shared limits (`oncelery_limits`): one GCRA row per limiter on the database clock, admitted in the intent's
prepared transaction, shared by every worker; real workers and the fake provider, whose 429 counters are the
oracle. Time is compressed (`window_s`) on both sides: the fake's fixed window and the limiter's."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from sqlalchemy import select

from oncelery import IdempotentTask, output_text
from oncelery.cli import oncelery as oncelery_cli
from oncelery.errors import ConfigurationError
from oncelery.fake_provider import FakeProvider, Knobs, generate_text
from oncelery.llm.adapters.anthropic_messages import AnthropicMessages
from oncelery.llm.adapters.gemini_generate import GeminiGenerateContent
from oncelery.llm.adapters.openai_responses import OpenAIResponses
from oncelery.llm.errors import ProviderRateLimited
from oncelery.llm.limits import (
    OUTPUT_KEY,
    LimitRule,
    Throttled,
    admit_txn,
    limiters_for,
    parse_limits,
    penalize,
    used_by,
)
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
        ("tenant:*", "tpm", 50, 1),  # the default burst: 2 % of the rate, rounded down
    ]
    # Shards: one per 6,000 requests a (real) minute unless given; every kind of a scope has the same count.
    big = parse_limits({"openai:big": {"rpm": 30_000, "tpm": 9_000_000}, "openai:fast": {"rpm": 200, "window_s": 1}})
    assert [(r.kind, r.shards, r.burst) for r in big] == [("rpm", 5, 600), ("tpm", 5, 180_000), ("rpm", 2, 4)]
    assert [r.shards for r in parse_limits({"openai:m": {"rpm": 30_000, "shards": 3}})] == [3]
    assert [r.burst for r in parse_limits({"openai:m": {"rpm": 49}})] == [0]  # none below 50 a window
    for bad, says in [
        ({"gpt-test": {"rpm": 5}}, "name a scope"),
        ({"openai:m": {"rpm": 0}}, "> 0"),
        ({"openai:m": {"rps": 5}}, "unknown limit 'rps'"),
        ({"openai:m": {"rpm": 5, "burst": -1}}, "'burst'"),
        ({"openai:m": {"rpm": 5, "window_s": 0}}, "'window_s'"),
        ({"openai:m": {"rpm": 5, "shards": 0}}, "'shards'"),
        ({"openai:m": {"rpm": 5, "shards": 65}}, "'shards'"),
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


def shard_rows(db_url: str, name: str) -> dict[str, dict[str, Any]]:
    """Every row of limiter `name` (its shards), by row name."""
    c = LIMITERS.c
    with get_engine(db_url).connect() as conn:
        rows = conn.execute(select(LIMITERS).where((c.name == name) | c.name.like(f"{name}#%")))
        return {r.name: dict(r._mapping) for r in rows}


def test_a_full_shard_sends_the_call_to_the_other_and_a_full_limiter_refuses(db_url: str) -> None:
    """Two shards of 1 a minute each (2 a minute in all): whichever shard the first call drew, the second is
    admitted by the other (the least-loaded one) and the third is refused with the wait of the soonest shard."""
    [a] = limiters_for((LimitRule("openai:m", "rpm", 2, shards=2),), "openai", "m", "", "t", (1, 1))
    db = Database(db_url)
    rows = []
    for _ in range(2):
        with db.begin() as conn:
            rows.append(admit_txn(conn, db.dialect, [a]))
    assert sorted(name for r in rows for name in r) == ["openai:m/rpm", "openai:m/rpm#1"], rows
    with pytest.raises(Throttled) as refused, db.begin() as conn:
        admit_txn(conn, db.dialect, [a])
    assert refused.value.limiter == "openai:m/rpm" and 55.0 < refused.value.wait_s <= 60.0
    assert {n: r["admitted"] for n, r in shard_rows(db_url, a.name).items()} == {a.name: 1, f"{a.name}#1": 1}


def test_racing_admissions_through_shards_keep_each_shards_pace_and_the_whole_rate(db_url: str) -> None:
    """8 threads race a limiter of 1,200 a minute split into 4 shards (each one call per 0.2 s): calls spread
    over the shards, no two share a slot of a shard, and the fleet never gets ahead of the whole rate by more
    than one call per shard."""
    [admission] = limiters_for((LimitRule("openai:m", "rpm", 1200, shards=4),), "openai", "m", "", "t", (1, 1))
    db = Database(db_url)
    got: list[tuple[str, float]] = []
    lock = threading.Lock()

    deadline = time.monotonic() + JOB
    enough = threading.Event()  # every shard admitted 3 calls: each has gaps to check

    def racer() -> None:
        while not enough.is_set() and time.monotonic() < deadline:
            try:
                with db.begin() as conn:
                    [row] = admit_txn(conn, db.dialect, [admission])
                    tat = conn.execute(select(LIMITERS.c.tat).where(LIMITERS.c.name == row)).scalar_one()
                with lock:
                    got.append((row, float(tat)))
                    per_shard = Counter(r for r, _ in got)
                    if len(per_shard) == 4 and min(per_shard.values()) >= 3:
                        enough.set()
            except Throttled as exc:
                # Come back when the limiter says (bounded): a race that ended in one burst could leave a shard
                # with a single call and no gap to check.
                enough.wait(min(exc.wait_s, 0.05))

    threads = [threading.Thread(target=racer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=JOB)
    by_shard: dict[str, list[float]] = {}
    for row, tat in got:
        by_shard.setdefault(row, []).append(tat)
    assert len(by_shard) == 4, sorted(by_shard)  # every shard took calls
    for tats in by_shard.values():
        tats.sort()
        assert min(b - a for a, b in itertools.pairwise(tats)) >= 0.2 * (1 - 1e-6), tats  # one slot per call
    rows = shard_rows(db_url, admission.name)
    assert sum(r["admitted"] for r in rows.values()) == len(got)
    # Over the span the tats cover, at most the whole rate (20 a second) plus one call per shard.
    tats = sorted(t for _, t in got)
    assert len(got) <= (tats[-1] - tats[0]) * 20 + 4 + 1, (len(got), tats[-1] - tats[0])


@ON_SQLITE
def test_a_cap_a_429_and_the_operator_views_cover_every_shard(db_url: str) -> None:
    """`oncelery limits set` caps the whole limiter (each shard paces at its share), a provider's 429 halves
    and holds every shard, and `oncelery limits` and the exporter show one limiter with its shards summed."""
    [a] = limiters_for((LimitRule("openai:m", "rpm", 6000, shards=2),), "openai", "m", "", "t", (1, 1))
    db = Database(db_url)
    with db.begin() as conn:
        admit_txn(conn, db.dialect, [a])  # makes both shard rows
    runner = CliRunner()
    said = runner.invoke(oncelery_cli, ["--database-url", db_url, "limits", "set", a.name, "--per-minute", "6"])
    assert said.exit_code == 0, said.output
    assert {r["capped_spu"] for r in shard_rows(db_url, a.name).values()} == {10.0}  # the whole limiter's pace
    with db.begin() as conn:
        conn.execute(LIMITERS.update().values(tat=0.0))
    for _ in range(2):  # one per shard, then both are 20 s ahead: 6 a minute in all
        with db.begin() as conn:
            admit_txn(conn, db.dialect, [a])
    with pytest.raises(Throttled) as refused, db.begin() as conn:
        admit_txn(conn, db.dialect, [a])
    assert 19.0 < refused.value.wait_s <= 20.0, refused.value.wait_s
    [listed] = json.loads(runner.invoke(oncelery_cli, ["--database-url", db_url, "limits", "--json"]).output)[
        "limiters"
    ]
    assert (listed["limiter"], listed["shards"], listed["per_minute"], listed["cap"]) == (a.name, 2, 6.0, 6.0)
    assert listed["admitted"] == 3
    with db.begin() as conn:
        penalize(conn, db.dialect, [a.name], 30.0)
    rows = shard_rows(db_url, a.name)
    assert {r["factor"] for r in rows.values()} == {0.5}, rows
    samples = scrape(db_url)
    assert samples[("oncelery_llm_limiter_admitted_total", (("limiter", a.name),))] == 3
    assert samples[("oncelery_llm_limiter_capacity_ratio", (("limiter", a.name),))] == 0.5
    assert samples[("oncelery_llm_limiter_backlog_seconds", (("limiter", a.name),))] >= 29.0  # held by the 429
    assert not any(dict(labels).get("limiter", "").endswith("#1") for _, labels in samples)  # one series


def test_settlement_gives_back_output_tokens_only_where_the_provider_does() -> None:
    """A call admitted for 30 input tokens (our estimate) + 100 output tokens (its limit) that used 20 + 10:
    OpenAI keeps the output limit counted (only the input estimate's excess comes back); Anthropic's output
    limit gives the unused 90 back too."""
    admitted = {"openai:m/rpm": 1, "openai:m/tpm#2": 130, "openai:m/itpm": 30, "openai:m/otpm": 100, OUTPUT_KEY: 100}
    assert used_by(admitted, 20, 10) == {
        "openai:m/rpm": 1, "openai:m/tpm#2": 120, "openai:m/itpm": 20, "openai:m/otpm": 100,
    }  # fmt: skip
    assert used_by(admitted, 20, 10, output_returned=True) == {
        "openai:m/rpm": 1, "openai:m/tpm#2": 30, "openai:m/itpm": 20, "openai:m/otpm": 10,
    }  # fmt: skip
    assert used_by(admitted, 50, 500) == {  # a provider that counted more than we estimated: no give-back
        "openai:m/rpm": 1, "openai:m/tpm#2": 130, "openai:m/itpm": 30, "openai:m/otpm": 100,
    }  # fmt: skip


@ON_POSTGRESQL
def test_a_token_limiter_holds_what_each_provider_counts_after_a_call(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    """One token a second (60 a minute): the limiter's backlog after one call, in seconds, is the tokens it
    still holds. OpenAI: the call's input as the provider counted it + its whole output limit (400); Anthropic:
    its input + the output it produced. The fake counts the same way (its headers: tokens remaining)."""
    app.conf.oncelery_limits = {"openai:gpt-test": {"tpm": 60}, "anthropic:claude-test": {"tpm": 60}}
    with AnthropicMessages(fake.openai_base_url, "sk-ant") as claude:

        @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_held", idempotency_key="d:{doc}")
        def held(self: IdempotentTask, doc: str, provider: str) -> str:
            if provider == "openai":
                return output_text(
                    self.llm("s", adapter=responses, model="gpt-test", input=TEXT, max_output_tokens=400)
                )
            message = [{"role": "user", "content": TEXT}]
            return output_text(self.llm("s", adapter=claude, model="claude-test", messages=message, max_tokens=400))

        with worker_factory(app):
            assert held.delay("o", "openai").get(timeout=JOB) == generate_text("gpt-test", TEXT)
            assert held.delay("a", "anthropic").get(timeout=JOB) == generate_text("claude-test", TEXT)
    db = Database(db_url)
    with db.begin() as conn:
        now = float(conn.execute(select(db.dialect.epoch())).scalar_one())
        calls = {r.model: r for r in conn.execute(select(INTENTS))}
    for model, provider, output in [("gpt-test", "openai", 400), ("claude-test", "anthropic", None)]:
        call = calls[model]
        assert call.admitted[OUTPUT_KEY] == 400, call.admitted
        expected = call.input_tokens + (call.output_tokens if output is None else output)
        assert call.output_tokens < 400  # the answer is shorter than its limit: the difference is what is at stake
        backlog = limiter(db_url, f"{provider}:{model}/tpm")["tat"] - now
        assert expected - 5 < backlog <= expected, (model, backlog, expected, dict(call._mapping))


@ON_SQLITE
def test_a_gemini_429_says_its_wait_in_retry_info_and_the_step_is_retried_through_the_limiter(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider
) -> None:
    """Gemini sends no retry-after header: its 429's wait is a RetryInfo detail (`retryDelay`) in the body. The
    adapter reads it, the limiter is held that long, and the step's next attempt is a new intent: one create."""
    fake.set_knobs(fail_next=1, fail_status=429, retry_after_s=0.3)
    with GeminiGenerateContent(fake.gemini_base_url, "g-key") as probe:
        body = {"model": "gemini-test", "contents": [{"role": "user", "parts": [{"text": TEXT}]}]}
        with pytest.raises(ProviderRateLimited) as limited:
            probe.create(body, "no-tag", background=False)
    assert 0.25 <= limited.value.retry_after_s <= 0.35, limited.value.retry_after_s
    fake.set_knobs(fail_next=1, fail_status=429, retry_after_s=0.3)
    app.conf.oncelery_limits = {"gemini:gemini-test": {"rpm": 600}}
    with GeminiGenerateContent(fake.gemini_base_url, "g-key") as gemini:

        @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_gemini_429", idempotency_key="g:{d}")
        def rate(self: IdempotentTask, d: str) -> str:
            request = {"contents": [{"role": "user", "parts": [{"text": TEXT}]}],
                       "generationConfig": {"maxOutputTokens": 40}}  # fmt: skip
            return output_text(self.llm("rate", adapter=gemini, model="gemini-test", **request))

        with worker_factory(app):
            assert rate.delay("a").get(timeout=JOB) == generate_text("gemini-test", TEXT)
    with get_engine(db_url).connect() as conn:
        states = [r.state for r in conn.execute(select(INTENTS).order_by(INTENTS.c.attempt))]
    assert states == [IntentState.FAILED, IntentState.DONE]  # the 429 its own intent, never an immediate re-call
    row = limiter(db_url, "gemini:gemini-test/rpm")
    assert row["throttled_provider"] == 1 and row["factor"] < 1.0, row
    assert fake.stats()["errors_served"]["429"] == 2  # the probe's and the step's first attempt
