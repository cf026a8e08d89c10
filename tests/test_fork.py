"""Forking a past run from step N: exactly the steps from N are paid again, with the overrides, and a fork's
effects never reach production unless it is `live`.

Real in-process workers, both stores, the fake provider's creates as the oracle, the ledger for the preview.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from sqlalchemy import func, select, update

from oncelery import IdempotentTask, RunStatus, output_text
from oncelery.cli import oncelery as oncelery_cli
from oncelery.errors import ConfigurationError, ForkRefused, StoreUnavailable
from oncelery.fake_provider import FakeProvider, Knobs, generate_text
from oncelery.llm.adapters.openai_responses import OpenAIResponses
from oncelery.ops.dead_letters import DeadLetters
from oncelery.ops.fork import fork_run, preview_fork
from oncelery.ops.fork_preview import fork_diff
from oncelery.outbox import enqueue
from oncelery.relay.retention import purge
from oncelery.runs.decisions import REASON_BAD_MESSAGE
from oncelery.runs.faults import fault_injected
from oncelery.runs.kept import redact_arguments
from oncelery.settings import HEADER_FORK, HEADER_KEY, HEADER_TENANT
from oncelery.store.database import Database, get_engine
from oncelery.store.tables import BUDGETS, CALLS, LETTERS, OUTBOX, RUNS, STEPS
from oncelery.testing import relay_running, wait_until
from oncelery.testing.waiting import poll
from tests.conftest import ON_SQLITE, migrated
from tests.services import count_rows, effects_table

TEXT = "The council approved the new library budget on Tuesday."
JOB = 60.0
PRICES = {"gpt-a": {"input": 1.0, "output": 2.0}, "gpt-b": {"input": 5.0, "output": 15.0}}


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """A fake provider (workers reach it over HTTP on 127.0.0.1)."""
    with FakeProvider(Knobs(poll_after_ms=5, generation_s=0.01)) as provider:
        yield provider


def article(app: Celery, adapter: Any, **options: Any) -> Any:
    """A 3-step pipeline (summarize -> keywords -> quality, each a model call) with effects and an outbox job."""
    app.conf.oncelery_prices = PRICES

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_fork", idempotency_key="doc:{doc}",
              concurrency_key="doc:{doc}", **options)  # fmt: skip
    def pipeline(self: IdempotentTask, doc: str, text: str) -> dict[str, str]:
        out: dict[str, str] = {}
        for step in ("summarize", "keywords", "quality"):
            text = output_text(self.llm(step, adapter=adapter, model="gpt-a", input=text, max_output_tokens=60))
            out[step] = text
        with self.effects() as session:
            session.execute(effects_table.insert().values(key=doc, pid=os.getpid()))
            enqueue(
                session, self.app.signature("oncelery.t_fork_next"), doc
            )  # published only if this effect commits in production
        return out

    return pipeline


def creates(fake: FakeProvider) -> int:
    return int(sum(fake.stats()["creates_by_intent"].values()))


def rows(db_url: str, table: Any) -> int:
    with get_engine(db_url).connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())


def test_a_fork_from_step_3_pays_one_call_and_writes_no_production_effect(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses, tmp_path: Path
) -> None:
    task = article(app, responses, keep_arguments=True)
    shadow_url = f"sqlite:///{tmp_path / 'shadow.db'}"
    shadow = migrated(shadow_url)
    engine = get_engine(db_url)
    with worker_factory(app):
        source = task.delay("a1", TEXT).get(timeout=JOB)
        assert creates(fake) == 3
        produced = (count_rows(engine, effects_table, "a1"), rows(db_url, OUTBOX))
        assert produced == (1, 1)

        # The preview: the source's own tokens for the quality step, at the new model's price (exact arithmetic).
        seen = preview_fork(app, task, "doc:a1", from_step="quality", overrides=["quality.model=gpt-b"])
        with engine.connect() as conn:
            tin, tout = conn.execute(
                select(CALLS.c.input_tokens, CALLS.c.output_tokens).where(CALLS.c.step == "quality")
            ).one()
        [line] = seen.steps
        assert (line["step"], line["model"], line["input_tokens"], line["output_tokens"]) == (
            "quality",
            "gpt-b",
            tin,
            tout,
        )
        assert seen.total_micros == tin * 5 + tout * 15  # USD per 1M tokens is micro-USD per token

        dry = fork_run(app, task, "doc:a1", from_step="quality", overrides={"quality": {"model": "gpt-b"}})
        result = dry.get(timeout=JOB)
        assert creates(fake) == 4, "steps 1-2 replayed from the source: one model call"
        assert result["summarize"] == source["summarize"] and result["keywords"] == source["keywords"]
        assert result["quality"] == generate_text("gpt-b", source["keywords"]) != source["quality"]

        live_before = rows(db_url, OUTBOX)
        sh = fork_run(app, task, "doc:a1", from_step="quality", overrides=["quality.model=gpt-b"], effects="shadow",
                      shadow_url=shadow_url)  # fmt: skip
        sh.get(timeout=JOB)
        assert creates(fake) == 5
    # 0 production rows from the dry and the shadow fork: effects and outbox as the source left them.
    assert (count_rows(engine, effects_table, "a1"), rows(db_url, OUTBOX)) == produced and live_before == 1
    assert count_rows(shadow, effects_table, "a1") == 1 and rows(shadow_url, OUTBOX) == 1
    # The fork's runs are their own (never production's key or concurrency slot), and say what they changed.
    with engine.connect() as conn:
        keys = sorted(conn.execute(select(RUNS.c.idempotency_key)).scalars())
        meta = conn.execute(
            select(STEPS.c.meta).join(RUNS, RUNS.c.id == STEPS.c.run_id).where(RUNS.c.idempotency_key == dry.key)
        ).scalar_one()
    assert keys == sorted(["doc:a1", dry.key, sh.key]) and dry.key == f"fork:{dry.id}:doc:a1"
    assert meta["fork"] == {"id": dry.id, "overrides": {"model": "gpt-b"}} and meta["llm"]["model"] == "gpt-b"
    # The diff: steps 1-2 replayed (no delta), step 3 changed, its cost from the ledger at gpt-b's price.
    diff = {d.step: d for d in fork_diff(Database(db_url), dry.id, lambda a, b: float(a == b))}
    assert diff["summarize"].replayed and not diff["summarize"].diff and diff["keywords"].cost_delta_micros == 0
    assert diff["quality"].diff and diff["quality"].score == 0.0 and diff["quality"].cost_delta_micros > 0


def test_a_fork_key_from_a_producer_never_gets_another_tenants_step_results(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses, published: list[str]
) -> None:
    task = article(app, responses, keep_arguments=True)
    with worker_factory(app):
        source = task.apply_async(("a1", TEXT), tenant="A").get(timeout=JOB)
        fork = fork_run(app, task, "doc:a1", from_step="quality", tenant="A")  # a real fork of tenant A's run
        assert fork.get(timeout=JOB)["keywords"] == source["keywords"] and creates(fake) == 4
        published.clear()
        # Tenant B names A's fork in its own call's key (the same arguments: A's steps would replay for B).
        with pytest.raises(ForkRefused, match="only `oncelery fork` sends"):
            task.apply_async(("a1", TEXT), idempotency_key=fork.key, tenant="B")
        with pytest.raises(ForkRefused, match="only `oncelery fork` sends"), Database(db_url).begin() as conn:
            enqueue(conn, task.s("a1", TEXT).set(idempotency_key=fork.key, tenant="B"))  # nor through the outbox
        assert published == [] and rows(db_url, OUTBOX) == 1  # refused at the call: nothing sent (the source's row)
        # Sent around the producer's checks: the key alone, or the fork command's header forged as well.
        forged = {HEADER_KEY: fork.key, HEADER_TENANT: "B"}
        for headers, why in (
            (forged, "without the fork command's header"),
            ({**forged, HEADER_FORK: fork.id}, "tenant"),
        ):
            with pytest.raises(ForkRefused, match=why):
                app.send_task(task.name, ["a1", TEXT], headers=headers).get(timeout=JOB)
    assert creates(fake) == 4, "no call made for B, and none of A's step results replayed for it"
    with get_engine(db_url).connect() as conn:
        assert conn.execute(select(func.count()).where(RUNS.c.tenant == "B")).scalar_one() == 0
        letters = conn.execute(select(LETTERS.c.reason, LETTERS.c.tenant)).all()
    assert sorted(letters) == [(REASON_BAD_MESSAGE, "B")] * 2


@ON_SQLITE
def test_a_parked_fork_whose_message_was_stored_before_its_header_wakes_as_that_fork(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    """Upgrade: a fork parked WAITING whose kept message predates the fork header (forks were once recognised by
    their key) is woken with the header put back from its key: it runs as its fork, never dead-lettered as a
    producer's fork-shaped key. The delivery still checks the fork row's task, tenant and key."""
    task = article(app, responses, keep_arguments=True, llm_inline_wait=0.1)
    engine = get_engine(db_url)
    with worker_factory(app):
        task.delay("a2", TEXT).get(timeout=JOB)
        fake.set_knobs(generation_s=1.0)  # the fork's call outlasts its inline wait: the fork parks
        fork = fork_run(app, task, "doc:a2", from_step="quality", overrides=["quality.model=gpt-b"])

        def parked() -> Any:
            with engine.connect() as conn:
                found = conn.execute(
                    select(RUNS.c.id, RUNS.c.message).where(
                        RUNS.c.idempotency_key == fork.key, RUNS.c.status == RunStatus.WAITING
                    )
                ).first()
            return found if found is not None and found.message else None

        found = wait_until(parked, timeout=JOB, what="the fork parked with its message kept")
        legacy = dict(found.message)
        legacy["headers"] = {k: v for k, v in (legacy.get("headers") or {}).items() if k != HEADER_FORK}
        assert legacy["headers"] != found.message.get("headers"), "the kept message carried the fork header"
        with engine.begin() as conn:  # what a release before the fork header kept
            conn.execute(update(RUNS).where(RUNS.c.id == found.id).values(message=legacy))
        with relay_running(app, db_url):
            result = fork.get(timeout=JOB)
    assert result["quality"] == generate_text("gpt-b", result["keywords"])
    assert rows(db_url, LETTERS) == 0, "woken as its fork, not refused as a producer's fork-shaped key"


def test_a_dead_forks_letter_stored_before_its_header_is_replayed_as_that_fork(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    """Upgrade: a dead fork's letter whose message predates the fork header is replayed with the header put back
    from its key (`oncelery dlq replay`): the enqueue takes it and the fork runs, instead of refusing it."""
    task = article(app, responses, keep_arguments=True, max_retries=0)
    engine = get_engine(db_url)
    with worker_factory(app):
        task.delay("a3", TEXT).get(timeout=JOB)
        fake.set_knobs(fail_next=1, fail_status=400)  # the fork's call is refused: never succeeds, the fork is DEAD
        fork = fork_run(app, task, "doc:a3", from_step="quality", overrides=["quality.model=gpt-b"])
        with pytest.raises(Exception):  # noqa: B017 - the provider's refusal, as the fork's failure
            fork.get(timeout=JOB)
        [letter] = DeadLetters(db_url).list()
        assert letter.key == fork.key and HEADER_FORK in (letter.message.get("headers") or {})
        legacy = dict(letter.message)
        legacy["headers"] = {k: v for k, v in legacy["headers"].items() if k != HEADER_FORK}
        with engine.begin() as conn:  # what a release before the fork header kept
            conn.execute(update(LETTERS).where(LETTERS.c.id == letter.letter_id).values(message=legacy))
        [letter] = DeadLetters(db_url).list()
        report = DeadLetters(db_url).replay(app, [letter])
        assert [x.letter_id for x in report.replayed] == [letter.letter_id] and report.publish_error is None

        def completed() -> bool:
            with engine.connect() as conn:
                status = conn.execute(select(RUNS.c.status).where(RUNS.c.idempotency_key == fork.key)).scalar_one()
            return status is RunStatus.COMPLETED

        wait_until(completed, timeout=JOB, what="the replayed fork to complete")
    with engine.connect() as conn:
        letters = conn.execute(select(LETTERS.c.reason)).scalars().all()
    assert len(letters) == 1, "replayed as its fork: no new letter for a refused fork-shaped key"


def test_a_fork_needs_kept_or_given_arguments_and_survives_a_store_fault_loading_its_fork(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    task = article(app, responses)  # keep_arguments off: completion clears the message
    fired: list[bool] = []

    def fail_once(_name: str, _context: dict[str, Any]) -> None:
        if not fired:
            fired.append(True)
            raise StoreUnavailable("the database went away right here")

    with worker_factory(app):
        task.delay("b1", TEXT).get(timeout=JOB)
        with pytest.raises(ConfigurationError, match="keep_arguments=True"):
            fork_run(app, task, "doc:b1", from_step="quality")
        with pytest.raises(ConfigurationError, match="no step 'nope'"):
            fork_run(app, task, "doc:b1", from_step="nope", args=["b1", TEXT])
        with fault_injected("fork_load", fail_once):
            handle = fork_run(app, task, "doc:b1", from_step="keywords", args=["b1", TEXT])
            handle.get(timeout=JOB)
    assert fired and creates(fake) == 3 + 2, "re-sent after the fault, the fork paid its two steps once"
    with get_engine(db_url).connect() as conn:
        kept = conn.execute(select(RUNS.c.message).where(RUNS.c.idempotency_key == "doc:b1")).scalar()
    assert redact_arguments(kept) == {"kept": False}


@ON_SQLITE
def test_a_shadow_fork_whose_shadow_write_fails_is_sent_again_and_writes_its_effect_once(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses, tmp_path: Path
) -> None:
    task = article(app, responses, keep_arguments=True)
    shadow_url = f"sqlite:///{tmp_path / 'shadow.db'}"
    shadow = migrated(shadow_url)
    fired: list[str] = []

    def fail_in_the_fork(_name: str, _context: dict[str, Any]) -> None:
        if not fired:  # installed after the source ran: the fork's shadow block is the first to flush
            fired.append("shadow")
            raise StoreUnavailable("the shadow database went away right here")

    with worker_factory(app):
        task.delay("s1", TEXT).get(timeout=JOB)
        with fault_injected("effects_flush", fail_in_the_fork):
            handle = fork_run(app, task, "doc:s1", from_step="quality", effects="shadow", shadow_url=shadow_url)
            handle.get(timeout=JOB)
    assert fired and count_rows(shadow, effects_table, "s1") == 1 and rows(shadow_url, OUTBOX) == 1
    assert count_rows(get_engine(db_url), effects_table, "s1") == 1, "production kept the source's row only"
    assert creates(fake) == 4, "the re-sent fork re-attached to or replayed its paid call"


def test_redacted_arguments_name_sizes_and_digests_never_values() -> None:
    shown = redact_arguments({"args": ["secret-doc"], "kwargs": {"text": "private words"}}, b"k")
    assert "secret-doc" not in repr(shown) and "private words" not in repr(shown)
    assert shown["kwargs"]["text"]["bytes"] == len('"private words"') and shown["args"][0]["type"] == "str"


@ON_SQLITE
def test_the_cli_previews_redacts_and_runs_a_cohort_within_its_cap(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    task = article(app, responses, keep_arguments=True)
    cli = CliRunner()

    def run(*argv: str) -> Any:
        return cli.invoke(oncelery_cli, ["--database-url", db_url, "fork", *argv], obj=SimpleNamespace(app=app))

    change = ("--task", task.name, "--from-step", "quality", "--set", "quality.model=gpt-b")
    with worker_factory(app):
        for doc in ("c1", "c2"):
            task.delay(doc, TEXT).get(timeout=JOB)
        made = creates(fake)
        shown = run("doc:c1", *change, "--dry-run", "--json")
        assert shown.exit_code == 0, shown.output
        document = json.loads(shown.output)
        assert TEXT not in shown.output and document["arguments"]["kept"] is True
        assert document["preview"]["total_micros"] > 0 and "fork" not in document
        assert TEXT in run("doc:c1", *change, "--dry-run", "--show-arguments").output
        refused = run("cohort", *change, "--max-cost-usd", "0.000001", "--yes")
        assert refused.exit_code == 2 and "over --max-cost-usd" in refused.output
        assert "nothing sent" in run("cohort", *change, "--max-cost-usd", "1").output
        assert creates(fake) == made, "a preview makes no call"
        sent = run("cohort", *change, "--max-cost-usd", "1", "--yes", "--json")
        assert sent.exit_code == 0, sent.output
        plan = json.loads(sent.output)
        assert plan["count"] == 2 and len(plan["forks"]) == 2

        def finished() -> bool:
            with get_engine(db_url).connect() as conn:
                done = conn.execute(
                    select(func.count()).where(RUNS.c.idempotency_key.like("fork:%"), RUNS.c.status == "COMPLETED")
                ).scalar_one()
            return int(done) == 2

        poll(finished, JOB)
    assert creates(fake) == made + 2
    # The cohort's forks reserved in one shared budget row, and spent what the ledger says, within the cap.
    with get_engine(db_url).connect() as conn:
        [(name, spent, limit)] = conn.execute(
            select(BUDGETS.c.name, BUDGETS.c.spent_micros, BUDGETS.c.limit_micros).where(
                BUDGETS.c.name.like("cohort:%")
            )
        ).all()
        ledger = conn.execute(
            select(func.sum(CALLS.c.cost_micros)).where(CALLS.c.idempotency_key.like("fork:%"))
        ).scalar_one()
    assert 0 < spent == ledger <= limit == 1_000_000 and name == f"cohort:{plan['forks'][0]['id']}"
    diff = run("diff", str(plan["forks"][0]["id"]), "--json")
    assert diff.exit_code == 0 and json.loads(diff.output)["count"] == 3
    # Retention clears kept arguments (here: all, age 0), never the runs.
    report = purge(Database(db_url), 10**9, kept_older_than=0)
    assert report.kept_arguments == 4 and report.runs == 0
    assert redact_arguments(kept_message(db_url, "doc:c1")) == {"kept": False}


def kept_message(db_url: str, key: str) -> Any:
    with get_engine(db_url).connect() as conn:
        return conn.execute(select(RUNS.c.message).where(RUNS.c.idempotency_key == key)).scalar()
