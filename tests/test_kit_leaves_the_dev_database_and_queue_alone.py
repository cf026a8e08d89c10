"""The test kit never writes to the developer's database or queue, though a developer's `celery worker` runs
beside it on the app's own configuration (tests/user_app/notes.py: Redis, a default queue and a routed one, and a
claims database of its own).

Through the kit's fixtures, the test process (the producer) and its workers use the test database, queues of
the test's own namespace and results under that namespace: producer dedupe answers a duplicate from the test
database, a debounced `.delay()` writes its row there, and the dev worker takes none of the test's jobs. The dev
worker is live all along: a job sent on the app's own configuration (the developer's shell) reaches it on each
queue. After a kit worker's block the app's configuration is the developer's again.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from oncelery.errors import ConfigurationError
from oncelery.store.database import dispose_engines
from oncelery.store.schema import upgrade_schema
from oncelery.testing import OnceleryDb, assert_outcomes, relay_running, running_worker, wait_until
from oncelery.testing.isolation import isolated, namespace_of
from tests import services

REDIS = os.environ.get("ONCELERY_TEST_REDIS_URL", "redis://127.0.0.1:6379/11")
_DEV = Path(tempfile.gettempdir()) / f"notes-dev-{uuid.uuid4().hex[:8]}"
os.environ.setdefault("NOTES_BROKER_URL", REDIS)
os.environ.setdefault("NOTES_QUEUE", f"notes-{uuid.uuid4().hex[:10]}")
# The developer's own claims database, named by the app's celeryconfig (its worker and the kit's inherit it).
os.environ.setdefault("NOTES_DATABASE_URL", f"sqlite:///{_DEV}/notes-dev.db")

from tests.user_app import notes, notesconfig  # noqa: E402  (configured from the environment above)

APP_PATH = "tests.user_app.notes:app"
QUEUE, DIGESTS = notesconfig.task_default_queue, notesconfig.DIGESTS
TIMEOUT = 60
ROOT = Path(__file__).resolve().parents[1]
# What a job leaves in a claims database: its run, steps, outcome counts, debounce row, outbox row, letters.
TABLES = ("task_runs", "step_results", "oncelery_debounce", "outbox", "dead_letters")
_RECEIVED = re.compile(r"Task notes\.\w+\[([0-9a-f-]+)\] received")


@dataclass
class DevWorker:
    """The developer's `celery worker` of the notes app on its own configuration, and its database."""

    proc: subprocess.Popen[bytes]
    log: Path
    db: OnceleryDb
    probes: set[str] = field(default_factory=set)  # the ids of the jobs the developer sent it

    def received(self) -> set[str]:
        """The task ids this worker has taken from its queues."""
        return set(_RECEIVED.findall(self.log.read_text(errors="replace")))

    def rows(self) -> dict[str, int]:
        """How many rows the developer's database holds, by table (and the outcomes counted)."""
        counts = {t: self.db.count(f"SELECT count(*) FROM {t}") for t in TABLES}
        counts["outcomes"] = self.db.count("SELECT coalesce(sum(count), 0) FROM delivery_outcomes")
        return counts


@pytest.fixture(scope="module")
def dev() -> Iterator[DevWorker]:
    """A developer's worker on the app's own queues and database, proved live by one job sent to each queue."""
    services.need("Redis", services.redis_available(), "start redis-server (see README: Services)")
    url = os.environ["NOTES_DATABASE_URL"]
    _DEV.mkdir(exist_ok=True)
    upgrade_schema(url)
    log = _DEV / "dev-worker.log"
    cmd = [sys.executable, "-m", "celery", "-A", APP_PATH, "worker", "--pool", "threads", "--concurrency", "2"]
    cmd += ["--loglevel=INFO", "--without-gossip", "--without-mingle", "-n", f"dev-{uuid.uuid4().hex[:6]}@%h"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    shell = Celery("notes")  # the developer's shell: the app's own configuration, no kit anywhere
    shell.config_from_object("tests.user_app.notesconfig")
    worker = DevWorker(proc, log, OnceleryDb(url))
    try:
        wait_until(lambda: " ready." in log.read_text() or proc.poll() is not None, TIMEOUT, what="the dev worker")
        assert proc.poll() is None, log.read_text()[-3000:]
        for doc, queue in (("dev-probe", QUEUE), ("dev-probe-2", DIGESTS)):
            probe = shell.send_task("notes.index", args=[doc], queue=queue)
            assert probe.get(timeout=TIMEOUT) == doc.replace("-", "/")
            worker.probes.add(probe.id)
        assert worker.received() == worker.probes
        yield worker
    finally:
        services.close_app(shell)
        services.stop_sessions([proc])
        dispose_engines()
        shutil.rmtree(_DEV, ignore_errors=True)
        for queue in (QUEUE, DIGESTS):
            services.delete_queue_keys(REDIS, queue)


@pytest.fixture
def oncelery_app() -> Any:
    return notes.app


def send_through_the_kit(db: OnceleryDb, dev: DevWorker, before: dict[str, int]) -> None:
    """Jobs, a duplicate and a debounced burst, sent by the test process as a user's test sends them."""
    results = [notes.index.delay(f"doc-{i}") for i in range(6)]
    assert [r.get(timeout=TIMEOUT) for r in results] == [f"doc/{i}" for i in range(6)]
    duplicate = notes.index.delay("doc-0")  # answered at the producer, from the test database
    assert duplicate.get(timeout=TIMEOUT) == "doc/0"
    at_producer = "SELECT coalesce(sum(at_producer), 0) FROM delivery_outcomes WHERE task_name = 'notes.index'"
    assert db.count(at_producer) == 1

    first, latest = notes.digest.delay("doc-0", 1), notes.digest.delay("doc-0", 2)  # one burst: one run
    assert latest.id == first.id
    assert dev.rows()["oncelery_debounce"] == 0, "a debounced .delay() wrote its row in the developer's database"
    assert db.count("SELECT count(*) FROM oncelery_debounce") == 1
    with relay_running(notes.app, db.url):  # the test's relay sends the burst, to the digests' queue of the test
        assert latest.get(timeout=TIMEOUT) == "doc-0@v2"

    assert_outcomes(db, notes.index, executed=6, replayed=1)
    assert_outcomes(db, notes.digest, executed=1)
    # The results are under the test's namespace in the app's result backend, not where the app keeps its own.
    client = redis.Redis.from_url(REDIS)
    try:
        for result in (*results, duplicate, latest):
            key = result.backend.get_key_for_task(result.id)
            assert client.exists(key) and not client.exists(f"celery-task-meta-{result.id}"), key
    finally:
        client.close()
    assert dev.rows() == before, "the kit wrote to the developer's database"
    assert dev.received() == dev.probes, "the developer's worker took jobs of the test"


def test_a_worker_subprocess_test_leaves_the_dev_database_and_queue_alone(
    dev: DevWorker, oncelery_app: Any, oncelery_db: OnceleryDb, oncelery_worker_process: Any
) -> None:
    before = dev.rows()
    oncelery_worker_process(APP_PATH)
    send_through_the_kit(oncelery_db, dev, before)


def test_an_in_process_worker_test_leaves_the_dev_database_and_queue_alone_and_restores_the_app(
    dev: DevWorker, oncelery_db: OnceleryDb
) -> None:
    before = dev.rows()
    with running_worker(notes.app, oncelery_db):
        send_through_the_kit(oncelery_db, dev, before)
    # The developer's configuration again: database, queues, routes and results.
    conf = notes.app.conf
    assert conf.oncelery_database_url == os.environ["NOTES_DATABASE_URL"]
    assert conf.task_default_queue == QUEUE and set(notes.app.amqp.queues) == {QUEUE, DIGESTS}
    assert notes.app.amqp.router.route({}, "notes.digest")["queue"].name == DIGESTS
    assert notes.app.amqp.router.route({}, "notes.index")["queue"].name == QUEUE
    assert not (conf.result_backend_transport_options or {}).get("global_keyprefix")
    assert notes.app.backend.get_key_for_task("x") == b"celery-task-meta-x"
    # The test's queues, bindings and bookkeeping keys are gone from Redis (its results expire as the app's do).
    client = redis.Redis.from_url(REDIS)
    try:
        assert not list(client.scan_iter(match=f"*{namespace_of(oncelery_db.url)}.{QUEUE}*", count=1000))
    finally:
        client.close()


def test_every_destination_and_result_store_of_an_app_is_the_tests_and_is_given_back(tmp_path: Path) -> None:
    """Without services: a call's own queue, an exchange and routing key a route names, a SQL result backend, and
    the refusal of a second test database for one app; every setting is the app's again after."""
    app = Celery("dev-shop", broker="memory://", backend=f"db+sqlite:///{tmp_path / 'dev-results.db'}")
    routes = {"shop.bill": {"exchange": "billing", "routing_key": "b"}}
    app.conf.update(task_default_exchange="shop", task_routes=routes)
    test_db = f"sqlite:///{tmp_path / 'test.db'}"
    ns = namespace_of(test_db) + "."
    with isolated(app, test_db):
        router = app.amqp.router
        assert router.route({"queue": "urgent"}, "shop.charge")["queue"].name == f"{ns}urgent"
        billed = router.route({}, "shop.bill")
        assert (billed["exchange"], billed["routing_key"]) == (f"{ns}billing", f"{ns}b")
        default = router.route({}, "shop.charge")["queue"]
        assert (default.name, default.exchange.name) == (f"{ns}celery", f"{ns}shop")
        assert app.conf.result_backend == f"db+{test_db}"
        with isolated(app, test_db):  # entered again on the same database: shared
            assert app.conf.task_default_queue == f"{ns}celery"
        assert app.conf.task_default_queue == f"{ns}celery"
        refused = pytest.raises(ConfigurationError, match="already isolated on the test database")
        with refused, isolated(app, f"sqlite:///{tmp_path / 'other.db'}"):
            pass
    assert app.conf.result_backend == f"db+sqlite:///{tmp_path / 'dev-results.db'}"
    assert app.conf.task_default_queue == "celery" and app.conf.task_default_exchange == "shop"
    assert app.amqp.router.route({"queue": "urgent"}, "shop.charge")["queue"].name == "urgent"
    app.conf.result_backend = "rpc://"  # replies to this process's own queue: nothing to isolate
    with isolated(app, test_db):
        assert app.conf.result_backend == "rpc://" and app.conf.task_default_queue == f"{ns}celery"
    app.close()
