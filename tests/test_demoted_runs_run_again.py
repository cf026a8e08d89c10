"""A run demoted because its entity's holder vanished is due for a retry, never failed for good.

A real `celery worker` holds version 1 of a document (one RUNNING run per document: `concurrency_key`) and is
SIGKILLed; the broker loses its message (Redis flushed). Version 2 then claims the document, which demotes
version 1. The sweeper re-sends version 1's kept message (`store_message=True`), and it completes once, with
one effect. With `entity_version`, version 2 is already applied, so the re-sent version 1 ends `stale`, settled
once and never re-sent again. The store alternates per case (SQLite, then PostgreSQL), as the crash tests do.
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

from oncelery import RunStatus
from oncelery.relay.sweeper import sweep_lost_runs
from oncelery.store.database import Database
from tests.conftest import ON_POSTGRESQL, ON_SQLITE
from tests.services import wait_for
from tests.test_crash import JOB_TIMEOUT, Cluster, Worker, cluster

LEASE = 2.0  # seconds: the killed holder's lease expires (database clock) soon after the kill
BODY_SECONDS = 30.0  # version 1's body: long enough to be killed inside it


def kill_holder_and_lose_its_message(c: Cluster, task: str, doc: str) -> tuple[str, Worker]:
    """Run version 1 on a worker, SIGKILL the worker mid-body, flush Redis; start the next worker (it boots while
    the lease runs out, on a queue with nothing in it); return version 1's key once its lease has expired by the
    database clock, and the next worker."""
    key = f"entity:{doc}:v1"
    release = c.tmp_path / "release"
    release.mkdir(exist_ok=True)
    c.env["ONCELERY_CRASH_RELEASE"] = str(release)
    holder = c.start("holder", pool="solo")
    c.wait_ready(holder)
    c.sender.send_task(task, args=[doc, 1, BODY_SECONDS])
    c.wait_executing(key)
    os.killpg(holder.pid, signal.SIGKILL)
    wait_for(lambda: holder.proc.poll() is not None, timeout=JOB_TIMEOUT, what="the killed holder to exit")
    c.flush_redis()  # its message, unacked copy included, is gone with it
    (release / key).touch()  # when it runs again, its body ends at once (nothing is waiting to kill it)
    worker = c.start("next", pool="solo")

    def expired() -> bool:
        run = c.store.get(task, key)
        return run is not None and run.status is RunStatus.RUNNING and not run.lease_live

    wait_for(expired, timeout=JOB_TIMEOUT, what="version 1's lease to expire")
    return key, worker


def version_two_demotes(c: Cluster, task: str, doc: str, key: str, worker: Worker) -> None:
    """Version 2 claims the document (on `worker`) and completes; version 1 is demoted with a retry due."""
    c.wait_ready(worker)
    assert c.sender.send_task(task, args=[doc, 2, 0.0]).get(timeout=JOB_TIMEOUT)["version"] == 2
    demoted = c.store.get(task, key)
    assert demoted is not None and demoted.status is RunStatus.FAILED, demoted
    assert demoted.not_before is not None, "demoted for good: nothing would ever run version 1 again"


@ON_SQLITE
def test_a_demoted_run_is_sent_again_and_completes_once(tmp_path: Path, db_url: str, redis_url: str) -> None:
    task, doc = "oncelery.crash_entity", f"d-{uuid.uuid4().hex[:8]}"
    with cluster(tmp_path, db_url, redis_url, lease=LEASE) as c:
        key, worker = kill_holder_and_lose_its_message(c, task, doc)
        version_two_demotes(c, task, doc, key, worker)
        assert sweep_lost_runs(c.sender, Database(db_url), interval=0.0) == 1

        def completed() -> bool:
            run = c.store.get(task, key)
            return run is not None and run.status is RunStatus.COMPLETED

        wait_for(completed, timeout=JOB_TIMEOUT, what="the demoted version 1 to complete")
        assert c.executions(key) == 2  # the killed body, then the re-sent one
        assert c.effects(key) == 1 and c.effects(f"entity:{doc}:v2") == 1
        run = c.store.get(task, key)
        assert run is not None and run.result is not None and run.result["version"] == 1


@ON_POSTGRESQL
def test_a_demoted_run_whose_version_is_overtaken_ends_stale_once(tmp_path: Path, db_url: str, redis_url: str) -> None:
    task, doc = "oncelery.crash_entity_versioned", f"d-{uuid.uuid4().hex[:8]}"
    with cluster(tmp_path, db_url, redis_url, lease=LEASE) as c:
        key, worker = kill_holder_and_lose_its_message(c, task, doc)
        version_two_demotes(c, task, doc, key, worker)
        db = Database(db_url)
        assert sweep_lost_runs(c.sender, db, interval=0.0) == 1

        def settled() -> bool:
            run = c.store.get(task, key)
            return run is not None and run.status is RunStatus.COMPLETED

        wait_for(settled, timeout=JOB_TIMEOUT, what="the re-sent version 1 to be settled as stale")
        run = c.store.get(task, key)
        assert run is not None and run.result is None and run.not_before is None
        assert c.effects(key) == 0 and c.effects(f"entity:{doc}:v2") == 1  # never applied out of order
        assert c.store.outcome_counts(task).get("stale") == 1
        assert sweep_lost_runs(c.sender, db, interval=0.0) == 0  # settled: nothing sends it again
