"""Debounce: a burst of edits of one key makes one run, on the latest edit; an older edit's message is acked
`debounced`; a run in flight for an older edit is fenced out (`superseded`) and its effects never commit.

Real in-process workers on the real Redis broker, the real relay loop (its dispatcher sends due bursts through
the outbox), the fake provider whose creates and cancels are the oracle, both stores, compressed periods.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from sqlalchemy import select

from oncelery import Debounce, DebouncedResult, IdempotentTask, output_text
from oncelery.basetask import producer
from oncelery.cli import oncelery as oncelery_cli
from oncelery.errors import ConfigurationError, UnknownOption
from oncelery.fake_provider import FakeProvider, Knobs
from oncelery.llm.adapters.openai_responses import OpenAIResponses
from oncelery.models import IntentState, OutboxStatus, RunStatus
from oncelery.relay.debounce import dispatch_due
from oncelery.runs.debounce import SUPERSEDED_LABEL, any_due, purge_dispatched, upsert_edit
from oncelery.store.database import Database, get_engine
from oncelery.store.tables import CALLS, DEBOUNCE, INTENTS, LABEL_TOTALS, OUTBOX, RUNS
from oncelery.testing import relay_running, wait_until
from tests.conftest import ON_POSTGRESQL, ON_SQLITE
from tests.services import effects_table, run_to_completion
from tests.test_outbox import REPO, relay_env

JOB = 60.0
PERIOD = 0.3  # compressed: production's would be tens of seconds
STEPS = ("summarize", "score")


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """A fake provider answering fast (each test slows it where it needs a call in flight)."""
    with FakeProvider(Knobs(poll_after_ms=10, generation_s=0.01)) as provider:
        yield provider


def scorer(app: Celery, adapter: Any, on_running: str = "supersede", **options: Any) -> Any:
    """A two-call article scorer debounced per document; its effect row names the version it scored."""

    @app.task(
        shared=False, base=IdempotentTask, bind=True, name="oncelery.t_debounce",
        idempotency_key="doc:{doc}:v{version}",
        debounce=Debounce(key="doc:{doc}", period=PERIOD, max_wait=10 * PERIOD, on_running=on_running),
        llm_adapter=adapter, **{"llm_inline_wait": None, **options},
    )  # fmt: skip
    def score(self: IdempotentTask, doc: str, version: int, text: str) -> dict[str, Any]:
        for step in STEPS:
            text = output_text(self.llm(step, adapter=adapter, model="gpt-a", input=text, max_output_tokens=40))
        with self.effects() as session:
            session.execute(effects_table.insert().values(key=f"{doc}:v{version}", pid=os.getpid()))
        return {"doc": doc, "version": version, "text": text}

    return score


def rows(db_url: str, which: Any) -> list[dict[str, Any]]:
    with get_engine(db_url).connect() as conn:
        return [dict(r._mapping) for r in conn.execute(select(which))]


def effects(db_url: str) -> list[str]:
    return sorted(r["key"] for r in rows(db_url, effects_table))


def test_a_burst_of_edits_makes_one_run_per_document_on_its_latest_version(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    task = scorer(app, responses)
    docs, edits = 10, 10
    handles: dict[str, list[Any]] = {}
    # All the edits before any dispatcher runs: one burst per document, however slow this machine is.
    for version in range(1, edits + 1):
        for d in range(docs):
            handles.setdefault(f"d{d}", []).append(task.delay(f"d{d}", version, f"Article {d}, version {version}."))
    for doc, hs in handles.items():
        # Every call of one burst returns the handle of the one run that will carry its latest edit.
        assert all(isinstance(h, DebouncedResult) for h in hs) and len({h.id for h in hs}) == 1, doc
        assert [h.debounce_seq for h in hs] == list(range(1, edits + 1))
    assert rows(db_url, OUTBOX) == []  # nothing published yet: no long countdown anywhere
    with worker_factory(app, concurrency=4), relay_running(app, db_url):
        got = {doc: hs[-1].get(timeout=JOB) for doc, hs in handles.items()}
    assert {doc: (g["doc"], g["version"]) for doc, g in got.items()} == {f"d{d}": (f"d{d}", edits) for d in range(docs)}
    assert effects(db_url) == sorted(f"d{d}:v{edits}" for d in range(docs))
    runs = rows(db_url, RUNS)
    assert len(runs) == docs and {r["status"] for r in runs} == {RunStatus.COMPLETED}
    assert len(rows(db_url, CALLS)) == docs * len(STEPS)  # the ledger: calls = runs x steps
    assert sum(fake.stats()["creates_by_intent"].values()) == docs * len(STEPS)
    assert task.outcome_counts() == {"executed": docs}
    for row in rows(db_url, DEBOUNCE):  # dispatched: the arguments are in the outbox row, not kept here
        assert row["seq"] == row["dispatched_seq"] == edits and row["args"] is None and row["kwargs"] is None


def test_a_sent_burst_overtaken_by_a_newer_edit_is_acked_as_debounced(
    app: Celery, worker_factory: Any, db_url: str, responses: OpenAIResponses
) -> None:
    task = scorer(app, responses)
    first = task.delay("a", 1, "First version.")
    db = Database(db_url)
    # The dispatcher sends burst 1 (due after PERIOD) into the outbox; no worker runs yet.
    wait_until(lambda: dispatch_due(app, db) == 1, timeout=JOB, what="burst 1 to be due and dispatched")
    second = task.delay("a", 2, "Second version.")  # a new burst: a new handle
    assert second.id != first.id and second.debounce_seq == 2
    with worker_factory(app, concurrency=2), relay_running(app, db_url):
        assert second.get(timeout=JOB)["version"] == 2
        assert first.get(timeout=JOB) is None  # acked without a run: the newer handle carries the latest
    assert effects(db_url) == ["a:v2"]
    assert task.outcome_counts() == {"debounced": 1, "executed": 1}
    [sent_first] = [r for r in rows(db_url, OUTBOX) if r["celery_task_id"] == first.id]
    assert sent_first["status"] is OutboxStatus.DONE and sent_first["outcome"] == "debounced"


def test_runs_superseded_mid_call_write_no_effects_and_their_spend_stays_labelled(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    task = scorer(app, responses, lease=0.6)  # renewed (and asked about newer edits) every 0.2 s
    docs = 4
    fake.set_knobs(generation_s=2.5)  # a call is in flight for 2.5 s: superseded well before it ends
    with worker_factory(app, concurrency=docs), relay_running(app, db_url):
        old = [task.delay(f"s{d}", 1, f"Old text {d}.") for d in range(docs)]
        # Each old run has paid its first call (a ledger row) and is in its second when the new edits come: its
        # second create is at the provider (waiting for the rows alone raced a slow run still between its calls).
        wait_until(lambda: len(rows(db_url, CALLS)) == docs, timeout=JOB, what="each old run's first call paid")
        wait_until(
            lambda: sum(fake.stats()["creates_by_intent"].values()) == 2 * docs,
            timeout=JOB, what="each old run's second call created",
        )  # fmt: skip
        new = [task.delay(f"s{d}", 2, f"New text {d}.") for d in range(docs)]
        wait_until(lambda: task.outcome_counts().get("superseded") == docs, timeout=JOB, what="old runs superseded")
        fake.set_knobs(generation_s=0.01)
        got = [h.get(timeout=JOB) for h in new]
        assert [h.get(timeout=JOB) for h in old] == [None] * docs
    assert [g["version"] for g in got] == [2] * docs
    assert effects(db_url) == sorted(f"s{d}:v2" for d in range(docs))  # 0 effect rows from superseded runs
    assert task.outcome_counts() == {"superseded": docs, "executed": docs}
    old_runs = {r["id"] for r in rows(db_url, RUNS) if r["idempotency_key"].endswith(":v1")}
    assert len(old_runs) == docs
    for run in rows(db_url, RUNS):
        assert run["status"] is RunStatus.COMPLETED
        if run["id"] in old_runs:
            assert run["result"] is None and run["error"].startswith("superseded")
    # Each old run's call in flight gets its own ledger row at its estimate with the supersede (the ledger rule:
    # a cancel is best effort), and is then cancelled at the provider.
    assert len(rows(db_url, CALLS)) == 2 * docs + docs * len(STEPS)
    # Each old call the provider has is cancelled: by the canceller (its reference was saved), or by its own holder
    # fenced out before it could save it (nobody could find it again).
    old_calls_at_provider = {
        i["public_id"] for i in rows(db_url, INTENTS) if i["run_id"] in old_runs and i["state"] is not IntentState.DONE
    } & set(fake.stats()["creates_by_intent"])
    assert len(old_calls_at_provider) == docs
    wait_until(lambda: fake.stats()["cancels"] == docs, timeout=JOB, what="the old calls cancelled")
    calls = rows(db_url, CALLS)
    old_calls = [c for c in calls if c["run_id"] in old_runs]
    assert sorted(c["reason"] for c in old_calls) == [SUPERSEDED_LABEL] * 2 * docs  # paid + cancelled
    assert sum(1 for c in old_calls if c["meta"].get("estimated") and not c["ok"]) == docs
    assert [c["reason"] for c in calls if c["run_id"] not in old_runs] == [None] * docs * len(STEPS)
    labels = {(r["label"], r["calls"]) for r in rows(db_url, LABEL_TOTALS)}
    assert labels == {(SUPERSEDED_LABEL, 2 * docs)}
    stats = fake.stats()
    assert stats["cancels"] == docs, stats  # each old run's call in flight, cancelled
    assert sum(stats["creates"].values()) <= len(calls), stats  # no hidden spend: creates <= ledger rows


def test_an_identical_edit_of_a_running_run_is_answered_by_that_run_not_superseding_it(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    task = scorer(app, responses, lease=0.6)  # asked about newer edits every 0.2 s
    fake.set_knobs(generation_s=0.6)  # each call in flight for 0.6 s: several renewals ask while the run runs
    with worker_factory(app, concurrency=2), relay_running(app, db_url):
        first = task.delay("i", 1, "Same text.")
        wait_until(lambda: len(rows(db_url, CALLS)) == 1, timeout=JOB, what="the run's first call paid")
        again = task.delay("i", 1, "Same text.")  # the same edit again: the same key, a new burst
        assert again.id != first.id and again.debounce_seq == 2
        # The second burst's message finds the run in flight and waits for it; the run is never fenced out.
        got = first.get(timeout=JOB)
        assert got is not None and got["version"] == 1, "the run was superseded by its own edit"
        assert again.get(timeout=JOB) == got
    assert effects(db_url) == ["i:v1"]
    counts = task.outcome_counts()
    assert "superseded" not in counts and counts["executed"] == 1 and counts.get("replayed") == 1, counts
    assert sum(fake.stats()["creates_by_intent"].values()) == len(STEPS), "the edit paid nothing again"


def test_a_later_edit_with_the_key_of_a_superseded_run_runs_it_again_instead_of_replaying_none(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    task = scorer(app, responses, lease=0.6)
    fake.set_knobs(generation_s=0.6)
    with worker_factory(app, concurrency=2), relay_running(app, db_url):
        old = task.delay("u", 1, "Version one.")
        wait_until(lambda: len(rows(db_url, CALLS)) == 1, timeout=JOB, what="the v1 run's first call paid")
        task.delay("u", 2, "Version two.")
        wait_until(lambda: task.outcome_counts().get("superseded") == 1, timeout=JOB, what="the v1 run superseded")
        back = task.delay("u", 1, "Version one.")  # back to v1: its key is the superseded run's
        got = back.get(timeout=JOB)
        assert got is not None and got["version"] == 1, "the superseded run's empty result was replayed"
        assert old.get(timeout=JOB) is None  # the superseded delivery itself answered nothing
    assert effects(db_url) == ["u:v1"]  # v2 was superseded (or never ran); v1 ran to completion, once
    [v1] = [r for r in rows(db_url, RUNS) if r["idempotency_key"].endswith(":v1")]
    assert v1["status"] is RunStatus.COMPLETED and v1["result"]["version"] == 1 and v1["error"] is None


@ON_SQLITE  # the same SQL as the test above; what differs is the parked run's wake
def test_a_run_parked_waiting_is_superseded_at_its_wake_and_writes_no_effects(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    task = scorer(app, responses, lease=0.6, llm_inline_wait=0.1)  # a call past 0.1 s parks the run WAITING
    fake.set_knobs(generation_s=1.5)
    with worker_factory(app, concurrency=2), relay_running(app, db_url):
        old = task.delay("w", 1, "Old.")
        waiting = lambda: [r for r in rows(db_url, RUNS) if r["status"] is RunStatus.WAITING]  # noqa: E731
        wait_until(lambda: len(waiting()) == 1, timeout=JOB, what="the old run parked")
        new = task.delay("w", 2, "New.")
        # No renewal runs while it waits: its wake finds the newer edit and fences it out.
        wait_until(lambda: task.outcome_counts().get("superseded") == 1, timeout=JOB, what="the parked run superseded")
        fake.set_knobs(generation_s=0.01)
        assert new.get(timeout=JOB)["version"] == 2
        assert old.get(timeout=JOB) is None
    assert effects(db_url) == ["w:v2"]
    assert fake.stats()["cancels"] == 1
    counts = task.outcome_counts()
    assert (
        counts["superseded"] == 1 and counts["executed"] == 1 and set(counts) <= {"superseded", "executed", "waiting"}
    )


@ON_POSTGRESQL  # no store difference: only the option's meaning
def test_on_running_finish_lets_the_older_run_finish(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    task = scorer(app, responses, on_running="finish", lease=0.6)
    fake.set_knobs(generation_s=0.8)
    with worker_factory(app, concurrency=2), relay_running(app, db_url):
        old = task.delay("f", 1, "Old.")
        wait_until(lambda: len(rows(db_url, CALLS)) == 1, timeout=JOB, what="the old run's first call paid")
        new = task.delay("f", 2, "New.")
        assert old.get(timeout=JOB)["version"] == 1 and new.get(timeout=JOB)["version"] == 2
    assert effects(db_url) == ["f:v1", "f:v2"]
    assert task.outcome_counts() == {"executed": 2}


def test_racing_producers_on_one_key_get_distinct_sequences_in_one_burst(db_url: str) -> None:
    db = Database(db_url)
    spec = Debounce(key="doc:{doc}", period=30, max_wait=300)
    n = 8
    barrier = threading.Barrier(n)
    edits: list[tuple[int, Any]] = []

    def edit(i: int) -> None:
        barrier.wait()
        edits.append((i, upsert_edit(db, "t", "", "doc:x", ([i], {}, {}), spec, f"task-{i}")))

    threads = [threading.Thread(target=edit, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=JOB)
    assert sorted(e.seq for _, e in edits) == list(range(1, n + 1))
    [first] = [i for i, e in edits if e.seq == 1]
    assert {e.task_id for _, e in edits} == {f"task-{first}"}  # one burst: the first edit's task id
    [row] = rows(db_url, DEBOUNCE)
    [latest] = [i for i, e in edits if e.seq == n]
    assert row["seq"] == n and row["dispatched_seq"] == 0 and row["args"] == [latest]  # the last edit's arguments


@ON_SQLITE  # no database involved: the option is checked where the task is defined
def test_a_bad_debounce_option_fails_at_decoration_naming_the_fix(app: Celery) -> None:
    def define(**options: Any) -> Any:
        @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_debounce_bad", **options)
        def job(self: IdempotentTask, doc: str) -> str:
            return doc

        _ = job.name  # evaluates Celery's lazy proxy: the task class is made and checked here
        return job

    with pytest.raises(ConfigurationError, match="Debounce"):
        define(debounce={"key": "doc:{doc}"})
    with pytest.raises(ConfigurationError, match="max_wait >= period"):
        define(debounce=Debounce(key="doc:{doc}", period=10, max_wait=5))
    with pytest.raises(ConfigurationError, match="supersede, finish"):
        define(debounce=Debounce(key="doc:{doc}", on_running="cancel"))
    with pytest.raises(ConfigurationError, match="nope"):
        define(debounce=Debounce(key="doc:{nope}"))
    with pytest.raises(UnknownOption, match="debounce"):
        define(debounse=Debounce(key="doc:{doc}"))


@pytest.mark.parametrize(
    ("db_url", "point"),
    [("sqlite", "debounce_dispatched"), ("postgresql", "relay_published")],  # a kill point per store, alternating
    indirect=["db_url"],
)
def test_a_dispatcher_killed_mid_dispatch_still_makes_one_run_per_document_on_its_latest_version(
    app: Celery, worker_factory: Any, db_url: str, point: str, responses: OpenAIResponses
) -> None:
    task = scorer(app, responses)
    docs, edits = 10, 5
    handles = [[task.delay(f"k{d}", v, f"Doc {d} v{v}.") for d in range(docs)] for v in range(1, edits + 1)]
    db = Database(db_url)
    wait_until(lambda: any_due(db) and not pending_not_due(db_url), timeout=JOB, what="every burst due")
    code, out, err = run_to_completion(
        [sys.executable, "-m", "tests.apps.debounce_relay", point],
        cwd=REPO,
        env=relay_env(db_url, str(app.conf.task_default_queue)),
        timeout=JOB,
        on_timeout=lambda _out: None,
    )
    assert code == -signal.SIGKILL, f"exit {code}\n--- stdout\n{out}\n--- stderr\n{err}"
    dispatched = {r["dispatched_seq"] for r in rows(db_url, DEBOUNCE)}
    sent = rows(db_url, OUTBOX)
    if point == "debounce_dispatched":  # killed before its commit: nothing taken, nothing in the outbox
        assert dispatched == {0} and sent == []
    else:  # committed and published, not marked: the next round publishes every burst again
        assert dispatched == {edits} and {r["status"] for r in sent} == {OutboxStatus.PENDING} and len(sent) == docs
    with worker_factory(app, concurrency=4), relay_running(app, db_url):
        got = [h.get(timeout=JOB) for h in handles[-1]]
    assert [g["version"] for g in got] == [edits] * docs
    assert effects(db_url) == sorted(f"k{d}:v{edits}" for d in range(docs))  # one run per document, the latest
    assert len(rows(db_url, RUNS)) == docs
    counts = task.outcome_counts()
    assert counts["executed"] == docs and set(counts) <= {"executed", "replayed", "in_progress"}, counts


def pending_not_due(db_url: str) -> bool:
    """Whether a burst is still waiting for its due time (database clock)."""
    db = Database(db_url)
    d = DEBOUNCE.c
    with db.read() as conn:
        query = select(d.seq).where(d.seq > d.dispatched_seq, d.due_at > db.dialect.now()).limit(1)
        return conn.execute(query).first() is not None


@ON_SQLITE  # the interplay is the delivery's order of checks, the same SQL on both stores
def test_with_entity_version_a_later_burst_carrying_an_older_version_ends_stale(
    app: Celery, worker_factory: Any, db_url: str, responses: OpenAIResponses
) -> None:
    task = scorer(app, responses, entity_version="version", concurrency_key="doc:{doc}")
    first = [task.delay("e", v, f"Version {v}.") for v in (1, 3)]
    with worker_factory(app, concurrency=2), relay_running(app, db_url):
        assert first[-1].get(timeout=JOB)["version"] == 3
        late = task.delay("e", 2, "Version 2, arriving last.")  # the latest edit to arrive, an older version
        assert late.id != first[-1].id
        assert late.get(timeout=JOB) is None
    assert effects(db_url) == ["e:v3"]
    assert task.outcome_counts() == {"executed": 1, "stale": 1}


def test_retention_deletes_dispatched_rows_and_never_a_pending_burst(db_url: str) -> None:
    db = Database(db_url)
    spec = Debounce(key="doc:{doc}", period=0.2, max_wait=1.0)
    for key in ("doc:sent", "doc:pending"):
        upsert_edit(db, "t", "", key, (["x"], {}, {}), spec, f"id-{key}")
    with db.begin() as conn:  # only doc:sent is dispatched: doc:pending's due time is pushed back
        conn.execute(DEBOUNCE.update().where(DEBOUNCE.c.debounce_key == "doc:sent").values(dispatched_seq=1))
    assert purge_dispatched(db, 3600.0) == 0  # idle for less than the retention
    assert purge_dispatched(db, 0.0) == 1
    assert [(r["debounce_key"], r["args"]) for r in rows(db_url, DEBOUNCE)] == [("doc:pending", ["x"])]


def test_racing_dispatchers_send_each_due_burst_once(app: Celery, db_url: str, responses: OpenAIResponses) -> None:
    task = scorer(app, responses)
    for d in range(20):
        task.delay(f"r{d}", 1, "Text.")
    db = Database(db_url)
    wait_until(lambda: any_due(db) and not pending_not_due(db_url), timeout=JOB, what="every burst due")
    n = 4
    barrier = threading.Barrier(n)
    moved: list[int] = []

    def dispatch() -> None:
        barrier.wait()
        moved.append(dispatch_due(app, Database(db_url)))

    threads = [threading.Thread(target=dispatch) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=JOB)
    assert sum(moved) == 20 and len(moved) == n
    sent = rows(db_url, OUTBOX)
    assert len(sent) == 20 and len({r["celery_task_id"] for r in sent}) == 20


@ON_SQLITE  # the producer's own fallback: no worker, no broker message read
def test_a_producer_whose_database_fails_publishes_the_edit_undebounced(
    app: Celery, tmp_path: Any, published: list[str], responses: OpenAIResponses
) -> None:
    task = scorer(app, responses)
    app.conf.oncelery_database_url = f"sqlite:///{tmp_path / 'missing' / 'claims.db'}"  # no such folder
    handle = task.delay("x", 1, "Text.")
    assert not isinstance(handle, DebouncedResult) and published == [task.name]


@ON_POSTGRESQL  # a row lock another transaction holds: the producer's bound, not the driver's, decides
def test_a_producer_blocked_on_a_held_debounce_row_publishes_the_edit_undebounced_within_its_bound(
    app: Celery, worker_factory: Any, db_url: str, published: list[str], responses: OpenAIResponses
) -> None:
    task = scorer(app, responses)
    app.conf.oncelery_producer_timeout = 0.2
    first = task.delay("held", 1, "First version.")
    assert isinstance(first, DebouncedResult) and published == []
    holder = get_engine(db_url).connect()
    try:
        tx = holder.begin()
        holder.execute(select(DEBOUNCE.c.seq).where(DEBOUNCE.c.debounce_key == "doc:held").with_for_update())
        second = task.delay("held", 2, "Second version.")  # blocked on the row: fails open after 0.2 s
        assert not isinstance(second, DebouncedResult) and published == [task.name]
        third = task.delay("held", 3, "Third version.")  # cooling down: published at once, no second wait
        assert not isinstance(third, DebouncedResult) and published == [task.name, task.name]
        tx.rollback()
    finally:
        holder.close()
        producer._cooldown.clear()  # the session's database must not stay "down" for the next test
    # Nothing is lost: the edits published undebounced run as they are, the recorded one runs when due.
    with worker_factory(app, concurrency=2), relay_running(app, db_url):
        assert second.get(timeout=JOB)["version"] == 2 and third.get(timeout=JOB)["version"] == 3
        assert first.get(timeout=JOB)["version"] == 1
    assert effects(db_url) == ["held:v1", "held:v2", "held:v3"]
    [row] = rows(db_url, DEBOUNCE)
    assert row["seq"] == row["dispatched_seq"] == 1  # the blocked edits never reached the row


def test_the_cli_lists_pending_bursts_with_their_arguments_redacted_unless_asked(db_url: str) -> None:
    db = Database(db_url)
    spec = Debounce(key="doc:{doc}", period=60, max_wait=300)
    secret = "patient Jane Roe, card 4111-1111"
    for n in (1, 2):
        upsert_edit(db, "oncelery.t_cli", "", "doc:p", (["p", n], {"text": secret}, {}), spec, "burst-1")
    cli = CliRunner()

    def listing(*argv: str) -> dict[str, Any]:
        done = cli.invoke(oncelery_cli, ["--database-url", db_url, "debounce", "--json", *argv])
        assert done.exit_code == 0, done.output
        return dict(json.loads(done.output))

    [row] = listing("--pending")["rows"]
    assert (row["debounce_key"], row["seq"], row["dispatched_seq"], row["state"]) == ("doc:p", 2, 0, "pending")
    assert row["task_id"] == "burst-1" and 0 < row["due_in_s"] <= 60
    assert row["arguments"]["kept"] is True and secret not in json.dumps(row)  # described, never printed
    assert row["arguments"]["kwargs"]["text"]["bytes"] == len(json.dumps(secret))
    shown = listing("--show-arguments")["rows"][0]["arguments"]
    assert shown == {"args": ["p", 2], "kwargs": {"text": secret}}  # the latest edit's, when asked
    assert listing("--task", "oncelery.other")["count"] == 0
    table = cli.invoke(oncelery_cli, ["--database-url", db_url, "debounce"])
    assert "doc:p" in table.output and "pending" in table.output and secret not in table.output
