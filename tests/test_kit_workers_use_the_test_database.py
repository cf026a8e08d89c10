"""The test kit's workers run a user's app on the test database, never on the database the app's own
celeryconfig names (tests/user_app/labels.py: a developer's SQLite file here), and a worker subprocess killed
mid-job has its job resumed within seconds, though the app sets a visibility timeout of an hour, a key prefix
of its own, and keeps Oncelery's 60 s lease.

Each test checks the developer's database is left empty: without the kit's override, the app's own setting
wins over $ONCELERY_DATABASE_URL and the workers write there.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine

from oncelery import Outcome, outcome_of
from oncelery.store.database import dispose_engines
from oncelery.store.schema import upgrade_schema
from oncelery.testing import (
    OnceleryDb,
    WorkerDatabaseMismatch,
    assert_ran_once,
    assert_steps,
    kill_holder,
    running_worker,
)

REDIS = os.environ.get("ONCELERY_TEST_REDIS_URL", "redis://127.0.0.1:6379/11")
_DEV = Path(tempfile.gettempdir()) / f"labels-dev-{uuid.uuid4().hex[:8]}"  # made by the dev_db fixture
os.environ.setdefault("LABELS_BROKER_URL", REDIS)
os.environ.setdefault("LABELS_QUEUE", f"labels-{uuid.uuid4().hex[:10]}")
# The developer's own claims database, named by the app's celeryconfig (subprocess workers inherit it).
os.environ.setdefault("LABELS_DATABASE_URL", f"sqlite:///{_DEV}/labels-dev.db")

from tests.user_app import labels  # noqa: E402  (configured from the environment above)

APP_PATH = "tests.user_app.labels:app"
LABELS = "SELECT count(*) FROM doc_labels WHERE 'label:' || doc = :key"
TIMEOUT = 60


@pytest.fixture(scope="module")
def dev_db() -> Iterator[OnceleryDb]:
    """The developer's database, migrated and with the app's table: a worker that used it would succeed."""
    url = os.environ["LABELS_DATABASE_URL"]
    _DEV.mkdir(exist_ok=True)  # again if another module using this fixture removed it after its tests
    upgrade_schema(url)
    engine = create_engine(url)
    labels.metadata.create_all(engine)
    engine.dispose()
    yield OnceleryDb(url)
    dispose_engines()
    shutil.rmtree(_DEV, ignore_errors=True)


@pytest.fixture
def oncelery_app(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    monkeypatch.setenv("LABELS_HOLD_DIR", str(tmp_path))
    return labels.app


@pytest.fixture
def labels_db(oncelery_db: OnceleryDb) -> OnceleryDb:
    engine = create_engine(oncelery_db.url)
    labels.metadata.create_all(engine)
    engine.dispose()
    return oncelery_db


def untouched(dev: OnceleryDb) -> None:
    assert dev.count("SELECT count(*) FROM task_runs") == 0, "a kit worker claimed in the app's own database"
    assert dev.count("SELECT count(*) FROM doc_labels") == 0


def test_a_killed_worker_subprocess_job_resumes_in_seconds_on_the_test_database(
    oncelery_app: Any, labels_db: OnceleryDb, dev_db: OnceleryDb, oncelery_worker_process: Any
) -> None:
    hold = Path(os.environ["LABELS_HOLD_DIR"]) / "doc-1"
    hold.touch()  # the first holder stops after its first step, until the test lets it go
    first = oncelery_worker_process(APP_PATH)
    result = labels.label.delay("doc-1")
    # The run is seen on the TEST database (the kit's override), RUNNING with its first step checkpointed.
    kill_holder(first, labels_db, labels.label, "label:doc-1", after_steps=1)
    hold.unlink()
    oncelery_worker_process(APP_PATH)
    # Within the bound, though the app's visibility timeout is an hour and its lease 60 s: the kit's worker
    # restores the dead holder's message (in the app's prefixed keys: its options merged, not replaced).
    assert result.get(timeout=TIMEOUT) == "short"
    assert outcome_of(result) is Outcome.RESUMED
    assert_ran_once(labels_db, labels.label, "label:doc-1", effects=LABELS)
    assert_steps(labels_db, labels.label, "label:doc-1", executed=["classify"], replayed=["read"])
    untouched(dev_db)


def test_an_in_process_worker_uses_the_test_database(
    oncelery_app: Any, labels_db: OnceleryDb, dev_db: OnceleryDb
) -> None:
    with running_worker(labels.app, labels_db):
        assert labels.label.delay("doc-2").get(timeout=TIMEOUT) == "short"
    assert_ran_once(labels_db, labels.label, "label:doc-2", effects=LABELS)
    untouched(dev_db)
    assert labels.app.conf.oncelery_database_url == dev_db.url  # the app's own setting, back after the block


def test_a_worker_whose_app_sets_its_database_again_at_start_refuses_at_once_naming_both(
    oncelery_app: Any,
    labels_db: OnceleryDb,
    dev_db: OnceleryDb,
    oncelery_worker_process: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LABELS_SET_DATABASE_AT_START", dev_db.url)  # a worker_init handler of the app
    with pytest.raises(WorkerDatabaseMismatch) as refused:
        oncelery_worker_process(APP_PATH)  # exits before consuming: no wait for a job that never shows
    message = str(refused.value)
    assert dev_db.url in message and labels_db.url in message, message
    assert "\n" not in message
    in_process = "in-process worker would use the claims database sqlite"
    with pytest.raises(WorkerDatabaseMismatch, match=in_process), running_worker(labels.app, labels_db):
        pass
    untouched(dev_db)
