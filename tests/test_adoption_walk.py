"""docs/adopting.md's walk, from the built wheel in a fresh virtualenv to a passing test of the user's own task.

The walk is read from the doc's section "From pip install to a green test of your own task", so the two cannot
drift: every `python FILE` block is written as that file of a new project folder, and every `console` block's
commands run in order in that folder, in the virtualenv, each checked against the doc: its exit code (0 unless
the line says `# exit N`), and the output shown under it (`...` matches anything; a failing command's stderr
must be exactly the lines shown: one line, no traceback).

What stands in for what (no network in tests):
- `python -m venv .venv && . .venv/bin/activate`: the test makes `.venv` itself (no pip in it) and runs each
  command with that virtualenv's bin/ first on PATH and VIRTUAL_ENV set.
- `pip install oncelery`: the wheel this session built (tests/wheel_venv.py), installed with `--no-deps`.
  Then it and every later `pip install ...` get their dependencies from `OfflineInstaller`: exactly the
  distributions the requirement needs (its Requires-Dist walked transitively, extras and markers evaluated),
  linked from this test's own virtualenv and put on the fresh one's path by a .pth file. So psycopg appears only
  with `oncelery[postgres]` and pytest only with `pip install pytest`; the test checks both after each install.
- `export NAME=VALUE`: this test's own resources instead of the doc's values, which are replaced by them in the
  expected output too: ONCELERY_DATABASE_URL is a fresh database on the local PostgreSQL (dropped afterwards),
  ONCELERY_TEST_DATABASE_URL the local PostgreSQL server. The project also gets REDIS_URL (the tests' Redis
  database) and SUMMARIES_QUEUE (a queue of its own), which its celeryconfig.py reads with defaults, and
  PYTEST_ADDOPTS with `-p no:cacheprovider` and a --basetemp of its own.

The walk starts the user's own dev worker (`celery -A tasks worker --detach`) on the project's database and
queue, sends it a document, and leaves it running beside the user's pytest; the doc stops it at the end with
`kill $(cat worker.pid)` (the test waits for that PID to exit, and SIGKILLs it if it does not).

After the walk: the user's pytest ran and passed every test of its test file (counted in its summary line),
`oncelery db upgrade` created the framework's tables only (no demo jobs' table), and the dev worker beside the
kit received one job, its own: the project's database holds that one run and one summary, nothing of the tests
(the kit gave each test a database, queues and results of its own; before it did, the dev worker took them).
The kill test's duration is a benchmark figure (bench/adoption_walk.py, docs/benchmarks.md), not asserted here.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import make_url

from oncelery.models.migrate import FRAMEWORK, JOBS
from oncelery.testing import wait_until
from oncelery.testing.waiting import poll
from tests import services
from tests.wheel_venv import Built, OfflineInstaller, Venv, new_venv, run

DOC = Path(__file__).resolve().parents[1] / "docs" / "adopting.md"
SECTION = "## From pip install to a green test of your own task"
# The user's test run: its three tests start real worker subprocesses and wait on them.
PYTEST_TIMEOUT = 150.0
# The modules a fresh virtualenv must not see until the user installs them (dev-only packages of this one).
OPTIONAL = ("psycopg", "pytest")
_FENCE = re.compile(r"^```([^\s`]+)[ \t]*(\S*)[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
# Which of its arguments the fresh virtualenv's Python can import (without importing them).
_PROBE = "import importlib.util as u, sys; print(*(u.find_spec(m) is not None for m in sys.argv[1:]))"
_EXIT = re.compile(r"#\s*exit\s+(\d+)\s*$")


@dataclass
class Command:
    """One `$ ...` line of a console block, the exit code it must have, and the output lines shown under it."""

    line: str
    expected: list[str]

    @property
    def exit_code(self) -> int:
        """The exit code the doc gives (`# exit N`), else 0."""
        found = _EXIT.search(self.line)
        return int(found.group(1)) if found else 0


@dataclass
class File:
    """A `python FILE` block: a file of the user's project."""

    name: str
    content: str


@dataclass
class Walk:
    """The doc section's files and commands, in the order a reader meets them."""

    steps: list[Command | File] = field(default_factory=list)

    @classmethod
    def read(cls, doc: Path = DOC) -> Walk:
        """Parse the walk section of docs/adopting.md."""
        text_ = doc.read_text()
        assert SECTION in text_, f"{doc} has no section {SECTION!r}"
        section = text_.split(SECTION, 1)[1].split("\n## ", 1)[0]
        walk = cls()
        for info, name, body in _FENCE.findall(section):
            if info == "python" and name:
                walk.steps.append(File(name, body))
            elif info == "console":
                walk.steps.extend(_commands(body))
        return walk

    def file(self, name: str) -> File:
        """The project file `name` of the walk."""
        return next(s for s in self.steps if isinstance(s, File) and s.name == name)


def _commands(body: str) -> Iterator[Command]:
    command: Command | None = None
    for line in body.splitlines():
        if line.startswith("$ "):
            if command is not None:
                yield command
            command = Command(line[2:].strip(), [])
        elif command is not None and line.strip():
            command.expected.append(line.strip())
    if command is not None:
        yield command


def _matches(expected: str, line: str) -> bool:
    pattern = ".*".join(re.escape(part) for part in expected.split("..."))
    return re.fullmatch(pattern, line.strip()) is not None


@dataclass
class Walker:
    """Runs a Walk's steps in a project folder and a fresh virtualenv, with the stand-ins the module names."""

    project: Path
    venv: Venv
    installer: OfflineInstaller
    exports: dict[str, str]
    env: dict[str, str]
    replaced: dict[str, str] = field(default_factory=dict)
    outputs: dict[str, services.Done] = field(default_factory=dict)
    importable: list[dict[str, bool]] = field(default_factory=list)
    background: list[int] = field(default_factory=list)  # the PIDs of workers the walk started with --detach

    def step(self, step: Command | File) -> None:
        """Write the file, or run the command (or its stand-in) and check it against the doc."""
        if isinstance(step, File):
            (self.project / step.name).write_text(step.content)
            return
        argv = shlex.split(step.line, comments=True)
        if argv[:3] == ["python", "-m", "venv"]:
            return  # the virtualenv exists: made by the test, activated in self.env
        if argv[:2] == ["pip", "install"]:
            self.installer.install(*[a for a in argv[2:] if not a.startswith("-")])
            self.importable.append(self._importable())
            return
        if argv[0] == "export":
            name, value = argv[1].split("=", 1)
            assert name in self.exports, f"the walk exports {name}: give the test a value for it"
            self.replaced[value] = self.exports[name]
            self.env[name] = self.exports[name]
            return
        self._check(step, run(["bash", "-c", step.line], self.project, self.env, timeout=PYTEST_TIMEOUT))
        if "--pidfile" in argv:  # a detached worker: its PID, to wait for its exit (or kill it) after the walk
            pidfile = self.project / argv[argv.index("--pidfile") + 1]
            wait_until(pidfile.exists, timeout=30, what=f"{pidfile} to be written")
            self.background.append(int(pidfile.read_text().strip()))

    def _check(self, step: Command, done: services.Done) -> None:
        self.outputs[step.line] = done
        shown = f"$ {step.line}\n--- exit {done.code}\n--- stdout\n{done.out[-4000:]}\n--- stderr\n{done.err[-4000:]}"
        assert done.code == step.exit_code, shown
        expected = [self._replace(line) for line in step.expected]
        lines = (done.out + done.err).splitlines()
        for line in expected:
            assert any(_matches(line, seen) for seen in lines), f"the doc shows {line!r}:\n{shown}"
        if step.exit_code:  # a refusal is exactly the lines shown: one line, never a traceback
            assert len(done.err.strip().splitlines()) == len(expected), shown
            assert "Traceback" not in done.err, shown

    def _replace(self, line: str) -> str:
        for doc_value, ours in self.replaced.items():
            line = line.replace(doc_value, ours)
        return line

    def _importable(self) -> dict[str, bool]:
        done = run([self.venv.python, "-c", _PROBE, *OPTIONAL], self.project, self.env)
        assert done.code == 0, done.err
        return dict(zip(OPTIONAL, (v == "True" for v in done.out.split()), strict=True))


def wait_for_exit(pids: list[int], timeout: float = 30.0) -> list[int]:
    """Wait up to `timeout` s for each of `pids` (not our children) to exit; SIGKILL and return those that did not."""
    alive = lambda: [pid for pid in pids if Path(f"/proc/{pid}").exists()]  # noqa: E731
    poll(lambda: not alive(), timeout)
    left = alive()
    for pid in left:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


def stop_leftovers(project: Path) -> list[int]:
    """SIGKILL every process still working in `project` (by PID; return them): the user's pytest stops its
    worker subprocesses itself, but not when it was stopped on a timeout before its teardown ran."""
    left = []
    for proc in Path("/proc").iterdir():
        try:
            inside = proc.name.isdigit() and Path(os.readlink(proc / "cwd")).is_relative_to(project)
        except OSError:  # gone, or not ours to read
            continue
        if inside and int(proc.name) != os.getpid():
            left.append(int(proc.name))
    for pid in left:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


@contextmanager
def fresh_database() -> Iterator[str]:
    """A fresh, empty database on the local PostgreSQL (the doc's `summaries`), dropped at the end of the block."""
    name = f"oncelery_walk_{uuid.uuid4().hex[:10]}"
    admin = create_engine(services.PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(services.PG_ADMIN_URL).set(drivername="postgresql", database=name).render_as_string(False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def new_walker(wheel: Path, database: str, workdir: Path, queue: str) -> Walker:
    """A Walker for a new project folder in `workdir`: a fresh virtualenv with `wheel`, its claims in `database`."""
    project = workdir / "summaries"
    project.mkdir()
    venv = new_venv(wheel, project / ".venv")
    server = make_url(services.PG_ADMIN_URL).set(drivername="postgresql").render_as_string(False)
    env = {k: v for k, v in venv.env.items() if not k.startswith("PYTEST_")}
    env |= {
        "REDIS_URL": services.REDIS_URL,
        "SUMMARIES_QUEUE": queue,
        "PYTEST_ADDOPTS": f"-p no:cacheprovider --basetemp={workdir / 'user-pytest'}",
    }
    exports = {"ONCELERY_DATABASE_URL": database, "ONCELERY_TEST_DATABASE_URL": server}
    return Walker(project, venv, OfflineInstaller(venv, workdir / "installed"), exports, env)


@pytest.fixture
def walk_database() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for the project's own claims."""
    services.need("PostgreSQL", services.postgres_available(), "start it (see README: Services)")
    with fresh_database() as url:
        yield url


def test_the_adoption_walk_ends_in_a_green_test_of_the_users_task(
    oncelery_wheel: Built, walk_database: str, tmp_path: Path
) -> None:
    """docs/adopting.md's walk, as a user types it, from `pip install` to the user's own passing tests: the
    refusal without the postgres extra is one line (exit 2), `db upgrade` migrates the framework only, and a
    duplicate storm, a killed worker and a database fault each leave one effect."""
    services.need("Redis", services.redis_available(), "start redis-server (see README: Services)")
    walk = Walk.read()
    queue = services.unique_queue()
    walker = new_walker(oncelery_wheel.wheel, walk_database, tmp_path, queue)
    try:
        for step in walk.steps:
            walker.step(step)
    finally:
        unstopped = wait_for_exit(walker.background)  # the doc stops its worker: `kill $(cat worker.pid)`
        leftovers = stop_leftovers(walker.project)
        services.delete_queue_keys(services.REDIS_URL, queue)
    assert walker.background and unstopped == [], "the walk's own worker did not stop on SIGTERM (SIGKILLed)"
    assert leftovers == [], "the user's pytest left processes running (SIGKILLed)"

    # -- installs: nothing the user did not ask for ---------------------------------------------------------------
    assert walker.importable == [
        {"psycopg": False, "pytest": False},  # pip install oncelery
        {"psycopg": True, "pytest": False},  # pip install 'oncelery[postgres]'
        {"psycopg": True, "pytest": True},  # pip install pytest
    ], walker.importable

    # -- the user's tests ran, and all passed ---------------------------------------------------------------------
    pytest_runs = [done for line, done in walker.outputs.items() if " pytest" in line]
    assert len(pytest_runs) == 1, list(walker.outputs)
    summary = pytest_runs[0].out.strip().splitlines()[-1]
    user_tests = re.findall(r"^def (test_\w+)", walk.file("test_summaries.py").content, re.MULTILINE)
    assert len(user_tests) >= 3, user_tests  # a duplicate storm, a killed worker, a database fault
    passed = rf"{len(user_tests)} passed(, \d+ warnings?)? in [\d.]+s( \(.*\))?"  # nothing failed, skipped
    assert re.fullmatch(passed, summary), pytest_runs[0].out[-4000:]

    # -- `oncelery db upgrade`: the framework's tables, nothing else; the tests wrote to their own databases -------
    engine = create_engine(walk_database.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        tables = set(inspect(engine).get_table_names())
        with engine.connect() as conn:
            keys = conn.execute(text("SELECT idempotency_key FROM task_runs")).scalars().all()
            summarised = conn.execute(text("SELECT doc_id FROM summaries")).scalars().all()
    finally:
        engine.dispose()
    assert FRAMEWORK.tables | {FRAMEWORK.version_table} <= tables, sorted(tables)
    # Not the demo jobs' schema (a branch of its own); the user's table is the one models.create_tables made.
    assert not tables & (JOBS.tables | {JOBS.version_table}), sorted(tables)
    # -- the dev worker beside the kit: it ran its own job and none of the tests', whose runs are elsewhere -------
    assert keys == ["summary:welcome"], f"the user's tests ran on the project's own claims database: {keys}"
    assert summarised == ["welcome"], f"the user's tests wrote to the project's own table: {summarised}"
    received = re.findall(r"Task summaries\.summarise\[[\w-]+\] received", (walker.project / "worker.log").read_text())
    assert len(received) == 1, f"the dev worker took the tests' jobs: {len(received)} received"
