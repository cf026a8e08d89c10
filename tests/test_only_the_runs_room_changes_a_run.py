"""Only runs/ (the run protocol) and store/ (its SQL) change a run row: every other room calls a runs/ function.

Parsed, not imported: every module under idempotency/ is read with `ast`, and a statement built on task_runs
(`update(RUNS)`, `delete(RUNS)`, `insert(RUNS)`, `dialect.insert(RUNS)`, `RUNS.update()`, a `table("task_runs")`
handle, or `UPDATE task_runs` in SQL text) outside those two rooms fails, unless ALLOWED names it with its reason.
So does a run's prepared statement used there (`store.sql.heartbeat`: store/statements.py's, executed by runs/).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "idempotency"
OWNERS = ("runs", "store")  # the rooms whose business a run's row is
TABLE = "task_runs"
HANDLE = "RUNS"  # oncelery.store.tables.RUNS
WRITES = {"update", "delete", "insert"}
SQL_WRITE = re.compile(rf"\b(update|delete\s+from|insert\s+into)\s+\"?{TABLE}\b", re.IGNORECASE)

#: (module path under idempotency/, what it builds) -> why it may.
ALLOWED = {
    ("ledger/rows.py", "update(RUNS)"): (
        "adds a recorded model call to the run's cost sums (llm_calls, tokens, cost), never its state, in the "
        "ledger row's own transaction; the ledger room is below runs/ and cannot call it"
    ),
}


def _handles(tree: ast.Module) -> set[str]:
    """The names this module binds to the RUNS table handle (`RUNS`, or what `import RUNS as X` calls it)."""
    names = {HANDLE}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names |= {alias.asname for alias in node.names if alias.name == HANDLE and alias.asname}
    return names


def _is_runs(node: ast.AST, handles: set[str]) -> bool:
    """Whether an expression is the task_runs table: its handle, `tables.RUNS`, or `table("task_runs", ...)`."""
    if isinstance(node, ast.Name):
        return node.id in handles
    if isinstance(node, ast.Attribute):
        return node.attr == HANDLE
    if isinstance(node, ast.Call) and _called(node) in {"table", "Table"} and node.args:
        first = node.args[0]
        return isinstance(first, ast.Constant) and first.value == TABLE
    return False


def _called(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _run_statement(node: ast.AST) -> str | None:
    """The name in `<store>.sql.<name>` (a RunStore's prepared statements, store/statements.py), else None;
    `sqlalchemy.sql.x` is not one."""
    if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "sql"):
        return None
    base = node.value.value
    return None if isinstance(base, ast.Name) and base.id in {"sqlalchemy", "sa"} else node.attr


def run_writes(source: str) -> list[tuple[int, str]]:
    """Each (line, what) in `source` that builds a statement changing task_runs."""
    tree = ast.parse(source)
    handles = _handles(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (verb := _called(node)) in WRITES:
            func = node.func
            if node.args and _is_runs(node.args[0], handles):  # update(RUNS), dialect.insert(RUNS)
                found.append((node.lineno, f"{verb}(RUNS)"))
            elif isinstance(func, ast.Attribute) and _is_runs(func.value, handles):  # RUNS.update()
                found.append((node.lineno, f"RUNS.{verb}()"))
        elif (statement := _run_statement(node)) is not None:
            found.append((node.lineno, f"Statements: .sql.{statement}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (sql := SQL_WRITE.search(node.value)):
            found.append((node.lineno, f"SQL text: {sql.group(0)}"))
    return sorted(found)


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] not in OWNERS)


def test_no_room_but_runs_and_store_builds_a_run_write() -> None:
    """Outside runs/ and store/, a module that builds a write on task_runs is an error unless ALLOWED says why."""
    offenders, used = [], set()
    for path in _modules():
        name = path.relative_to(PACKAGE).as_posix()
        for line, what in run_writes(path.read_text(encoding="utf-8")):
            if (name, what) in ALLOWED:
                used.add((name, what))
            else:
                offenders.append(f"idempotency/{name}:{line}: {what}")
    assert not offenders, (
        "a run's row is changed outside runs/ and store/; move the statement into a named function of oncelery.runs "
        "(runs/letters.py, sweeps.py, retention.py, faults.py, debounce.py, forks.py ...) and call it:\n  "
        + "\n  ".join(offenders)
    )
    stale = set(ALLOWED) - used
    assert not stale, f"ALLOWED names writes that are gone; drop them: {sorted(stale)}"


@pytest.mark.parametrize(
    "source",
    [
        "from oncelery.store.tables import RUNS\nupdate(RUNS).values(status='DEAD')",
        "from oncelery.store.tables import RUNS as R\nsa.delete(R)",
        "from oncelery.store import tables\ndb.dialect.insert(tables.RUNS).values()",
        "RUNS.update().values(not_before=None)",
        "delete(table('task_runs', column('id')))",
        "conn.exec_driver_sql('UPDATE task_runs SET status = 1')",
        "conn.execute(store.sql.heartbeat, params)",
    ],
)
def test_each_way_of_writing_a_run_is_seen(source: str) -> None:
    """The check sees each way a statement on task_runs can be built (a check that sees nothing proves nothing)."""
    assert run_writes(source)


def test_reads_of_a_run_are_not_writes() -> None:
    """Selecting, joining and other tables' writes are not run writes."""
    source = (
        "select(RUNS.c.id).select_from(LETTERS.outerjoin(RUNS, x))\n"
        "update(LETTERS).values(run_id=RUNS.c.id)\n"
        "attributes.update({'a': 1})\n"
        "text('SELECT * FROM task_runs')\n"
        "from sqlalchemy.sql.elements import ColumnElement\n"
        "sqlalchemy.sql.expression.func.now()\n"
    )
    assert run_writes(source) == []
