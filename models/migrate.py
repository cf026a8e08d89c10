"""Apply and inspect Alembic migrations programmatically (no alembic.ini needed), one branch at a time.

Two independent migration histories, each with its own version table, so they never step on each other
or on a user's own Alembic history in the same database:
- FRAMEWORK (`oncelery.models:migrations`): task_runs, step_results, ..., model_calls — `oncelery db upgrade`;
- JOBS (`oncelery.models:jobs_migrations`): the demo pipeline's article_scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.environment import EnvironmentContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine
from sqlalchemy.engine import Engine

from oncelery.models.base import Base

_BRANCH_OPTION = "oncelery_branch"


@dataclass(frozen=True)
class Branch:
    """One migration history: where its scripts are, its version table, and the tables it owns."""

    name: str
    script_location: str
    version_table: str
    tables: frozenset[str]


FRAMEWORK = Branch(
    "oncelery",
    "oncelery.models:migrations",
    "oncelery_alembic_version",
    frozenset(
        {
            "task_runs",
            "step_results",
            "delivery_outcomes",
            "oncelery_secrets",
            "outbox",
            "dead_letters",
            "entity_versions",
            "model_calls",
            "ledger_totals",
            "ledger_label_totals",
            "run_status_totals",
            "letter_totals",
            "histogram_buckets",
            "llm_intents",
            "llm_limiters",
        }
    ),
)
JOBS = Branch(
    "jobs",
    "oncelery.models:jobs_migrations",
    "oncelery_jobs_alembic_version",
    frozenset({"article_scores"}),
)
BRANCHES = {b.name: b for b in (FRAMEWORK, JOBS)}


def alembic_config(engine: Engine | None, branch: Branch = FRAMEWORK) -> Config:
    """Return an Alembic config for `branch`'s scripts, bound to `engine` (if given)."""
    cfg = Config()
    cfg.set_main_option("script_location", branch.script_location)
    cfg.set_main_option(_BRANCH_OPTION, branch.name)
    if engine is not None:
        # ConfigParser interpolates "%": an encoded password (p%40ss) must be escaped.
        cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    return cfg


def upgrade(engine: Engine, revision: str = "head", branch: Branch = FRAMEWORK) -> None:
    """Create or migrate `branch`'s tables on `engine` to `revision`, in one transaction."""
    cfg = alembic_config(engine, branch)
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def downgrade(engine: Engine, revision: str, branch: Branch = FRAMEWORK) -> None:
    """Revert `branch`'s tables on `engine` to `revision` (use "base" to drop every table of the branch)."""
    cfg = alembic_config(engine, branch)
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def head_revision(branch: Branch = FRAMEWORK) -> str:
    """Return the newest revision of `branch`'s scripts."""
    heads = ScriptDirectory.from_config(alembic_config(None, branch)).get_heads()
    return ",".join(sorted(heads))


def current_revision(engine: Engine, branch: Branch = FRAMEWORK) -> str | None:
    """Return the revision `branch` is at on `engine` (None before its first upgrade); writes nothing."""
    cfg = alembic_config(engine, branch)
    script = ScriptDirectory.from_config(cfg)
    heads: list[str] = []

    def collect(_rev: Any, context: Any) -> list[Any]:
        heads.extend(context.get_current_heads())
        return []  # no migration steps: only read the version table

    with engine.connect() as conn, EnvironmentContext(cfg, script, fn=collect):
        cfg.attributes["connection"] = conn
        script.run_env()
    return ",".join(sorted(heads)) or None


def run_env(context: Any) -> None:
    """Body of each branch's env.py: run its migrations on the given connection, its tables only."""
    branch = BRANCHES[context.config.get_main_option(_BRANCH_OPTION) or FRAMEWORK.name]

    def include_object(obj: Any, name: str | None, type_: str, _reflected: bool, _compare_to: Any) -> bool:
        # Only this branch's tables: never the other branch's, a user's own, or the version tables.
        table = obj if type_ == "table" else getattr(obj, "table", None)
        table_name = name if type_ == "table" else getattr(table, "name", None)
        return table_name in branch.tables

    def run(connection: Any) -> None:
        context.configure(
            connection=connection,
            target_metadata=Base.metadata,
            version_table=branch.version_table,
            include_object=include_object,
            render_as_batch=True,  # SQLite cannot ALTER most constraints; batch mode copies the table.
            compare_type=True,
        )
        with context.begin_transaction():
            context.run_migrations()

    connection = context.config.attributes.get("connection")
    if connection is not None:
        run(connection)
        return

    engine = create_engine(context.config.get_main_option("sqlalchemy.url") or "")
    with engine.begin() as conn:
        run(conn)
    engine.dispose()
