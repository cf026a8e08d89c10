"""Two values share a key's text if and only if they are equal once normalised; keys stored before still match.

The normalisation (runs/encoding.py): strings are NFC (inside lists and dicts too; a dict's keys are kept as
given), integral floats are ints (3 == 3.0), tuples are lists. Proved by a property test over strings, numbers,
None, booleans and nested containers, with the strings that collided before ("~null" was None, "42" was 42) drawn
often. A lone surrogate is refused. Runs and entity versions stored under the old text are still found (SQLite
and PostgreSQL: the lookup is SQL).
"""

from __future__ import annotations

import json
import math
import unicodedata
from itertools import combinations
from typing import Any

import pytest
from celery import Celery
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from oncelery import IdempotentTask, InvalidKey, Relay, Runs, RunStatus, outbox
from oncelery.models import OutboxStatus
from oncelery.runs.encoding import encode_key_value
from oncelery.store.database import get_engine
from oncelery.store.tables import OUTBOX, VERSIONS
from tests.services import delete_queue_keys
from tests.stored_before import BeforeUpgrade, before_upgrade, old_digest, old_text  # noqa: F401

# Bounded, and no deadline: a slow moment on a shared 2-core machine must not fail a property.
PROPERTY = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

# Both sides of each collision an encoding can have (a string written like another type's text, or like an
# escape): drawn often, so that a pair of them is in most examples and any collision is found at once.
CONFUSABLE: list[Any] = [None, True, False, 1.5, -3, 0, 42, 3.0, [], {}, ["x"], {"a": 1}]
CONFUSABLE += ["~null", "~true", "~false", "~1.5", "-3", "0", "42", "3", "03", "3.0", "~%5B%5D", "~%7B%7D"]
CONFUSABLE += ["~%5B%22x%22%5D", "%342", "%7E", "~", "%", "caf\u00e9", unicodedata.normalize("NFD", "caf\u00e9")]
texts = st.sampled_from([s for s in CONFUSABLE if isinstance(s, str)]) | st.text(max_size=6)
scalars = (
    st.sampled_from(CONFUSABLE)
    | st.none()
    | st.booleans()
    | st.integers(min_value=-(10**20), max_value=10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.integers(min_value=-50, max_value=50).map(float)
    | texts
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=6,
)


def normal(value: Any) -> Any:
    """The documented normalisation, written independently of the encoder: NFC strings, 3.0 is 3, tuples are lists."""
    if isinstance(value, str):
        return unicodedata.normalize("NFC", value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, list | tuple):
        return [normal(v) for v in value]
    if isinstance(value, dict):
        return {k: normal(v) for k, v in value.items()}
    return value


def same(a: Any, b: Any) -> bool:
    """Equal once normalised, telling apart what Python's == does not (True is not 1, "1" is not 1)."""
    return json.dumps(normal(a), sort_keys=True) == json.dumps(normal(b), sort_keys=True)


def respelled(value: Any) -> Any:
    """The same value written another way: NFD strings, ints as floats (where exact), lists as tuples."""
    if isinstance(value, str):
        return unicodedata.normalize("NFD", value)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**53:
        return float(value)
    if isinstance(value, list):
        return tuple(respelled(v) for v in value)
    if isinstance(value, tuple):
        return [respelled(v) for v in value]
    if isinstance(value, dict):
        return {k: respelled(v) for k, v in value.items()}
    return value


@PROPERTY
@given(st.lists(st.sampled_from(CONFUSABLE) | values, min_size=4, max_size=12))
def test_values_share_a_key_text_iff_they_are_equal_once_normalised(drawn: list[Any]) -> None:
    """For every pair drawn: one text if and only if one normalised value."""
    for a, b in combinations(drawn, 2):
        assert (encode_key_value(a) == encode_key_value(b)) == same(a, b), (a, b)


@PROPERTY
@given(values)
def test_a_value_written_another_way_keeps_its_key_text(value: Any) -> None:
    """NFD for NFC, 3.0 for 3, a tuple for a list: the same text."""
    assert encode_key_value(respelled(value)) == encode_key_value(value)


def test_values_that_collided_before_now_differ() -> None:
    """The review's collisions: "~null" was None, "~true" was True, "~1.5" was 1.5, "42" was 42."""
    for text, value in (("~null", None), ("~true", True), ("~1.5", 1.5), ("42", 42), ("-3", -3.0)):
        assert encode_key_value(text) != encode_key_value(value), text
    assert encode_key_value("42") == "%342" and encode_key_value(42) == "42"
    assert encode_key_value("a~b") == "a%7Eb" and encode_key_value("a1") == "a1"  # the usual text is unchanged


@pytest.mark.parametrize("value", ["\ud800", "ok\udfffok", ["\ud800"], {"k": "\udc00"}])
def test_a_lone_surrogate_is_refused(value: Any) -> None:
    """A lone surrogate has no UTF-8 form: InvalidKey, naming it, for a string or inside a container."""
    with pytest.raises(InvalidKey, match="lone surrogate"):
        encode_key_value(value)


# -- upgrade: keys stored under the old text still deduplicate ----------------------------------------------


def test_runs_stored_under_the_old_text_are_replayed(
    app: Celery,
    db_url: str,
    before_upgrade: BeforeUpgrade,  # noqa: F811
) -> None:
    """A key ("42", "~x") and a tenant ("7") rendered the old way: the run is found and replayed, never run again."""
    calls: list[tuple[str, str]] = []

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_old_text",
        idempotency_key="doc:{doc}",
        tenant="{org}",
    )
    def job(self: IdempotentTask, org: str, doc: str) -> str:
        calls.append((org, doc))
        return f"new {org}/{doc}"

    app.finalize()
    stored = [("a", "42"), ("a", "~x"), ("7", "d1")]
    for org, doc in stored:
        fingerprint = old_digest({"doc": doc, "org": org})
        before_upgrade.run(job.name, f"doc:{old_text(doc)}", fingerprint, tenant=old_text(org), result=f"old {doc}")
    assert job.key_of(("a", "42")).key == "doc:%342" and job.key_of(("7", "d1")).tenant == "%37"  # what changed

    assert [job(org, doc) for org, doc in stored] == ["old 42", "old ~x", "old d1"]
    assert job("a", "43") == "new a/43"  # a call with no old run is claimed in the new form
    assert calls == [("a", "43")]
    runs = Runs(db_url)
    assert len(runs.list(task_name=job.name)) == 4
    assert runs.get(job.name, "doc:%343", "a") is not None
    assert runs.outcome_counts(job.name) == {"replayed": 3, "executed": 1}


def test_an_entity_version_stored_under_its_old_name_still_orders_events(
    app: Celery,
    db_url: str,
    before_upgrade: BeforeUpgrade,  # noqa: F811
) -> None:
    """Entity "doc:42" at version 5 (the old text of doc "42"): version 3 is stale, version 6 runs and applies."""
    calls: list[int] = []

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_old_entity",
        idempotency_key="doc:{doc}:v{version}",
        entity="doc:{doc}",
        entity_version="version",
    )
    def apply(self: IdempotentTask, doc: str, version: int) -> int:
        calls.append(version)
        return version

    app.finalize()
    before_upgrade.run("oncelery.t_other", "k", "f")  # the database held runs before the upgrade
    before_upgrade.entity_version(apply.name, "doc:42", 5)

    assert apply("42", 3) is None  # stale against the version stored under the old name
    assert apply("42", 6) == 6
    assert calls == [6]
    v = VERSIONS.c
    with get_engine(db_url).connect() as conn:
        rows = conn.execute(select(v.entity, v.version).where(v.task_name == apply.name))
        stored = {row.entity: row.version for row in rows}
    assert stored == {"doc:42": 6}  # the old row moved forward; no second row started at 6 beside it
    assert Runs(db_url).outcome_counts(apply.name) == {"stale": 1, "executed": 1}


def test_the_outbox_stores_the_key_of_a_run_stored_under_the_old_text(
    app: Celery,
    db_url: str,
    before_upgrade: BeforeUpgrade,  # noqa: F811
) -> None:
    """An outbox row for doc "42" carries "doc:42", the key its old run holds: the relay's join finds the run and
    closes the row (a row under the new text would find none, and be re-published until dead-lettered)."""

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_old_outbox", idempotency_key="doc:{doc}")
    def job(self: IdempotentTask, doc: str) -> str:
        return doc

    app.finalize()
    before_upgrade.run(job.name, "doc:42", old_digest({"doc": "42"}), result="old")
    engine = get_engine(db_url)
    with engine.begin() as conn:
        outbox.enqueue(conn, job, "42")
        outbox.enqueue(conn, job, "43")
    relay = Relay(app, db_url, republish_after=0.0, sweep_interval=None)
    try:
        rounds = [relay.run_once(), relay.run_once()]
        assert sum(r.published for r in rounds) == 2
        assert sum(r.done for r in rounds) == 1  # its run finished before the upgrade: the row is closed
    finally:
        delete_queue_keys(str(app.conf.broker_url), str(app.conf.task_default_queue))
    with engine.connect() as conn:
        outbox_rows = conn.execute(select(OUTBOX.c.idempotency_key, OUTBOX.c.status))
        rows = {row.idempotency_key: row.status for row in outbox_rows}
    assert rows == {"doc:42": OutboxStatus.DONE, "doc:%343": OutboxStatus.SENT}
    run = Runs(db_url).get(job.name, "doc:42")
    assert run is not None and run.status is RunStatus.COMPLETED and run.result == "old"
