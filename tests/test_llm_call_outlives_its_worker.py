"""A model call outlives the worker that made it: real `celery worker` subprocesses, SIGKILLed (or SIGSTOPped)
at each point of the call, against the fake provider, whose count of creates per intent is the oracle.

Kill points and what the next holder must do (issue "an LLM call that outlives its worker"):

    | killed                                   | next holder               | creates for the step |
    |------------------------------------------|---------------------------|----------------------|
    | before the create (intent prepared)      | re-send, labelled         | 1 (0 repeated)       |
    | in the create window (created, not sent) | re-send, labelled         | 2 (1 labelled)       |
    | after the reference commits (mid-poll)   | re-attach                 | 1                    |
    | after the result, before the checkpoint  | re-attach                 | 1                    |
    | a zombie (SIGSTOP past its lease)        | re-attach; zombie fenced  | 1                    |

Every job ends with one effect. The kill points alternate the store (SQLite, PostgreSQL), as the other crash
tests do; each store runs its jobs on one worker (prefork, 2 children), so the cost is one worker start each.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from oncelery.fake_provider import FakeProvider, Knobs, generate_text
from oncelery.models import IntentState
from oncelery.store.tables import CALLS, INTENTS
from tests.services import proc_state, wait_for
from tests.test_crash import JOB_TIMEOUT, Cluster, cluster

pytestmark = pytest.mark.crash

LLM_TASK = "oncelery.crash_llm"
TEXT = "Rain is expected over the coast on Friday, the weather service said."
ANSWER = generate_text("gpt-crash", TEXT)


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """The provider the workers call (a thread of this test, on 127.0.0.1); its calls take 0.3 s."""
    with FakeProvider(Knobs(generation_s=0.3, poll_after_ms=50)) as provider:
        yield provider


def started(c: Cluster, tmp_path: Path, fake: FakeProvider) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    c.env.update(ONCELERY_FAKE_PROVIDER_URL=fake.url, ONCELERY_CRASH_MARKS=str(marks))
    c.wait_ready(c.start("llm", concurrency=2))


def intents_of(c: Cluster, key: str, task: str = LLM_TASK, prefix: str = "llm") -> list[dict[str, Any]]:
    run = c.store.get(task, f"{prefix}:{key}")
    assert run is not None
    with c.engine.connect() as conn:
        rows = conn.execute(select(INTENTS).where(INTENTS.c.run_id == run.run_id).order_by(INTENTS.c.attempt))
        return [dict(r._mapping) for r in rows]


def ledger_of(c: Cluster, key: str, prefix: str = "llm") -> list[dict[str, Any]]:
    with c.engine.connect() as conn:
        rows = conn.execute(select(CALLS).where(CALLS.c.idempotency_key == f"{prefix}:{key}").order_by(CALLS.c.id))
        return [dict(r._mapping) for r in rows]


def creates(fake: FakeProvider, intents: list[dict[str, Any]]) -> list[int]:
    by_intent = fake.stats()["creates_by_intent"]
    return [by_intent.get(i["public_id"], 0) for i in intents]


def run_killed_jobs(c: Cluster, points: list[str]) -> dict[str, str]:
    """Send one job per kill point (its child is SIGKILLed there once); wait for every result."""
    keys = {point: f"{point}-{uuid.uuid4().hex[:6]}" for point in points}
    results = {p: c.sender.send_task(LLM_TASK, args=[k, TEXT], kwargs={"at": p}) for p, k in keys.items()}
    for point, result in results.items():
        value = result.get(timeout=JOB_TIMEOUT)
        assert value["text"] == ANSWER, point
        assert c.effects(keys[point]) == 1, f"{point}: one effect"
        assert c.executions(keys[point]) == 2, f"{point}: killed once, finished by the next holder"
    return keys


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_killed_before_the_create_or_mid_poll(tmp_path: Path, db_url: str, redis_url: str, fake: FakeProvider) -> None:
    with cluster(tmp_path, db_url, redis_url, lease=2) as c:
        started(c, tmp_path, fake)
        keys = run_killed_jobs(c, ["llm_create", "llm_poll"])

        before = intents_of(c, keys["llm_create"])
        assert [(i["state"], i["repeat_reason"] and i["repeat_reason"].value) for i in before] == [
            (IntentState.LOST, None),
            (IntentState.DONE, "create_window"),
        ]
        assert creates(fake, before) == [0, 1], "never sent before the kill: no call was paid twice"
        assert [r["reason"] for r in ledger_of(c, keys["llm_create"])] == ["unknown_outcome", "create_window"]

        polled = intents_of(c, keys["llm_poll"])
        assert [i["state"] for i in polled] == [IntentState.DONE] and creates(fake, polled) == [1]
        [row] = ledger_of(c, keys["llm_poll"])
        assert row["reattached"] is True and row["ok"] is True


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_killed_in_the_create_window_or_before_the_checkpoint_and_a_zombie(
    tmp_path: Path, db_url: str, redis_url: str, fake: FakeProvider
) -> None:
    with cluster(tmp_path, db_url, redis_url, lease=2) as c:
        started(c, tmp_path, fake)
        zombie_key = f"zombie-{uuid.uuid4().hex[:6]}"
        first = c.sender.send_task(LLM_TASK, args=[zombie_key, TEXT], kwargs={"at": "llm_poll", "sig": "SIGSTOP"})
        zombie = c.wait_executing(zombie_key)
        wait_for(lambda: proc_state(zombie) == "T", timeout=JOB_TIMEOUT, what="the holder to stop at its poll")
        try:
            # The same job again: the other child waits out the stopped holder's lease, then re-attaches.
            taker = c.sender.send_task(LLM_TASK, args=[zombie_key, TEXT]).get(timeout=JOB_TIMEOUT)
            assert taker["text"] == ANSWER and taker["pid"] != zombie
        finally:
            os.kill(zombie, signal.SIGCONT)
        # The zombie wakes, polls the same reference (free) and is fenced out of every write.
        assert first.get(timeout=JOB_TIMEOUT) == taker
        assert c.effects(zombie_key) == 1 and c.effect_pids(zombie_key) == [taker["pid"]]
        zombie_intents = intents_of(c, zombie_key)
        assert [i["state"] for i in zombie_intents] == [IntentState.DONE] and creates(fake, zombie_intents) == [1]
        assert len(ledger_of(c, zombie_key)) == 1, "only the live holder's row"

        keys = run_killed_jobs(c, ["llm_created", "step_save"])
        window = intents_of(c, keys["llm_created"])
        assert [i["repeat_reason"] and i["repeat_reason"].value for i in window] == [None, "create_window"]
        assert creates(fake, window) == [1, 1], "the create window: one call paid twice, and labelled"
        rows = ledger_of(c, keys["llm_created"])
        assert len(rows) == 2 and [r["reason"] for r in rows] == ["unknown_outcome", "create_window"]

        saved = intents_of(c, keys["step_save"])
        assert [i["state"] for i in saved] == [IntentState.DONE] and creates(fake, saved) == [1]
        [row] = ledger_of(c, keys["step_save"])
        assert row["reattached"] is True
