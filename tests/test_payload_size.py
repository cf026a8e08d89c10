"""A call's payload is measured at apply_async as the JSON it sends (its args and kwargs): over
oncelery_warn_payload_bytes (1 MiB by default) the caller logs a warning suggesting a reference; over
oncelery_max_payload_bytes (off by default) the call raises PayloadTooLarge, and nothing is published or claimed.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from celery import Celery
from kombu.serialization import dumps

from oncelery import ConfigurationError, IdempotentTask, PayloadError, PayloadTooLarge, Runs, RunStatus
from tests.conftest import ON_SQLITE, offline_job, running_worker
from tests.services import wait_for

TASK_LOGGER = "oncelery.task"


def json_size(*args: Any, **kwargs: Any) -> int:
    """The size in bytes of the JSON a call with these arguments sends (kombu escapes non-ASCII: 1 char, 1 byte)."""
    return len(dumps((list(args), kwargs), serializer="json")[2])


def size_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The payload-size warnings the caller logged."""
    return [r.getMessage() for r in caplog.records if r.name == TASK_LOGGER and "bytes of JSON" in r.getMessage()]


@pytest.fixture
def memory_app() -> Any:
    """An app on an in-memory broker and no database: the checks run in the caller."""
    app = Celery("payload-size", broker="memory://", set_as_current=False)
    yield app
    app.close()


def test_over_the_warning_size_the_call_warns_and_publishes(
    memory_app: Celery, published: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """By default a call over 1 MiB of JSON is sent, with one warning naming the task, the size and what to pass
    instead; a call under it logs nothing."""
    job = offline_job(memory_app, "oncelery.t_payload_warn")
    big = "x" * (1 << 20)
    with caplog.at_level(logging.WARNING, logger=TASK_LOGGER):
        job.delay("small")
        assert size_warnings(caplog) == []
        job.delay(big)
    assert published == [job.name, job.name]
    (line,) = size_warnings(caplog)
    assert line.startswith(f"oncelery.t_payload_warn: the arguments are {json_size(big)} bytes of JSON")
    assert "oncelery_warn_payload_bytes=1048576" in line and "pass a reference (an id, a URL)" in line


@pytest.mark.parametrize("doc", ["a" * 100, "é" * 20], ids=["ascii", "non-ascii"])
def test_the_limit_is_the_bytes_sent_and_a_call_over_it_is_refused_saying_what_to_do(
    memory_app: Celery, published: list[str], doc: str
) -> None:
    """At the limit the call is sent; one byte over it, PayloadTooLarge (a PayloadError) with the size, the limit and
    the fix, and nothing is published. Non-ASCII counts as it travels (escaped: 6 bytes a character)."""
    size = json_size(doc)
    memory_app.conf.oncelery_max_payload_bytes = size
    job = offline_job(memory_app, "oncelery.t_payload_max")
    job.delay(doc)
    assert published == [job.name]
    other = Celery("payload-size-2", broker="memory://", set_as_current=False)
    other.conf.oncelery_max_payload_bytes = size - 1
    try:
        tight = offline_job(other, "oncelery.t_payload_max")
        with pytest.raises(PayloadTooLarge) as refused:
            tight.delay(doc)
    finally:
        other.close()
    assert isinstance(refused.value, PayloadError) and (refused.value.size, refused.value.limit) == (size, size - 1)
    assert str(refused.value) == (
        f"oncelery.t_payload_max: the arguments are {size} bytes of JSON, over oncelery_max_payload_bytes={size - 1}; "
        "nothing was sent: store the data (a table, object storage) and pass a reference (an id, a URL)"
    )
    assert published == [job.name]


@ON_SQLITE
def test_a_refused_call_reaches_no_worker_and_claims_nothing(app: Celery, db_url: str, published: list[str]) -> None:
    """With a worker consuming the queue: a call under the limit runs; the call over it raises in the caller and no
    message, run or claim exists for it."""
    app.conf.oncelery_max_payload_bytes = 1000

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_payload_worker")
    def job(self: IdempotentTask, doc: str) -> int:
        return len(doc)

    runs = Runs(db_url)
    with running_worker(app, concurrency=1):
        assert job.delay("x" * 10).get(timeout=30) == 10
        with pytest.raises(PayloadTooLarge, match=r"the arguments are \d+ bytes of JSON, over"):
            job.delay("y" * 2000)
        job.delay("z" * 20).get(timeout=30)  # the queue's next message is the one after the refused call
    assert published == [job.name, job.name]
    done = wait_for(lambda: runs.list(task_name=job.name), timeout=10, what="the runs of the two calls")
    assert sorted(run.result for run in done) == [10, 20]
    assert all(run.status is RunStatus.COMPLETED for run in done)


@pytest.mark.parametrize(
    ("setting", "value"),
    [("oncelery_max_payload_bytes", "1MB"), ("oncelery_warn_payload_bytes", -1), ("oncelery_max_payload_bytes", 1.5)],
)
def test_a_bad_size_setting_is_refused_at_the_call_naming_it(memory_app: Celery, setting: str, value: Any) -> None:
    """The setting must be an int of bytes (0: off); anything else is a ConfigurationError naming it."""
    memory_app.conf[setting] = value
    job = offline_job(memory_app, "oncelery.t_payload_bad")
    with pytest.raises(ConfigurationError, match=f"app.conf.{setting}={value!r}: give bytes as an int"):
        job.delay("doc")


def test_zero_switches_the_warning_off(
    memory_app: Celery, published: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """oncelery_warn_payload_bytes=0: a large call is sent without a warning."""
    memory_app.conf.oncelery_warn_payload_bytes = 0
    job = offline_job(memory_app, "oncelery.t_payload_quiet")
    with caplog.at_level(logging.WARNING, logger=TASK_LOGGER):
        job.delay("x" * (2 << 20))
    assert published == [job.name] and size_warnings(caplog) == []
