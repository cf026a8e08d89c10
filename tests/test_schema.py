"""Models and migrations agree; a missing table is a clear, typed error on both stores."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from celery import Celery
from oncelery import IdempotentTask, SchemaMissing
from oncelery.db import get_engine
from oncelery.keys import Identity
from oncelery.models import Base
from oncelery.models.migrate import downgrade, upgrade
from oncelery.store import RunStore


def test_migrations_match_models(db_url: str) -> None:
    engine = get_engine(db_url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True, "version_table": "oncelery_alembic_version"})
        diff = compare_metadata(ctx, Base.metadata)
    # test_* tables belong to the test suite, not to Oncelery's schema.
    diff = [d for d in diff if "test_" not in repr(d)]
    assert diff == []


def test_upgrade_is_idempotent_and_downgrade_removes_everything(tmp_path: Path) -> None:
    engine = get_engine(f"sqlite:///{tmp_path / 'm.db'}")
    upgrade(engine)
    upgrade(engine)  # a second run is a no-op
    downgrade(engine, "base")
    with engine.connect() as conn:
        names = set(conn.exec_driver_sql("SELECT name FROM sqlite_master WHERE type='table'").scalars())
    assert not names & {"task_runs", "step_results", "delivery_outcomes"}


def test_missing_table_says_to_run_db_upgrade(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    store = RunStore(url)
    with pytest.raises(SchemaMissing, match="oncelery db upgrade"):
        store.claim("oncelery.x", Identity("k", "f", {}), lease=5)

    app = Celery("schema-missing")
    app.conf.oncelery_database_url = url

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.schema_missing")
    def job(self: IdempotentTask, n: int) -> int:
        return n

    app.finalize()
    with pytest.raises(SchemaMissing, match="oncelery db upgrade"):
        job(1)


def test_missing_table_on_postgresql(pg_session_url: str) -> None:
    engine = get_engine(pg_session_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE SCHEMA IF NOT EXISTS empty_schema")
    url = engine.url.set(query={"options": "-csearch_path=empty_schema"}).render_as_string(hide_password=False)
    with pytest.raises(SchemaMissing, match="oncelery db upgrade"):
        RunStore(url).claim("oncelery.x", Identity("k", "f", {}), lease=5)
