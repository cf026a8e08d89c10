"""A job whose worker is SIGKILLed on Redis is back within its lease, not the visibility timeout, by default.

A synchronous model call's worker (`celery worker`, prefork) is killed whole (host loss) right after the fake
provider answered the call and before the answer was recorded. Its message stays in kombu's unacked hash, and
with the workers' visibility timeout at an hour kombu would give it back in an hour. The relay's sweeper sees
the run's lease expire by the database clock and puts that message back on its queue at once
(oncelery.relay.unacked); the surviving worker takes the run over. The task declares no `store_message`: the run
kept no copy of its message in the database.

Then `oncelery runs show` tells the truth about the killed call: its intent `lost` (nobody recorded the answer)
with an `unknown_outcome` row at the estimate, shown as outcome `unknown`, never `failed`; the second attempt
`done`, labelled `sync_unknown`. The fake provider's own count of creates is the oracle: two, each on the books.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner

from oncelery import CELERY_DELIVERY_DEFAULTS
from oncelery.cli import oncelery as oncelery_cli
from oncelery.fake_provider import FakeProvider, Knobs, generate_text
from oncelery.models import IntentState, RunStatus
from oncelery.store.clock import stored_message
from oncelery.store.tables import RUNS
from oncelery.testing import relay_running
from tests.services import proc_state, wait_for
from tests.test_crash import JOB_TIMEOUT, Cluster, cluster
from tests.test_llm_call_outlives_its_worker import creates, intents_of, ledger_of
from tests.test_visibility_timeout import own_bookkeeping

pytestmark = pytest.mark.crash

TASK = "oncelery.crash_llm_sync"
TEXT = "The river rose two metres overnight and the old bridge was closed to traffic."
ANSWER = generate_text("gpt-crash", TEXT)
HOUR = 3600


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """The provider the workers call (a thread of this test, on 127.0.0.1)."""
    with FakeProvider(Knobs(generation_s=0.1)) as provider:
        yield provider


def relay_app(c: Cluster) -> Celery:
    """An app as the relay process has it: the workers' broker and their unacked bookkeeping names."""
    app = Celery(f"relay-{c.queue}")
    app.conf.update(
        **CELERY_DELIVERY_DEFAULTS,
        broker_url=c.broker_url,
        task_default_queue=c.queue,
        broker_transport_options=own_bookkeeping(c.queue),
        broker_connection_retry_on_startup=True,
    )
    return app


def show(db_url: str, key: str) -> Any:
    """`oncelery runs show --json` of the job's run."""
    argv = ["--database-url", db_url, "runs", "show", f"llmsync:{key}", "--task", TASK, "--json"]
    result = CliRunner().invoke(oncelery_cli, argv)
    assert result.exit_code == 0, result.output
    [run] = json.loads(result.output)["runs"]
    return run


@pytest.mark.parametrize("db_url", ["sqlite", "postgresql"], indirect=True)
def test_a_sync_call_whose_worker_is_killed_is_back_within_the_lease(
    tmp_path: Path, db_url: str, redis_url: str, fake: FakeProvider
) -> None:
    key = f"sync-{uuid.uuid4().hex[:8]}"
    with cluster(tmp_path, db_url, redis_url, lease=2, visibility_timeout=HOUR) as c:
        marks = tmp_path / "marks"
        marks.mkdir()
        c.env.update(ONCELERY_FAKE_PROVIDER_URL=fake.url, ONCELERY_CRASH_MARKS=str(marks))
        holder = c.start("holder")
        c.wait_ready(holder)
        # Stopped (not killed) at the point, so that the whole worker can then be killed at once: a pool child
        # killed alone is requeued by its parent, which is not what this test is about.
        result = c.sender.send_task(TASK, args=[key, TEXT], kwargs={"at": "llm_created", "sig": "SIGSTOP"})
        child = c.wait_executing(key)
        wait_for(lambda: proc_state(child) == "T", timeout=JOB_TIMEOUT, what="the holder to stop once answered")
        assert sum(fake.stats()["creates"].values()) == 1, "the provider answered the call the holder never recorded"
        os.killpg(holder.pid, signal.SIGKILL)
        holder.proc.wait(timeout=30)

        survivor = c.start("survivor")
        c.wait_ready(survivor)
        with relay_running(relay_app(c), db_url, sweep_interval=30.0):
            # An hour's visibility timeout: only the sweeper can bring the job back within this wait.
            value = result.get(timeout=JOB_TIMEOUT)
        assert value["text"] == ANSWER and value["pid"] != child
        assert c.effects(key) == 1 and c.executions(key) == 2
        assert survivor.log().count("] received") == 1, "put back once (a restore is not a re-send)"

        run = c.store.get(TASK, f"llmsync:{key}")
        assert run is not None and run.status is RunStatus.COMPLETED and run.token == 2
        with c.engine.connect() as conn:
            kept = conn.execute(RUNS.select().where(RUNS.c.id == run.run_id, stored_message(RUNS.c.message)))
            assert kept.first() is None, "no copy of the message was kept in the database for the recovery"

        intents = intents_of_sync(c, key)
        assert [(i["state"], i["repeat_reason"] and i["repeat_reason"].value) for i in intents] == [
            (IntentState.LOST, None),
            (IntentState.DONE, "sync_unknown"),
        ]
        assert creates(fake, intents) == [1, 1], "a sync call cannot be re-attached to: paid twice, labelled"
        rows = ledger_of_sync(c, key)
        assert [r["reason"] for r in rows] == ["unknown_outcome", "sync_unknown"]

        shown = show(db_url, key)
        assert [(i["state"], i["label"]) for i in shown["intents"]] == [
            ("lost", "unknown_outcome"),
            ("done", "sync_unknown"),
        ]
        assert [call["outcome"] for call in shown["model_calls"]] == ["unknown", "ok"], "never `failed`"


def intents_of_sync(c: Cluster, key: str) -> list[dict[str, Any]]:
    """The job's intents, oldest attempt first."""
    return intents_of(c, key, task=TASK, prefix="llmsync")


def ledger_of_sync(c: Cluster, key: str) -> list[dict[str, Any]]:
    """The job's ledger rows, oldest first."""
    return ledger_of(c, key, prefix="llmsync")
