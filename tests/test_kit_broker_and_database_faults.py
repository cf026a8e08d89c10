"""The test kit's broker and database faults on a user's app (tests/user_app/labels.py):

- `flush_broker(app)` deletes that app's queues (every priority), bindings and unacked entries, and nothing
  else of the Redis database: a neighbour app's queue, binding and unacked entry, and a foreign key, survive;
- `terminate_connections`, `fail_at(point, ...)` and `database_down(...)` break the test database under a real
  in-process worker, and the user's job still ends exactly once (one effect, executed-or-resumed once, none
  failed), on the kit's throwaway cluster; the app's own database stays untouched.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import redis
from celery import Celery
from celery.exceptions import TimeoutError as CeleryTimeoutError
from sqlalchemy import create_engine

from oncelery.testing import (
    OnceleryDb,
    assert_ran_once,
    database_down,
    fail_at,
    flush_broker,
    running_worker,
    terminate_connections,
    wait_until,
)
from tests.pg_cluster import PgCluster
from tests.services import close_app
from tests.test_kit_workers_use_the_test_database import LABELS, REDIS, labels, untouched
from tests.test_kit_workers_use_the_test_database import dev_db as dev_db  # the fixture, here too

TIMEOUT = 60


@pytest.fixture
def oncelery_db(pg_cluster: PgCluster, oncelery_cluster_db: OnceleryDb) -> OnceleryDb:
    """The kit's database on its throwaway cluster (which database_down may stop), as this module's oncelery_db
    (`pg_cluster` first: without PostgreSQL's server binaries the test fails in CI instead of skipping)."""
    engine = create_engine(oncelery_cluster_db.url)
    labels.metadata.create_all(engine)
    engine.dispose()
    return oncelery_cluster_db


@pytest.fixture
def hold_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("LABELS_HOLD_DIR", str(tmp_path))
    return tmp_path


def warm_up(db: OnceleryDb) -> None:
    """One job first: it fills the worker's connection pools, so a fault finds connections to break."""
    assert labels.label.delay("doc-w").get(timeout=TIMEOUT) == "short"
    assert db.outcome_counts(labels.label) == {"executed": 1}


def ended_once(db: OnceleryDb, doc: str) -> None:
    """One effect, COMPLETED, executed-or-resumed counted once (besides the warm-up's), nothing failed."""
    assert_ran_once(db, labels.label, f"label:{doc}", effects=LABELS)
    counts = db.outcome_counts(labels.label)
    assert counts.get("executed", 0) + counts.get("resumed", 0) == 2 and not counts.get("failed"), counts


def test_flush_broker_deletes_this_apps_jobs_and_nothing_else(redis_url: str) -> None:
    client = redis.Redis.from_url(REDIS)
    prefix = "labels:"  # the app's global_keyprefix: its keys, and its neighbour's, carry it
    queue = str(labels.app.conf.task_default_queue)
    neighbour = Celery("neighbour", broker=REDIS, backend=REDIS)
    # Another app on the same Redis database and key prefix: it shares kombu's `unacked` hash with this one.
    neighbour.conf.update(
        task_default_queue=f"neighbour-{uuid.uuid4().hex[:8]}", broker_transport_options={"global_keyprefix": prefix}
    )
    foreign = f"someone-else:{uuid.uuid4().hex[:8]}"
    client.set(foreign, "keep me")
    try:
        for app in (labels.app, neighbour):
            for doc, priority in (("doc-f", None), ("doc-g", None), ("doc-h", 9)):
                app.send_task("labels.label", args=[doc], queue=app.conf.task_default_queue, priority=priority)
            take_unacked(app)
        ours = [f"{prefix}{queue}", f"{prefix}{queue}\x06\x169"]
        theirs = f"{prefix}{neighbour.conf.task_default_queue}"
        assert all(client.exists(k) for k in ours) and client.hlen(f"{prefix}unacked") >= 2

        gone = flush_broker(labels.app)

        assert not any(client.exists(k) for k in ours), gone
        assert client.smembers(f"{prefix}_kombu.binding.{queue}") == set()
        assert unacked_queues(client, prefix) & {queue} == set()
        # The neighbour's queue, binding and unacked entry, and the foreign key, are all still there.
        assert client.llen(theirs) == 1 and client.llen(theirs + "\x06\x169") == 1
        assert client.smembers(f"{prefix}_kombu.binding.{neighbour.conf.task_default_queue}")
        assert neighbour.conf.task_default_queue in unacked_queues(client, prefix)
        assert client.get(foreign) == b"keep me"
        assert gone["queue_lists"] == 2 and gone["bindings"] >= 1 and gone["unacked"] == 1, gone
    finally:
        flush_broker(neighbour)
        client.delete(foreign)
        client.close()
        close_app(neighbour)


def take_unacked(app: Celery) -> None:
    """Take one message of the app's queue without acking it (kombu writes it to the unacked hash)."""
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        channel.do_restore = False  # leave it unacked when the channel closes, as a killed worker would
        assert channel.basic_get(app.conf.task_default_queue, no_ack=False) is not None


def unacked_queues(client: redis.Redis, prefix: str) -> set[str]:
    """The routing keys (the queues, on Celery's direct exchanges) of the shared unacked hash's entries."""
    return {json.loads(v)[2] for v in client.hgetall(f"{prefix}unacked").values()}


def test_terminating_the_connections_mid_body_the_job_ends_once(
    oncelery_db: OnceleryDb, dev_db: OnceleryDb, hold_dir: Path
) -> None:
    hold = hold_dir / "doc-t"
    with running_worker(labels.app, oncelery_db):
        warm_up(oncelery_db)
        hold.touch()
        result = labels.label.delay("doc-t")
        wait_until(lambda: oncelery_db.steps(labels.label, "label:doc-t")[0] == ["read"], what="the first step")
        assert terminate_connections(oncelery_db) >= 1  # the worker's pooled connections, dead now
        hold.unlink()
        assert result.get(timeout=TIMEOUT) == "short"
    ended_once(oncelery_db, "doc-t")
    untouched(dev_db)


def test_a_fault_at_the_claim_the_job_ends_once(oncelery_db: OnceleryDb, dev_db: OnceleryDb) -> None:
    with running_worker(labels.app, oncelery_db):
        warm_up(oncelery_db)
        with fail_at("claim", terminate_connections, oncelery_db, task=labels.label, key="label:doc-c") as fault:
            result = labels.label.delay("doc-c")
            fault.wait()
        assert result.get(timeout=TIMEOUT) == "short"
    assert fault.results[0] >= 1, fault.results  # the worker's pooled connections were killed right there
    ended_once(oncelery_db, "doc-c")
    untouched(dev_db)


def test_the_database_down_at_the_completion_the_job_ends_once(oncelery_db: OnceleryDb, dev_db: OnceleryDb) -> None:
    with running_worker(labels.app, oncelery_db):
        warm_up(oncelery_db)
        with database_down(oncelery_db, at="complete", task=labels.label, key="label:doc-d") as down:
            result = labels.label.delay("doc-d")
            assert down is not None
            down.wait()
            assert oncelery_db.cluster is not None and not oncelery_db.cluster.running()
        # Started again at the block's end; the job, sent again with a backoff (at most 10 s) while the server
        # was down, completes. Restarting a server on a loaded machine takes a while: a longer bound here.
        try:
            assert result.get(timeout=2 * TIMEOUT) == "short"
        except CeleryTimeoutError:  # say where the job is: it timed out once in CI under load
            run = oncelery_db.run(labels.label, "label:doc-d")
            running = oncelery_db.cluster.running()
            pytest.fail(f"the job did not end: run {run}, outcomes {oncelery_db.outcome_counts(labels.label)}, "
                        f"server running {running}")  # fmt: skip
    ended_once(oncelery_db, "doc-d")
    untouched(dev_db)
