"""An entity's lock (concurrency_key) is held by a live lease only: an expired holder never blocks the entity.

The next version runs, the expired holder is demoted to FAILED and its completion is fenced out; a live holder
still keeps its entity. On SQLite and PostgreSQL.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from oncelery import IdempotentTask, LeaseLost, Runs, RunStatus
from oncelery.runs.claims import RunStore
from oncelery.runs.keys import Identity
from oncelery.testing import expire_lease


def test_an_expired_entity_holder_does_not_block_the_next_version(
    app: Celery, worker_factory: Any, db_url: str
) -> None:
    """Version 2 runs although version 1 was left RUNNING by a dead holder; version 1 is demoted."""

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_entity",
        idempotency_key="doc:{doc}:v{version}",
        concurrency_key="doc:{doc}",
        lease=5,
    )
    def score(self: IdempotentTask, doc: str, version: int) -> str:
        return f"{doc}@{version}"

    app.finalize()
    store = RunStore(db_url)
    dead = store.claim("oncelery.t_entity", score.identity_of(("a", 1)), lease=5, concurrency_key="doc:a")
    assert dead.claim is not None
    expire_lease(db_url, "oncelery.t_entity", "doc:a:v1")
    with worker_factory(app):
        assert score.delay("a", 2).get(timeout=60) == "a@2"
    v1 = Runs(db_url).get("oncelery.t_entity", "doc:a:v1")
    assert v1 is not None and v1.status is RunStatus.FAILED
    # The dead holder is fenced out: its completion is refused.
    with pytest.raises(LeaseLost):
        store.complete(dead.claim, "zombie")


def test_a_live_entity_holder_still_blocks(db_url: str) -> None:
    """The demotion applies only to an expired lease: a live holder keeps its entity."""
    store = RunStore(db_url)
    live = store.claim("oncelery.t_entity2", Identity("doc:b:v1", "f1", {}), lease=30, concurrency_key="doc:b")
    assert live.claim is not None
    second = store.claim("oncelery.t_entity2", Identity("doc:b:v2", "f2", {}), lease=30, concurrency_key="doc:b")
    assert second.decision.value == "entity_busy"
