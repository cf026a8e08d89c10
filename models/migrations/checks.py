"""Widening (or narrowing) a VARCHAR + CHECK enum column's IN list, on PostgreSQL and SQLite, for migrations.

SQLite cannot alter a CHECK in place, and a batch rebuild would DROP the table (with foreign keys on, that
cascades to the rows that reference it). Widening an IN list only admits more rows, so on SQLite the schema text
is edited in sqlite_master (`PRAGMA writable_schema`, then a new schema_version), as SQLite's ALTER TABLE
documentation gives for changes that leave the stored rows valid (see 0016).
"""

from __future__ import annotations

import re

from alembic import op

__all__ = ["set_in_check"]


def set_in_check(table: str, name: str, column: str, values: tuple[str, ...]) -> None:
    """Make CHECK `name` of `table` read `column IN (values)`; on SQLite the table's rows are never copied."""
    in_list = f"{column} IN (" + ", ".join(f"'{v}'" for v in values) + ")"
    bind = op.get_bind()
    if bind.dialect.name != "sqlite":
        op.drop_constraint(op.f(name), table, type_="check")
        op.create_check_constraint(op.f(name), table, in_list)
        return
    version = bind.exec_driver_sql("PRAGMA schema_version").scalar_one()
    bind.exec_driver_sql("PRAGMA writable_schema=ON")
    try:
        sql = bind.exec_driver_sql("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (table,))
        text = sql.scalar_one()
        pattern = re.compile(rf"CONSTRAINT {name} CHECK \({column} IN \([^)]*\)\)")
        new, count = pattern.subn(f"CONSTRAINT {name} CHECK ({in_list})", text)
        if count != 1:
            raise RuntimeError(f"{table}: constraint {name} not found as expected in its schema: {text}")
        bind.exec_driver_sql("UPDATE sqlite_master SET sql = ? WHERE type = 'table' AND name = ?", (new, table))
        bind.exec_driver_sql(f"PRAGMA schema_version={int(version) + 1}")
    finally:
        bind.exec_driver_sql("PRAGMA writable_schema=OFF")
    problems = bind.exec_driver_sql("PRAGMA quick_check").scalars().all()
    if problems != ["ok"]:
        raise RuntimeError(f"SQLite schema check failed after the CHECK change: {problems}")
