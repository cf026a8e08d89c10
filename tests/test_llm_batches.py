"""Batch steps (`self.llm(..., mode="batch")`): parked items pooled into one provider batch at half the price, the
runs waiting without a worker slot and woken once each; real workers, the relay's batcher, and the fake
provider's batch API, whose counters (batches created, submissions per custom_id) are the oracle."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from sqlalchemy import func, select

from oncelery import BatchPolicy, GeminiBatches, GeminiGenerateContent, IdempotentTask, output_text
from oncelery.cli import oncelery as oncelery_cli
from oncelery.fake_provider import FakeProvider, Knobs, count_tokens
from oncelery.ledger.prices import batch_micros
from oncelery.ledger.recording import CallLedger
from oncelery.llm.adapters.anthropic_messages import AnthropicMessages
from oncelery.llm.adapters.batch import AnthropicBatches, OpenAIBatches
from oncelery.llm.adapters.openai_responses import OpenAIResponses
from oncelery.llm.batches import group_key
from oncelery.models import IntentState, RunStatus
from oncelery.models.batches import BatchState, ItemState
from oncelery.relay.batcher import DUPLICATE_BATCH, Batcher, Suspects
from oncelery.relay.retention import purge
from oncelery.runs.faults import fault_injected
from oncelery.store.database import Database, get_engine
from oncelery.store.tables import BATCH_ITEMS, BATCHES, BUDGETS, CALLS, INTENTS, LABEL_TOTALS, RUNS
from oncelery.testing import relay_running
from tests.conftest import ON_POSTGRESQL, ON_SQLITE
from tests.services import stop_sessions

JOB = 60.0
OUT = 8
PRICE = {"gpt-test": {"input": 1000, "output": 1000}}  # 1,000 micro-USD per token, synchronous
TEXTS = [f"Article {n}: the council met on Tuesday to discuss the harbour's new budget." for n in range(6)]


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """A fake provider whose batches end after two polls."""
    with FakeProvider(Knobs(poll_after_ms=5, generation_s=0.0, batch_polls=2)) as provider:
        yield provider


@pytest.fixture
def adapters(fake: FakeProvider) -> Iterator[tuple[OpenAIResponses, OpenAIBatches]]:
    """The synchronous adapter (provider, usage, fallback) and the batch API adapter, on the fake."""
    with OpenAIResponses(fake.openai_base_url, "sk") as sync, OpenAIBatches(fake.openai_base_url, "sk") as batches:
        yield sync, batches


def scorer(app: Celery, adapters: tuple[OpenAIResponses, OpenAIBatches], policy: BatchPolicy) -> Any:
    sync, batches = adapters

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_batch_score",
              idempotency_key="doc:{doc}", llm_batch_adapter=batches)  # fmt: skip
    def score(self: IdempotentTask, doc: str, text: str) -> str:
        answer = self.llm("score", adapter=sync, model="gpt-test", input=text, max_output_tokens=OUT, mode="batch",
                          batch=policy)  # fmt: skip
        return output_text(answer)

    return score


def rows(db_url: str, table: Any) -> list[dict[str, Any]]:
    with get_engine(db_url).connect() as conn:
        return [dict(r._mapping) for r in conn.execute(select(table))]


def sync_answers(fake: FakeProvider, texts: list[str]) -> list[str]:
    """What the same requests answer synchronously (made after the batch ran: their creates are not counted)."""
    with OpenAIResponses(fake.openai_base_url, "sk") as sync:
        return [
            output_text(
                sync.create(
                    {"model": "gpt-test", "input": t, "max_output_tokens": OUT}, "ref", background=False
                ).response
            )
            for t in texts
        ]


@ON_SQLITE
def test_batch_steps_share_one_provider_batch_at_half_price_and_each_run_wakes_once(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, adapters: Any
) -> None:
    app.conf.oncelery_prices = PRICE
    task = scorer(app, adapters, BatchPolicy(max_items=5, max_wait_s=30))
    with worker_factory(app, concurrency=2), relay_running(app, db_url, batch_poll_s=0.05):
        pending = [task.delay(f"d{n}", text) for n, text in enumerate(TEXTS[:5])]
        answers = [p.get(timeout=JOB) for p in pending]
    stats = fake.stats()
    assert stats["creates_by_intent"] == {}, "no synchronous call"
    assert stats["batches_created"] == {"openai": 1}, stats["batches_created"]  # 5 items = max_items: one batch
    assert sorted(stats["items_by_custom_id"].values()) == [1] * 5  # each custom_id processed once
    assert answers == sync_answers(fake, TEXTS[:5])
    counts = task.outcome_counts()
    assert counts["executed"] == 5 and counts["waiting"] >= 5, counts  # each parked, none held a slot waiting
    # The ledger: each call at exactly half its synchronous price (money is exact, integer micro-USD).
    sync_cost = sum((count_tokens(t) + OUT) * 1000 for t in TEXTS[:5])
    with get_engine(db_url).connect() as conn:
        assert conn.execute(select(func.sum(CALLS.c.cost_micros))).scalar_one() * 2 == sync_cost
        assert {r.state for r in conn.execute(select(INTENTS))} == {IntentState.DONE}
        assert {r.status for r in conn.execute(select(RUNS))} == {RunStatus.COMPLETED}
    [batch] = rows(db_url, BATCHES)
    assert batch["state"] is BatchState.ENDED and batch["items"] == 5 and batch["provider_batch_id"]
    items = rows(db_url, BATCH_ITEMS)
    assert {i["state"] for i in items} == {ItemState.DONE}
    assert all(i["request"] is None and i["response"] is None for i in items), "no prompt or answer kept at rest"
    assert stats["files_deleted"] >= 1, "the input file is deleted once the batch ended"
    shown = CliRunner().invoke(oncelery_cli, ["--database-url", db_url, "batches", "--items", "--json"])
    assert shown.exit_code == 0, shown.output
    listed = json.loads(shown.output)
    assert [(b["state"], b["items"]) for b in listed["batches"]] == [("ended", 5)]
    assert listed["items_by_state"] == {"done": 5} and all(i["request"] is None for i in listed["items"])
    # `oncelery costs`: the batch calls, and what batching saved against the synchronous price, exactly.
    report = CliRunner().invoke(oncelery_cli, ["--database-url", db_url, "costs", "--json"])
    assert report.exit_code == 0, report.output
    total = json.loads(report.output)["total"]
    assert total["batched"]["calls"] == total["made"]["calls"] == 5, total
    assert round(total["batch_saved"] * 1_000_000) == sync_cost // 2 == round(total["batched"]["cost"] * 1_000_000)
    said = CliRunner().invoke(oncelery_cli, ["--database-url", db_url, "costs"]).output
    assert f"saved by batching: {sync_cost // 2 / 1_000_000:.6f} USD" in said, said
    # Retention: purging the finished runs takes their intents and batch items with them.
    report = purge(Database(db_url), older_than=0.0)
    assert (report.runs, report.intents, report.batch_items) == (5, 5, 5), report
    assert rows(db_url, BATCH_ITEMS) == [] and rows(db_url, INTENTS) == []


@ON_POSTGRESQL
def test_items_with_another_policy_never_share_a_batch_and_a_stale_item_falls_back(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, adapters: Any
) -> None:
    """Two policies: two batches. An item whose fallback time passes while still queued (never submitted)
    becomes a background call: one synchronous create, no batch for it."""
    app.conf.oncelery_prices = PRICE
    quick = scorer(app, adapters, BatchPolicy(max_items=2, max_wait_s=0.2))
    sync, batches = adapters

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_batch_other",
              idempotency_key="doc:{doc}", llm_batch_adapter=batches)  # fmt: skip
    def other(self: IdempotentTask, doc: str, text: str) -> str:
        policy = BatchPolicy(max_items=1000, max_wait_s=3600, fallback_after_s=0.5)  # never full, never due
        answer = self.llm("score", adapter=sync, model="gpt-test", input=text, max_output_tokens=OUT, mode="batch",
                          batch=policy)  # fmt: skip
        return output_text(answer)

    with worker_factory(app, concurrency=2), relay_running(app, db_url, batch_poll_s=0.05):
        firsts = [quick.delay(f"q{n}", TEXTS[n]) for n in range(2)]
        late = other.delay("o", TEXTS[2])
        assert [p.get(timeout=JOB) for p in firsts] == sync_answers(fake, TEXTS[:2])
        assert late.get(timeout=JOB) == sync_answers(fake, TEXTS[2:3])[0]
    stats = fake.stats()
    assert stats["batches_created"] == {"openai": 1} and len(stats["items_by_custom_id"]) == 2
    # sync_answers made 3 creates of their own (reference "ref"); the fallback made one more, by its intent.
    assert len(stats["creates_by_intent"]) == 2, stats["creates_by_intent"]
    with get_engine(db_url).connect() as conn:
        fell = conn.execute(select(BATCH_ITEMS).where(BATCH_ITEMS.c.state == ItemState.FALLBACK)).all()
        assert len(fell) == 1 and fell[0].batch_id is None
        intents = conn.execute(select(INTENTS).where(INTENTS.c.step_name == "score").order_by(INTENTS.c.id)).all()
    late_intents = [i for i in intents if i.run_id == fell[0].run_id]
    assert [(i.mode, i.state) for i in late_intents] == [
        ("batch", IntentState.CANCELLED),
        ("background", IntentState.DONE),
    ]


# -- the batcher SIGKILLed at each crash point ------------------------------------------------------------------

POINTS = ["batch_claimed", "batch_uploaded", "batch_created", "batch_saved", "batch_downloaded", "batch_applying"]


def relay_process(
    app: Celery,
    db_url: str,
    fake: FakeProvider,
    marks: Path,
    kill_at: str | None,
    provider: str = "openai",
    untagged_search_s: float | None = None,
) -> Any:
    bound = {} if untagged_search_s is None else {"ONCELERY_BATCH_UNTAGGED_SEARCH_S": str(untagged_search_s)}
    env = {
        **bound,
        **os.environ,
        "ONCELERY_DATABASE_URL": db_url,
        "ONCELERY_BROKER_URL": str(app.conf.broker_url),
        "ONCELERY_RESULT_BACKEND": str(app.conf.result_backend),
        "ONCELERY_OUTBOX_QUEUE": str(app.conf.task_default_queue),
        "ONCELERY_FAKE_PROVIDER_URL": fake.url,
        "ONCELERY_CRASH_MARKS": str(marks),
        "ONCELERY_KILL_AT": kill_at or "",
        "ONCELERY_BATCH_PROVIDER": provider,
        "ONCELERY_TEST_PRICES": json.dumps(app.conf.get("oncelery_prices")),
    }
    with (marks / f"relay-{kill_at or 'after'}.log").open("ab") as log:  # the child keeps its own copy
        return subprocess.Popen(
            [sys.executable, "-m", "tests.apps.batch_relay"], env=env, start_new_session=True, stdout=log, stderr=log
        )


def answers_through_a_killed_relay(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, tmp_path: Path, task: Any,
    jobs: list[tuple[str, str]], point: str, provider: str = "openai",
) -> list[Any]:  # fmt: skip
    """Send `jobs` ((key, text) each) with a relay subprocess that SIGKILLs itself at crash point `point`, then a
    second relay that finishes the work; return the jobs' answers. Both relays are stopped by PID."""
    marks = tmp_path / "marks"
    marks.mkdir()
    first = relay_process(app, db_url, fake, marks, point, provider=provider)
    second = None
    try:
        with worker_factory(app, concurrency=2):
            pending = [task.delay(key, text) for key, text in jobs]
            assert first.wait(timeout=JOB) == -signal.SIGKILL, f"the relay was not killed at {point}"
            second = relay_process(app, db_url, fake, marks, None, provider=provider)
            return [p.get(timeout=JOB) for p in pending]
    finally:
        # By PID, SIGKILL after 10 s: a relay stuck in a round never outlives the test.
        stop_sessions([proc for proc in (first, second) if proc is not None], grace=10)
        for log in sorted(marks.glob("relay-*.log")):  # shown by pytest if the test fails: what each relay did
            print(f"===== {log.name} =====\n{log.read_text(errors='replace')[-5000:]}")


@pytest.mark.crash
@pytest.mark.parametrize(
    ("point", "db_url"), [(p, ("sqlite", "postgresql")[n % 2]) for n, p in enumerate(POINTS)], indirect=["db_url"]
)
def test_the_batcher_sigkilled_at_each_crash_point_submits_and_applies_each_item_once(
    point: str, app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, adapters: Any, tmp_path: Path
) -> None:
    app.conf.oncelery_prices = PRICE
    task = scorer(app, adapters, BatchPolicy(max_items=4, max_wait_s=30))
    texts = TEXTS[:4]
    jobs = [(f"k{n}", text) for n, text in enumerate(texts)]
    answers = answers_through_a_killed_relay(app, worker_factory, db_url, fake, tmp_path, task, jobs, point)
    assert answers == sync_answers(fake, texts)
    stats = fake.stats()
    assert stats["batches_created"] == {"openai": 1}, f"{point}: {stats['batches_created']}"  # 0 duplicates
    assert sorted(stats["items_by_custom_id"].values()) == [1] * 4, f"{point}: each custom_id processed once"
    assert stats["files_uploaded"] == 1, f"{point}: an upload left by the crash is reused, not repeated"
    with get_engine(db_url).connect() as conn:
        assert conn.execute(select(func.count()).select_from(CALLS)).scalar_one() == 4  # one ledger row each
        assert {r.status for r in conn.execute(select(RUNS))} == {RunStatus.COMPLETED}
    assert task.outcome_counts()["executed"] == 4


@ON_SQLITE
def test_item_errors_are_requeued_then_fail_the_step_and_an_expired_batch_requeues_its_unfinished_items(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, adapters: Any
) -> None:
    """Each item fails its first submission (a 500 in the error file): re-queued, it succeeds in the next batch.
    Then a batch that expires with half its items done: the done half is applied, the rest goes again, free.
    And items failing past their policy's attempts fail their step through the normal failure path."""
    app.conf.oncelery_prices = PRICE
    app.conf.oncelery_budgets = {"global": {"usd_per_day": 100}}  # batch items reserve at the batch price
    task = scorer(app, adapters, BatchPolicy(max_items=3, max_wait_s=0.2, max_attempts=2))
    fake.set_knobs(batch_fail_first=1)
    with worker_factory(app, concurrency=2), relay_running(app, db_url, batch_poll_s=0.05):
        assert [task.delay(f"e{n}", TEXTS[n]).get(timeout=JOB) for n in range(3)] == sync_answers(fake, TEXTS[:3])
        stats = fake.stats()
        assert sorted(stats["items_by_custom_id"].values()) == [2, 2, 2], "each failed once, then succeeded"
        fake.set_knobs(batch_fail_first=0, batch_expire=True)
        expiring = [task.delay(f"x{n}", TEXTS[n]) for n in range(3, 6)]
        assert [p.get(timeout=JOB) for p in expiring] == sync_answers(fake, TEXTS[3:6])
        fake.set_knobs(batch_expire=False, batch_fail_first=5)
        with pytest.raises(Exception, match="failed"):
            task.delay("doomed", TEXTS[0] + " again").get(timeout=JOB)
    with get_engine(db_url).connect() as conn:
        calls = conn.execute(select(CALLS.c.cost_micros)).scalars().all()
        spent, reserved = conn.execute(select(BUDGETS.c.spent_micros, BUDGETS.c.reserved_micros)).one()
        doomed = conn.execute(select(BATCH_ITEMS).where(BATCH_ITEMS.c.state == ItemState.FAILED)).all()
    assert len(calls) == 6, "one ledger row per applied result, none for a failed or expired submission"
    assert sum(calls) == spent and reserved == 0, (sum(calls), spent, reserved)
    assert len(doomed) == 1 and doomed[0].attempts == 1 and doomed[0].request is None


@pytest.mark.crash
@ON_POSTGRESQL
def test_an_untagged_anthropic_batch_created_before_a_crash_is_found_by_its_items_not_created_again(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, tmp_path: Path
) -> None:
    """Anthropic's batches carry no metadata: killed after the create, before its id is saved, the next batcher
    lists the batches created since, waits for them to end, and adopts the one whose custom_ids are its own."""
    app.conf.oncelery_prices = {"claude-test": {"input": 1000, "output": 1000}}
    marks = tmp_path / "marks"
    marks.mkdir()
    with (
        AnthropicMessages(fake.openai_base_url, "sk-ant") as sync,
        AnthropicBatches(fake.openai_base_url, "sk-ant") as b,
    ):

        @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_batch_claude",
                  idempotency_key="doc:{doc}", llm_batch_adapter=b)  # fmt: skip
        def judge(self: IdempotentTask, doc: str, text: str) -> str:
            messages = [{"role": "user", "content": text}]
            answer = self.llm("judge", adapter=sync, model="claude-test", messages=messages, max_tokens=OUT,
                              mode="batch", batch=BatchPolicy(max_items=3, max_wait_s=30))  # fmt: skip
            return str(answer["content"][0]["text"])

        first = relay_process(app, db_url, fake, marks, "batch_created", provider="anthropic")
        second = None
        try:
            with worker_factory(app, concurrency=2):
                pending = [judge.delay(f"c{n}", TEXTS[n]) for n in range(3)]
                assert first.wait(timeout=JOB) == -signal.SIGKILL
                second = relay_process(app, db_url, fake, marks, None, provider="anthropic")
                answers = [p.get(timeout=JOB) for p in pending]
        finally:
            # By PID, SIGKILL after 10 s: a relay stuck in a round never outlives the test.
            stop_sessions([proc for proc in (first, second) if proc is not None], grace=10)
        expected = [
            sync.create({"model": "claude-test", "messages": [{"role": "user", "content": t}], "max_tokens": OUT},
                        "ref", background=False).response["content"][0]["text"]
            for t in TEXTS[:3]
        ]  # fmt: skip
    assert answers == expected
    stats = fake.stats()
    assert stats["batches_created"] == {"anthropic": 1}, stats["batches_created"]
    assert sorted(stats["items_by_custom_id"].values()) == [1, 1, 1]
    with get_engine(db_url).connect() as conn:
        assert conn.execute(select(func.count()).select_from(CALLS)).scalar_one() == 3


CLAUDE = "claude-test"
CLAUDE_PRICE = {CLAUDE: {"input": 1000, "output": 1000}}  # 1,000 micro-USD per token, synchronous


def claude_request(text: str) -> dict[str, Any]:
    """A Messages request of one user turn, its output limited to OUT tokens."""
    return {"model": CLAUDE, "messages": [{"role": "user", "content": text}], "max_tokens": OUT}


def wait_for(what: str, predicate: Callable[[], bool], timeout: float = JOB) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.crash
@ON_POSTGRESQL
def test_an_anthropic_batch_created_again_past_the_search_bound_applies_the_first_result_and_labels_the_duplicate(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, tmp_path: Path
) -> None:
    """Killed in the create window while its batch runs on (held by the fake past the search bound): the next
    batcher creates it again, once, keeping the running one as a suspect. The new batch ends first and is applied
    (each run completes once, with its answer); the first ends later with the same custom_ids: the duplicate, one
    ledger row per call labelled `duplicate_batch` at the batch price, nothing applied twice."""
    app.conf.oncelery_prices = CLAUDE_PRICE
    marks = tmp_path / "marks"
    marks.mkdir()
    bound = 2.0
    fake.set_knobs(batch_hold=1)  # the batch whose id the crash loses runs until released
    texts = TEXTS[:3]
    with AnthropicMessages(fake.openai_base_url, "sk-ant") as sync, AnthropicBatches(fake.openai_base_url, "sk") as b:

        @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_batch_claude_dup",
                  idempotency_key="doc:{doc}", llm_batch_adapter=b)  # fmt: skip
        def judge(self: IdempotentTask, doc: str, text: str) -> str:
            answer = self.llm("judge", adapter=sync, mode="batch", batch=BatchPolicy(max_items=3, max_wait_s=30),
                              **claude_request(text))  # fmt: skip
            return str(answer["content"][0]["text"])

        first = relay_process(app, db_url, fake, marks, "batch_created", provider="anthropic")
        second = None
        try:
            with worker_factory(app, concurrency=2):
                pending = [judge.delay(f"dup{n}", text) for n, text in enumerate(texts)]
                assert first.wait(timeout=JOB) == -signal.SIGKILL, "the relay was not killed after the create"
                second = relay_process(app, db_url, fake, marks, None, provider="anthropic", untagged_search_s=bound)
                answers = [p.get(timeout=JOB) for p in pending]
                # Applied from the new batch while the first still runs: the batch row watches it.
                [batch] = rows(db_url, BATCHES)
                watch = Suspects.read(batch["suspects"])
                assert batch["state"] is BatchState.SUBMITTED and watch is not None, batch
                assert watch.applied and len(watch.watched) == 1 and watch.watched[0] != batch["provider_batch_id"]
                assert fake.stats()["batches_created"] == {"anthropic": 2}
                fake.release()
                wait_for("the duplicate's end", lambda: rows(db_url, BATCHES)[0]["state"] is BatchState.ENDED)
        finally:
            # By PID, SIGKILL after 10 s: a relay stuck in a round never outlives the test.
            stop_sessions([proc for proc in (first, second) if proc is not None], grace=10)
        expected = [
            sync.create(claude_request(t), "ref", background=False).response["content"][0]["text"] for t in texts
        ]
        listed = {state.id: state for state in b.list_since(0)}
    assert answers == expected
    stats = fake.stats()
    assert stats["batches_created"] == {"anthropic": 2}, "at most one duplicate batch"
    assert sorted(stats["items_by_custom_id"].values()) == [2, 2, 2], "each request ran in both batches"
    [batch] = rows(db_url, BATCHES)
    watch = Suspects.read(batch["suspects"])
    assert watch is not None and watch.watched == () and watch.others == ()
    [duplicate] = watch.duplicates
    applied = batch["provider_batch_id"]
    assert batch["state"] is BatchState.ENDED and applied != duplicate and set(listed) == {applied, duplicate}
    assert listed[applied].created_at - listed[duplicate].created_at >= bound - 0.5, "created again past the bound"
    items = {i["custom_id"]: i for i in rows(db_url, BATCH_ITEMS)}
    assert {i["state"] for i in items.values()} == {ItemState.DONE} and len(items) == 3
    with get_engine(db_url).connect() as conn:
        calls = [dict(r._mapping) for r in conn.execute(select(CALLS).order_by(CALLS.c.id))]
        intents = conn.execute(select(INTENTS.c.state)).scalars().all()
        statuses = conn.execute(select(RUNS.c.status)).scalars().all()
        labels = dict(conn.execute(select(LABEL_TOTALS.c.label, LABEL_TOTALS.c.calls)).all())
    assert sorted(intents, key=str) == [IntentState.DONE] * 3 and statuses == [RunStatus.COMPLETED] * 3
    assert judge.outcome_counts()["executed"] == 3, "each run completed once"
    made = [c for c in calls if c["reason"] is None]
    dups = [c for c in calls if c["reason"] == DUPLICATE_BATCH]
    assert len(made) == 3 and len(dups) == 3 and len(calls) == 6, calls
    assert labels == {DUPLICATE_BATCH: 3}, labels
    by_run = {c["run_id"]: c for c in made}
    for dup in dups:
        item = items[dup["meta"]["custom_id"]]
        assert dup["meta"]["provider_batch"] == duplicate and dup["ok"] and dup["fencing_token"] is None
        assert (dup["run_id"], dup["step"], dup["task_name"], dup["tenant"]) == (
            item["run_id"],
            "judge",
            judge.name,
            "",
        )
        assert dup["idempotency_key"] == by_run[item["run_id"]]["idempotency_key"]
        sync_cost = (dup["input_tokens"] + dup["output_tokens"]) * 1000
        assert dup["cost_micros"] == batch_micros(sync_cost) == by_run[item["run_id"]]["cost_micros"], dup
        assert dup["batch_saved_micros"] is None, "a duplicate saved nothing"
    said = CliRunner().invoke(oncelery_cli, ["--database-url", db_url, "costs"]).output
    assert "repeated calls: 3 duplicate_batch;" in said, said


# -- the suspects, at the batcher's level (in process: the fake and the database are the oracle) -----------------


class Crash(Exception):
    """Raised at a fault point: the batcher's round stops there, as a kill would stop it."""


def crash_once(point: str) -> Any:
    fired: list[str] = []

    def hook(_name: str, _context: dict[str, Any]) -> None:
        if not fired:
            fired.append(point)
            raise Crash(point)

    return fault_injected(point, hook)


def park(db: Database, texts: list[str]) -> list[str]:
    """Queue one Anthropic batch item per text (runs 1.., none of which exists), as parked steps would."""
    policy = BatchPolicy(max_items=len(texts), max_wait_s=3600)
    custom_ids = [uuid.uuid4().hex for _ in texts]
    with db.begin() as conn:
        for n, (custom_id, text) in enumerate(zip(custom_ids, texts, strict=True), start=1):
            conn.execute(
                BATCH_ITEMS.insert().values(
                    custom_id=custom_id, run_id=n, position=0, provider="anthropic", model=CLAUDE,
                    endpoint="messages", group_key=group_key("anthropic", CLAUDE, "messages", policy),
                    max_items=policy.max_items, max_wait_s=policy.max_wait_s, state=ItemState.QUEUED,
                    request=claude_request(text),
                    queued_at=time.time(),
                )
            )  # fmt: skip
    return custom_ids


def batcher_on(db: Database, adapter: AnthropicBatches, bound: float) -> Batcher:
    """A batcher as the relay builds it: its duplicates priced from CLAUDE_PRICE alone and written by its ledger."""
    prices = {"oncelery_prices": CLAUDE_PRICE, "oncelery_price_file": None}
    return Batcher(
        db, {"anthropic": adapter}, poll_s=0.0, untagged_search_s=bound, ledger=CallLedger(db.dialect, prices),
    )  # fmt: skip


def rounds(batcher: Batcher, until: Callable[[], bool], most: int = 500) -> None:
    for _ in range(most):
        batcher.run_once()
        if until():
            return
        time.sleep(0.01)
    raise AssertionError("the batcher never got there")


def the_batch(db: Database) -> Any:
    with db.read() as conn:
        return conn.execute(select(BATCHES)).one()


def items_done(db: Database) -> bool:
    with db.read() as conn:
        return set(conn.execute(select(BATCH_ITEMS.c.state)).scalars()) == {ItemState.DONE}


@ON_SQLITE
def test_a_suspect_with_other_custom_ids_is_forgotten_not_labelled(db_url: str, fake: FakeProvider) -> None:
    """The create is refused (a 500: it never ran) after the batch was marked maybe sent, while another's batch
    runs: past the bound the batch is created (once), that batch kept as a suspect; it ends with its own
    custom_ids: forgotten, no ledger row, and the batch ends."""
    db = Database(db_url)
    with AnthropicBatches(fake.openai_base_url, "sk") as adapter:
        fake.set_knobs(batch_hold=1)
        other = adapter.create([("someone-else", claude_request("not ours"))])
        park(db, TEXTS[:2])
        batcher = batcher_on(db, adapter, bound=1.5)
        fake.set_knobs(fail_next=1, fail_status=500)
        batcher.run_once()  # claimed, marked maybe sent; the create fails
        assert the_batch(db).state is BatchState.UPLOADED and fake.stats()["batches_created"] == {"anthropic": 1}
        started = time.monotonic()
        rounds(batcher, lambda: the_batch(db).state is BatchState.SUBMITTED)
        # Up to the bound since the claim (SQLite keeps the claim's time to the second: up to 1 s less here).
        assert time.monotonic() - started >= 0.5, "it waited for the running batch up to the bound"
        rounds(batcher, lambda: items_done(db))
        watch = Suspects.read(the_batch(db).suspects)
        assert watch is not None and watch.applied and watch.watched == (other.id,), watch
        fake.release()
        rounds(batcher, lambda: the_batch(db).state is BatchState.ENDED)
    watch = Suspects.read(the_batch(db).suspects)
    assert watch is not None and watch.others == (other.id,) and watch.duplicates == () and watch.watched == ()
    assert fake.stats()["batches_created"] == {"anthropic": 2}
    with db.read() as conn:
        assert conn.execute(select(func.count()).select_from(CALLS)).scalar_one() == 0, "nothing labelled"


@pytest.mark.parametrize("crash_again", [False, True], ids=["suspect-ends-first", "crash-after-create-again"])
@ON_SQLITE
def test_a_suspect_of_ours_that_ends_first_is_applied_and_the_batch_created_again_is_labelled(
    db_url: str, fake: FakeProvider, crash_again: bool
) -> None:
    """The first create's batch (held) ends first after the create was repeated: its results are applied, and
    the repeated batch, ending later with the same custom_ids, is the labelled duplicate. With a crash right after
    the repeated create (its id not saved), the next round never creates a third batch: it waits, adopts the first
    to end and watches the other."""
    db = Database(db_url)
    with AnthropicBatches(fake.openai_base_url, "sk") as adapter:
        custom_ids = park(db, TEXTS[:3])
        batcher = batcher_on(db, adapter, bound=0.3)
        fake.set_knobs(batch_hold=1)
        with crash_once("batch_created"), pytest.raises(Crash):
            rounds(batcher, lambda: False)
        [first] = [state.id for state in adapter.list_since(0)]
        fake.set_knobs(batch_polls=40)  # the batch created again runs longer than the first, once released
        if crash_again:
            with crash_once("batch_created_again"), pytest.raises(Crash):
                rounds(batcher, lambda: False)
            for _ in range(5):  # both run: the batcher waits for them, never a third create
                batcher.run_once()
            assert fake.stats()["batches_created"] == {"anthropic": 2}
            assert the_batch(db).state is BatchState.UPLOADED
        else:
            rounds(batcher, lambda: the_batch(db).state is BatchState.SUBMITTED)
            watch = Suspects.read(the_batch(db).suspects)
            assert watch is not None and watch.watched == (first,), watch
        fake.release()
        rounds(batcher, lambda: items_done(db))
        assert the_batch(db).provider_batch_id == first, "the first to end is the one applied"
        rounds(batcher, lambda: the_batch(db).state is BatchState.ENDED)
        [again] = [state.id for state in adapter.list_since(0) if state.id != first]
        batcher.run_once()  # nothing left to do: no row written twice
    watch = Suspects.read(the_batch(db).suspects)
    assert watch is not None and watch.duplicates == (again,) and watch.watched == () and watch.applied
    assert fake.stats()["batches_created"] == {"anthropic": 2}, "at most one duplicate batch"
    with db.read() as conn:
        calls = conn.execute(select(CALLS)).all()
        labels = dict(conn.execute(select(LABEL_TOTALS.c.label, LABEL_TOTALS.c.calls)).all())
    assert sorted(c.meta["custom_id"] for c in calls) == sorted(custom_ids) and labels == {DUPLICATE_BATCH: 3}
    assert {(c.reason, c.meta["provider_batch"], c.ok) for c in calls} == {(DUPLICATE_BATCH, again, True)}
    assert sorted(c.run_id for c in calls) == [1, 2, 3]
    assert all(c.cost_micros == batch_micros((c.input_tokens + c.output_tokens) * 1000) > 0 for c in calls)


@ON_POSTGRESQL
def test_a_batch_the_provider_refuses_fails_its_items_steps_instead_of_retrying_for_ever(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, adapters: Any
) -> None:
    app.conf.oncelery_prices = PRICE
    task = scorer(app, adapters, BatchPolicy(max_items=2, max_wait_s=30))  # both items in one batch
    fake.set_knobs(fail_next=1, fail_status=400)  # the batch's first request (its upload or its create): a 400
    with worker_factory(app, concurrency=2), relay_running(app, db_url, batch_poll_s=0.05):
        pending = [task.delay(f"r{n}", TEXTS[n]) for n in range(2)]
        for p in pending:
            with pytest.raises(Exception, match="400"):
                p.get(timeout=JOB)
    # The database may hold earlier tests' batches (the same PostgreSQL database for the session).
    [batch] = [b for b in rows(db_url, BATCHES) if b["state"] is BatchState.FAILED]
    assert "400" in (batch["error"] or ""), batch
    items = [i for i in rows(db_url, BATCH_ITEMS) if i["batch_id"] == batch["id"]]
    assert len(items) == 2 and {i["state"] for i in items} == {ItemState.FAILED}
    assert fake.stats()["batches_created"] in ({}, {"openai": 0}) and fake.stats()["creates_by_intent"] == {}
    with get_engine(db_url).connect() as conn:
        statuses = {r.status for r in conn.execute(select(RUNS).where(RUNS.c.task_name == task.name))}
    assert statuses <= {RunStatus.FAILED, RunStatus.DEAD}, statuses


# -- Gemini: inline requests, tagged by displayName, answers matched by position ---------------------------------

GEMINI = "gemini-test"


def gemini_request(text: str) -> dict[str, Any]:
    """A GenerateContentRequest of one user turn, its output limited to OUT tokens."""
    return {"contents": [{"role": "user", "parts": [{"text": text}]}], "generationConfig": {"maxOutputTokens": OUT}}


@pytest.fixture
def gemini(fake: FakeProvider) -> Iterator[tuple[GeminiGenerateContent, GeminiBatches]]:
    """Gemini's synchronous adapter (provider, usage) and its batch adapter, on the fake."""
    with (
        GeminiGenerateContent(fake.gemini_base_url, "g-key") as sync,
        GeminiBatches(fake.gemini_base_url, "g-key") as batches,
    ):
        yield sync, batches


def rater(app: Celery, adapters: tuple[GeminiGenerateContent, GeminiBatches], policy: BatchPolicy) -> Any:
    sync, batches = adapters

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_batch_gemini",
              idempotency_key="doc:{doc}", llm_batch_adapter=batches)  # fmt: skip
    def rate(self: IdempotentTask, doc: str, text: str) -> str:
        answer = self.llm("rate", adapter=sync, model=GEMINI, mode="batch", batch=policy, **gemini_request(text))
        return output_text(answer)

    return rate


def gemini_answers(fake: FakeProvider, texts: list[str]) -> list[str]:
    """What generateContent answers the same requests synchronously (its creates carry no intent)."""
    with GeminiGenerateContent(fake.gemini_base_url, "g-key") as sync:
        return [output_text(sync.create({"model": GEMINI, **gemini_request(t)}, "ref", background=False).response)
                for t in texts]  # fmt: skip


@ON_SQLITE
def test_gemini_batch_steps_share_one_provider_batch_at_half_price_answered_by_position(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, gemini: Any
) -> None:
    """Four Gemini steps pooled into one batch of inline requests named by the batch's id: each custom_id sent once
    (as its request's metadata key), each run given the answer at its request's position (the responses carry no
    key), equal to generateContent's own, and the ledger at exactly half the synchronous price."""
    app.conf.oncelery_prices = {GEMINI: {"input": 1000, "output": 1000}}
    task = rater(app, gemini, BatchPolicy(max_items=4, max_wait_s=30))
    texts = TEXTS[:4]
    with worker_factory(app, concurrency=2), relay_running(app, db_url, batch_poll_s=0.05):
        pending = [task.delay(f"g{n}", text) for n, text in enumerate(texts)]
        answers = [p.get(timeout=JOB) for p in pending]
    stats = fake.stats()
    assert stats["creates"] == {} and stats["batches_created"] == {"gemini": 1}, stats
    [batch] = rows(db_url, BATCHES)
    items = rows(db_url, BATCH_ITEMS)
    assert stats["items_by_custom_id"] == {i["custom_id"]: 1 for i in items}, "each custom_id sent once, as its key"
    assert batch["provider_batch_id"].startswith("batches/") and batch["state"] is BatchState.ENDED
    assert len(set(answers)) == 4 and answers == gemini_answers(fake, texts), "each answer from its own position"
    sync_cost = sum((count_tokens(t) + OUT) * 1000 for t in texts)
    with get_engine(db_url).connect() as conn:
        assert conn.execute(select(func.sum(CALLS.c.cost_micros))).scalar_one() * 2 == sync_cost
        assert {r.status for r in conn.execute(select(RUNS))} == {RunStatus.COMPLETED}
    assert {i["state"] for i in items} == {ItemState.DONE}
    assert task.outcome_counts()["executed"] == 4


@pytest.mark.crash
@ON_POSTGRESQL
def test_a_gemini_batch_created_before_a_crash_is_found_by_its_display_name_not_created_again(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, gemini: Any, tmp_path: Path
) -> None:
    """The batcher SIGKILLed right after the create, before the batch's name is saved: the next batcher lists
    Gemini's batches, finds the one whose displayName is the batch's id, and polls it: one batch, each item once."""
    app.conf.oncelery_prices = {GEMINI: {"input": 1000, "output": 1000}}
    task = rater(app, gemini, BatchPolicy(max_items=3, max_wait_s=30))
    texts = TEXTS[:3]
    jobs = [(f"gk{n}", text) for n, text in enumerate(texts)]
    answers = answers_through_a_killed_relay(
        app, worker_factory, db_url, fake, tmp_path, task, jobs, "batch_created", provider="gemini"
    )
    assert answers == gemini_answers(fake, texts)
    stats = fake.stats()
    assert stats["batches_created"] == {"gemini": 1}, stats["batches_created"]  # found again, not created twice
    assert sorted(stats["items_by_custom_id"].values()) == [1, 1, 1]
    with get_engine(db_url).connect() as conn:
        assert conn.execute(select(func.count()).select_from(CALLS).where(CALLS.c.model == GEMINI)).scalar_one() == 3
        statuses = {r.status for r in conn.execute(select(RUNS).where(RUNS.c.task_name == task.name))}
    assert statuses == {RunStatus.COMPLETED}


@pytest.mark.crash
@ON_SQLITE
def test_a_gemini_batch_read_again_after_a_crash_mid_apply_keeps_every_answer_at_its_position(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, gemini: Any, tmp_path: Path
) -> None:
    """Each item fails its first submission; the batcher is SIGKILLed while applying the lines. Re-read, the
    responses must still meet their items at the same positions: no item left the batch before its end (a
    re-queue would shift them), so every item is re-queued once, then answered with its own answer."""
    app.conf.oncelery_prices = {GEMINI: {"input": 1000, "output": 1000}}
    task = rater(app, gemini, BatchPolicy(max_items=3, max_wait_s=0.2))
    fake.set_knobs(batch_fail_first=1)
    texts = TEXTS[3:6]
    jobs = [(f"ga{n}", text) for n, text in enumerate(texts)]
    answers = answers_through_a_killed_relay(
        app, worker_factory, db_url, fake, tmp_path, task, jobs, "batch_applying", provider="gemini"
    )
    assert answers == gemini_answers(fake, texts)
    stats = fake.stats()
    assert stats["batches_created"] == {"gemini": 2}, stats["batches_created"]  # the failed one, then the re-queue
    assert sorted(stats["items_by_custom_id"].values()) == [2, 2, 2], "each failed once, then succeeded once"
    with get_engine(db_url).connect() as conn:
        assert conn.execute(select(func.count()).select_from(CALLS)).scalar_one() == 3
