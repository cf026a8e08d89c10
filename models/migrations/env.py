"""Alembic environment: runs migrations on the connection or URL that `oncelery db upgrade` passes in."""

from __future__ import annotations

from alembic import context
from oncelery.models.base import Base
from sqlalchemy import create_engine

config = context.config
target_metadata = Base.metadata
# Our own version table name, so Oncelery can share a database with a user's Alembic history.
VERSION_TABLE = "oncelery_alembic_version"


def run_migrations_online() -> None:
    """Run migrations inside one transaction on the given connection (or a new engine for the URL)."""
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = create_engine(config.get_main_option("sqlalchemy.url") or "")
    with engine.begin() as conn:
        _run(conn)
    engine.dispose()


def _run(connection: object) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        version_table=VERSION_TABLE,
        render_as_batch=True,  # SQLite cannot ALTER most constraints; batch mode copies the table.
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


run_migrations_online()
