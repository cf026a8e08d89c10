"""Models and migrations agree; a missing table is a clear, typed error on both stores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from celery import Celery

import oncelery.models.jobs  # noqa: F401  (the demo tables join the metadata)
from oncelery import IdempotentTask, SchemaMissing
from oncelery.models import Base
from oncelery.models.migrate import FRAMEWORK, JOBS, Branch, downgrade, upgrade
from oncelery.models.totals import TRIGGERS
from oncelery.runs.claims import RunStore
from oncelery.runs.keys import Identity
from oncelery.store.database import get_engine


@pytest.mark.parametrize("branch", [FRAMEWORK, JOBS], ids=lambda b: b.name)
def test_migrations_match_models(db_url: str, branch: Branch) -> None:
    """Each migration branch creates exactly its models' tables, columns, types and constraints."""
    engine = get_engine(db_url)

    def own(obj: Any, name: str | None, type_: str, _reflected: bool, _compare_to: Any) -> bool:
        table = name if type_ == "table" else getattr(getattr(obj, "table", None), "name", None)
        return table in branch.tables

    with engine.connect() as conn:
        opts = {"compare_type": True, "version_table": branch.version_table, "include_object": own}
        diff = compare_metadata(MigrationContext.configure(conn, opts=opts), Base.metadata)
    assert diff == []
    assert branch.tables <= set(Base.metadata.tables)  # the filter did not hide a whole branch


_TRIGGER_NAMES = {
    "postgresql": "SELECT tgname FROM pg_trigger WHERE NOT tgisinternal",
    "sqlite": "SELECT name FROM sqlite_master WHERE type = 'trigger'",
}


def test_the_totals_triggers_exist_at_head(db_url: str) -> None:
    """The triggers that keep run_status_totals and letter_totals exist at head: a migration that rebuilds
    task_runs or dead_letters (SQLite's batch mode copies the table and drops its triggers) must recreate them."""
    engine = get_engine(db_url)
    with engine.connect() as conn:
        names = set(conn.exec_driver_sql(_TRIGGER_NAMES[engine.dialect.name]).scalars())
    assert {name for name in names if name.startswith("oncelery_")} == set(TRIGGERS[engine.dialect.name])


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
