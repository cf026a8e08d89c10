"""The effects() transaction: a user's commit inside it cannot escape the fence, and each block is a savepoint.

On SQLite and PostgreSQL, through direct calls of the task.
"""

from __future__ import annotations

import pytest
from celery import Celery
from sqlalchemy import insert

from oncelery import IdempotentTask, LeaseLost, Runs, RunStatus
from oncelery.runs.claims import RunStore
from oncelery.testing import expire_lease
from tests.services import count_rows, effects_table


def test_a_users_commit_inside_effects_cannot_escape_the_fence(db_url: str) -> None:
    """A zombie that calls session.commit() in effects() still has its writes rolled back."""
    app = Celery("zombie-commit")
    app.conf.oncelery_database_url = db_url
    store = RunStore(db_url)

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_zcommit", idempotency_key="z:{n}")
    def charge(self: IdempotentTask, n: int) -> str:
        # Another worker takes the run over (this holder's lease expired): this holder is now a zombie that
        # does not know it yet. (Taken over first: on SQLite an open effects transaction holds the one
        # writer lock, so no takeover could happen while it is open.)
        expire_lease(db_url, "oncelery.t_zcommit", f"z:{n}")
        taken = store.claim("oncelery.t_zcommit", self.identity_of((n,)), lease=30)
        assert taken.claim is not None and taken.claim.token == 2
        with self.effects() as session:
            session.execute(insert(effects_table).values(key=f"z:{n}", pid=1))
            session.commit()  # a user's commit: must not reach the database on its own
        # Nothing visible outside the run's transaction.
        assert count_rows(store.read_engine, effects_table, f"z:{n}") == 0
        return "charged"

    app.finalize()
    with pytest.raises(LeaseLost):
        charge(1)
    assert count_rows(store.engine, effects_table, "z:1") == 0


def test_each_effects_block_is_a_savepoint(db_url: str) -> None:
    """A caught error in the second block rolls back that block only; the first block's rows commit."""
    app = Celery("savepoints")
    app.conf.oncelery_database_url = db_url

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_savepoint", idempotency_key="s:{n}")
    def two_blocks(self: IdempotentTask, n: int) -> str:
        with self.effects() as session:
            session.execute(insert(effects_table).values(key=f"s:{n}:first", pid=1))
        try:
            with self.effects() as session:
                session.execute(insert(effects_table).values(key=f"s:{n}:second", pid=1))
                raise ValueError("the second block fails and is caught")
        except ValueError:
            pass
        return "done"

    app.finalize()
    assert two_blocks(1) == "done"
    engine = RunStore(db_url).engine
    assert count_rows(engine, effects_table, "s:1:first") == 1
    assert count_rows(engine, effects_table, "s:1:second") == 0
    run = Runs(db_url).get("oncelery.t_savepoint", "s:1")
    assert run is not None and run.status is RunStatus.COMPLETED
