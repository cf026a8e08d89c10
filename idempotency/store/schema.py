"""The framework's schema in a configured database: its revision, the check workers run, the upgrade.

Only the framework's tables (task_runs, step_results, delivery_outcomes) belong to this schema; an
application's own tables (and the demo jobs') live on migration branches of their own.
"""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError

from oncelery.errors import SchemaMissing, StoreError
from oncelery.models.migrate import FRAMEWORK, Branch, current_revision, head_revision, upgrade
from oncelery.store.database import Database, safe_url, translated

__all__ = [
    "check_schema",
    "schema_revision",
    "upgrade_schema",
]


def schema_revision(url: str, branch: Branch = FRAMEWORK) -> str | None:
    """Return the revision `branch` is at in `url` (None if never upgraded); creates nothing."""
    db = Database(url)
    db.require_file()
    with translated(url):
        return current_revision(db.engine, branch)


def check_schema(url: str, branch: Branch = FRAMEWORK) -> str:
    """Return the current revision if it is the code's head, else raise SchemaMissing naming the fix."""
    current = schema_revision(url, branch)
    head = head_revision(branch)
    if current is None:
        raise SchemaMissing.for_url(safe_url(url), f"Oncelery's tables ({branch.name}) are missing")
    if current != head:
        raise SchemaMissing.for_url(
            safe_url(url), f"Oncelery's schema ({branch.name}) is at revision {current}, this code needs {head}"
        )
    return current


def upgrade_schema(url: str, branch: Branch = FRAMEWORK) -> str:
    """Migrate `branch` in `url` to head (idempotent); return a line saying from which revision to which."""
    db = Database(url)
    where = safe_url(url)
    try:
        before = current_revision(db.engine, branch)
        upgrade(db.engine, branch=branch)
        after = current_revision(db.engine, branch)
    except DBAPIError as exc:
        # Not translated to SchemaMissing: "run `oncelery db upgrade`" is no advice to `db upgrade` itself.
        raise StoreError(f"Cannot upgrade {where}: {str(exc.orig or exc).strip()}", url=where) from exc
    label = "" if branch is FRAMEWORK else f" ({branch.name})"
    if before == after:
        return f"{where}: schema{label} already at revision {after} (head)"
    return f"{where}: schema{label} upgraded from revision {before or '<none>'} to {after} (head)"
